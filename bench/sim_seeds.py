"""Policy comparison over several seeds: how much of a difference is noise.

The simulator's seed draws what the traces do not say: the made-up users inside
each virtual cluster, the time limits and which jobs have none. One seed's
comparison can mislead: on scenario ``b`` the p99 JCT (its 18th longest of 1,819
jobs) moves by 10-30 % between seeds for the same policy. For each scenario of
``bench/sim_report.py`` this replays every policy on every seed and writes, per seed,
each policy's average and p99 JCT, its Jain index over users, its longest wait
and its ratio to the baseline policy on the same seed; then, per policy, the mean of those ratios, their standard error, the worst
seed and on how many seeds the policy did better, for the average JCT, the p99 JCT
and each size class. Per policy, too, the ratio of each job's wait (queue time: JCT
less time run) to its wait under the baseline on the same seed, over the jobs that
waited more than an hour under the baseline and finished under both: p50, p99 and
max per seed and over all seeds pooled (``wait_ratios``). And per policy and seed,
user by user, the ratio of each user's mean bounded slowdown to the same user's
under the baseline: how many users are better off, how many worse by more than
10 %, the largest ratio, and the worst user's mean under each (``user_ratios``).

``python bench/sim_seeds.py [--only a,b] [--seeds 0-4] [--policies slurm,gpulab]
[--baseline slurm] [--parallel 2] [--reuse] [--max-jobs N] [--out-dir DIR]
[--checkpointable-fraction F] [--max-wait S]
[--variant 'LABEL=POLICY OPTION...']``

``--variant`` (repeatable) names a policy run with simulator options, usable in
``--policies`` like the built-in ones (``tiresias``): for example
``--variant 'gpulab-oracle=gpulab --oracle-runtime --backfill-plan prediction'``.

The co-location scenarios (``--only colo-b,colo-k80``) take the co-location
policies (``gpulab-exclusive``, ``pack-by-memory``, ``gpulab``, ``oracle``) and
variants of them. For those, per policy: the co-location goals' keys summed or
ranged over the seeds (trials, bad trials, jobs over their cap past the window,
bad admissions, trial GPU-hours, trial seconds over a cap) and, when
``gpulab-exclusive`` and ``oracle`` ran too, the share of the oracle's JCT gain
over ``gpulab-exclusive``: per seed, and summed over the seeds (sum of the
policy's gains over the sum of the oracle's) with its standard error as a ratio
estimator over seeds (``colo_share``). One decision changed early moves a
replay's average JCT by hours on these cases, so a share over five seeds is
known to about +-10-20 points: the standard error says how far to trust it.

Writes ``OUT/seeds_<scenario>_<policy>_<seed>.json`` (the simulator's output),
``OUT/sim_seeds.md`` and ``OUT/sim_seeds.json`` (per scenario, the ratio summaries
under ``ratios``, the wait ratios under ``wait_ratios``, the per-user ratios
under ``user_ratios``); prints the Markdown too. Bad options exit 2 naming the
problem; a failed replay is reported and left out, and the exit is 1.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_report import (
    COLO_POLICIES,
    COLO_SCENARIOS,
    POLICIES,
    ROOT,
    SCENARIOS,
    VARIANTS,
    replay,
)

sys.path.insert(0, str(ROOT))
from scheduler.sim.metrics import percentile

SIZE_KEYS = ("1", "2-4", "5-8", "9+")
WAITED_OVER_S = (
    3600.0  # the jobs whose wait ratio is reported: over 1 h in the baseline
)
# a user counts as worse off when their mean slowdown is over the baseline's by
# more than this
USER_WORSE_BY = 0.10


def parse_seeds(text: str) -> list[int]:
    """``0-4`` or ``0,2,7`` (or both: ``0-2,9``) -> sorted distinct seeds."""
    seeds: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if dash else a
        except ValueError:
            raise ValueError(f"--seeds: {part!r} is not a seed or a range") from None
        if a < 0 or b < a:
            raise ValueError(f"--seeds: {part!r} is not a range of seeds >= 0")
        seeds.update(range(a, b + 1))
    if not seeds:
        raise ValueError("--seeds: no seed given")
    return sorted(seeds)


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base - 1, or None when either is missing (or the base is 0)."""
    if value is None or not base:
        return None
    return value / base - 1.0


