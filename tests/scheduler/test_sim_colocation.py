"""Co-location in the simulator: variable-rate physics, out-of-memory joins,
evictions, the noisy measurement, the oracle and the baselines (pure, no DB).

The ground truth is a tiny hand-made table: isolated throughput 10 steps/s for
every workload, so a co-located throughput of 8 is a normalised 0.8."""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import replace
from itertools import product
from typing import TYPE_CHECKING

import pytest

from agents.spec import parse_cluster_spec
from scheduler.policy import (
    ClusterState,
    Evict,
    GpuView,
    NodeView,
    PendingJob,
    PolicyConfig,
    Reason,
    RunningJob,
    Start,
    Wait,
    decide,
)
from scheduler.policy.colocate import Admission
from scheduler.sim import oracle
from scheduler.sim.cli import build_parser, main
from scheduler.sim.colocation import (
    NOISE_SIGMA,
    REPORT_S,
    ColocationTable,
    Meter,
    Segment,
    read_colocation,
)
from scheduler.sim.engine import (
    CLASSES,
    InvariantError,
    PolicyContractError,
    SimOptions,
    Simulator,
)
from scheduler.sim.jobs import SimJob
from scheduler.sim.metrics import summarize
from scheduler.sim.prepare import PrepareOptions, prepare
from scheduler.sim.trace import TraceError, read_trace

if TYPE_CHECKING:
    from pathlib import Path

    from scheduler.policy import Decision

HEADER = (
    "worker_type,gpu_type,consolidated,job_a,scale_factor_a,job_b,scale_factor_b,"
    "isolated_a,isolated_b,colocated_a,colocated_b,norm_a,norm_b,combined_norm,"
    "feasible,n_at_isolated\n"
)
# (job_a, job_b, colocated_a, colocated_b, feasible) on p100, isolated 10 each
P100_ROWS = [
    ("A", "B", 8.0, 7.5, 1),  # 0.8 / 0.75: gain 1.55, slowdowns 1.25 / 1.33
    ("A", "C", 5.0, 4.5, 1),  # gain 0.95: sharing loses
    ("A", "D", 9.0, 6.0, 1),  # gain 1.5 but D 1.67x slower: over the 1.5 cap
    ("B", "C", 0.0, 0.0, 0),  # does not fit in memory
    ("B", "D", 7.0, 7.0, 1),  # 1.43x each: gain 1.4
    ("A", "A", 6.0, 6.0, 1),  # gain 1.2, but 1.67x each
]  # (C, D) and (B, B), (C, C), (D, D): not in the table
NORM = {}
for _a, _b, _ca, _cb, _f in P100_ROWS:
    NORM[(_a, _b)] = _ca / 10 if _f else None
    NORM[(_b, _a)] = _cb / 10 if _f else None
GIB = 1024


def table_csv(tmp_path: Path) -> str:
    lines = [HEADER]
    for a, b, ca, cb, feasible in P100_ROWS:
        lines.append(
            f"p100,p100,1,{a},1,{b},1,10,10,{ca},{cb},{ca / 10},{cb / 10},"
            f"{(ca + cb) / 10},{feasible},0\n"
        )
    lines.append("k80,k80,1,A,1,B,1,5,5,2,2,0.4,0.4,0.8,1,0\n")
    lines.append("p100,p100,1,A,2,B,2,0,0,0,0,,,,0,0\n")  # multi-GPU: left out
    path = tmp_path / "pairs.csv"
    path.write_text("".join(lines))
    return str(path)


@pytest.fixture
def table(tmp_path: Path) -> ColocationTable:
    return read_colocation(table_csv(tmp_path))


def job(
    job_id: int,
    submit: float,
    work: float,
    workload: str = "A",
    *,
    gpus: int = 1,
    shareable: bool = True,
    limit: float = 86400.0,
    cls: str = "normal",
    mem: int | None = 4 * GIB,
) -> SimJob:
    return SimJob(
        id=job_id,
        name=str(job_id),
        submit=submit,
        gpus=gpus,
        ref_duration=work,
        user="u",
        group="g",
        label=workload,
        priority_class=cls,
        time_limit=limit,
        user_limit=True,
        gpu_mem_mib=mem,
        shareable=shareable,
    )


