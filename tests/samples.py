"""Stored GPU samples written straight into the history table (bypassing
``store_samples``' retention and clock checks), for tests of what reads it."""

from __future__ import annotations

import json
from typing import Any

from scheduler import metrics

COLUMNS = [name for name, _ in metrics.SAMPLE_COLUMNS]


def insert_samples(rows: list[tuple[Any, ...]]) -> None:
    """Store rows given as tuples in the table's column order
    (``metrics.SAMPLE_COLUMNS``; ``processes`` a JSON string), as the ingest does."""
    metrics._insert(
        [
            {
                **dict(zip(COLUMNS, row, strict=True)),
                "at": row[1].isoformat(),
                "processes": json.loads(row[-1]),
            }
            for row in rows
        ]
    )
