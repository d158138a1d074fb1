"""The simulator's physics and metrics on small hand-made traces (pure, no DB)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from agents.spec import parse_cluster_spec
from scheduler.policy import (
    ClusterState,
    Placement,
    PolicyConfig,
    Preempt,
    Reason,
    Start,
    Wait,
    decide,
)
from scheduler.sim.engine import (
    DecayedUsage,
    PolicyContractError,
    SimOptions,
    Simulator,
)
from scheduler.sim.jobs import SimJob
from scheduler.sim.metrics import jain, percentile, summarize

if TYPE_CHECKING:
    from scheduler.policy import Decision

FIFO = PolicyConfig(name="fifo")


def job(
    job_id: int,
    submit: float,
    duration: float,
    gpus: int = 1,
    *,
    limit: float = 86400.0,
    group: str = "g",
    user: str = "u",
    cls: str = "normal",
    label: str = "",
) -> SimJob:
    return SimJob(
        id=job_id,
        name=str(job_id),
        submit=submit,
        gpus=gpus,
        ref_duration=duration,
        user=user,
        group=group,
        label=label,
        priority_class=cls,
        time_limit=limit,
        user_limit=True,
    )


def simulate(jobs, cluster="1x2:p100", decide_fn=decide, **opts):
    sim = Simulator(
        jobs,
        parse_cluster_spec(cluster),
        FIFO,
        SimOptions(**opts),
        decide_fn=decide_fn,
    )
    return sim, sim.run()


def test_fifo_tiny_trace_metrics_by_hand():
    # 2 GPUs on one node. j1 (2 GPUs, 100 s) at 0; j2 (1 GPU, 50 s) at 10 waits
    # until 100; j3 (1 GPU, 5 s) at 20 waits behind nothing but GPUs: starts 100.
    jobs = [
        job(1, 0, 100, 2, group="a"),
        job(2, 10, 50, 1, group="b"),
        job(3, 20, 5, 1, group="b"),
    ]
    _, result = simulate(jobs)
    assert [(j.first_start, j.end) for j in jobs] == [(0, 100), (100, 150), (100, 105)]
    out = summarize(result)
    assert out["jobs"] == 3
    jcts = [100, 140, 85]
    assert out["avg_jct_s"] == pytest.approx(sum(jcts) / 3)
    assert out["p50_jct_s"] == pytest.approx(100)
    assert out["avg_queue_s"] == pytest.approx((0 + 90 + 80) / 3)
    assert out["queue_s_by_job"] == {"1": 0, "2": 90, "3": 80}
    assert out["makespan_s"] == pytest.approx(150)
    # busy: 2x100 + 50 + 5 = 255 GPU-s over 2 GPUs x 150 s
    assert out["gpu_utilization"] == pytest.approx(255 / 300)
    # bounded slowdown: 100/100, 140/50, 85/max(5, 10)
    slow = [1.0, 2.8, 8.5]
    assert out["avg_slowdown"] == pytest.approx(sum(slow) / 3)
    a, b = 1.0, (2.8 + 8.5) / 2
    assert out["jain_fairness"] == pytest.approx((a + b) ** 2 / (2 * (a * a + b * b)))
    assert out["jct_by_size"] == {
        "1": pytest.approx(112.5),
        "2-4": 100,
        "5-8": None,
        "9+": None,
    }
    assert out["timeouts"] == 0
    assert out["preemptions"] == 0


def test_metric_helpers():
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([], 50) is None
    assert jain([1, 1, 1]) == pytest.approx(1.0)
    assert jain([1, 0]) == pytest.approx(0.5)


def test_timeout_at_start_plus_limit():
    jobs = [job(1, 0, 500, limit=100), job(2, 0, 50)]
    _, result = simulate(jobs, cluster="1x1:p100")
    assert jobs[0].outcome == "timeout"
    assert jobs[0].end == 100
    assert jobs[1].first_start == 100 and jobs[1].end == 150
    out = summarize(result)
    assert out["timeouts"] == 1 and out["completed"] == 1


def test_no_gpu_over_allocated_and_every_job_finishes_once():
    jobs = [job(i, i * 7.0, 30 + (i * 37) % 200, 1 + i % 3) for i in range(1, 60)]
    sim, _result = simulate(jobs, cluster="2x4:p100", check=True)
    assert all(j.state == "done" and j.outcome == "completed" for j in jobs)
    assert sim.finished == len(jobs)
    # work conserved
    assert sum(j.run_total for j in jobs) == pytest.approx(
        sum(j.ref_duration for j in jobs)
    )
    assert not sim.occupants


def test_over_allocating_policy_is_rejected():
    def greedy(state: ClusterState) -> list[Decision]:
        gpu = state.gpus[0]
        return [Start.on(p.id, gpu.node_id, (gpu.id,)) for p in state.pending]

    with pytest.raises(PolicyContractError, match="over-allocation"):
        simulate([job(1, 0, 10), job(2, 0, 10)], decide_fn=greedy)


def test_start_for_a_job_not_pending_is_rejected():
    def bogus(state: ClusterState) -> list[Decision]:
        return [Start.on(99, 1, (1,))]

    with pytest.raises(PolicyContractError, match="not pending"):
        simulate([job(1, 0, 10)], decide_fn=bogus)


def test_multi_node_start_accepted():
    def spread(state: ClusterState) -> list[Decision]:
        out: list[Decision] = []
        free = [g for g in state.gpus if g.free_slots == g.slots]
        for p in state.pending:
            if len(free) < p.gpus:
                continue
            take, free = free[: p.gpus], free[p.gpus :]
            by_node: dict[int, list[int]] = {}
            for g in take:
                by_node.setdefault(g.node_id, []).append(g.id)
            out.append(
                Start(
                    p.id, tuple(Placement(n, tuple(ids)) for n, ids in by_node.items())
                )
            )
        return out

    jobs = [job(1, 0, 100, 8)]
    _sim, _ = simulate(jobs, cluster="2x4:p100", decide_fn=spread)
    assert jobs[0].outcome == "completed" and jobs[0].end == 100
    assert len(jobs[0].gpu_ids) == 8


def test_preempt_returns_victim_with_age_kept_and_restarts_from_scratch():
    calls: list[float] = []

    def policy(state: ClusterState) -> list[Decision]:
        calls.append(state.now)
        pending = {p.id: p for p in state.pending}
        running = {r.id: r for r in state.running}
        free = [g for g in state.gpus if g.free_slots == g.slots]
        out: list[Decision] = []
        if 2 in pending and 1 in running and running[1].preemptible:
            out.append(Preempt(1, 2, "high class"))
        for jid in sorted(pending, key=lambda i: -pending[i].priority_weight):
            if free:
                g = free.pop(0)
                out.append(Start.on(jid, g.node_id, (g.id,)))
            else:
                out.append(Wait(jid, Reason.WAITING_FOR_PREEMPTION, "", 1))
        return out

    victim = job(1, 0, 100, cls="best-effort")
    boss = job(2, 40, 10, cls="high")
    _sim, result = simulate(
        [victim, boss], cluster="1x1:p100", decide_fn=policy, preempt_grace_s=5
    )
    assert result.preemptions == 1 and victim.preemptions == 1
    assert boss.first_start == 45 and boss.end == 55
    # the victim restarts from scratch after the boss, keeping its submit time
    assert victim.submit == 0
    assert victim.started_at == 55 and victim.end == 155
    assert victim.run_total == pytest.approx(45 + 100)
    assert result.lost_gpu_s == pytest.approx(45)
    assert summarize(result)["preemptions"] == 1


def test_periodic_pass_skipped_when_nothing_changed():
    seen: list[float] = []

    def waiter(state: ClusterState) -> list[Decision]:
        seen.append(state.now)
        return decide(state)

    # one job runs 1000 s; the second waits; period 60: periodic passes in between
    # see nothing new and are skipped.
    jobs = [job(1, 0, 1000), job(2, 1, 10)]
    _, result = simulate(jobs, cluster="1x1:p100", decide_fn=waiter, period_s=60)
    assert seen == [0, 1, 1000, 1010]
    assert result.passes_by_trigger["periodic"] == 0
    assert result.periodic_skipped == 16  # 60, 120, ..., 960
    assert result.passes == 4


def test_periodic_pass_runs_after_a_pass_that_changed_the_state():
    seen: list[float] = []

    def one_per_pass(state: ClusterState) -> list[Decision]:
        seen.append(state.now)
        starts = [d for d in decide(state) if isinstance(d, Start)]
        return starts[:1]

    jobs = [job(1, 0, 1000), job(2, 0, 1000)]
    _, result = simulate(jobs, cluster="1x2:p100", decide_fn=one_per_pass, period_s=60)
    assert seen[:3] == [0, 60, 120]  # 60 starts job 2; 120 sees that start
    assert jobs[1].first_start == 60
    assert result.passes_by_trigger["periodic"] == 2


def test_coalesced_arrivals_one_pass():
    jobs = [job(i, 5, 10) for i in range(1, 5)]
    _, result = simulate(jobs, cluster="1x4:p100", period_s=1e9)
    # one pass for the 4 arrivals at t=5 and one for the 4 ends at t=15
    assert result.passes_by_trigger["event"] == 2


def test_prediction_from_history_and_slipped_reservation():
    def reserve(state: ClusterState) -> list[Decision]:
        out = decide(state)
        return [
            Wait(d.job_id, d.reason, d.message, d.position, est_start=state.now + 1)
            if isinstance(d, Wait)
            else d
            for d in out
        ]

    jobs = [
        job(1, 0, 100, label="r"),
        job(2, 1, 300, label="r"),
        job(3, 2, 50, label="r"),
    ]
    _, result = simulate(jobs, cluster="1x1:p100", decide_fn=reserve, period_s=1e9)
    # job 3 was planned with the history of job 1 (100 s) once job 1 finished,
    # and the planned value at its start used jobs 1 and 2 (the longest: 300).
    assert jobs[2].pred_source == "user+label"
    assert jobs[2].planned_s == pytest.approx(300)
    assert result.slipped == 2  # jobs 2 and 3 started long after est_start
    out = summarize(result)
    assert out["prediction"]["predicted_jobs"] == 2


def test_decayed_usage_half_life():
    u = DecayedUsage(half_life_s=100.0)
    u.add_rate("a", 0.0, 2)  # 2 GPUs from 0
    u.add_rate("a", 100.0, -2)  # until 100
    v100 = u.values(100.0)["a"]
    # integral of 2 * 2^(-(100-s)/100) ds over 0..100 = 2*100/ln2*(1-1/2)
    assert v100 == pytest.approx(200 / 1.3862943611198906 * 1.0, rel=1e-9)
    assert u.values(200.0)["a"] == pytest.approx(v100 / 2)


def test_stuck_job_ends_the_run():
    # a 16-GPU job on 8 GPUs can never start: it stays pending, reported.
    jobs = [job(1, 0, 10, 16), job(2, 0, 10, 1)]
    _, result = simulate(jobs, cluster="2x4:p100")
    out = summarize(result)
    assert out["jobs"] == 1
    assert out["unfinished"] == {"no_such_shape": 1}


def test_same_seed_same_result():
    jobs_a = [job(i, i * 3.0, 20 + i % 7, 1 + i % 2) for i in range(1, 40)]
    jobs_b = [job(i, i * 3.0, 20 + i % 7, 1 + i % 2) for i in range(1, 40)]
    _, ra = simulate(jobs_a, cluster="1x2:p100")
    _, rb = simulate(jobs_b, cluster="1x2:p100")
    a, b = summarize(ra), summarize(rb)
    for key in ("avg_jct_s", "p99_jct_s", "gpu_utilization", "passes", "jain_fairness"):
        assert a[key] == b[key]


def test_the_replay_runs_the_staged_pass_and_sums_its_stats():
    """The default pass is ``run_pass``: each pass's ``PassStats`` is summed into
    the result's new keys (a bare ``decide_fn`` records none)."""
    from scheduler.policy.state import STAGES

    # 2 GPUs. Passes at 0 (j1 starts on both), 10 (j2 reserved behind j1), 20
    # (j2 reserved again, j3 has no free GPU), 100 (j1 ended: j2 starts, j3
    # reserved behind it), 150 (j3 starts) and 155 (j3 ended, nothing waits):
    # 1+1+2+2+1+0 jobs considered.
    jobs = [job(1, 0, 100, 2), job(2, 10, 50, 2), job(3, 20, 5, 1)]
    sim = Simulator(
        jobs, parse_cluster_spec("1x2:p100"), PolicyConfig(name="slurm"),
        SimOptions(period_s=1e9),
    )  # fmt: skip
    result = sim.run()
    out = summarize(result)
    assert sum(out["passes_by_stop_reason"].values()) == result.passes
    assert out["passes_by_stop_reason"] == {"queue exhausted": result.passes}
    assert result.passes == 6
    assert out["pass_counts"] == {
        "considered": 7, "started": 3, "preempted": 0, "reserved": 3,
        "backfilled": 0,
    }  # fmt: skip
    assert set(out["stage_mean_ms"]) == set(STAGES)
    assert all(v >= 0.0 for v in out["stage_mean_ms"].values())
    _, bare = simulate(jobs, cluster="1x2:p100")
    assert summarize(bare)["passes_by_stop_reason"] == {}
    assert summarize(bare)["stage_mean_ms"] == {}