def simulate(jobs, table, decide_fn=decide, *, cluster="1x1:p100", policy="gpulab",
             pass_fn=None, **opts):  # fmt: skip
    """``pass_fn``: a ``run_pass``-like pass instead of ``decide_fn``."""
    more = {"decide_fn": decide_fn} if pass_fn is None else {"pass_fn": pass_fn}
    sim = Simulator(
        jobs,
        parse_cluster_spec(cluster),
        PolicyConfig(name=policy),
        SimOptions(**opts),
        colocation=table,
        **more,
    )
    return sim, sim.run()


def packer(*, trial: bool = False, evict: dict[int, float] | None = None):
    """A scripted policy: oldest first, a free GPU first, else join any GPU with a
    free slot whose jobs are all shareable single-GPU ones (not a pair the state
    says is harmful); ``evict``: job id -> time from which it is evicted."""

    evicted: set[int] = set()

    def policy(state: ClusterState) -> list[Decision]:
        out: list[Decision] = []
        left = {g.id: g.free_slots for g in state.gpus}
        node = {g.id: g.node_id for g in state.gpus}
        residents: dict[int, list[tuple[int, str, bool]]] = {}
        for r in state.running:
            for g in r.gpu_ids:
                ok = r.shareable and len(r.gpu_ids) == 1
                residents.setdefault(g, []).append((r.id, r.workload, ok))
        for r in state.running:
            rs = residents[r.gpu_ids[0]]
            due = evict is not None and state.now >= evict.get(r.id, math.inf)
            if due and len(rs) > 1 and r.id not in evicted:
                evicted.add(r.id)
                partner = next(o for o, _, _ in rs if o != r.id)
                out.append(Evict(r.id, partner, "test", (r.workload, "")))
        harmful = state.knowledge.harmful
        for p in sorted(state.pending, key=lambda p: (p.submitted_at, p.id)):
            free = [g for g in state.gpus if left[g.id] == g.slots]
            if len(free) >= p.gpus:
                ids = tuple(g.id for g in free[: p.gpus])
                out.append(Start.on(p.id, node[ids[0]], ids))
                for g in ids:
                    left[g] -= 1 if p.shareable and p.gpus == 1 else state.gpus[0].slots
                    residents[g] = [(p.id, p.workload, p.shareable and p.gpus == 1)]
                continue
            joined = False
            if p.gpus == 1 and p.shareable:
                for g, rs in sorted(residents.items()):
                    if left[g] < 1 or not all(ok for _, _, ok in rs):
                        continue
                    if any(frozenset((p.workload, w)) in harmful for _, w, _ in rs):
                        continue
                    adm = Admission(
                        p.id, g, admitted=True, rule="trial" if trial else "ok",
                        message="test", trial=trial,
                        partners=tuple(i for i, _, _ in rs),
                    )  # fmt: skip
                    out.append(Start(p.id, Start.on(p.id, node[g], (g,)).placements,
                                     admission=adm))  # fmt: skip
                    left[g] -= 1
                    rs.append((p.id, p.workload, True))
                    joined = True
                    break
            if not joined:
                out.append(Wait(p.id, Reason.RESOURCES, "", 1))
        return out

    return policy


# ------------------------------------------------------------------ the table


def test_the_table_keeps_single_gpu_pairs_both_ways_and_unfit_pairs_as_none(table):
    assert table.norm("p100", "A", "B") == pytest.approx(0.8)
    assert table.norm("P100", "B", "A") == pytest.approx(0.75)  # any case
    assert table.norm("k80", "A", "B") == pytest.approx(0.4)
    assert table.norm("p100", "B", "C") is None  # feasible 0
    assert table.norm("p100", "C", "D") is None  # not in the table
    assert table.combined("p100", "A", "C") == pytest.approx(0.95)
    assert table.combined("p100", "C", "B") == 0.0
    assert table.workloads(["p100"]) == {"A", "B", "C", "D"}
    assert table.workloads(["k80"]) == {"A", "B"}


def test_a_bad_table_names_the_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text(HEADER + "p100,p100,1,A,1,B,1,10,x,8,7,,,,1,0\n")
    with pytest.raises(TraceError, match=r"bad.csv:2: column 'isolated_b'"):
        read_colocation(str(path))
    path.write_text("worker_type,job_a\np100,A\n")
    with pytest.raises(TraceError, match="missing column"):
        read_colocation(str(path))


