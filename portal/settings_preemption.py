"""When the scheduler may preempt a checkpointable job to start a waiting one
(``gpulab``: least attained service first, docs/policy.md "Preemption by
attained service"). Imported at the end of ``portal.settings``; the hourly bound
on preemptions of one job is ``GPULAB_PREEMPT_MAX_PER_HOUR`` (``GPULAB_POLICY``)."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from portal.settings_env import envbool, envchoice, envfloat, envint

# Preempt checkpointable jobs by attained service at all (off: class preemption
# of best-effort jobs only).
GPULAB_LAS_PREEMPTION = envbool("GPULAB_LAS_PREEMPTION", default=True)
# Seconds a job runs after its own start before it may be preempted by attained
# service (a resumed job is protected again after each restart).
GPULAB_PREEMPT_MIN_RUN = envfloat("GPULAB_PREEMPT_MIN_RUN", 600.0, minimum=0)
# GPU-hours of attained service (GPUs x hours run, every attempt) from which a job
# is in the lower LAS queue: only such jobs are preempted by attained service, and
# only for a job that stays under it through its own minimum run.
GPULAB_LAS_THRESHOLD = envfloat("GPULAB_LAS_THRESHOLD", 16.0, minimum=0.01)
# The wait bound: a job in the system (since its submission) longer than this many
# times its service time (attained GPU-seconds / its GPUs) is no longer preempted
# by attained service nor held behind the jobs it was preempted for.
GPULAB_LAS_MAX_SLOWDOWN = envfloat("GPULAB_LAS_MAX_SLOWDOWN", 2.0, minimum=1.0)
# The absolute wait bound (``scheduler.policy.wait_bound``, gpulab): a batch job
# that has waited (time in the system not running) more than this many seconds
# goes ahead of every job of its class and below, whatever its priority, and is
# not preempted by attained service (4 days: docs/policy.md, "The wait bound" and
# "The (b) tail with predictions by pools, job by job"). 0: no bound.
GPULAB_MAX_WAIT = envfloat("GPULAB_MAX_WAIT", 96 * 3600.0, minimum=0)
if 0 < GPULAB_MAX_WAIT < 3600:
    raise ImproperlyConfigured(
        f"GPULAB_MAX_WAIT={GPULAB_MAX_WAIT} must be 0 (no bound) or at least 3600"
        " (seconds: an hour)"
    )
# The wait bound after a preemption (``scheduler.policy.wait_bound``, gpulab): a
# preempted job that has waited more than this many seconds since its preemption
# goes ahead of every job of its class and below, and once restarted that late it
# is not preempted by attained service again (docs/policy.md, "A bound after a
# preemption"). 0: none (GPULAB_MAX_WAIT still applies).
GPULAB_PREEMPTED_MAX_WAIT = envfloat("GPULAB_PREEMPTED_MAX_WAIT", 0.0, minimum=0)
if 0 < GPULAB_PREEMPTED_MAX_WAIT < 600:
    raise ImproperlyConfigured(
        f"GPULAB_PREEMPTED_MAX_WAIT={GPULAB_PREEMPTED_MAX_WAIT} must be 0 (no bound)"
        " or at least 600 (seconds: ten minutes)"
    )
# Waiting jobs after the top blocked one that may each get a preemption plan by
# attained service in one pass (0: only the top blocked job preempts).
GPULAB_LAS_EXTRA_PLANS = envint("GPULAB_LAS_EXTRA_PLANS", 0, minimum=0)
# The order victims are tried in: "attained" (the most attained service first),
# "checkpoint" (the least work lost since the last GPULAB_CHECKPOINT first) or
# "remaining" (the most time left by progress or prediction first).
GPULAB_LAS_VICTIMS = envchoice(
    "GPULAB_LAS_VICTIMS", "attained", ("attained", "checkpoint", "remaining")
)
# Victims by attained service only among the jobs with more time left (by
# progress or prediction) than the waiting job is planned to run.
GPULAB_LAS_SHORTER = envbool("GPULAB_LAS_SHORTER", default=False)
# Guests: a checkpointable job that fits now only on GPUs reserved for the first
# job waiting, and would run past that job's planned start, starts there as a
# guest and is preempted when that job can start ("on"); "predicted": only when
# its prediction ends by then (its limit alone would keep it out); "off" (the
# default): never (docs/policy.md, "Guests on reserved GPUs").
GPULAB_GUEST_BACKFILL = envchoice(
    "GPULAB_GUEST_BACKFILL", "off", ("off", "on", "predicted")
)
