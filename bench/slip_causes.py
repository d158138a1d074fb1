"""Why shown start times slip: one replay, each slipped reservation classified.

A reservation slips (``scheduler.sim.progress``) when a job starts more than
max(60 s, 10 % of the promised wait) after the earliest start time shown to it
while it waited. This wraps the simulator (the decisions are the simulator's own:
the wrapper only reads each pass's state and decisions) and, for each job shown a
start, keeps the pass that showed its earliest deadline: the running jobs whose
planned ends fell by that start (the reservation's releases), which of them read
progress, and the job it was shown to wait for last (``behind``). At the job's first
start past its deadline, the slip is put in one class:

- ``ends_late``: a running job planned to end by the shown start ended past the
  deadline, and the job stayed the top blocked job (it was shown a start at every
  pass until it started): the plan's predicted ends were too early;
- ``displaced``: every job planned to end by then ended in time, but in some pass
  after the shown one another job was the top blocked job (a job ahead in
  priority, or one planned by preemption): the GPUs went to others;
- ``both``: a late end and a displacement;
- ``other``: neither (the reservation moved to other GPUs, or jobs started ahead
  on the GPUs it would have taken).

It also counts the slips against the last start shown (not the earliest): how
many are slips only because an earlier, more optimistic start was shown.

``python bench/slip_causes.py [simulator options]`` (the same as
``python -m scheduler.sim``; ``--out`` is required) prints a JSON summary on stdout.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.policy import Wait
from scheduler.policy.index import _planned_end
from scheduler.policy.state import Reason
from scheduler.sim import cli
from scheduler.sim.engine import Simulator
from scheduler.sim.progress import SLIP_MIN_S, SLIP_SHARE

BEHIND = re.compile(r"when job (\d+) is planned to end")


def _deadline(now: float, est: float) -> float:
    return est + max(SLIP_MIN_S, SLIP_SHARE * max(0.0, est - now))


class Instrumented(Simulator):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        inner = self.run_pass
        self.last: tuple[Any, Any] | None = None

        def wrapped(state: Any) -> Any:
            got = inner(state)
            self.last = (state, got)
            return got

        self.run_pass = wrapped
        # job -> (deadline, shown at, est, behind, {running id: (started, planned
        # end, reads progress)})
        self.first: dict[int, tuple[float, float, float, int | None, dict]] = {}
        self.latest: dict[int, float] = {}  # job -> deadline of the last shown
        self.displaced: set[int] = set()
        self.ended: dict[tuple[int, float], float] = {}  # (job, started) -> end
        self.classes: Counter[str] = Counter()
        self.late_by: list[float] = []  # s past the deadline of the late release
        self.late_progress = Counter()  # late releases: planned from progress?
        self.slipped_vs_last = 0
        self.waited_for_preemption = 0

    def _pass(self, now: float, trigger: str) -> None:
        super()._pass(now, trigger)
        if self.last is None:
            return
        state, got = self.last
        self.last = None
        cfg = state.config
        pred, prog = cfg.plans_with_prediction, cfg.plans_with_progress
        top: int | None = None
        for d in got.decisions:
            if not isinstance(d, Wait):
                continue
            if d.reason == Reason.WAITING_FOR_PREEMPTION:
                top = d.job_id
            if d.est_start is None:
                continue
            top = d.job_id
            job = self.by_id[d.job_id]
            if job.first_start is not None:
                continue
            dl = _deadline(now, d.est_start)
            self.latest[job.id] = dl
            if job.id in self.first and self.first[job.id][0] <= dl:
                continue
            m = BEHIND.search(d.message)
            rel = {}
            for r in state.running:
                end = _planned_end(r, now, pred, prog)
                if r.stopping:
                    end = min(end, now)
                if end <= d.est_start:
                    rel[r.id] = (
                        r.started_at,
                        end,
                        prog
                        and r.progress is not None
                        and r.progress.end(now) is not None,
                    )
            self.first[job.id] = (
                dl,
                now,
                d.est_start,
                int(m.group(1)) if m else None,
                rel,
            )
            self.displaced.discard(job.id)
        for jid in self.first:
            job = self.by_id[jid]
            if job.first_start is None and jid != top and job.state == "pending":
                self.displaced.add(jid)

    def _end(self, job: Any, now: float) -> None:
        self.ended[job.id, job.started_at] = now
        super()._end(job, now)

    def _requeue(self, job: Any, now: float) -> None:
        self.ended[job.id, job.started_at] = now
        super()._requeue(job, now)

    def _evict(self, decision: Any, now: float) -> None:
        job = self.by_id.get(decision.job_id)
        if job is not None:
            self.ended[job.id, job.started_at] = now
        super()._evict(decision, now)

    def _start(self, start: Any, now: float) -> None:
        job = self.by_id[start.job_id]
        first = job.first_start is None and job.id in self.first
        super()._start(start, now)
        if not first:
            return
        dl, _at, _est, _behind, rel = self.first[job.id]
        if now > self.latest.get(job.id, math.inf):
            self.slipped_vs_last += 1
        if now <= dl:
            return
        late = []
        for rid, (started, _end, progress) in rel.items():
            end = self.ended.get((rid, started))
            r = self.by_id[rid]
            if end is None and r.started_at == started and r.state != "done":
                end = now  # still running when the job started
            if end is not None and end > dl:
                late.append((end - dl, progress))
        displaced = job.id in self.displaced
        key = (
            "both"
            if late and displaced
            else "ends_late"
            if late
            else "displaced"
            if displaced
            else "other"
        )
        self.classes[key] += 1
        if late:
            by, progress = max(late)
            self.late_by.append(by)
            self.late_progress["progress" if progress else "plan"] += 1


def main(argv: list[str]) -> int:
    cli.Simulator = Instrumented  # type: ignore[misc]
    holder: dict[str, Instrumented] = {}
    orig_run = Instrumented.run

    def run(self: Instrumented) -> Any:
        holder["sim"] = self
        return orig_run(self)

    Instrumented.run = run  # type: ignore[method-assign]
    rc = cli.main(argv)
    sim = holder["sim"]
    s = sim.tracker.summary()["reservation_slips"]
    late = sorted(sim.late_by)
    out = {
        "reservation_slips": s,
        "classes": dict(sim.classes),
        "slipped_vs_last_shown": sim.slipped_vs_last,
        "late_release_planned_from": dict(sim.late_progress),
        "late_by_s_median": late[len(late) // 2] if late else None,
    }
    sys.stdout.write(json.dumps(out, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