# ------------------------------------------------------------------ physics


def test_a_pair_progresses_at_the_tables_rates_and_re_rates_when_one_leaves(table):
    # job 1 (A, 100 s of work) alone from 0; job 2 (B, 50 s) joins at 10: A runs at
    # 0.8, B at 0.75, so B ends at 10 + 50 / 0.75; A has done 10 + 0.8 * 66.67 =
    # 63.33 s of work by then and does the rest alone.
    j1, j2 = job(1, 0, 100, "A"), job(2, 10, 50, "B")
    _sim, result = simulate([j1, j2], table, packer())
    b_end = 10 + 50 / 0.75
    a_end = b_end + (100 - 10 - 0.8 * (b_end - 10))
    assert j2.end == pytest.approx(b_end)
    assert j1.end == pytest.approx(a_end)
    assert (j1.outcome, j2.outcome) == ("completed", "completed")
    assert j2.joined_at == 10 and j1.joined_at is None
    out = summarize(result)
    assert out["avg_jct_s"] == pytest.approx((a_end + b_end - 10) / 2)
    # one GPU, busy 0..a_end, shared 10..b_end
    assert out["shared_gpu_fraction"] == pytest.approx((b_end - 10) / a_end)
    assert out["gpu_utilization"] == pytest.approx(1.0)
    assert out["admitted_pairs"] == 1 and out["bad_admissions"] == 0
    assert out["max_true_slowdown"] == pytest.approx(1 / 0.75)
    assert out["over_cap_beyond_window"] == 0
    assert out["requeues"] == 0 and out["lost_gpu_hours"] == 0


def test_the_gpu_model_selects_the_rows(table):
    j1, j2 = job(1, 0, 100, "A"), job(2, 0, 100, "B")
    simulate([j1, j2], table, packer(), cluster="1x1:k80")
    assert j1.end == pytest.approx(100 / 0.4)  # k80 rows: 0.4 each


def test_a_slowed_job_times_out_on_the_wall_clock(table):
    # alone it would need 100 s; beside D it runs at 0.9 and its limit is 105 s
    j1 = job(1, 0, 100, "A", limit=105)
    j2 = job(2, 0, 1000, "D")
    _sim, result = simulate([j1, j2], table, packer())
    assert j1.outcome == "timeout" and j1.end == pytest.approx(105)
    assert j1.done_work == pytest.approx(105 * 0.9)
    out = summarize(result)
    assert out["timeouts"] == 1 and out["colocation"]["shared_timeouts"] == 1


def test_an_unfit_pair_fails_at_start_and_the_later_job_is_requeued(table):
    # B runs; C joins at 10, but (B, C) does not fit: C fails 5 s later, goes back
    # to the queue with its age, and the pair is harmful from then on, so C
    # waits for the GPU; B never noticed it.
    b, c = job(1, 0, 100, "B"), job(2, 10, 30, "C")
    sim, result = simulate([b, c], table, packer(), oom_after_s=5)
    assert b.end == pytest.approx(100)
    assert c.submit == 10 and c.first_start == 10
    assert c.started_at == pytest.approx(100) and c.end == pytest.approx(130)
    assert result.oom_failures == 1 and result.requeues == 1
    assert frozenset(("B", "C")) in sim.meter.knowledge().harmful
    out = summarize(result)
    assert out["lost_gpu_hours"] == pytest.approx(5 / 3600)
    assert out["bad_admissions"] == 1  # a pair that does not fit is a bad one
    assert out["shared_gpu_fraction"] == pytest.approx(5 / 130)


def test_a_joiner_whose_unfit_partner_leaves_before_it_fails_runs_on(table):
    # C joins B at 10 and would fail at 70, but B ends at 40: C loads and runs
    b, c = job(1, 0, 40, "B"), job(2, 10, 30, "C")
    _sim, result = simulate([b, c], table, packer(), oom_after_s=60)
    assert result.oom_failures == 0 and c.attempt == 1
    assert c.end == pytest.approx(40 + 30)
    assert summarize(result)["bad_admissions"] == 1