def test_pools_prediction_reads_other_users_runs_and_refreshes_waiting_jobs():
    """``--prediction pools``: a waiting job of one user is planned from another
    user's completed run with the same label, GPUs and limit, and planned again
    when that run ends while it waits."""
    jobs = [
        job(1, 0, 100, user="a", label="r", limit=3600.0),
        job(2, 1, 500, user="b", label="r", limit=3600.0),
        job(3, 2, 50, user="c", label="r", limit=3600.0),
        job(4, 3, 50, user="d", label="x", limit=7200.0),
    ]
    sim = Simulator(
        jobs,
        parse_cluster_spec("1x1:p100"),
        PolicyConfig(name="gpulab", prediction="pools"),
        SimOptions(period_s=1e9),
    )
    sim.run()
    # job 2 waited behind job 1 and was planned again from job 1's run: one
    # run is under the label x GPUs x limit pool's minimum, so the limit's pool;
    # job 3 from the median of jobs 1 and 2; job 4 (another limit) has none
    assert (jobs[1].pred_source, jobs[1].planned_s) == ("limit", 100)
    assert (jobs[2].pred_source, jobs[2].planned_s) == ("limit", 300)
    assert (jobs[3].pred_source, jobs[3].planned_s) == ("default", 7200.0)
    assert jobs[2].end < jobs[3].end  # planned shorter, it went first


