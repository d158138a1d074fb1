"""The queue threshold of ``tiresias`` (simulator only), swept on scenario (b).

Tiresias (Gu et al., NSDI 2019) demotes a job from its top queue once its
attained service (GPUs x seconds run) passes a threshold; the paper tunes that
threshold per cluster. This replays scenario ``b`` of ``bench/sim_report.py``
(Gavel-Philly VC 11cb48, time scale 0.63, ``8x4:p100``) with ``--policy tiresias``
for each threshold of ``--grid`` (GPU-hours), every job checkpointable
(``--checkpointable-fraction 1``), under each preemption cost of ``--costs``:
``free`` (``--checkpoint-interval 0 --restart-overhead 0``: the yardstick check,
no work lost and no restart) and ``default`` (the simulator's 1800 s between
checkpoints and 60 s restart overhead). ``slurm`` on the same seed is the
reference row. Prints and writes ``OUT/tiresias_sweep.md`` and
``OUT/tiresias_sweep.json``; the best threshold is the one with the lowest
average JCT under ``free``.

``python bench/tiresias_sweep.py [--grid 0.5,1,2,4,8,16] [--costs free,default]
[--seed 0] [--parallel 2] [--reuse] [--out-dir DIR]``

Exits 2 on bad options, 1 when a replay failed (the others are still reported).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_report import ROOT, replay

COSTS = {
    "free": ("--checkpoint-interval", "0", "--restart-overhead", "0"),
    "default": (),
}
GRID = "0.25,0.5,1,2,4,8,16,32"


def hours(value: float | None) -> str:
    return "-" if value is None else f"{value / 3600:.2f}"


def row(label: str, r: dict[str, Any], base: dict[str, Any] | None) -> str:
    size = r.get("jct_by_size") or {}
    vs = (
        f"{(r['avg_jct_s'] / base['avg_jct_s'] - 1) * 100:+.1f} %"
        if base and base.get("avg_jct_s") and r.get("avg_jct_s")
        else "-"
    )
    promotions = (r.get("tiresias") or {}).get("promotions", "-")
    return (
        f"| {label} | {hours(r.get('avg_jct_s'))} | {vs} | {hours(r.get('p99_jct_s'))}"
        f" | {' / '.join(hours(size.get(k)) for k in ('1', '2-4', '5-8'))}"
        f" | {r.get('preemptions', '-')} | {promotions}"
        f" | {r.get('preempted_gpu_s_lost', 0) / 3600:.1f}"
        f" | {r.get('jain_fairness_users') or 0:.3f} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--grid", default=GRID, help="thresholds, GPU-hours")
    p.add_argument("--costs", default="free,default", help="free, default or both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--timeout", type=float, default=3600.0, help="per replay, s")
    p.add_argument("--reuse", action="store_true", help="keep replays in --out-dir")
    args = p.parse_args(argv)
    try:
        grid = [float(x) for x in args.grid.split(",") if x.strip()]
    except ValueError:
        p.error(f"--grid: not a list of numbers: {args.grid!r}")
    if not grid or any(g <= 0 for g in grid):
        p.error("--grid: give thresholds > 0 (GPU-hours)")
    costs = [c for c in args.costs.split(",") if c]
    unknown = [c for c in costs if c not in COSTS]
    if unknown or not costs:
        p.error(f"--costs: choose from {', '.join(COSTS)} (got {args.costs!r})")
    if args.parallel < 1:
        p.error("--parallel must be at least 1")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def one(item: tuple[str, float | None]) -> dict[str, Any] | None:
        cost, threshold = item
        if threshold is None:
            return replay(
                "b", "slurm", args.seed, out_dir / f"sweep_b_slurm_{args.seed}.json",
                reuse=args.reuse, max_jobs=None, timeout=args.timeout,
                extra=("--no-check",),
            )  # fmt: skip
        extra = (
            "--no-check", "--checkpointable-fraction", "1",
            "--tiresias-threshold", f"{threshold:g}", *COSTS[cost],
        )  # fmt: skip
        name = f"sweep_b_tiresias_{cost}_{threshold:g}_{args.seed}.json"
        got = replay(
            "b", "tiresias", args.seed, out_dir / name, reuse=args.reuse,
            max_jobs=None, timeout=args.timeout, extra=extra,
        )  # fmt: skip
        if (
            got is not None
            and (got.get("tiresias") or {}).get("threshold_gpu_h") != threshold
        ):
            return None  # a reused file of another threshold
        return got

    items: list[tuple[str, float | None]] = [("", None)]
    items += [(c, t) for c in costs for t in grid]
    with ThreadPoolExecutor(args.parallel) as pool:
        done = list(pool.map(one, items))
    base = done[0]
    lines = [
        "# Tiresias queue threshold on (b)",
        "",
        f"Seed {args.seed}; every job checkpointable; `free`: no work lost and no"
        " restart overhead at a preemption; `default`: a checkpoint every 1800 s of"
        " progress and a 60 s restart overhead. Hours; `vs slurm`: average JCT"
        " against `slurm` on the same seed.",
        "",
        "| run | avg JCT | vs slurm | p99 JCT | 1 / 2-4 / 5-8 GPUs | preemptions"
        " | promotions | lost GPU-h | Jain (users) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    if base is not None:
        lines.append(row("`slurm`", base, None))
    best: dict[str, tuple[float, float]] = {}
    summary: list[dict[str, Any]] = []
    for (cost, threshold), r in zip(items, done, strict=True):
        if threshold is None or r is None:
            continue
        lines.append(row(f"`tiresias` {cost}, {threshold:g} GPU-h", r, base))
        summary.append(
            {
                "cost": cost,
                "threshold_gpu_h": threshold,
                **{k: r.get(k) for k in ("avg_jct_s", "p99_jct_s", "jct_by_size")},
                "preemptions": r.get("preemptions"),
                "promotions": (r.get("tiresias") or {}).get("promotions"),
                "jain_fairness_users": r.get("jain_fairness_users"),
            }
        )
        avg = r.get("avg_jct_s")
        if avg is not None and (cost not in best or avg < best[cost][1]):
            best[cost] = (threshold, avg)
    lines.append("")
    for cost, (threshold, avg) in best.items():
        lines.append(
            f"Best threshold ({cost}): {threshold:g} GPU-h, average JCT"
            f" {avg / 3600:.2f} h."
        )
    text = "\n".join(lines) + "\n"
    (out_dir / "tiresias_sweep.md").write_text(text)
    (out_dir / "tiresias_sweep.json").write_text(
        json.dumps(
            {
                "seed": args.seed,
                "slurm": None
                if base is None
                else {
                    k: base.get(k) for k in ("avg_jct_s", "p99_jct_s", "jct_by_size")
                },
                "runs": summary,
                "best": {c: b[0] for c, b in best.items()},
            },
            indent=1,
        )
        + "\n"
    )
    sys.stdout.write("\n" + text)
    return 1 if any(r is None for r in done) else 0


if __name__ == "__main__":
    sys.exit(main())
