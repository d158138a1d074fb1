"""Strict ``fifo``, greedy ``first-fit`` and the simulator's ``tiresias`` on
hand-built states and traces (pure, no DB)."""

from __future__ import annotations

import pytest

from agents.spec import parse_cluster_spec
from scheduler.policy import (
    ClusterState,
    GpuView,
    NodeView,
    PendingJob,
    Placement,
    PolicyConfig,
    Preempt,
    Reason,
    RunningJob,
    Start,
    Wait,
    decide,
)
from scheduler.sim.engine import SimOptions, Simulator
from scheduler.sim.jobs import SimJob
from scheduler.sim.metrics import summarize
from scheduler.sim.tiresias import Service, Tiresias, TiresiasParams, runner

# ------------------------------------------------------------------ helpers


def gpus(node_id: int, count: int, busy: tuple[int, ...] = ()) -> tuple[GpuView, ...]:
    return tuple(
        GpuView(
            id=node_id * 100 + i,
            node_id=node_id,
            index=i,
            memory_total_mib=16384,
            slots=1,
            free_slots=0 if i in busy else 1,
        )
        for i in range(count)
    )


def pend(job_id: int, n: int = 1, at: float = 0.0, weight: float = 0.5) -> PendingJob:
    return PendingJob(job_id, n, None, weight, at or float(job_id))


def cluster(
    nodes: int,
    per_node: int,
    pending: list[PendingJob],
    *,
    policy: str = "fifo",
    busy: dict[int, tuple[int, ...]] | None = None,
    running: tuple[RunningJob, ...] = (),
    now: float = 1000.0,
) -> ClusterState:
    busy = busy or {}
    views: tuple[GpuView, ...] = ()
    for n in range(1, nodes + 1):
        views += gpus(n, per_node, busy.get(n, ()))
    return ClusterState(
        now=now,
        nodes=tuple(NodeView(n, f"n{n}") for n in range(1, nodes + 1)),
        gpus=views,
        pending=tuple(pending),
        running=running,
        config=PolicyConfig(name=policy),
    )


def starts(decisions) -> list[int]:
    return [d.job_id for d in decisions if isinstance(d, Start)]


def waits(decisions) -> dict[int, Wait]:
    return {d.job_id: d for d in decisions if isinstance(d, Wait)}


def sim_job(job_id, submit, duration, gpus=1, *, user="u", ckpt=False, limit=1e6):
    return SimJob(
        id=job_id,
        name=str(job_id),
        submit=submit,
        gpus=gpus,
        ref_duration=duration,
        user=user,
        group="g",
        label="",
        priority_class="normal",
        time_limit=limit,
        user_limit=True,
        checkpointable=ckpt,
    )


# ------------------------------------------------------------------ fifo


def test_strict_fifo_the_first_job_that_does_not_fit_blocks_every_later_one():
    # 4 GPUs, 2 busy: job 1 takes one, job 2 (3 GPUs) does not fit, job 3 would
    s = cluster(1, 4, [pend(1), pend(2, 3), pend(3)], busy={1: (0, 1)})
    got = decide(s)
    assert starts(got) == [1]
    w = waits(got)
    assert w[2].reason is Reason.RESOURCES
    assert w[3].reason is Reason.PRIORITY
    assert "behind job 2" in w[3].message
    assert [w[2].position, w[3].position] == [1, 2]


def test_first_fit_lets_later_jobs_start_where_they_fit():
    s = cluster(
        1, 4, [pend(1), pend(2, 3), pend(3)], policy="first-fit", busy={1: (0, 1)}
    )
    got = decide(s)
    assert starts(got) == [1, 3]
    assert waits(got)[2].reason is Reason.RESOURCES


def test_strict_fifo_orders_by_class_first_and_blocks_across_classes():
    # the high job arrived last but comes first; it does not fit and blocks the
    # older normal job that would
    s = cluster(
        1, 2, [pend(1, 1, at=1.0), pend(2, 2, at=5.0, weight=1.0)], busy={1: (0,)}
    )
    got = decide(s)
    assert starts(got) == []
    assert waits(got)[1].reason is Reason.PRIORITY
    assert waits(got)[2].reason is Reason.RESOURCES


def test_a_job_that_can_never_start_blocks_nothing():
    s = cluster(1, 2, [pend(1, 3), pend(2)])
    got = decide(s)
    assert starts(got) == [2]
    assert waits(got)[1].reason is Reason.NO_SUCH_SHAPE


@pytest.mark.parametrize("policy", ["fifo", "first-fit"])
def test_fifo_places_a_gang_on_the_fewest_nodes(policy):
    # 3 nodes of 4 GPUs, node 1 has 1 free, nodes 2 and 3 all free: a 6-GPU job
    # takes node 2 whole (rank 0, larger free count first) and 2 GPUs of node 3
    s = cluster(3, 4, [pend(1, 6)], policy=policy, busy={1: (0, 1, 2)})
    [start] = decide(s)
    assert start == Start(
        1, (Placement(2, (200, 201, 202, 203)), Placement(3, (300, 301)))
    )