def test_pools_prediction_follows_a_more_specific_pool_than_the_one_it_used():
    """``--prediction pools``: a waiting job planned from its owner's runs (the
    least specific pool) is planned again when another user's run gives its time
    limit's pool a run, though that run adds nothing to the pool it used."""
    jobs = [
        job(1, 0, 100, user="a", label="x", limit=7200.0),
        job(2, 0, 200, user="b", label="y", limit=3600.0),
        job(3, 1, 50, 2, user="a", label="r", limit=3600.0),
    ]
    sim = Simulator(
        jobs,
        parse_cluster_spec("1x2:p100"),
        PolicyConfig(name="gpulab", prediction="pools"),
        SimOptions(period_s=1e9),
    )
    sim.run()
    # job 3 (2 GPUs) waits for both: from 100 planned from job 1 ("user"), at
    # 200 from job 2's run of the same limit, the more specific pool
    assert jobs[2].first_start == 200
    assert (jobs[2].pred_source, jobs[2].planned_s) == ("limit", 200)


def test_pools_prediction_of_every_waiting_job_is_current_at_every_pass():
    """``--prediction pools``: at every pass each waiting job is planned from the
    pools' runs completed so far, as if every waiting job were predicted again
    (the simulator predicts again only those whose pools gained a run)."""
    import random

    from scheduler.policy.predict import Request, planned_runtime

    rng = random.Random(7)
    jobs = [
        job(
            i,
            i * 20.0,
            rng.choice((30.0, 60.0, 90.0, 400.0)) * rng.uniform(0.5, 1.5),
            rng.choice((1, 1, 2)),
            user=rng.choice("abcd"),
            label=rng.choice(("r", "x", "y")),
            limit=rng.choice((600.0, 3600.0, 7200.0)),
        )
        for i in range(1, 150)
    ]
    config = PolicyConfig(name="gpulab", prediction="pools")
    checked = 0

    def checking_decide(state: ClusterState) -> list[Decision]:
        nonlocal checked
        for p in state.pending:
            req = Request(p.user, p.workload, p.gpus, p.time_limit_s)
            want = planned_runtime(p.time_limit_s, sim.pools.predict(req)[0])
            assert p.planned_s == want, (state.now, p.id)
            checked += 1
        return decide(state)

    sim = Simulator(
        jobs,
        parse_cluster_spec("1x2:p100"),
        config,
        SimOptions(period_s=1e9),
        decide_fn=checking_decide,
    )
    result = sim.run()
    assert summarize(result)["jobs"] == len(jobs)
    assert checked > 500  # jobs waited through many passes
    sources = {j.pred_source for j in jobs}
    assert {"user+label+gpus+limit", "limit", "default"} <= sources
