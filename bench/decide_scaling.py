"""Policy pass cost: wall time of one ``policy.decide`` call (pure, no database) for
100 / 1,000 / 10,000 pending jobs on 64 / 512 / 4,096 GPUs (8-GPU nodes).

Input, seeded and the same every run: nodes of 8 GPUs, a quarter of them NVLink
pairs with NVML topology levels, two GPU models; pending jobs of 1/2/4/8 GPUs
(a few larger than a node: gangs), three classes, 20 groups with decayed usage,
1 in 10 asking for a model, 1 in 10 for a memory minimum. Two fills: ``busy`` (3 in 4
GPUs running, with planned ends, some best-effort: backfill and preemption work) and
``empty`` (every GPU free: the most starts per pass). For preemption by attained
service (a second generator, so the draws above are those of earlier runs): a
third of the running jobs checkpointable with 0-40 GPU-h attained before their
attempt, and 1 in 10 pending jobs resumed checkpointable work with 0-40 GPU-h, so
the LAS order and candidates run. The figures are the median of
``--repeat`` calls, wall time and this thread's CPU time. Goal: under 100 ms for 10,000 pending on 4,096 GPUs.

Prints a table and writes ``<out-dir>/decide_scaling.json``. Needs no database.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler.policy import (  # noqa: E402
    ClassSpec,
    ClusterState,
    GpuView,
    NodeView,
    PendingJob,
    PolicyConfig,
    RunningJob,
    Start,
    Usage,
    decide,
)

NOW = 1_800_000_000.0
CLASSES = {
    "high": ClassSpec("high", 1.0),
    "normal": ClassSpec("normal", 0.5),
    "best-effort": ClassSpec("best-effort", 0.0, preemptible=True),
}


def build(n_gpus: int, n_pending: int, fill: str, policy: str) -> ClusterState:
    rng = random.Random(n_gpus * 7919 + n_pending)
    las = random.Random(n_gpus * 7919 + n_pending + 1)
    per_node = 8
    nodes = []
    gpus = []
    for n in range(n_gpus // per_node):
        nodes.append(NodeView(n, f"node{n:04d}"))
        model = "NVIDIA A100-80GB" if n % 3 else "NVIDIA H100-80GB"
        mem = 81920 if n % 2 else 40960
        nv = n % 4 == 0
        for i in range(per_node):
            topo = tuple(
                (j, 10 if j // 2 == i // 2 else 20 if j // 4 == i // 4 else 50)
                for j in range(per_node)
                if j != i
            )
            gpus.append(
                GpuView(
                    id=n * 100 + i,
                    node_id=n,
                    index=i,
                    memory_total_mib=mem,
                    slots=1,
                    free_slots=1,
                    model=model,
                    nvlink_peers=(i ^ 1,) if nv else (),
                    topology=topo,
                )
            )
    running = []
    if fill == "busy":
        ids = [g.id for g in gpus]
        busy = set()
        jid = 10_000_000
        for g in ids:
            if g in busy or rng.random() > 0.75:
                continue
            k = rng.choice((1, 1, 2, 4))
            node = g // 100
            mine = [x for x in range(g, node * 100 + per_node) if x not in busy][:k]
            busy.update(mine)
            cls = rng.choice(("normal", "normal", "high", "best-effort"))
            running.append(
                RunningJob(
                    jid,
                    tuple(mine),
                    NOW - rng.uniform(0, 36000),
                    rng.uniform(3600, 86400),
                    86400.0,
                    user=f"u{rng.randrange(100)}",
                    group=f"g{rng.randrange(20)}",
                    priority_class=cls,
                    preemptible=cls == "best-effort",
                    checkpointable=las.random() < 1 / 3,
                    prior_gpu_s=las.uniform(0, 40 * 3600.0),
                )
            )
            jid += 1
        gpus = [
            GpuView(**{**g.__dict__, "free_slots": 0}) if g.id in busy else g
            for g in gpus
        ]
    pending = []
    for j in range(n_pending):
        k = rng.choice((1, 1, 1, 2, 2, 4, 8, 8)) if rng.random() > 0.01 else 16
        cls = rng.choice(("normal", "normal", "high", "best-effort"))
        group = f"g{rng.randrange(20)}"
        pending.append(
            PendingJob(
                id=j + 1,
                gpus=k,
                gpu_memory_mib=65536 if rng.random() < 0.1 else None,
                priority_weight=CLASSES[cls].weight,
                submitted_at=NOW - rng.uniform(0, 7 * 86400),
                user=f"u{rng.randrange(100)}",
                group=group,
                priority_class=cls,
                gpu_model="h100" if rng.random() < 0.1 else "",
                planned_s=rng.choice((600.0, 3600.0, 4 * 3600.0, 86400.0)),
                checkpointable=(resumed := las.random() < 0.1),
                attained_gpu_s=las.uniform(0, 40 * 3600.0) if resumed else 0.0,
            )
        )
    usage = Usage(
        group_usage={f"g{i}": rng.uniform(0, 1e6) for i in range(20)},
        user_usage={
            (f"g{i}", f"u{u}"): rng.uniform(0, 1e5) for i in range(20) for u in range(5)
        },
    )
    return ClusterState(
        now=NOW,
        nodes=tuple(nodes),
        gpus=tuple(gpus),
        pending=tuple(pending),
        running=tuple(running),
        usage=usage,
        classes=CLASSES,
        config=PolicyConfig(name=policy),
    )


def calibrate() -> float:
    """ms for a 1,000,000-iteration empty loop: how fast this interpreter and CPU
    are right now, to compare figures across machines (about 20 ms on a recent
    desktop with CPython 3.11)."""
    t0 = time.perf_counter()
    for _ in range(1_000_000):
        pass
    return (time.perf_counter() - t0) * 1000.0


def measure(state: ClusterState, repeat: int) -> dict[str, Any]:
    """Wall and CPU time of ``repeat`` calls. The CPU time (this thread's,
    ``time.thread_time``) leaves out the time other processes hold the cores, so
    on a shared machine it stays near the quiet wall time when the wall time
    does not."""
    times = []
    cpu = []
    decisions: list[Any] = []
    gc.collect()  # no debris from building earlier states in this pass's timing
    for _ in range(repeat):
        c0 = time.thread_time()
        t0 = time.perf_counter()
        decisions = decide(state)
        times.append((time.perf_counter() - t0) * 1000.0)
        cpu.append((time.thread_time() - c0) * 1000.0)
    return {
        "ms_median": round(statistics.median(times), 2),
        "ms_max": round(max(times), 2),
        "cpu_ms_median": round(statistics.median(cpu), 2),
        "starts": sum(1 for d in decisions if isinstance(d, Start)),
        "decisions": len(decisions),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--policies", default="gpulab,slurm,fifo")
    ap.add_argument("--fills", default="busy,empty")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    rows = []
    out_ = sys.stdout.write
    out_(
        f"{'policy':8} {'fill':6} {'GPUs':>6} {'pending':>8} {'ms(med)':>9}"
        f" {'ms(max)':>9} {'cpu ms':>7} {'starts':>7}\n"
    )
    for policy in args.policies.split(","):
        for fill in args.fills.split(","):
            for n_gpus in (64, 512, 4096):
                for n_pending in (100, 1000, 10000):
                    if policy == "fifo" and n_pending * n_gpus > 1000 * 4096:
                        continue  # fifo scans every node per job: minutes, not ms
                    state = build(n_gpus, n_pending, fill, policy)
                    got = measure(state, args.repeat)
                    row = {
                        "policy": policy,
                        "fill": fill,
                        "gpus": n_gpus,
                        "pending": n_pending,
                        **got,
                    }
                    rows.append(row)
                    out_(
                        f"{policy:8} {fill:6} {n_gpus:>6} {n_pending:>8} "
                        f"{got['ms_median']:>9.1f} {got['ms_max']:>9.1f}"
                        f" {got['cpu_ms_median']:>7.1f} {got['starts']:>7}\n"
                    )
                    sys.stdout.flush()
    loop_ms = round(statistics.median(calibrate() for _ in range(5)), 1)
    out_(f"calibration: 1M-iteration empty loop = {loop_ms} ms\n")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "decide_scaling.json"
    out.write_text(
        json.dumps(
            {"python": sys.version.split()[0], "loop_1m_ms": loop_ms, "rows": rows},
            indent=2,
        )
    )
    out_(f"wrote {out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