def test_a_pair_the_table_lacks_is_out_of_memory_too(table):
    c, d = job(1, 0, 100, "C"), job(2, 0, 30, "D")
    _sim, result = simulate([c, d], table, packer())
    assert result.oom_failures == 1
    assert d.end == pytest.approx(130)


def test_evict_requeues_the_job_and_loses_its_work(table):
    # A (100 s) and D (300 s) share from 0: D at 0.6, A at 0.9. The policy
    # evicts D at the periodic pass at 60: D did 36 s of work, lost; A goes on
    # alone; D restarts from scratch after A, its age kept.
    a, d = job(1, 0, 100, "A"), job(2, 0, 300, "D")
    sim, result = simulate([a, d], table, packer(evict={2: 60.0}), period_s=60)
    assert result.evictions == 1 and result.requeues == 1
    assert result.evicted_work_s == pytest.approx(60 * 0.6)
    assert a.end == pytest.approx(60 + (100 - 60 * 0.9))
    assert d.submit == 0 and d.started_at == pytest.approx(a.end)
    assert d.end == pytest.approx(a.end + 300)
    assert d.run_total == pytest.approx(60 + 300)
    assert frozenset(("A", "D")) in sim.meter.knowledge().harmful
    out = summarize(result)
    assert out["lost_gpu_hours"] == pytest.approx(36 / 3600)
    assert out["max_true_slowdown"] == pytest.approx(1 / 0.6)


def test_an_evict_naming_no_partner_is_a_policy_bug(table):
    def bogus(state: ClusterState) -> list[Decision]:
        if state.running:
            return [Evict(state.running[0].id, 99, "x")]
        return packer()(state)

    with pytest.raises(PolicyContractError, match="does not share"):
        simulate([job(1, 0, 100)], table, bogus)


def test_a_job_over_its_cap_past_the_window_is_counted(table):
    # nothing evicts D (1.67x beside A, cap 1.5): over its cap for 20 min
    a, d = job(1, 0, 1200 * 0.9, "A"), job(2, 0, 5000, "D")
    _sim, result = simulate([a, d], table, packer())
    out = summarize(result)
    assert d.over_cap_s == pytest.approx(1200)
    assert out["over_cap_beyond_window"] == 1
    assert out["colocation"]["over_cap_window_s"] == 600 + 60
    # the same pair under a best-effort D (no cap) is not over anything
    a, d = job(1, 0, 1200 * 0.9, "A"), job(2, 0, 5000, "D", cls="best-effort")
    _sim, result = simulate([a, d], table, packer())
    assert summarize(result)["over_cap_beyond_window"] == 0


# ------------------------------------------------------------------ invariants


def test_a_join_beyond_the_slots_or_beside_an_exclusive_job_is_refused(table):
    def join_first(state: ClusterState) -> list[Decision]:
        if not state.running:
            return packer()(state)
        g = state.running[0].gpu_ids[0]
        partners = tuple(r.id for r in state.running)
        return [
            Start(
                p.id,
                Start.on(p.id, 1, (g,)).placements,
                admission=Admission(
                    p.id, g, admitted=True, rule="ok", message="", partners=partners
                ),
            )
            for p in state.pending
        ]

    jobs = [job(1, 0, 100, "A", shareable=False), job(2, 1, 10, "B")]
    with pytest.raises(PolicyContractError, match="held exclusively"):
        simulate(jobs, table, join_first)
    jobs = [job(1, 0, 100, "A"), job(2, 1, 10, "B"), job(3, 1, 10, "B")]
    with pytest.raises(PolicyContractError, match="over-allocation"):
        simulate(jobs, table, join_first)
    jobs = [job(1, 0, 100, "A", gpus=2), job(2, 1, 10, "B")]
    with pytest.raises(PolicyContractError, match="held exclusively"):
        simulate(jobs, table, join_first, cluster="1x2:p100")


def mixed_jobs(seed: int) -> list[SimJob]:
    rng = random.Random(seed)
    jobs = []
    for i in range(1, 120):
        gpus = rng.choice((1, 1, 1, 2))
        jobs.append(
            job(
                i, i * 20.0, rng.uniform(100, 2000), rng.choice("ABCD"), gpus=gpus,
                shareable=gpus == 1 and rng.random() < 0.8,
                cls=rng.choice(("normal", "best-effort")),
                limit=rng.choice((86400.0, 1500.0)),
            )
        )  # fmt: skip
    return jobs


