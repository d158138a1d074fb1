"""Job arrays in the pass: the gate's check (``stages.gate``) for an array's run-at-once
limit (the ``%8`` of ``--array 0-99%8``, Slurm's ``JobArrayTaskLimit``).

A task of an array whose ``array_limit`` tasks already run (live attempts,
STARTING or RUNNING, counting those being stopped: they still hold their GPUs
and still run) or were started earlier in this pass waits with ``ARRAY_LIMIT``;
it is never the top blocked job, so it reserves and preempts nothing. The
simulator and production run this same rule."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from scheduler.policy.state import PendingJob, RunningJob


class ArrayLimits:
    """Per-pass count of each array's running tasks, updated as the pass
    starts them."""

    def __init__(self, running: Iterable[RunningJob]) -> None:
        self.running: dict[int, int] = {}
        for r in running:
            if r.array_id is not None:
                self.running[r.array_id] = self.running.get(r.array_id, 0) + 1

    def refusal(self, job: PendingJob) -> str | None:
        """Why ``job`` may not start now under its array's limit, or None."""
        if job.array_id is None or job.array_limit is None:
            return None
        now = self.running.get(job.array_id, 0)
        if now < job.array_limit:
            return None
        return (
            f"array {job.array_id} runs at most {job.array_limit} task(s) at once"
            f" (%{job.array_limit}) and {now} run now; it waits for one to end"
        )

    def take(self, job: PendingJob) -> None:
        """``job`` starts in this pass: it counts against its array's limit."""
        if job.array_id is not None:
            self.running[job.array_id] = self.running.get(job.array_id, 0) + 1
