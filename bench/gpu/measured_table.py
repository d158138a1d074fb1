"""What we do with the co-location table measured on a real H200 (issue #26).

The harness (``bench/gpu/script.py``) writes, in Gavel's formats, into one folder:
``h200_colocation_pairs.csv`` (Gavel's ``colocation_pairs.csv`` columns, our five
suite jobs, a pair in one order or in both), ``h200_isolated_throughputs.csv`` (not
read here: the replay keeps P100 timing) and ``h200_solo_nvml.csv`` (each suite
job's solo SM busy fraction, memory and power). Subcommands:

- ``to-p100``: a co-location table for the simulator's ``colo-b`` case that keeps
  its P100 timing and takes from the measurement only who slows whom (norm_a,
  norm_b) and what fits: Gavel's P100 1-GPU pairs, each job mapped to a suite
  family (``GAVEL_FAMILY``; Recommendation and A3C by busy fraction, see
  ``family_map``), colocated_x = measured norm_x * Gavel's isolated_x. A pair the
  measurement lacks keeps Gavel's row and is reported.
- ``prior``: the interference model's prior (``Model.estimate`` with no
  knowledge: solo busy fraction and memory only) against each measured slowdown.
- ``replay``: ``colo-b`` with Gavel's table and with the mapped one, same seeds,
  figures side by side.
- ``fake``: a fake measured folder made of Gavel's own P100 pairs (tests the
  pipeline before the real run; its figures mean nothing).

``python -m bench.gpu.measured_table {to-p100,prior,replay,fake} -h``. Bad input
exits non-zero with a message naming the file, line and column.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.gpu.pairs import PAIR_COLUMNS
from bench.gpu.workloads import SUITE as WORKLOADS
from bench.sim_report import (
    COLO_KEYS,
    COLOCATION,
    TABLE_KEYS,
    fmt,
)
from bench.sim_report import (
    replay as sim_replay,
)
from scheduler.policy.interference import DEFAULT_BUSY, Knowledge, Model, Profile

if TYPE_CHECKING:
    from collections.abc import Sequence

PAIRS_FILE = "h200_colocation_pairs.csv"
SOLO_FILE = "h200_solo_nvml.csv"
MAPPED_FILE = "p100_from_h200_colocation_pairs.csv"
SOLO_COLUMNS = ("workload", "busy_fraction", "memory_mib", "power_w")
# The suite's families, in its order (bench.gpu.workloads).
SUITE = tuple(
    fam for name, (fam, _) in WORKLOADS.items() if not name.startswith("fake")
)
# Gavel family -> the suite family measured in its place (same model, or the
# nearest kind of work: LM is an LSTM language model, CycleGAN a conv generator)
GAVEL_FAMILY = {
    "ResNet-18": "ResNet-50",
    "ResNet-50": "ResNet-50",
    "Transformer": "Transformer",
    "LM": "LSTM",
    "CycleGAN": "FCN",
}
# mapped to the suite job whose solo busy fraction is nearest to theirs in the
# simulator, which is DEFAULT_BUSY: the simulator never fills Knowledge.busy
# (Meter.knowledge) and colocate builds Profiles without one, so every workload's
# busy fraction there is the interference model's default
BY_BUSY = ("Recommendation", "A3C")
SIM_BUSY = DEFAULT_BUSY
REPLAY_KEYS = ("avg_jct_s", "p50_jct_s", "p99_jct_s", "avg_queue_s", "gpu_utilization")
REPLAY_COLO = (
    "shared_gpu_fraction", "admitted_pairs", "bad_admissions", "exploration_trials",
    "bad_trials", "requeues", "lost_gpu_hours", "max_true_slowdown",
)  # fmt: skip


def fail(msg: str) -> SystemExit:
    return SystemExit(f"measured_table: {msg}")


def family(job: str) -> str:
    """``"ResNet-50 (batch size 64)"`` -> ``"ResNet-50"``; ``"A3C"`` -> ``"A3C"``."""
    return job.split(" (batch size", 1)[0].strip()


def read_rows(path: Path, columns: Sequence[str]) -> list[tuple[int, dict[str, str]]]:
    """(line, row) of a CSV that must have ``columns``."""
    try:
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in columns if c not in (reader.fieldnames or ())]
            if missing:
                raise fail(f"{path}: missing column(s) {', '.join(missing)}")
            return [(i + 2, row) for i, row in enumerate(reader)]
    except OSError as exc:
        raise fail(f"{path}: {exc.strerror}") from None


def number(path: Path, line: int, row: dict[str, str], col: str) -> float:
    try:
        v = float(row[col])
    except (TypeError, ValueError):
        raise fail(f"{path}:{line}: column {col!r} is not a number") from None
    if not 0 <= v < float("inf"):
        raise fail(f"{path}:{line}: column {col!r} is not >= 0")
    return v


def suite_family(path: Path, line: int, job: str) -> str:
    fam = family(job)
    if fam not in SUITE:
        raise fail(f"{path}:{line}: job {job!r}: family {fam!r} is not a suite one")
    return fam


@dataclass(frozen=True)
class Measured:
    """An ordered family pair (A, B): A's and B's normalised throughputs beside
    each other, averaged over every measured row of either order; ``orders``: 1
    or 2 (measured as (A, B), as (B, A), or both); infeasible if any row was."""

    norm_a: float
    norm_b: float
    feasible: bool
    orders: int


def read_measured(path: Path) -> dict[tuple[str, str], Measured]:
    """Both orientations of every measured pair, keyed by (family A, family B)."""
    seen: dict[tuple[str, str], list[tuple[float, float, bool, bool]]] = {}
    for line, row in read_rows(path, PAIR_COLUMNS):
        fa = suite_family(path, line, row["job_a"])
        fb = suite_family(path, line, row["job_b"])
        if row["feasible"] not in ("0", "1"):
            raise fail(f"{path}:{line}: column 'feasible' must be 0 or 1")
        ok = row["feasible"] == "1"
        na, nb = (number(path, line, row, c) for c in ("norm_a", "norm_b"))
        if ok and min(na, nb) <= 0:
            raise fail(f"{path}:{line}: a feasible pair needs norm_a, norm_b > 0")
        # (norm of the key's first, of its second, feasible, measured in this order)
        seen.setdefault((fa, fb), []).append((na, nb, ok, True))
        seen.setdefault((fb, fa), []).append((nb, na, ok, False))
    out = {}
    for key, got in seen.items():
        ok = all(g[2] for g in got)
        out[key] = Measured(
            statistics.fmean(g[0] for g in got) if ok else 0.0,
            statistics.fmean(g[1] for g in got) if ok else 0.0,
            ok,
            len({g[3] for g in got}) if key[0] != key[1] else 1,
        )
    return out


@dataclass(frozen=True)
class Solo:
    workload: str
    busy: float
    memory_mib: int


def read_solo(path: Path) -> dict[str, Solo]:
    """Suite family -> its solo NVML figures."""
    out = {}
    for line, row in read_rows(path, SOLO_COLUMNS):
        fam = suite_family(path, line, row["workload"])
        busy = number(path, line, row, "busy_fraction")
        if busy > 1:
            raise fail(f"{path}:{line}: busy_fraction {busy} is over 1")
        mem = round(number(path, line, row, "memory_mib"))
        out[fam] = Solo(row["workload"], busy, mem)
    return out


def family_map(gavel: set[str], solo: dict[str, Solo]) -> dict[str, str]:
    """Gavel family -> suite family: ``GAVEL_FAMILY``, or for ``BY_BUSY`` the
    suite job whose measured solo busy fraction is nearest ``SIM_BUSY`` (ties:
    ``SUITE`` order)."""
    out = {}
    for fam in sorted(gavel):
        if fam in GAVEL_FAMILY:
            out[fam] = GAVEL_FAMILY[fam]
        elif fam in BY_BUSY:
            if not solo:
                raise fail(f"Gavel family {fam!r} maps by busy fraction: no solo rows")
            near = [f for f in SUITE if f in solo]
            out[fam] = min(near, key=lambda f: abs(solo[f].busy - SIM_BUSY))
        else:
            raise fail(f"Gavel family {fam!r} maps to no suite workload")
    return out


def gavel_p100(path: Path) -> list[tuple[int, dict[str, str]]]:
    """Gavel's P100 rows of two 1-GPU jobs (the only ones colo-b shares)."""
    return [
        (line, row)
        for line, row in read_rows(path, PAIR_COLUMNS)
        if row["worker_type"] == "p100"
        and row["scale_factor_a"] == row["scale_factor_b"] == "1"
    ]