def summarise(values: list[float | None]) -> dict[str, Any]:
    """Mean, standard error, worst (largest) and count below 0 of the ratios
    that exist; ``n`` says how many seeds had one."""
    got = [v for v in values if v is not None]
    if not got:
        return {"n": 0, "mean": None, "se": None, "worst": None, "better": 0}
    se = statistics.stdev(got) / math.sqrt(len(got)) if len(got) > 1 else None
    return {
        "n": len(got),
        "mean": statistics.fmean(got),
        "se": se,
        "worst": max(got),
        "better": sum(1 for v in got if v < 0),
    }


def metric(result: dict[str, Any], key: str) -> float | None:
    """A result's ``avg_jct_s`` / ``p99_jct_s``, or ``size:<class>``."""
    if key.startswith("size:"):
        value = (result.get("jct_by_size") or {}).get(key[5:])
    else:
        value = result.get(key)
    return None if value is None else float(value)


def max_wait(result: dict[str, Any]) -> float | None:
    """The longest wait of a finished job (``queue_s_by_job``), s."""
    waits = (result.get("queue_s_by_job") or {}).values()
    return max(waits, default=None)


def both_ran(
    runs: dict[tuple[str, int], dict[str, Any]],
    policy: str,
    baseline: str,
    seeds: list[int],
) -> Iterator[tuple[int, dict[str, Any], dict[str, Any]]]:
    """(seed, ``policy``'s result, ``baseline``'s) for each seed where both ran."""
    for seed in seeds:
        mine, base = runs.get((policy, seed)), runs.get((baseline, seed))
        if mine is not None and base is not None:
            yield seed, mine, base