def test_strict_fifo_in_the_simulator_holds_a_small_job_behind_a_wide_one():
    # 1x2 GPUs. j1 (1 GPU, 100 s) at 0; j2 (2 GPUs, 10 s) at 1 waits for j1;
    # j3 (1 GPU, 10 s) at 2: first-fit starts it at 2, strict fifo after j2.
    def run(name: str) -> list[tuple[float, float]]:
        jobs = [sim_job(1, 0, 100), sim_job(2, 1, 10, 2), sim_job(3, 2, 10)]
        Simulator(jobs, parse_cluster_spec("1x2:p100"), PolicyConfig(name=name)).run()
        return [(j.first_start, j.end) for j in jobs]

    assert run("fifo") == [(0, 100), (100, 110), (110, 120)]
    assert run("first-fit") == [(0, 100), (100, 110), (2, 12)]


# ------------------------------------------------------------------ tiresias


def running(job_id: int, gpu_ids: tuple[int, ...], *, stopping=False) -> RunningJob:
    return RunningJob(
        id=job_id,
        gpu_ids=gpu_ids,
        started_at=0.0,
        planned_s=1e6,
        time_limit_s=1e6,
        preemptible=not stopping,
        stopping=stopping,
    )


def book(services: dict[int, Service]):
    return lambda job_id, now: services[job_id]


def fresh(submitted: float) -> Service:
    return Service(0.0, 0.0, submitted, submitted)


PARAMS = TiresiasParams(threshold_gpu_s=3600.0, starve_limit=8.0)


def test_tiresias_a_job_past_the_threshold_goes_behind_a_newer_one():
    # job 1 arrived first but has 2 GPU-h of service (queue 1); job 2 is new
    svc = {1: Service(7200.0, 600.0, 900.0, 10.0), 2: fresh(950.0)}
    t = Tiresias(PARAMS, book(svc))
    got = t.run(cluster(1, 1, [pend(1, at=10.0), pend(2, at=950.0)]))
    assert starts(got.decisions) == [2]
    assert "queue 1" in waits(got.decisions)[1].message
    assert t.queue_of(1, svc[1], 1000.0) == 1
    assert t.queue_of(2, svc[2], 1000.0) == 0


def test_tiresias_queue_one_is_served_in_the_order_jobs_crossed_the_threshold():
    # 1-GPU jobs; both stopped at 900. Job 1 is over by 3600 s (crossed at -2700),
    # job 2 over by 100 s (crossed at 800): job 1 first, whatever the submit order
    svc = {
        1: Service(7200.0, 600.0, 900.0, 50.0),
        2: Service(3700.0, 600.0, 900.0, 5.0),
    }
    got = Tiresias(PARAMS, book(svc)).run(
        cluster(1, 1, [pend(1, at=50.0), pend(2, at=5.0)])
    )
    assert starts(got.decisions) == [1]


def test_tiresias_promotes_a_job_starving_longer_than_its_limit_times_its_last_run():
    # both in queue 1, job 2 crossed first; job 1 ran 100 s last and has waited
    # 900 s > 8 x 100: promoted to queue 0, it starts; job 2 (last run 600 s) not
    svc = {
        1: Service(7200.0, 100.0, 100.0, 50.0),
        2: Service(9000.0, 600.0, 100.0, 5.0),
    }
    t = Tiresias(PARAMS, book(svc))
    got = t.run(cluster(1, 1, [pend(1, at=50.0), pend(2, at=5.0)]))
    assert starts(got.decisions) == [1]
    assert t.promotions == 1
    # its service counts afresh from the promotion: queue 0 until 1 GPU-h more
    assert (
        t.queue_of(1, Service(7200.0 + 3599.0, 100.0, 0.0, 50.0, running=True), 1e4)
        == 0
    )
    assert (
        t.queue_of(1, Service(7200.0 + 3601.0, 100.0, 0.0, 50.0, running=True), 1e4)
        == 1
    )


def test_tiresias_without_starvation_keeps_the_crossing_order():
    svc = {
        1: Service(7200.0, 200.0, 100.0, 50.0),
        2: Service(9000.0, 600.0, 100.0, 5.0),
    }
    t = Tiresias(PARAMS, book(svc))
    got = t.run(cluster(1, 1, [pend(1, at=50.0), pend(2, at=5.0)]))
    # job 2 crossed at 100 - 5400 = -5300, job 1 at 100 - 3600 = -3500
    assert starts(got.decisions) == [2]
    assert t.promotions == 0


def test_tiresias_preempts_a_queue_one_job_for_a_waiting_queue_zero_job():
    r = running(1, (100,))
    svc = {1: Service(7200.0, 0.0, 0.0, 0.0, running=True), 2: fresh(990.0)}
    got = Tiresias(PARAMS, book(svc)).run(
        cluster(1, 1, [pend(2, at=990.0)], busy={1: (0,)}, running=(r,))
    )
    assert [d for d in got.decisions if isinstance(d, Preempt)] == [
        Preempt(1, 2, "tiresias: job 2 is in a higher queue")
    ]
    assert waits(got.decisions)[2].reason is Reason.WAITING_FOR_PREEMPTION
    assert got.stats.preempted == 1


