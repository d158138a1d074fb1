"""What makes one policy's tail worse than another's: the jobs, job by job.

Two steps. ``record`` wraps one replay (the simulator's options, ``--out``
required; the decisions are the simulator's own: the wrapper only reads each
pass's decisions) and writes ``<out>.jobs.json``: per finished job its request
(GPUs, time limit, whether the user set it, label), its true run time, its
planned run time when it arrived and when it first started, its submit, first
start and end, its queue time (``metrics.queue_time``), how many passes it
waited by reason, how many as the top blocked job (shown a start, or waiting
for a preemption), its first and last shown start, and its priority breakdown
at its first and last wait; and every start (time, job, backfilled).

``compare A B`` reads two such files of the same case and seed (A the
baseline, e.g. ``slurm``; B the policy looked at) and prints:

- the tail: the jobs at or above B's p99 JCT that are below A's p99 under A,
  and the jobs of each size class whose JCT grew most (``--top``), each with
  its wait under both, its time as the top blocked job under both, and what
  started while it waited under B and not under A: GPU-hours of starts in
  priority order (jobs the order put ahead of it) and of backfilled starts,
  each split by the started job's GPUs (1 / 2-4 / 5-8) and planned run time
  (under / over 6 h, the run-time factor's reference);
- per size class, the sum of JCT differences (B - A, hours) split by how the
  jobs' planned run time compares with the reference, to say which jobs make a
  class's mean worse.

``python bench/tail_causes.py record [simulator options] --out F``,
``python bench/tail_causes.py compare A.jobs.json B.jobs.json [--top N]``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.policy import Start, Wait
from scheduler.policy.state import Reason
from scheduler.sim import cli
from scheduler.sim.engine import Simulator
from scheduler.sim.metrics import queue_time

REF_S = 6 * 3600.0  # the run-time factor's reference (``GPULAB_RUNTIME_REF``)
H = 3600.0


class Recorder(Simulator):
    """The simulator, reading each pass's decisions into per-job records."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        inner = self.run_pass
        self.last: Any = None

        def wrapped(state: Any) -> Any:
            got = inner(state)
            self.last = got
            return got

        self.run_pass = wrapped
        self.reasons: dict[int, Counter[str]] = defaultdict(Counter)
        self.top: Counter[int] = Counter()
        self.first_top: dict[int, float] = {}
        self.shown: dict[int, list[float]] = {}  # job -> [first, last] shown start
        self.first_bd: dict[int, dict[str, float]] = {}
        self.last_bd: dict[int, dict[str, float]] = {}
        self.last_pos: dict[int, int] = {}
        self.planned_arrival: dict[int, float] = {}
        self.planned_start: dict[int, float] = {}
        self.starts: list[tuple[float, int, bool]] = []
        # hours the top blocked job was of each size class (or none was)
        self.top_by_size: Counter[str] = Counter()
        self.prev: tuple[float, str] | None = None

    def _pass(self, now: float, trigger: str) -> None:
        super()._pass(now, trigger)
        got, self.last = self.last, None
        if got is None:
            return
        top = "none"
        for d in got.decisions:
            if type(d) is Start:
                self.starts.append((now, d.job_id, d.backfilled))
                continue
            if type(d) is not Wait:
                continue
            j = d.job_id
            self.reasons[j][str(d.reason)] += 1
            if j not in self.first_bd:
                self.first_bd[j] = dict(d.breakdown)
                self.planned_arrival[j] = self.by_id[j].planned_s
            self.last_bd[j] = dict(d.breakdown)
            self.last_pos[j] = d.position
            if d.est_start is not None or d.reason == Reason.WAITING_FOR_PREEMPTION:
                if top == "none":
                    top = size_class(self.by_id[j].gpus)
                self.top[j] += 1
                self.first_top.setdefault(j, now)
            if d.est_start is not None:
                s = self.shown.setdefault(j, [d.est_start, d.est_start])
                s[1] = d.est_start
        if self.prev is not None:
            self.top_by_size[self.prev[1]] += (now - self.prev[0]) / H
        self.prev = (now, top)

    def _start(self, start: Any, now: float) -> None:
        job = self.by_id[start.job_id]
        if job.first_start is None:
            self.planned_start[job.id] = job.planned_s
            self.planned_arrival.setdefault(job.id, job.planned_s)
        super()._start(start, now)

    def records(self) -> dict[str, Any]:
        jobs = []
        for job in self.jobs:
            if job.state != "done":
                continue
            j = job.id
            jobs.append(
                {
                    "id": j,
                    "gpus": job.gpus,
                    "user": job.user,
                    "label": job.label,
                    "limit_s": job.time_limit,
                    "user_limit": job.user_limit,
                    "run_s": job.ref_duration,
                    "ran_s": job.run_total,
                    "submit": job.submit,
                    "first_start": job.first_start,
                    "end": job.end,
                    "queue_s": queue_time(job),
                    "planned_arrival_s": self.planned_arrival.get(j),
                    "planned_start_s": self.planned_start.get(j),
                    "pred_source": job.pred_source,
                    "reasons": dict(self.reasons.get(j, {})),
                    "top_passes": self.top.get(j, 0),
                    "first_top": self.first_top.get(j),
                    "shown": self.shown.get(j),
                    "first_breakdown": self.first_bd.get(j),
                    "last_breakdown": self.last_bd.get(j),
                    "last_position": self.last_pos.get(j),
                    "preemptions": job.preemptions,
                }
            )
        return {
            "jobs": jobs,
            "starts": self.starts,
            "top_h_by_size": dict(self.top_by_size),
        }