@pytest.mark.parametrize("policy", ["pack-by-memory", "gpulab"])
def test_invariants_hold_and_work_is_conserved_under_heavy_sharing(table, policy):
    # the per-pass check (slots, only shareable single-GPU jobs share, books) runs
    # in every pass; work is checked at every completion
    jobs = mixed_jobs(3)
    # pack-by-memory retries a pair that does not fit (its rule ignores what was
    # learned) every ``oom_after_s`` while the partner runs: keep that rare here
    sim, result = simulate(
        jobs, table, policy=policy, cluster="2x2:p100", oom_after_s=600
    )
    assert result.admissions
    assert all(j.state == "done" for j in jobs), policy
    assert not sim.occupants and not sim.shared_gpus
    for j in jobs:
        if j.outcome == "completed":
            assert j.done_work == pytest.approx(j.run_duration)
    sharers = {jid for a in result.admissions for jid in a[1:3]}
    assert all(sim.by_id[i].gpus == 1 and sim.by_id[i].shareable for i in sharers)
    assert result.shared_gpu_s <= result.busy_gpu_s


def test_the_check_catches_a_broken_physics(table):
    sim = Simulator(
        [job(1, 0, 100, "A"), job(2, 0, 100, "B")],
        parse_cluster_spec("1x1:p100"),
        PolicyConfig(),
        colocation=table,
        decide_fn=packer(),
    )
    for j in sim.jobs:
        sim._arrive(j, 0.0)
    sim._start(Start.on(1, 1, (1,)), 0.0)
    sim._check()
    # break the books on purpose: an exclusive job on the shared GPU
    sim.by_id[2].slots_taken = 2
    sim.occupants[1].append(2)
    sim.used[1] += 2
    with pytest.raises(InvariantError):
        sim._check()


# ------------------------------------------------------------------ measurement


def test_the_analytic_mean_of_n_reports_has_the_spread_of_n_reports():
    meter = Meter(seed=5)
    n = 25
    means = []
    for _ in range(3000):
        seg = Segment(0.0, 0.5, partners=(7,))
        # in two instalments, as a pass and then the segment's end would draw them
        meter.advance(seg, 10 * REPORT_S + 1, ("A", "p100"))
        meter.advance(seg, n * REPORT_S + 30, ("A", "p100"))
        assert seg.n == n
        means.append(seg.sum_log / n)
    assert statistics.fmean(means) == pytest.approx(math.log(0.5), abs=0.002)
    assert statistics.stdev(means) == pytest.approx(
        NOISE_SIGMA / math.sqrt(n), rel=0.08
    )


def test_the_measured_slowdown_converges_to_the_tables(table):
    # B runs alone for an hour (its solo rate: 60 reports), then A joins for
    # 10 hours: B's measured slowdown tends to 1 / 0.75 within the noise, and
    # none is shown before 2 minutes of reports. B ends first; A then runs alone
    # for 10 minutes, which gives A's solo rate and so A's side of the episode.
    seen: list[tuple[float, float | None, float]] = []

    def spy(state: ClusterState) -> list[Decision]:
        for r in state.running:
            if r.id == 1 and r.joined_at is None and len(state.running) == 2:
                seen.append((state.now, r.measured_slowdown, r.measured_for_s))
        return packer()(state)

    b = job(1, 0, 3600 + 36000 * 0.75, "B")
    a = job(2, 3600, 36000 * 0.8 + 600, "A")
    sim, result = simulate([b, a], table, spy)
    early = [s for t, s, _ in seen if t < 3600 + 2 * REPORT_S]
    assert early and all(s is None for s in early)
    late = [(s, f) for t, s, f in seen if t > 3600 + 5 * 3600]
    assert late
    # solo: 60 reports, shared: 300+: log-sd about 0.05 * sqrt(1/60 + 1/300)
    tol = 4 * NOISE_SIGMA * math.sqrt(1 / 60 + 1 / 300)
    for s, f in late:
        assert s is not None and abs(math.log(s) - math.log(1 / 0.75)) < tol
        assert f >= 5 * 3600
    assert b.end == pytest.approx(3600 + 36000) and a.end == pytest.approx(40200)
    # the episode's end taught both directions of the pair: B's at once, A's once
    # A's solo rate was measured (10 reports)
    pairs = sim.meter.knowledge().pairs
    assert pairs[("B", "A")].n == 1
    assert math.log(pairs[("B", "A")].slowdown) == pytest.approx(
        math.log(1 / 0.75), abs=tol
    )
    assert pairs[("A", "B")].n == 1
    tol_a = 4 * NOISE_SIGMA * math.sqrt(1 / 10 + 1 / 600)
    assert math.log(pairs[("A", "B")].slowdown) == pytest.approx(
        math.log(1 / 0.8), abs=tol_a
    )
    assert result.observations == 2


