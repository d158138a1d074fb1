"""The wait bound in a replay (``policy.wait_bound``): a long job that a stream of
short ones keeps passing (shortest first) starts once it has waited
``max_wait_s``; ``slurm`` and ``gpulab`` without the bound keep it waiting."""

from __future__ import annotations

from agents.spec import parse_cluster_spec
from scheduler.policy import PolicyConfig
from scheduler.sim.engine import SimOptions, Simulator
from tests.scheduler.test_sim_policies import sim_job

HOUR = 3600.0


def replay(policy: str, max_wait_s: float) -> float:
    """The long job's wait (s). 1 GPU, one user. A 10-h job labelled ``long`` runs
    first (its history: the next ``long`` job is predicted at 10 h); at its end
    the long job L waits beside a stream of 500-s jobs (limit 600 s) arriving
    every 500 s for about 14 h, so the GPU always has a short job to run."""
    first = sim_job(1, 0, 10 * HOUR)
    first.label = "long"
    long = sim_job(2, 10 * HOUR - 1, HOUR)
    long.label = "long"
    shorts = []
    for k in range(100):
        s = sim_job(3 + k, 10 * HOUR - 1 + 500 * k, 500, limit=600)
        s.label = "short"
        shorts.append(s)
    sim = Simulator(
        [first, long, *shorts],
        parse_cluster_spec("1x1:p100"),
        PolicyConfig(name=policy, max_wait_s=max_wait_s),
        SimOptions(),
    )
    sim.run()
    assert long.state == "done"
    return long.first_start - long.submit


def test_a_long_job_passed_by_short_ones_starts_once_it_has_waited_the_bound():
    # with a 2-h bound it starts when the short job running then ends
    assert 2 * HOUR < replay("gpulab", 2 * HOUR) <= 2 * HOUR + 600 + 120
    # without it, shortest-first runs the whole stream first
    assert replay("gpulab", 0.0) > 13 * HOUR
    # ``slurm`` (no run-time factor: the older job first) never reads the bound
    assert replay("slurm", 2 * HOUR) == replay("slurm", 0.0) < 60
