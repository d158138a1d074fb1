"""Job output: the log chunks agents send, kept within a per-job cap, and the
stored output read back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.conf import settings
from django.db.models import F, Func, IntegerField, Sum

from scheduler.models import Attempt, Job, JobLogChunk, Node
from scheduler.services.checkpoints import note_checkpoint

if TYPE_CHECKING:
    from agents import protocol


def append_log(node_id: int, data: protocol.JobLogData) -> str | None:
    """Store a log chunk of the node's attempt, within the per-job size cap, and
    return the text kept (None: nothing, e.g. the cap is reached); a replayed chunk
    (same offset) is ignored (and its text returned again: pages drop a chunk
    whose offset they already have)."""
    attempt = (
        Attempt.objects.filter(pk=data.attempt_id, job_id=data.job_id)
        .only("id", "node_id", "ranks")
        .first()
    )
    if attempt is None or node_id not in attempt.node_ids or not data.data:
        return None
    # Checkpoints count past the size cap too (a long job's log may be full).
    note_checkpoint(attempt.pk, data.data)
    stored = (
        JobLogChunk.objects.filter(attempt__job_id=data.job_id).aggregate(
            n=Sum(Func(F("data"), function="octet_length", output_field=IntegerField()))
        )["n"]
        or 0
    )
    if stored >= settings.GPULAB_LOG_MAX_BYTES:
        return None
    room = settings.GPULAB_LOG_MAX_BYTES - stored
    # Cut by bytes, never inside a UTF-8 sequence.
    text = data.data.encode("utf-8")[:room].decode("utf-8", "ignore")
    if not text:
        return None
    JobLogChunk.objects.bulk_create(
        [JobLogChunk(attempt=attempt, node_id=node_id, offset=data.offset, data=text)],
        ignore_conflicts=True,
    )
    return text


def log_tail(job: Job, max_chars: int = 20_000) -> str:
    """The end of a job's stored output: its attempts in order; for a job spanning
    nodes, each rank's output in turn under a ``[rank N on NODE]`` header."""
    rows = list(
        JobLogChunk.objects.filter(attempt__job=job)
        .order_by("-attempt__number", "-node_id", "-offset")
        .values_list("attempt_id", "node_id", "data")[:400]
    )
    rows.reverse()
    ranks = {
        a.pk: a.node_ids
        for a in Attempt.objects.filter(pk__in={r[0] for r in rows}).only(
            "id", "node_id", "ranks"
        )
    }
    names = dict(Node.objects.values_list("pk", "name"))
    parts: list[str] = []
    current: tuple[int, int | None] | None = None
    for attempt_id, node_id, data in sorted(
        rows,
        key=lambda r: (
            r[0],
            ranks.get(r[0], []).index(r[1]) if r[1] in ranks.get(r[0], []) else 0,
        ),
    ):
        nodes = ranks.get(attempt_id, [])
        if len(nodes) > 1 and (attempt_id, node_id) != current:
            rank = nodes.index(node_id) if node_id in nodes else "?"
            if parts and not parts[-1].endswith("\n"):
                parts.append("\n")
            parts.append(f"[rank {rank} on {names.get(node_id or 0, '?')}]\n")
        current = (attempt_id, node_id)
        parts.append(data)
    return "".join(parts)[-max_chars:]