def test_trials_are_counted_apart_and_fill_trials_last_hour(table):
    budgets: list[dict] = []

    def spy(state: ClusterState) -> list[Decision]:
        budgets.append(dict(state.trials_last_hour))
        return packer(trial=True)(state)

    a, c = job(1, 0, 100, "A"), job(2, 0, 100, "C")
    _sim, result = simulate([a, c], table, spy, period_s=600)
    out = summarize(result)
    assert out["exploration_trials"] == 1 and out["bad_trials"] == 1
    assert out["admitted_pairs"] == 0 and out["bad_admissions"] == 0
    assert {frozenset(("A", "C")): 1} in budgets


# ------------------------------------------------------------------ policies


def state_for(resident: str, candidate: str, *, cap_r=1.5, cap_c=1.5) -> ClusterState:
    gpu = GpuView(1, 1, 0, 16 * GIB, slots=2, free_slots=1, model="p100")
    run = RunningJob(
        1, (1,), 0.0, 3600.0, 3600.0, user="u", group="g", shareable=True,
        workload=resident, gpu_memory_mib=4 * GIB, slowdown_cap=cap_r,
    )  # fmt: skip
    pend = PendingJob(
        2, 1, 4 * GIB, 0.5, 10.0, user="u", group="g", shareable=True,
        workload=candidate, slowdown_cap=cap_c,
    )  # fmt: skip
    return ClusterState(
        now=20.0,
        nodes=(NodeView(1, "n1"),),
        gpus=(gpu,),
        pending=(pend,),
        running=(run,),
        classes=CLASSES,
        config=PolicyConfig(name=oracle.NAME),
    )


@pytest.mark.parametrize("caps", [(1.5, 1.5), (None, None), (None, 1.5)])
def test_the_oracle_admits_exactly_the_pairs_the_rules_admit_with_true_values(
    table, caps
):
    cfg = PolicyConfig()
    run_oracle = oracle.runner(table, ["p100"])
    for resident, candidate in product("ABCD", repeat=2):
        st = state_for(resident, candidate, cap_r=caps[0], cap_c=caps[1])
        ds = run_oracle(st).decisions
        shared = [d for d in ds if isinstance(d, Start) and d.admission is not None]
        n_rc, n_cr = NORM.get((resident, candidate)), NORM.get((candidate, resident))
        want = (
            n_rc is not None
            and n_cr is not None
            and n_rc + n_cr > 1 + cfg.colo_gain_margin
            and (caps[0] is None or 1 / n_rc <= caps[0])
            and (caps[1] is None or 1 / n_cr <= caps[1])
        )
        assert bool(shared) == want, (resident, candidate, caps)
        if shared:
            assert not shared[0].admission.trial


def test_the_oracle_never_admits_a_bad_pair_in_a_replay(table):
    rng = random.Random(1)
    jobs = [
        job(i, i * 30.0, rng.uniform(200, 3000), rng.choice("ABCD"))
        for i in range(1, 80)
    ]
    _sim, result = simulate(jobs, table, policy=oracle.NAME, cluster="1x2:p100",
                            pass_fn=oracle.runner(table, ["p100"]))  # fmt: skip
    out = summarize(result)
    assert out["admitted_pairs"] > 0
    assert out["bad_admissions"] == 0 and out["exploration_trials"] == 0
    assert out["requeues"] == 0
    assert out["max_true_slowdown"] <= 1.5