def compare(
    runs: dict[tuple[str, int], dict[str, Any]],
    policies: list[str],
    baseline: str,
    seeds: list[int],
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per policy other than the baseline, per metric: the summary of its ratio
    to the baseline on each seed where both ran."""
    keys = ["avg_jct_s", "p99_jct_s", *(f"size:{k}" for k in SIZE_KEYS)]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for policy in policies:
        if policy == baseline:
            continue
        out[policy] = {}
        for key in keys:
            values = [
                ratio(metric(mine, key), metric(base, key))
                for _seed, mine, base in both_ran(runs, policy, baseline, seeds)
            ]
            out[policy][key] = summarise(values)
    return out


# the two co-location policies every other one's share is measured between
EXCLUSIVE, ORACLE = "gpulab-exclusive", "oracle"
COLO_SUMS = (
    ("exploration_trials", "trials"),
    ("bad_trials", "bad trials"),
    ("over_cap_beyond_window", "over cap past the window"),
    ("bad_admissions", "bad admissions"),
    ("admitted_pairs", "admitted pairs"),
)


def colo_share(
    runs: dict[tuple[str, int], dict[str, Any]], policy: str, seeds: list[int]
) -> dict[str, Any] | None:
    """``policy``'s share of the oracle's average-JCT gain over
    ``gpulab-exclusive``, on the seeds where all three ran: per seed, and summed
    (sum of its gains over the sum of the oracle's) with its standard error (the
    ratio estimator's over seeds: sqrt(n / (n - 1) * sum (g_s - share * G_s)^2) /
    sum G_s). None when no seed has all three, or the oracle gains nothing."""
    gains: list[tuple[int, float, float]] = []
    for seed in seeds:
        mine = runs.get((policy, seed))
        excl = runs.get((EXCLUSIVE, seed))
        orac = runs.get((ORACLE, seed))
        if mine is None or excl is None or orac is None:
            continue
        x, o, m = (metric(r, "avg_jct_s") for r in (excl, orac, mine))
        if x is None or o is None or m is None:
            continue
        gains.append((seed, x - m, x - o))
    total = sum(g for _, _, g in gains)
    if not gains or total <= 0:
        return None
    mine_total = sum(g for _, g, _ in gains)
    share = mine_total / total
    n = len(gains)
    se = (
        math.sqrt(n / (n - 1) * sum((g - share * o) ** 2 for _, g, o in gains)) / total
        if n > 1
        else None
    )
    return {
        "seeds": n,
        "share": share,
        "se": se,
        "gain_h": mine_total / 3600.0,
        "oracle_gain_h": total / 3600.0,
        "by_seed": {str(seed): (g / o if o > 0 else None) for seed, g, o in gains},
    }


def colo_markdown(
    runs: dict[tuple[str, int], dict[str, Any]],
    policies: list[str],
    seeds: list[int],
) -> list[str]:
    """The co-location goals' keys per policy over the seeds, and the share of
    the oracle's gain (``colo_share``)."""
    head = ["policy", "seeds"]
    head += [label for _, label in COLO_SUMS]
    head += [
        "trial GPU-h (mean)",
        "trial s over cap (mean)",
        "share of the oracle's gain",
    ]
    lines = [
        "Co-location over the seeds (counts: the range over seeds and the sum;"
        " the share of the oracle's average-JCT gain over `gpulab-exclusive`,"
        " summed over the seeds, +- its standard error):",
        "",
        "| " + " | ".join(head) + " |",
        "|" + " --- |" * len(head),
    ]
    for p in policies:
        got = [r for seed in seeds if (r := runs.get((p, seed))) is not None]
        if not got:
            continue
        row = [f"`{p}`", str(len(got))]
        for key, _ in COLO_SUMS:
            vals = [v for r in got if (v := metric(r, key)) is not None]
            row.append(
                f"{min(vals):.0f}-{max(vals):.0f} ({sum(vals):.0f})" if vals else "-"
            )
        for key, how in (
            ("trial_lost_gpu_hours", "{:.2f}"),
            ("trial_over_cap_s", "{:,.0f}"),
        ):
            vals = [v for r in got if (v := metric(r, key)) is not None]
            row.append(how.format(statistics.fmean(vals)) if vals else "-")
        share = None if p in (EXCLUSIVE, ORACLE) else colo_share(runs, p, seeds)
        if share is None:
            row.append("-")
        else:
            se = "" if share["se"] is None else f" +- {100 * share['se']:.0f}"
            row.append(
                f"{100 * share['share']:.0f} %{se} ({share['gain_h']:.2f} h of"
                f" {share['oracle_gain_h']:.2f} h)"
            )
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    return lines


def wait_summary(ratios: list[float], unfinished: int) -> dict[str, Any]:
    """p50, p99 and max of per-job wait ratios (``percentile`` of the simulator);
    ``unfinished``: jobs of the set that did not finish under the policy."""
    return {
        "jobs": len(ratios),
        "p50": percentile(ratios, 50),
        "p99": percentile(ratios, 99),
        "max": max(ratios, default=None),
        "unfinished": unfinished,
    }


def wait_ratios(
    runs: dict[tuple[str, int], dict[str, Any]],
    policy: str,
    baseline: str,
    seeds: list[int],
    over_s: float = WAITED_OVER_S,
) -> dict[str, Any] | None:
    """The ratio of each job's wait under ``policy`` to its wait under
    ``baseline`` on the same seed (``queue_s_by_job``: time not running between
    submission and end), over the jobs that waited more than ``over_s`` under
    the baseline: ``wait_summary`` per seed (``by_seed``) and over every seed's
    jobs together (``all``). A job of that set that did not finish under
    ``policy`` has no wait to divide: it is counted in ``unfinished``, not in
    the ratios. None when no seed has both replays with per-job waits."""
    pooled: list[float] = []
    pooled_unfinished = 0
    by_seed: dict[str, dict[str, Any]] = {}
    for seed, mine, base in both_ran(runs, policy, baseline, seeds):
        mq, bq = mine.get("queue_s_by_job"), base.get("queue_s_by_job")
        if mq is None or bq is None:
            continue
        ratios = []
        unfinished = 0
        for job, waited in bq.items():
            if waited <= over_s:
                continue
            got = mq.get(job)
            if got is None:
                unfinished += 1
            else:
                ratios.append(got / waited)
        by_seed[str(seed)] = wait_summary(ratios, unfinished)
        pooled += ratios
        pooled_unfinished += unfinished
    if not by_seed:
        return None
    return {
        "waited_over_s": over_s,
        "by_seed": by_seed,
        "all": wait_summary(pooled, pooled_unfinished),
    }


def user_ratios(
    runs: dict[tuple[str, int], dict[str, Any]],
    policy: str,
    baseline: str,
    seeds: list[int],
    worse_by: float = USER_WORSE_BY,
) -> dict[str, dict[str, Any]]:
    """Per seed, each user's mean bounded slowdown (``user_slowdown``) under
    ``policy`` over the same user's under ``baseline``: how many users both
    replays finished jobs of, how many are better off (ratio under 1), how many
    worse by more than ``worse_by``, the largest ratio and its user, and the
    worst user's mean under each (the largest over users, whoever it is).

    Jain's index over users ranks by how even the users' means are, so a
    policy that slows every user alike scores well (docs/policy.md); this says
    who gains and who loses against the baseline, user by user."""
    out: dict[str, dict[str, Any]] = {}
    for seed, mine, base in both_ran(runs, policy, baseline, seeds):
        mu, bu = mine.get("user_slowdown"), base.get("user_slowdown")
        if not mu or not bu:
            continue
        ratios = {u: mu[u][1] / b[1] for u, b in bu.items() if u in mu and b[1] > 0}
        largest = max(ratios, key=lambda u: (ratios[u], u), default=None)
        out[str(seed)] = {
            "users": len(ratios),
            "better": sum(1 for r in ratios.values() if r < 1.0),
            "worse": sum(1 for r in ratios.values() if r > 1.0 + worse_by),
            "worse_by": worse_by,
            "largest_ratio": None if largest is None else ratios[largest],
            "largest_user": largest,
            "worst_mean": max((v[1] for v in mu.values()), default=None),
            "baseline_worst_mean": max((v[1] for v in bu.values()), default=None),
        }
    return out


def user_markdown(policy: str, baseline: str, users: dict[str, Any]) -> list[str]:
    """The per-user table of one policy (``user_ratios``)."""
    worse_by = next(iter(users.values()))["worse_by"]
    lines = [
        f"Per user, mean bounded slowdown under `{policy}` / under `{baseline}`:",
        "",
        f"| seed | users | better off | worse by > {100 * worse_by:g} %"
        " | largest ratio (user) | worst user's mean, "
        f"`{policy}` / `{baseline}` |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for seed, u in users.items():
        largest = (
            "-"
            if u["largest_user"] is None
            else f"{u['largest_ratio']:.2f} ({u['largest_user']})"
        )
        lines.append(
            f"| {seed} | {u['users']} | {u['better']} | {u['worse']} | {largest}"
            f" | {u['worst_mean']:.1f} / {u['baseline_worst_mean']:.1f} |"
        )
    lines.append("")
    return lines


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f} %"


def hours(value: float | None) -> str:
    return "-" if value is None else f"{value / 3600:.2f}"


def ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def wait_markdown(policy: str, baseline: str, waits: dict[str, Any]) -> list[str]:
    """The wait-ratio table of one policy (``wait_ratios``)."""
    lines = [
        f"Per-job waits, `{policy}` / `{baseline}`, over the jobs that waited more"
        f" than {waits['waited_over_s'] / 3600:g} h under `{baseline}` (wait: time"
        " not running between submission and end):",
        "",
        "| seed | jobs | p50 | p99 | max | not finished |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    rows = [*waits["by_seed"].items(), ("all", waits["all"])]
    for seed, w in rows:
        lines.append(
            f"| {seed} | {w['jobs']} | {ratio_text(w['p50'])} | {ratio_text(w['p99'])}"
            f" | {ratio_text(w['max'])} | {w['unfinished']} |"
        )
    lines.append("")
    return lines


def markdown(
    scenario: str,
    runs: dict[tuple[str, int], dict[str, Any]],
    policies: list[str],
    baseline: str,
    seeds: list[int],
) -> str:
    lines = [f"## ({scenario}) {SCENARIOS[scenario][0]}", ""]
    head = ["seed"]
    for p in policies:
        head += [
            f"{p} avg (h)",
            f"{p} p99 (h)",
            f"{p} Jain (users)",
            f"{p} max wait (h)",
        ]
        if p != baseline:
            head += [f"{p} avg vs {baseline}", f"{p} p99 vs {baseline}"]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for seed in seeds:
        row = [str(seed)]
        base = runs.get((baseline, seed))
        for p in policies:
            r = runs.get((p, seed))
            jain = None if r is None else metric(r, "jain_fairness_users")
            row += [
                hours(None if r is None else metric(r, "avg_jct_s")),
                hours(None if r is None else metric(r, "p99_jct_s")),
                "-" if jain is None else f"{jain:.3f}",
                hours(None if r is None else max_wait(r)),
            ]
            if p != baseline:
                for key in ("avg_jct_s", "p99_jct_s"):
                    row.append(
                        pct(
                            None
                            if r is None or base is None
                            else ratio(metric(r, key), metric(base, key))
                        )
                    )
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lost = []
    for p in policies:
        got = [
            (metric(r, "preemption_lost_gpu_hours"), metric(r, "preemption_lost_share"))
            for seed in seeds
            if (r := runs.get((p, seed))) is not None
        ]
        pairs = [(h, f) for h, f in got if h is not None and f is not None]
        if pairs:
            h = statistics.mean(x for x, _ in pairs)
            f = statistics.mean(y for _, y in pairs)
            lost.append(f"`{p}` {h:.1f} GPU-h ({100 * f:.2f} %)")
    if lost:
        lines += [
            "Work lost to preemption (since the last checkpoint, plus restart"
            " overheads; mean over the seeds, share of busy GPU time): "
            + ", ".join(lost)
            + ".",
            "",
        ]
    if scenario in COLO_SCENARIOS:
        lines += colo_markdown(runs, policies, seeds)
    summary = compare(runs, policies, baseline, seeds)
    names = {"avg_jct_s": "avg JCT", "p99_jct_s": "p99 JCT"}
    for policy, by_key in summary.items():
        lines += [
            f"`{policy}` / `{baseline}` - 1 over the seeds where both ran:",
            "",
            "| metric | seeds | mean | standard error | worst seed | better on |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for key, s in by_key.items():
            if not s["n"]:
                continue
            size = key[5:]
            name = names.get(key) or f"avg JCT, {size} GPU{'' if size == '1' else 's'}"
            se = "-" if s["se"] is None else f"{100 * s['se']:.1f}"
            lines.append(
                f"| {name} | {s['n']} | {pct(s['mean'])} | {se} | {pct(s['worst'])}"
                f" | {s['better']} of {s['n']} |"
            )
        lines.append("")
        waits = wait_ratios(runs, policy, baseline, seeds)
        if waits is not None:
            lines += wait_markdown(policy, baseline, waits)
        users = user_ratios(runs, policy, baseline, seeds)
        if users:
            lines += user_markdown(policy, baseline, users)
    return "\n".join(lines)


def parse_variant(text: str) -> tuple[str, tuple[str, tuple[str, ...]]]:
    """``LABEL=POLICY OPTION...`` -> (label, (policy, options))."""
    label, eq, rest = text.partition("=")
    words = rest.split()
    if not eq or not label.strip() or not words:
        raise ValueError(f"--variant: {text!r} is not LABEL=POLICY [OPTION ...]")
    if words[0] not in POLICIES and words[0] not in COLO_POLICIES:
        raise ValueError(f"--variant: {text!r}: unknown policy {words[0]!r}")
    base = VARIANTS.get(words[0], (words[0], ()))
    return label.strip(), (base[0], (*base[1], *words[1:]))


def run_one(
    scenario: str, policy: str, seed: int, out_dir: Path, args: argparse.Namespace
) -> dict[str, Any] | None:
    name, extra = {**VARIANTS, **args.variants}.get(policy, (policy, ()))
    result = replay(
        scenario,
        name,
        seed,
        out_dir / f"seeds_{scenario}_{policy}_{seed}.json",
        reuse=args.reuse,
        max_jobs=args.max_jobs,
        timeout=args.timeout,
        extra=("--no-check", *extra, *args.common),
    )
    if result is not None:
        sys.stdout.write(
            f"   {scenario}/{policy}/seed {seed}: avg JCT {hours(metric(result, 'avg_jct_s'))} h,"
            f" p99 {hours(metric(result, 'p99_jct_s'))} h\n"
        )
        sys.stdout.flush()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--only", default="a,b", help="scenarios of sim_report, e.g. a,b")
    p.add_argument("--seeds", default="0-4", help="e.g. 0-4 or 0,3,7")
    p.add_argument(
        "--policies",
        default="slurm,gpulab",
        help=f"of {', '.join(POLICIES)} (tiresias: every job checkpointable;"
        " tiresias-free: the same at no preemption cost)",
    )
    p.add_argument("--baseline", default="slurm")
    p.add_argument("--parallel", type=int, default=2, help="replays at once")
    p.add_argument("--max-jobs", type=int)
    p.add_argument("--timeout", type=float, default=3600.0, help="per replay, s")
    p.add_argument(
        "--reuse", action="store_true", help="keep replays already in --out-dir"
    )
    p.add_argument(
        "--checkpointable-fraction",
        type=float,
        help="every policy's replays (tiresias' too) with this seeded share of"
        " checkpointable jobs (use a separate --out-dir per value)",
    )
    p.add_argument(
        "--max-wait",
        type=float,
        help="gpulab's wait bound, s, in every replay (0: none; slurm ignores"
        " it; use a separate --out-dir per value)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="LABEL=POLICY OPTION...: a policy run with simulator options, named"
        " LABEL in --policies (repeatable)",
    )
    args = p.parse_args(argv)
    try:
        args.variants = dict(parse_variant(v) for v in args.variant)
    except ValueError as exc:
        p.error(str(exc))
    frac = args.checkpointable_fraction
    if frac is not None and not 0.0 <= frac <= 1.0:
        p.error(f"--checkpointable-fraction must be in [0, 1], not {frac:g}")
    args.common = () if frac is None else ("--checkpointable-fraction", f"{frac:g}")
    if args.max_wait is not None:
        if not args.max_wait >= 0:
            p.error(f"--max-wait must be 0 or more seconds, not {args.max_wait:g}")
        args.common += ("--max-wait", f"{args.max_wait:g}")
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as exc:
        p.error(str(exc))
    scenarios = [s for s in args.only.split(",") if s]
    policies = [s for s in args.policies.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            p.error(
                f"--only: unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}"
            )
    known = dict.fromkeys((*POLICIES, *COLO_POLICIES, *args.variants))
    bad = [pol for pol in policies if pol not in known]
    if bad:
        p.error(f"--policies: unknown {', '.join(bad)}; choose from {', '.join(known)}")
    if args.baseline not in policies:
        p.error(f"--baseline {args.baseline!r} is not one of --policies")
    if args.parallel < 1:
        p.error("--parallel must be at least 1")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(sc, pol, seed) for sc in scenarios for pol in policies for seed in seeds]
    with ThreadPoolExecutor(args.parallel) as pool:
        done = list(pool.map(lambda j: run_one(*j, out_dir, args), jobs))
    failed = False
    parts = [
        "# Policies over seeds",
        "",
        f"Seeds {', '.join(map(str, seeds))}; ratios are per seed against"
        f" `{args.baseline}` on the same seed (negative: shorter);"
        " `python -m scheduler.sim` with the scenario options of"
        " `bench/sim_report.py` and `--no-check`"
        + (f", `--max-jobs {args.max_jobs}`" if args.max_jobs else "")
        + (f", `{' '.join(args.common)}`" if args.common else "")
        + ".",
        "",
    ]
    summary: dict[str, Any] = {}
    for sc in scenarios:
        runs = {
            (pol, seed): r
            for (s, pol, seed), r in zip(jobs, done, strict=True)
            if s == sc and r is not None
        }
        failed = failed or len(runs) < len(policies) * len(seeds)
        parts.append(markdown(sc, runs, policies, args.baseline, seeds))
        summary[sc] = {
            "baseline": args.baseline,
            "seeds": seeds,
            "ratios": compare(runs, policies, args.baseline, seeds),
            "wait_ratios": {
                pol: wait_ratios(runs, pol, args.baseline, seeds)
                for pol in policies
                if pol != args.baseline
            },
            "user_ratios": {
                pol: user_ratios(runs, pol, args.baseline, seeds)
                for pol in policies
                if pol != args.baseline
            },
        }
        if sc in COLO_SCENARIOS:
            summary[sc]["colo_share"] = {
                pol: colo_share(runs, pol, seeds)
                for pol in policies
                if pol not in (EXCLUSIVE, ORACLE)
            }
    text = "\n".join(parts)
    (out_dir / "sim_seeds.md").write_text(text + "\n")
    (out_dir / "sim_seeds.json").write_text(json.dumps(summary, indent=1) + "\n")
    sys.stdout.write(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