def test_tiresias_never_preempts_within_the_top_queue_nor_twice_for_one_start():
    r = running(1, (100,))
    pending = [pend(2, at=990.0)]
    state = cluster(1, 1, pending, busy={1: (0,)}, running=(r,))
    low = {1: Service(1000.0, 0.0, 0.0, 0.0, running=True), 2: fresh(990.0)}
    got = Tiresias(PARAMS, book(low)).run(state)
    assert not [d for d in got.decisions if isinstance(d, Preempt)]
    high = {1: Service(7200.0, 0.0, 0.0, 0.0, running=True), 2: fresh(990.0)}
    stopping = cluster(
        1, 1, pending, busy={1: (0,)}, running=(running(1, (100,), stopping=True),)
    )
    got = Tiresias(PARAMS, book(high)).run(stopping)
    assert not [d for d in got.decisions if isinstance(d, Preempt)]


def test_tiresias_preempts_as_few_jobs_as_the_placement_needs_the_last_first():
    # 2 GPUs, two queue-1 jobs; a 1-GPU job waits: only the one that crossed the
    # threshold last (job 2) is stopped
    rs = (running(1, (100,)), running(2, (101,)))
    svc = {
        1: Service(9000.0, 0.0, 0.0, 0.0, running=True),
        2: Service(4000.0, 0.0, 0.0, 0.0, running=True),
        3: fresh(990.0),
    }
    got = Tiresias(PARAMS, book(svc)).run(
        cluster(1, 2, [pend(3, at=990.0)], busy={1: (0, 1)}, running=rs)
    )
    assert [d.victim_id for d in got.decisions if isinstance(d, Preempt)] == [2]


def tiresias_run(*, ckpt: bool, **opts) -> tuple[list[SimJob], dict]:
    # 1 GPU, threshold 100 GPU-s. A (1000 s) at 0 is in queue 1 from 100; B (50 s)
    # arrives at 200, preempts A (stopped at 230 after the 30 s grace), runs
    # 230-280; A resumes at 280.
    jobs = [sim_job(1, 0, 1000, ckpt=ckpt), sim_job(2, 200, 50, ckpt=ckpt)]
    policy = runner(TiresiasParams(threshold_gpu_s=100.0), {j.id: j for j in jobs})
    sim = Simulator(
        jobs,
        parse_cluster_spec("1x1:p100"),
        PolicyConfig(name="tiresias"),
        SimOptions(preempt_any=True, **opts),
        pass_fn=policy.run,
    )
    return jobs, summarize(sim.run())


def test_tiresias_in_the_simulator_resumes_a_checkpointed_job_with_its_work():
    jobs, out = tiresias_run(
        ckpt=True, checkpoint_interval_s=0.0, restart_overhead_s=0.0
    )
    a, b = jobs
    assert (b.first_start, b.end) == (230, 280)
    # every second of A's first 230 s was kept: 770 s left from 280
    assert a.end == pytest.approx(1050) and a.preemptions == 1 and a.resumes == 1
    assert out["preempted_gpu_s_lost"] == pytest.approx(0.0)
    assert out["preempted_gpu_s_kept"] == pytest.approx(230.0)


def test_a_preempted_job_loses_the_work_since_its_last_checkpoint_and_pays_a_restart():
    jobs, out = tiresias_run(
        ckpt=True, checkpoint_interval_s=100.0, restart_overhead_s=60.0
    )
    a, _ = jobs
    # kept 200 of 230 s; 800 s left plus a 60 s restart from 280
    assert a.end == pytest.approx(280 + 60 + 800)
    assert out["preempted_gpu_s_lost"] == pytest.approx(30.0)
    assert out["resumes"] == 1


def test_a_preempted_job_that_does_not_checkpoint_restarts_from_scratch():
    jobs, out = tiresias_run(ckpt=False)
    a, _ = jobs
    assert a.end == pytest.approx(280 + 1000) and a.resumes == 0
    assert out["preempted_gpu_s_lost"] == pytest.approx(230.0)


def test_a_resumed_job_keeps_its_time_limit_budget():
    # A's limit is 500 s of progress: 230 kept, so it times out 270 s after 280
    jobs = [sim_job(1, 0, 1000, ckpt=True, limit=500), sim_job(2, 200, 50, ckpt=True)]
    policy = runner(TiresiasParams(threshold_gpu_s=100.0), {j.id: j for j in jobs})
    Simulator(
        jobs,
        parse_cluster_spec("1x1:p100"),
        PolicyConfig(name="tiresias"),
        SimOptions(preempt_any=True, checkpoint_interval_s=0, restart_overhead_s=0),
        pass_fn=policy.run,
    ).run()
    assert jobs[0].outcome == "timeout" and jobs[0].end == pytest.approx(550)