def test_the_oracle_never_evicts_on_noise(table):
    # D beside B is truly 1.43x, under its 1.5 cap; a measurement of 1.6x for
    # the window (noise) makes the pass's rule evict, but the oracle knows better
    st = state_for("D", "B")
    run = replace(
        st.running[0], joined_at=5.0, measured_slowdown=1.6, measured_for_s=900.0
    )
    other = replace(run, id=3, joined_at=None, measured_slowdown=1.43, workload="B")
    gpu = replace(st.gpus[0], free_slots=0)
    st = replace(st, running=(run, other), gpus=(gpu,), pending=())
    assert any(isinstance(d, Evict) for d in decide(replace(st, config=PolicyConfig())))
    assert not oracle.runner(table, ["p100"])(st).decisions


def _baseline_jobs():
    # A then C: sharing loses (gain 0.95) but fits in memory
    return [job(1, 0, 1000, "A"), job(2, 0, 1000, "A"), job(3, 5, 100, "C")]


def test_gpulab_exclusive_never_shares(table):
    jobs = _baseline_jobs()
    _sim, result = simulate(jobs, table, policy="gpulab-exclusive", cluster="1x2:p100")
    out = summarize(result)
    assert out["shared_gpu_fraction"] == 0 and not result.admissions
    assert jobs[2].first_start == pytest.approx(1000)


def test_pack_by_memory_shares_whatever_the_gain(table):
    jobs = _baseline_jobs()
    _sim, result = simulate(jobs, table, policy="pack-by-memory", cluster="1x2:p100")
    out = summarize(result)
    assert jobs[2].first_start == 5 and out["admitted_pairs"] == 1
    assert out["bad_admissions"] == 1 and out["bad_admission_rate"] == 1.0


def test_pack_by_memory_still_needs_a_known_memory_need(table):
    jobs = [job(1, 0, 1000, "A", mem=None), job(2, 5, 100, "B", mem=None)]
    _sim, result = simulate(jobs, table, policy="pack-by-memory")
    assert not result.admissions


# ------------------------------------------------------------------ trace and CLI


def test_shareable_from_the_column_else_from_the_table(tmp_path, table):
    nodes = parse_cluster_spec("1x4:p100")
    with_col = tmp_path / "c.csv"
    with_col.write_text(
        "job_id,submit_time,num_gpus,duration,workload,shareable\n"
        "a,0,1,10,Z,1\nb,0,1,10,A,0\n"
    )
    _, raw = read_trace(str(with_col))
    got = prepare("canonical", raw, nodes, None, PrepareOptions(), table)
    assert [j.shareable for j in got.jobs] == [True, False]
    without = tmp_path / "w.csv"
    without.write_text(
        "job_id,submit_time,num_gpus,duration,workload\n"
        "a,0,1,10,A\nb,0,2,10,A\nc,0,1,10,Z\nd,0,1,10,\n"
    )
    _, raw = read_trace(str(without))
    got = prepare("canonical", raw, nodes, None, PrepareOptions(), table)
    assert [j.shareable for j in got.jobs] == [True, False, False, False]
    assert any(a.startswith("shareable:") for a in got.assumptions)
    got = prepare("canonical", raw, nodes, None, PrepareOptions(), None)
    assert not any(j.shareable for j in got.jobs)
    k80 = prepare("canonical", raw, parse_cluster_spec("1x4:k80"), None,
                  PrepareOptions(), table)  # fmt: skip
    assert [j.shareable for j in k80.jobs] == [True, False, False, False]
    philly = tmp_path / "p.csv"
    philly.write_text(
        "timestamp,duration,num_gpus,cluster\n2017-10-01 00:00:00,10,1,vc\n"
    )
    _, raw = read_trace(str(philly))
    got = prepare("philly", raw, nodes, None, PrepareOptions(), table)
    assert not got.jobs[0].shareable


def test_an_assumed_memory_fraction_declares_memory_for_shareable_jobs(tmp_path, table):
    path = tmp_path / "w.csv"
    path.write_text(
        "job_id,submit_time,num_gpus,duration,workload,gpu_mem_mib\n"
        "a,0,1,10,A,\nb,0,1,10,A,2000\nc,0,2,10,A,\n"
    )
    _, raw = read_trace(str(path))
    opts = PrepareOptions(assume_memory_fraction=0.45)
    got = prepare("canonical", raw, parse_cluster_spec("1x4:p100"), None, opts, table)
    assert [j.gpu_mem_mib for j in got.jobs] == [int(0.45 * 16384), 2000, None]


