"""Interactive activity: the last time a person used a job through the portal.

The JupyterLab proxy and the terminal relay call ``touch`` (or ``atouch`` on the
event loop) on every request, websocket message or keystroke they carry. A write
per keystroke would be a database write per keystroke, so each process writes a
job's time at most once per ``GPULAB_INTERACTIVE_ACTIVITY_RESOLUTION`` seconds;
the idle check's windows are minutes long, so the time it sees is late by at most
that. The row only moves forward (``GREATEST``), so two processes writing at once
cannot move it back.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from channels.db import database_sync_to_async
from django.conf import settings
from django.db import connection
from django.utils import timezone

from portal.idle.models import Activity

if TYPE_CHECKING:
    from datetime import datetime

_lock = threading.Lock()
# job id -> time.monotonic() of this process's last write
_written: dict[int, float] = {}
# Above this many jobs remembered, the oldest half is forgotten (a web process
# lives for weeks; ended jobs need no entry).
_MAX_REMEMBERED = 10_000


def _due(job_id: int, now: float) -> bool:
    resolution = settings.GPULAB_INTERACTIVE_ACTIVITY_RESOLUTION
    with _lock:
        last = _written.get(job_id)
        if last is not None and now - last < resolution:
            return False
        if len(_written) >= _MAX_REMEMBERED:
            for key in sorted(_written, key=_written.__getitem__)[
                : _MAX_REMEMBERED // 2
            ]:
                del _written[key]
        _written[job_id] = now
        return True


def touch(job_id: int, at: datetime | None = None) -> bool:
    """Record that the job was used now; False when this process wrote it less
    than the resolution ago (nothing written)."""
    if not _due(job_id, time.monotonic()):
        return False
    _write(job_id, at or timezone.now())
    return True


async def atouch(job_id: int) -> bool:
    """``touch`` from the event loop: returns at once when no write is due."""
    if not _due(job_id, time.monotonic()):
        return False
    await database_sync_to_async(_write)(job_id, timezone.now())
    return True


def _write(job_id: int, at: datetime) -> None:
    table = Activity._meta.db_table
    with connection.cursor() as cursor:
        # The job may have been deleted meanwhile: the join inserts nothing then.
        cursor.execute(
            f"""
            INSERT INTO {table} (job_id, at)
            SELECT id, %s FROM scheduler_job WHERE id = %s
            ON CONFLICT (job_id) DO UPDATE SET at = GREATEST({table}.at, EXCLUDED.at)
            """,
            [at, job_id],
        )


def last_used(job_ids: list[int]) -> dict[int, datetime]:
    """Each job's last recorded use (jobs never used are absent)."""
    return dict(Activity.objects.filter(job_id__in=job_ids).values_list("job_id", "at"))