def to_p100(measured_dir: Path, gavel: Path, out: Path) -> dict[str, Any]:
    """Write the mapped table to ``out``; the summary (also on stderr)."""
    measured = read_measured(measured_dir / PAIRS_FILE)
    solo = read_solo(measured_dir / SOLO_FILE)
    rows = gavel_p100(gavel)
    fmap = family_map({family(r[j]) for _, r in rows for j in ("job_a", "job_b")}, solo)
    written: list[dict[str, Any]] = []
    missing: set[str] = set()
    used: set[frozenset[str]] = set()
    taken = kept = both = infeasible = 0
    for line, row in rows:
        fa, fb = fmap[family(row["job_a"])], fmap[family(row["job_b"])]
        m = measured.get((fa, fb))
        if m is None:
            kept += 1
            missing.add(" + ".join(sorted((fa, fb))))
            written.append({c: row[c] for c in PAIR_COLUMNS})
            continue
        taken += 1
        both += m.orders == 2
        infeasible += not m.feasible
        used.add(frozenset((fa, fb)))
        iso_a, iso_b = (
            number(gavel, line, row, c) for c in ("isolated_a", "isolated_b")
        )
        na, nb = m.norm_a, m.norm_b
        if row["job_a"] == row["job_b"]:  # a job beside itself: one value
            na = nb = (na + nb) / 2
        written.append({
            **{c: row[c] for c in PAIR_COLUMNS[:9]},
            "colocated_a": repr(na * iso_a), "colocated_b": repr(nb * iso_b),
            "norm_a": f"{na:.4f}", "norm_b": f"{nb:.4f}",
            "combined_norm": f"{na + nb:.4f}", "feasible": int(m.feasible),
            "n_at_isolated": (na == 1.0) + (nb == 1.0) if m.feasible else 0,
        })  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=PAIR_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(written)
    unused = {frozenset(k) for k in measured} - used
    summary: dict[str, Any] = {
        "table": str(out),
        "sim_busy": SIM_BUSY,
        "mapping": fmap,
        "mapped_by_busy": {
            f: {"to": fmap[f], "busy": solo[fmap[f]].busy} for f in fmap if f in BY_BUSY
        },
        "gavel_pairs": len(rows),
        "taken": taken,
        "kept": kept,
        "taken_both_orders": both,
        "taken_infeasible": infeasible,
        "missing_family_pairs": sorted(missing),
        "unused_measured_pairs": sorted(" + ".join(sorted(p)) for p in unused),
    }
    sys.stderr.write(
        f"to-p100: {taken} of {len(rows)} Gavel P100 pairs from the measurement "
        f"({both} averaged over both orders, {infeasible} infeasible), {kept} kept "
        f"Gavel's\n  mapping: {fmap}\n  missing: {', '.join(sorted(missing)) or '-'}"
        f"\n  measured, unused: {', '.join(summary['unused_measured_pairs']) or '-'}\n"
    )
    return summary