def test_cli_reports_the_colocation_keys_and_needs_the_table_for_the_oracle(
    tmp_path, capsys
):
    trace = tmp_path / "t.csv"
    trace.write_text(
        "job_id,submit_time,num_gpus,duration,workload,gpu_mem_mib\n"
        + "".join(f"j{i},{i * 5},1,{300 + i * 17 % 200},{'ABD'[i % 3]},4096\n"
                  for i in range(30))
    )  # fmt: skip
    pairs = table_csv(tmp_path)
    base = ["--trace", str(trace), "--cluster", "1x2:p100", "--quiet"]
    assert main([*base, "--policy", "oracle"]) == 2
    assert "--colocation" in capsys.readouterr().err
    out = tmp_path / "o.json"
    args = [*base, "--colocation", pairs, "--policy", "oracle", "--out", str(out)]
    assert main(args) == 0
    got = json.loads(out.read_text())
    for key in (
        "shared_gpu_fraction", "admitted_pairs", "bad_admissions",
        "exploration_trials", "bad_trials", "requeues", "lost_gpu_hours",
        "max_true_slowdown", "p99_true_slowdown", "over_cap_beyond_window",
    ):  # fmt: skip
        assert key in got
    assert got["admitted_pairs"] > 0 and got["bad_admissions"] == 0
    assert got["options"]["gpu_job_limit"] == 2
    assert main([*base, "--colocation", pairs, "--gpu-job-limit", "1",
                 "--policy", "pack-by-memory", "--out", str(out)]) == 0  # fmt: skip
    assert json.loads(out.read_text())["admitted_pairs"] == 0


def test_what_exploration_trials_cost_is_counted_apart(table):
    # the eviction above, admitted as a trial: D's 36 s of work are lost to the
    # trial, and D ran 1.67x slower (over its 1.5 cap) for the trial's 60 s
    a, d = job(1, 0, 100, "A"), job(2, 0, 300, "D")
    _sim, result = simulate([a, d], table, packer(trial=True, evict={2: 60.0}),
                            period_s=60)  # fmt: skip
    out = summarize(result)
    assert out["trial_lost_gpu_hours"] == pytest.approx(36 / 3600)
    assert out["trial_over_cap_s"] == pytest.approx(60)
    # a trial pair that loses: A (0.5) and C (0.45) do 0.95 GPU's worth until A
    # ends at 200 s: 10 s of the GPU lost; both ran over their cap (2x, 2.2x)
    a, c = job(1, 0, 100, "A"), job(2, 0, 1000, "C")
    _sim, result = simulate([a, c], table, packer(trial=True))
    out = summarize(result)
    assert a.end == pytest.approx(200)
    assert out["trial_lost_gpu_hours"] == pytest.approx(10 / 3600)
    assert out["trial_over_cap_s"] == pytest.approx(400)
    # a trial pair that does not fit: the joiner's 5 s on the GPU
    b, c = job(1, 0, 100, "B"), job(2, 10, 30, "C")
    _sim, result = simulate([b, c], table, packer(trial=True), oom_after_s=5)
    assert summarize(result)["trial_lost_gpu_hours"] == pytest.approx(5 / 3600)
    # the same pairs admitted as known pairs cost no trial anything
    a, c = job(1, 0, 100, "A"), job(2, 0, 1000, "C")
    _sim, result = simulate([a, c], table, packer())
    out = summarize(result)
    assert out["trial_lost_gpu_hours"] == 0 and out["trial_over_cap_s"] == 0
    assert out["over_cap_beyond_window"] == 0 and a.over_cap_s == pytest.approx(200)


def test_the_known_pair_rule_is_on_by_default_and_off_by_name(capsys):
    base = ["--trace", "t.csv", "--cluster", "1x1:p100"]
    assert build_parser().parse_args(base).colo_evict_z == 2.0
    assert (
        build_parser().parse_args([*base, "--colo-evict-z", "OFF"]).colo_evict_z is None
    )
    assert (
        build_parser().parse_args([*base, "--colo-evict-z", "2.5"]).colo_evict_z == 2.5
    )
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*base, "--colo-evict-z", "-1"])
    assert exc.value.code == 2 and "--colo-evict-z" in capsys.readouterr().err
