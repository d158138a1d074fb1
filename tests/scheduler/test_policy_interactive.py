"""Interactive jobs in the policy: ahead of batch work, they may preempt
checkpointable batch jobs without waiting for their LAS rank, and they are never
preempted nor evicted themselves."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from scheduler.policy import DEFAULT_CLASSES, Evict, Preempt, decide
from tests.scheduler import test_policy_support as support
from tests.scheduler.test_policy_support import NOW, node_gpus, pending, running, starts

HOUR = 3600.0
CLASSES = MappingProxyType(
    {**support.CLASSES, "interactive": DEFAULT_CLASSES["interactive"]}
)


def cluster(*args, **kw):
    return replace(support.cluster(*args, **kw), classes=CLASSES)


def shell(job_id: int, gpus: int = 1, **kw):
    return pending(job_id, gpus, cls="interactive", **kw)


def ckpt(job_id, gpu_ids, *, ran=HOUR, cls="normal", **kw):
    return replace(
        running(job_id, gpu_ids, cls=cls, started_ago=ran, **kw), checkpointable=True
    )


def preempts(ds):
    return [d for d in ds if isinstance(d, Preempt)]


def test_an_interactive_job_goes_ahead_of_batch_work():
    # an old high job and an interactive one wait for the only free GPU
    jobs = [pending(1, 1, cls="high", age=30 * 86400.0), shell(2)]
    assert list(starts(decide(cluster(node_gpus(1, 1), jobs)))) == [2]
    # the slurm policy too
    ds = decide(cluster(node_gpus(1, 1), jobs, config=support.SLURM))
    assert list(starts(ds)) == [2]


def test_it_preempts_a_checkpointable_job_without_a_las_rank():
    # 20 min of service: far under the 16 GPU-h lower queue, a victim anyway
    run = [ckpt(10, (100,), ran=20 * 60.0)]
    ds = decide(cluster(node_gpus(1, 1), [shell(1)], run=run))
    [p] = preempts(ds)
    assert (p.victim_id, p.for_job_id) == (10, 1)
    # a batch job with the same service could not
    ds = decide(cluster(node_gpus(1, 1), [pending(1, 1)], run=run))
    assert not preempts(ds)


def test_it_keeps_the_bounds_of_every_preemption():
    # the minimum run, the hourly bound, and no job that does not checkpoint
    for run in (
        [ckpt(10, (100,), ran=5 * 60.0)],
        [ckpt(10, (100,), ran=HOUR, preemptions=2)],
        [running(10, (100,), started_ago=HOUR)],
    ):
        assert not preempts(decide(cluster(node_gpus(1, 1), [shell(1)], run=run)))


def test_an_interactive_job_is_never_preempted():
    # a checkpointable interactive job with much service, beside a batch one
    run = [
        ckpt(10, (100,), ran=40 * HOUR, cls="interactive"),
        ckpt(11, (101,), ran=20 * HOUR),
    ]
    ds = decide(cluster(node_gpus(1, 2), [pending(1, 1), shell(2)], run=run))
    assert [p.victim_id for p in preempts(ds)] == [11]
    # nor by class, whatever marks it preemptible
    run = [replace(running(10, (100,), cls="interactive"), preemptible=True)]
    ds = decide(cluster(node_gpus(1, 1), [pending(1, 1, cls="high")], run=run))
    assert not preempts(ds)


def shared(job_id, *, cls, joined, slowdown=None):
    return replace(
        running(job_id, (100,), cls=cls),
        shareable=True,
        workload=f"w{job_id}",
        joined_at=NOW - joined if joined else None,
        measured_slowdown=slowdown,
        measured_for_s=600.0 if slowdown else 0.0,
    )


def test_an_interactive_job_is_never_evicted_its_batch_partner_goes():
    # the interactive job joined the batch job's GPU and slowed it over its cap
    run = [
        shared(10, cls="normal", joined=None, slowdown=2.0),
        shared(11, cls="interactive", joined=300.0),
    ]
    ds = decide(cluster(node_gpus(1, 1), [], run=run))
    [e] = [d for d in ds if isinstance(d, Evict)]
    assert (e.job_id, e.partner_id) == (10, 11)
    # two batch jobs: the later one goes, as ever
    run = [
        shared(10, cls="normal", joined=None, slowdown=2.0),
        shared(11, cls="normal", joined=300.0),
    ]
    [e] = [
        d for d in decide(cluster(node_gpus(1, 1), [], run=run)) if isinstance(d, Evict)
    ]
    assert (e.job_id, e.partner_id) == (11, 10)