def prior(measured_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per measured ordered pair (A beside B, feasible ones): the model's prior
    r_AB from the solo figures alone against the measured 1 / norm_A."""
    measured = read_measured(measured_dir / PAIRS_FILE)
    solo = read_solo(measured_dir / SOLO_FILE)
    model = Model(Knowledge())  # no pairs: the estimate is the prior
    rows: list[dict[str, Any]] = []
    for (fa, fb), m in sorted(measured.items()):
        if not m.feasible:
            continue
        for f in (fa, fb):
            if f not in solo:
                raise fail(f"{measured_dir / SOLO_FILE}: no row for family {f!r}")
        a, b = solo[fa], solo[fb]
        est = model.estimate(
            Profile(a.workload, a.memory_mib, a.busy),
            Profile(b.workload, b.memory_mib, b.busy),
        )
        got = 1.0 / m.norm_a
        rows.append({
            "job": a.workload, "beside": b.workload, "predicted": est.slowdown,
            "measured": got, "error": est.slowdown - got,
            "rel_error": est.slowdown / got - 1.0, "orders": m.orders,
        })  # fmt: skip
    errs: list[float] = [r["error"] for r in rows]
    worst = sorted(rows, key=lambda r: -abs(r["rel_error"]))[:3]
    sim = model.estimate(Profile("", 1, None), Profile("", 1, None)).slowdown
    mean = statistics.fmean(errs) if errs else None
    summary: dict[str, Any] = {
        "pairs": len(rows),
        "infeasible": sorted(" + ".join(k) for k, m in measured.items()
                             if not m.feasible and k[0] <= k[1]),
        "median_abs_error": statistics.median(map(abs, errs)) if errs else None,
        "median_abs_rel_error": (
            statistics.median(abs(r["rel_error"]) for r in rows) if rows else None
        ),
        "mean_error": mean,
        "bias": mean and ("over-predicts" if mean > 0 else "under-predicts"),
        "worst": [f"{r['job']} beside {r['beside']}" for r in worst],
        "sim_prior": sim,  # what colo-b's policy assumes for every pair at first
    }  # fmt: skip
    return rows, summary


def prior_markdown(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    out = [
        "| job | beside | prior r | measured r | error | relative |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        out.append(
            f"| {r['job']} | {r['beside']} | {r['predicted']:.3f} | "
            f"{r['measured']:.3f} | {r['error']:+.3f} | {r['rel_error']:+.1%} |"
        )
    if rows:
        out.append(
            f"\n{summary['pairs']} ordered pairs: median |error| "
            f"{summary['median_abs_error']:.3f} ({summary['median_abs_rel_error']:.1%})"
            f", mean error {summary['mean_error']:+.3f} ({summary['bias']}); worst: "
            f"{'; '.join(summary['worst'])}. Infeasible: "
            f"{', '.join(summary['infeasible']) or '-'}. The simulator's prior for "
            f"every pair (default busy, equal memory): {summary['sim_prior']:.3f}."
        )
    return "\n".join(out) + "\n"


def parse_seeds(text: str) -> list[int]:
    """``0-2`` or ``0,3`` -> the seeds."""
    seeds: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or not (hi or lo).isdigit() or int(hi or lo) < int(lo):
            raise fail(f"--seeds: {part!r} is not a seed or a range of seeds")
        seeds.update(range(int(lo), int(hi or lo) + 1))
    if not seeds:
        raise fail("--seeds: no seed given")
    return sorted(seeds)


def run_replay(args: argparse.Namespace) -> int:
    """colo-b (``bench/sim_report.py``'s options, ``--no-check``) with Gavel's
    table and with the mapped one on each seed; a side-by-side table."""
    out_dir = Path(args.out_dir)
    mapped = out_dir / MAPPED_FILE
    summary = to_p100(Path(args.measured_dir), Path(args.gavel_pairs), mapped)
    tables = {"gavel": Path(args.gavel_pairs).resolve(), "h200": mapped.resolve()}
    jobs = [(s, t) for s in parse_seeds(args.seeds) for t in tables]

    def one(job: tuple[int, str]) -> dict[str, Any] | None:
        seed, label = job
        got = sim_replay(
            "colo-b", args.policy, seed, out_dir / f"colo_b_{label}_{seed}.json",
            reuse=False, max_jobs=args.max_jobs, timeout=args.timeout,
            extra=("--colocation", str(tables[label]), "--no-check"),
        )  # fmt: skip
        # the later --colocation wins (argparse); check it did
        if got is not None and got["options"]["colocation"] != str(tables[label]):
            raise fail(f"seed {seed}: replay read {got['options']['colocation']}")
        return got

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        results = dict(zip(jobs, pool.map(one, jobs), strict=True))
    how = {k: (label, h) for k, label, h in (*TABLE_KEYS, *COLO_KEYS)}
    seeds = sorted({s for s, _ in jobs})
    head = " | ".join(f"seed {s} {t}" for s in seeds for t in tables)
    lines = [f"| figure | {head} |", "|---" * (len(jobs) + 1) + "|"]
    for key in (*REPLAY_KEYS, *REPLAY_COLO):
        cells = [fmt((results[j] or {}).get(key), how[key][1]) for j in jobs]
        lines.append(f"| {how[key][0]} | {' | '.join(cells)} |")
    md = "\n".join(lines) + "\n"
    (out_dir / "replay.md").write_text(md)
    figures = {
        f"{s}/{t}": {k: (results[(s, t)] or {}).get(k) for k in how} for s, t in jobs
    }
    (out_dir / "replay.json").write_text(
        json.dumps({"to_p100": summary, "figures": figures}, indent=2) + "\n"
    )
    print(md, end="")
    return 1 if None in results.values() else 0


# fake: each suite job stands for a Gavel P100 job (VGG-19 for ResNet-18, which
# Gavel's table has and the suite does not), with made-up solo figures
FAKE = {
    "FCN (batch size 8)": ("CycleGAN", 0.97, 9000),
    "VGG-19 (batch size 32)": ("ResNet-18 (batch size 32)", 0.93, 7000),
    "ResNet-50 (batch size 64)": ("ResNet-50 (batch size 64)", 0.95, 12000),
    "LSTM (batch size 20)": ("LM (batch size 20)", 0.55, 3000),
    "Transformer (batch size 32)": ("Transformer (batch size 32)", 0.78, 6000),
}


def fake(gavel: Path, out_dir: Path) -> None:
    """A measured folder from Gavel's P100 pairs of the ``FAKE`` stand-ins."""
    rows = {(r["job_a"], r["job_b"]): r for _, r in gavel_p100(gavel)}
    jobs = list(FAKE)
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / PAIRS_FILE).open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=PAIR_COLUMNS, lineterminator="\n")
        w.writeheader()
        for i, a in enumerate(jobs):
            for b in jobs[i + 1 :]:
                ga, gb = FAKE[a][0], FAKE[b][0]
                swap = (ga, gb) not in rows
                r = rows[(gb, ga)] if swap else rows[(ga, gb)]
                names = {"job_a": b, "job_b": a} if swap else {"job_a": a, "job_b": b}
                w.writerow({**r, **names, "worker_type": "h200", "gpu_type": "h200"})
    with (out_dir / SOLO_FILE).open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=SOLO_COLUMNS, lineterminator="\n")
        w.writeheader()
        for job, (_, busy, mem) in FAKE.items():
            w.writerow({"workload": job, "busy_fraction": busy, "memory_mib": mem,
                        "power_w": 300})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.measured_table")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("to-p100", "prior", "replay", "fake"):
        s = sub.add_parser(name)
        s.add_argument("--gavel-pairs", default=str(COLOCATION))
        if name != "fake":
            s.add_argument("--measured-dir", required=True)
    sub.choices["to-p100"].add_argument("--out", required=True, help="mapped CSV")
    sub.choices["to-p100"].add_argument("--summary", help="summary JSON")
    sub.choices["prior"].add_argument("--out-md")
    sub.choices["prior"].add_argument("--out-json")
    sub.choices["fake"].add_argument("--out-dir", required=True)
    r = sub.choices["replay"]
    r.add_argument("--out-dir", required=True)
    r.add_argument("--seeds", default="0-2")
    r.add_argument("--parallel", type=int, default=2, help="replays at once")
    r.add_argument("--policy", default="gpulab")
    r.add_argument("--max-jobs", type=int)
    r.add_argument("--timeout", type=float, default=3600.0, help="per replay, s")
    args = p.parse_args(argv)
    if args.cmd == "to-p100":
        summary = to_p100(
            Path(args.measured_dir), Path(args.gavel_pairs), Path(args.out)
        )
        if args.summary:
            Path(args.summary).write_text(json.dumps(summary, indent=2) + "\n")
        return 0
    if args.cmd == "prior":
        rows, summary = prior(Path(args.measured_dir))
        md = prior_markdown(rows, summary)
        print(md, end="")
        if args.out_md:
            Path(args.out_md).write_text(md)
        if args.out_json:
            text = json.dumps({"pairs": rows, "summary": summary}, indent=2)
            Path(args.out_json).write_text(text + "\n")
        return 0
    if args.cmd == "fake":
        fake(Path(args.gavel_pairs), Path(args.out_dir))
        return 0
    return run_replay(args)


if __name__ == "__main__":
    sys.exit(main())
