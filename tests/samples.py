"""Stored GPU samples written straight into the history table (bypassing
``store_samples``' retention and clock checks), for tests of what reads it."""

from __future__ import annotations

import json
from typing import Any

from scheduler import metrics

# The column order of the tuples the tests write (``processes`` a JSON string).
COLUMNS = (
    "gpu_id", "at", "util_gpu", "util_mem", "memory_used_mib", "temperature_c",
    "power_w", "sm_clock_mhz", "pcie_rx_kib_s", "pcie_tx_kib_s", "ecc_uncorrected",
    "energy_mj", "lost", "processes",
)  # fmt: skip


def insert_samples(rows: list[tuple[Any, ...]]) -> None:
    """Store rows given as tuples in ``COLUMNS`` order, as the ingest does."""
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
