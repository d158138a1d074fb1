"""Idle evidence: the one definition of "this job did nothing on this GPU", read by
the idle flags (``portal.idle.detect``) and by the admin overview's idle GPU-hours
(``portal.accounting.hours``).

Per persisted sample of a GPU an attempt holds, its *own* SM utilisation is the sum
of the ``sm_util`` of its processes on that GPU when the agent reported ``sm_util``
for any process there (a process of ours NVML left out did nothing), else the
whole GPU's ``util_gpu`` (an upper bound: never a false idle); a lost GPU or an
unknown reading is no evidence either way (NULL). Memory does not count: a job
holding 20 GiB at 0 % SM is idle. The sample is idle evidence when that figure is
below the attempt's class threshold (``rules.IdleRule.threshold``).

Between samples: a gap longer than ``max_gap()`` (three persist intervals: the
agent was cut off, or the portal did not persist) is no evidence; the flags'
idle run starts again after it, and a sample before it covers only one persist
interval of idle time.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings


def own_sm(sample: str, attempt_id: str) -> str:
    """SQL for the attempt's own SM utilisation (%) in one persisted sample (NULL:
    no evidence). ``sample`` names a row of ``scheduler_gpusample`` (or anything
    with its ``lost``, ``processes`` and ``util_gpu``), ``attempt_id`` the
    attempt's id expression."""
    return f"""CASE
            WHEN {sample}.lost THEN NULL
            WHEN EXISTS (SELECT 1 FROM jsonb_array_elements({sample}.processes) p
                         WHERE p->>'sm_util' IS NOT NULL)
            THEN (SELECT coalesce(sum((p->>'sm_util')::float8), 0)
                  FROM jsonb_array_elements({sample}.processes) p
                  WHERE (p->>'attempt_id')::bigint = {attempt_id})
            ELSE {sample}.util_gpu
        END"""


def own_memory(sample: str, attempt_id: str) -> str:
    """SQL for the GPU memory (MiB) the attempt's own processes hold in a sample."""
    return f"""(SELECT sum((p->>'used_memory_mib')::bigint)
         FROM jsonb_array_elements({sample}.processes) p
         WHERE (p->>'attempt_id')::bigint = {attempt_id})"""


def max_gap() -> timedelta:
    """The longest silence between two samples that still joins them."""
    return timedelta(seconds=3 * settings.GPULAB_METRICS_PERSIST_INTERVAL)


def step() -> timedelta:
    """What one sample stands for when the next one is further than ``max_gap``:
    one persist interval."""
    return timedelta(seconds=settings.GPULAB_METRICS_PERSIST_INTERVAL)
