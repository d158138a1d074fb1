"""GPU-seconds charged per group, read from the totals PostgreSQL keeps
(``portal.prometheus.models``) instead of summing every usage record.

``group_seconds`` reads each group's total plus its pending deltas in one
statement (one snapshot): exactly the sum of its records as committed, whether or
not the deltas were folded yet. ``fold`` moves the pending deltas into the totals
in one statement (DELETE ... RETURNING, then an upsert), so a delta is counted
either as pending or as folded, never both; a delta whose transaction has not
committed is not visible to it and stays for the next fold. Scrapes fold under a
transaction-level advisory lock they only try for: one folds, the others read.
"""

from __future__ import annotations

from django.db import connection, transaction

# pg_try_advisory_xact_lock's key: "prom" "fold".
_FOLD_LOCK = 0x70726F6D_666F6C64

_FOLD_SQL = """
WITH moved AS (
    DELETE FROM prometheus_gpusecondsdelta RETURNING group_id, seconds
)
INSERT INTO prometheus_gpusecondstotal (group_id, seconds)
SELECT group_id, sum(seconds) FROM moved GROUP BY group_id
ON CONFLICT (group_id)
DO UPDATE SET seconds = prometheus_gpusecondstotal.seconds + EXCLUDED.seconds
"""

_READ_SQL = """
SELECT g.name, (coalesce(t.seconds, 0) + coalesce(d.seconds, 0))::float8
FROM scheduler_group g
LEFT JOIN prometheus_gpusecondstotal t ON t.group_id = g.id
LEFT JOIN (
    SELECT group_id, sum(seconds) AS seconds
    FROM prometheus_gpusecondsdelta GROUP BY group_id
) d ON d.group_id = g.id
ORDER BY g.name
"""


def fold() -> int:
    """Fold the pending deltas into the totals, unless another process is folding
    now; returns how many groups' totals changed (0 when skipped)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [_FOLD_LOCK])
        if not cursor.fetchone()[0]:
            return 0
        cursor.execute(_FOLD_SQL)
        return int(cursor.rowcount)


def group_seconds() -> list[tuple[str, float]]:
    """(group name, GPU-seconds of its usage records) for every group, by name;
    0 for a group with none."""
    with connection.cursor() as cursor:
        cursor.execute(_READ_SQL)
        return [(str(name), float(seconds)) for name, seconds in cursor.fetchall()]
