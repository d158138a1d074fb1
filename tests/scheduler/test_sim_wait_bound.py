"""The wait bound in a replay (``policy.wait_bound``): a long job that a stream of
short ones keeps passing (shortest first) starts once it has waited
``max_wait_s``; ``slurm`` and ``gpulab`` without the bound keep it waiting. And the
head start earned by waiting (``runtime_age_gpu_s``): a wide job that short narrow
ones keep passing starts once it has waited its GPU-hours."""

from __future__ import annotations

from agents.spec import parse_cluster_spec
from scheduler.policy import PolicyConfig
from scheduler.sim.engine import SimOptions, Simulator
from tests.scheduler.test_sim_policies import sim_job

HOUR = 3600.0


def passed_job_wait(
    gpus: int, every_s: float, count: int, spec: str, config: PolicyConfig
) -> float:
    """The wait (s) of a job that short ones keep passing. One user. A 10-h job of
    ``gpus`` GPUs labelled ``long`` runs first (its history: the next ``long`` job
    is predicted at 10 h); at its end the job L (``gpus`` GPUs) waits beside
    ``count`` 1-GPU 500-s jobs (limit 600 s) arriving every ``every_s``, so the
    cluster always has a short job to run."""
    first = sim_job(1, 0, 10 * HOUR, gpus=gpus)
    first.label = "long"
    long = sim_job(2, 10 * HOUR - 1, HOUR, gpus=gpus)
    long.label = "long"
    shorts = []
    for k in range(count):
        s = sim_job(3 + k, 10 * HOUR - 1 + every_s * k, 500, limit=600)
        s.label = "short"
        shorts.append(s)
    sim = Simulator(
        [first, long, *shorts], parse_cluster_spec(spec), config, SimOptions()
    )
    sim.run()
    assert long.state == "done"
    return long.first_start - long.submit


def replay(policy: str, max_wait_s: float) -> float:
    """The long job's wait on 1 GPU beside a job of 500 s every 500 s for about
    14 h."""
    config = PolicyConfig(name=policy, max_wait_s=max_wait_s)
    return passed_job_wait(1, 500.0, 100, "1x1:p100", config)


def test_a_long_job_passed_by_short_ones_starts_once_it_has_waited_the_bound():
    # with a 2-h bound it starts when the short job running then ends
    assert 2 * HOUR < replay("gpulab", 2 * HOUR) <= 2 * HOUR + 600 + 120
    # without it, shortest-first runs the whole stream first
    assert replay("gpulab", 0.0) > 13 * HOUR
    # ``slurm`` (no run-time factor: the older job first) never reads the bound
    assert replay("slurm", 2 * HOUR) == replay("slurm", 0.0) < 60


def replay_wide(runtime_age_gpu_s: float) -> float:
    """The wait of a 2-GPU job on one 2-GPU node, no wait bound, beside a 1-GPU job
    of 500 s every 250 s for about 14 h: a GPU is always taken and a short job
    always waits."""
    config = PolicyConfig(
        name="gpulab", max_wait_s=0.0, runtime_age_gpu_s=runtime_age_gpu_s
    )
    return passed_job_wait(2, 250.0, 200, "1x2:p100", config)


def test_a_wide_job_passed_by_short_narrow_ones_earns_its_head_start_by_waiting():
    """With 4 GPU-hours, the 2-GPU job has a short job's head start (about 0.6
    of the weight, for a 500-s plan) after about 1.1 h of waiting, then holds the
    reservation the next short jobs cannot backfill around; at 8 GPU-hours it
    takes twice as long; without the rule the whole stream goes first."""
    assert HOUR < replay_wide(4 * HOUR) < 1.5 * HOUR
    assert 2 * HOUR < replay_wide(8 * HOUR) < 2.5 * HOUR
    assert replay_wide(0.0) > 13 * HOUR


def preempted_then_passed(preempted_max_wait_s: float):
    """A checkpointable job A (20,000 s on the only GPU, limit 25,000 s, in the
    lower LAS queue from 2,000 GPU-s) is preempted at 3,000 by the first of 40
    short jobs of another user (500 s, limit 600 s) arriving every 500 s;
    shortest-first then ranks every later short job ahead of A. Returns A."""
    a = sim_job(1, 0, 20_000, user="a", ckpt=True, limit=25_000)
    shorts = [sim_job(2 + k, 3000 + 500 * k, 500, limit=600) for k in range(40)]
    config = PolicyConfig(
        name="gpulab",
        las_threshold_gpu_s=2000.0,
        max_wait_s=0.0,
        las_max_slowdown=100.0,  # no relative bound: only the one under test
        preempted_max_wait_s=preempted_max_wait_s,
    )
    Simulator([a, *shorts], parse_cluster_spec("1x1:p100"), config, SimOptions()).run()
    assert a.state == "done"
    return a


def test_a_preempted_job_restarts_once_it_has_waited_the_bound_after_its_preemption():
    # with a 2-h bound it restarts when the short job running then ends, and the
    # next short jobs (each in the top queue) do not preempt it again
    a = preempted_then_passed(2 * HOUR)
    assert a.preemptions == 1
    assert 3000 + 2 * HOUR < a.started_at <= 3030 + 2 * HOUR + 600 + 120
    # without it the whole stream (to about 23,000 s) runs first
    a = preempted_then_passed(0.0)
    assert a.preemptions == 1
    assert a.started_at > 22_000