def record(argv: list[str]) -> int:
    holder: dict[str, Recorder] = {}

    class Held(Recorder):
        def run(self) -> Any:
            holder["sim"] = self
            return super().run()

    cli.Simulator = Held  # type: ignore[misc]
    rc = cli.main(argv)
    out = argv[argv.index("--out") + 1]
    Path(out + ".jobs.json").write_text(json.dumps(holder["sim"].records()))
    return rc


def size_class(gpus: int) -> str:
    return "1" if gpus == 1 else "2-4" if gpus <= 4 else "5-8" if gpus <= 8 else "9+"


def p99(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]


def passed(
    data: dict[str, Any], by_id: dict[int, dict[str, Any]], job: dict[str, Any]
) -> dict[str, float]:
    """GPU-hours (GPUs x true run) of the jobs started while ``job`` waited, by
    (backfilled or in order, size class, planned under / over the reference)."""
    starts = data["starts"]
    times = [s[0] for s in starts]
    lo = bisect.bisect_right(times, job["submit"])
    hi = bisect.bisect_left(times, job["first_start"])
    out: Counter[str] = Counter()
    for _t, jid, bf in starts[lo:hi]:
        o = by_id.get(jid)
        if o is None or jid == job["id"]:
            continue
        planned = o["planned_start_s"] or o["limit_s"]
        key = (
            f"{'bf' if bf else 'order'} {size_class(o['gpus'])}"
            f" {'short' if planned < REF_S else 'long'}"
        )
        out[key] += o["gpus"] * o["run_s"] / H
    return dict(out)


def jct(j: dict[str, Any]) -> float:
    return (j["end"] - j["submit"]) / H


def top_h(j: dict[str, Any]) -> float:
    """Hours from its first pass as the top blocked job to its first start."""
    return 0.0 if j["first_top"] is None else (j["first_start"] - j["first_top"]) / H


def line(
    j: dict[str, Any], a: dict[str, Any], da: dict[str, Any], db: dict[str, Any]
) -> str:
    ba = {o["id"]: o for o in da["jobs"]}
    bb = {o["id"]: o for o in db["jobs"]}
    pa, pb = passed(da, ba, a), passed(db, bb, j)
    keys = sorted(set(pa) | set(pb))
    diff = {k: round(pb.get(k, 0.0) - pa.get(k, 0.0)) for k in keys}
    diff = {k: v for k, v in diff.items() if abs(v) >= 20}
    planned = j["planned_arrival_s"]
    rt = (j["first_breakdown"] or {}).get("runtime")
    return (
        f"job {j['id']:5d} {j['gpus']} GPU run {j['run_s'] / H:6.1f} h limit"
        f" {j['limit_s'] / H:5.0f} h{'*' if j['user_limit'] else ' '} planned"
        f" {(planned or 0) / H:6.1f} h (rt {rt if rt is None else round(rt)})"
        f" | JCT {jct(a):6.1f} -> {jct(j):6.1f} | wait {a['queue_s'] / H:6.1f} ->"
        f" {j['queue_s'] / H:6.1f} | top {top_h(a):5.1f} -> {top_h(j):5.1f} h"
        f" | more GPU-h started: {diff}"
    )


def compare(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tail_causes.py compare")
    ap.add_argument("baseline")
    ap.add_argument("policy")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args(argv)
    da = json.loads(Path(args.baseline).read_text())
    db = json.loads(Path(args.policy).read_text())
    ja = {j["id"]: j for j in da["jobs"]}
    jb = {j["id"]: j for j in db["jobs"]}
    common = [i for i in jb if i in ja]
    pa = p99([jct(ja[i]) for i in ja])
    pb = p99([jct(jb[i]) for i in jb])
    print(f"p99 JCT: baseline {pa:.1f} h, policy {pb:.1f} h")
    for name, d in (("baseline", da), ("policy", db)):
        t = d.get("top_h_by_size", {})
        total = sum(t.values()) or 1.0
        shares = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(t.items()))
        print(f"  {name}: time with the top blocked job of each size: {shares}")
    tail = sorted(
        (i for i in common if jct(jb[i]) >= pb and jct(ja[i]) < pa),
        key=lambda i: -jct(jb[i]),
    )
    print(f"\nin the policy's tail (>= {pb:.1f} h), not the baseline's: {len(tail)}")
    for i in tail:
        print(" ", line(jb[i], ja[i], da, db))
    print("\nsum of JCT differences (policy - baseline), h, by size class and plan:")
    sums: dict[str, Counter[str]] = defaultdict(Counter)
    counts: Counter[str] = Counter()
    for i in common:
        b, a = jb[i], ja[i]
        c = size_class(b["gpus"])
        planned = b["planned_arrival_s"] or b["limit_s"]
        k = "short" if planned < REF_S else "long"
        d = jct(b) - jct(a)
        sums[c][k] += d
        sums[c]["worse" if d > 0 else "better"] += d
        counts[c] += 1
    for c in sorted(sums):
        s = sums[c]
        print(
            f"  {c:4s} ({counts[c]} jobs): total {s['short'] + s['long']:+8.0f};"
            f" planned < 6 h {s['short']:+8.0f}, >= 6 h {s['long']:+8.0f};"
            f" jobs worse {s['worse']:+8.0f}, better {s['better']:+8.0f}"
        )
    for c in ("2-4", "5-8", "1"):
        grown = sorted(
            (i for i in common if size_class(jb[i]["gpus"]) == c),
            key=lambda i: jct(ja[i]) - jct(jb[i]),
        )[: args.top]
        print(f"\n{c} GPUs: the {len(grown)} jobs whose JCT grew most")
        for i in grown:
            print(" ", line(jb[i], ja[i], da, db))
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "record":
        return record(argv[1:])
    if argv and argv[0] == "compare":
        return compare(argv[1:])
    sys.stderr.write(__doc__ or "")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
