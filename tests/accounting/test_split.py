"""The charging rule alone (no database): a GPU's time split between its runs."""

from __future__ import annotations

import random
from datetime import UTC, date, datetime

import pytest

from portal.accounting.charging import (
    Run,
    charged,
    pieces,
    split,
    split_parts,
    weight,
)


def union(runs: list[Run], until: float) -> float:
    spans = sorted((r.start, min(r.end or until, until)) for r in runs)
    total, reach = 0.0, float("-inf")
    for start, end in spans:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


@pytest.mark.parametrize("seed", range(20))
def test_every_gpu_second_is_charged_exactly_once(seed: int) -> None:
    rng = random.Random(seed)
    runs = []
    for i in range(rng.randint(1, 8)):
        start = rng.uniform(0, 3 * 86400)
        end = None if rng.random() < 0.2 else start + rng.uniform(0, 86400)
        runs.append(Run(i, start, end, rng.choice([1.0, 8192.0, 40960.0, 81920.0])))
    until = 4 * 86400.0

    charges = split(runs, until)

    total = sum(s for days in charges.values() for s in days.values())
    assert total == pytest.approx(union(runs, until))


def test_it_splits_by_weight_and_by_utc_day() -> None:
    midnight = datetime(2027, 3, 2, tzinfo=UTC).timestamp()
    runs = [Run(1, midnight - 100, midnight + 100, 1.0), Run(2, midnight, None, 3.0)]

    charges = split(runs, midnight + 200)

    assert charges[1] == {date(2027, 3, 1): 100, date(2027, 3, 2): 25}
    assert charges[2] == {date(2027, 3, 2): 75 + 100}


@pytest.mark.parametrize(
    ("mode", "declared", "expected"),
    [
        ("memory", 20480, 20480.0),
        ("memory", None, 81920.0),  # undeclared: the whole GPU
        ("memory", 10**9, 81920.0),  # at most the GPU's memory
        ("memory", 0, 1.0),
        ("equal", 20480, 1.0),
    ],
)
def test_weights(mode: str, declared: int | None, expected: float) -> None:
    assert weight(mode, declared, 81920) == expected


@pytest.mark.parametrize("seed", range(10))
def test_charged_from_a_time_is_the_split_after_it(seed: int) -> None:
    """``charged(runs, until, since)``: what ``split`` charges each attempt after
    ``since`` (clipping the runs there changes no share after it)."""
    rng = random.Random(seed)
    runs = []
    for i in range(rng.randint(1, 6)):
        start = rng.uniform(0, 2 * 86400)
        end = None if rng.random() < 0.3 else start + rng.uniform(0, 86400)
        runs.append(Run(i, start, end, rng.choice([1.0, 20480.0, 81920.0])))
    until = 3 * 86400.0
    midnight = 86400.0  # 1970-01-02 00:00 UTC: since = the start of a UTC day

    got = charged(runs, until, since=midnight)

    whole = split(runs, until)
    expected = {
        a: sum(s for d, s in days.items() if d >= date(1970, 1, 2))
        for a, days in whole.items()
    }
    assert got.keys() <= expected.keys()
    for attempt_id, seconds in expected.items():
        assert got.get(attempt_id, 0.0) == pytest.approx(seconds, abs=1e-6)
    assert charged(runs, until) == pytest.approx(
        {a: sum(days.values()) for a, days in whole.items()}
    )


def test_pieces_are_cut_at_the_given_times_and_carry_the_shares() -> None:
    runs = [Run(1, 0.0, 100.0, 1.0), Run(2, 50.0, None, 3.0)]

    got = list(pieces(runs, 150.0, cuts=[25.0, 75.0, 500.0]))

    assert got == [
        (0.0, 25.0, {1: 1.0}),
        (25.0, 50.0, {1: 1.0}),
        (50.0, 75.0, {1: 0.25, 2: 0.75}),
        (75.0, 100.0, {1: 0.25, 2: 0.75}),
        (100.0, 150.0, {2: 1.0}),
    ]


@pytest.mark.parametrize("seed", range(20))
def test_charged_and_lost_add_up_to_every_gpu_second_once(seed: int) -> None:
    # Some ended runs lost their work from a point inside them (a requeue).
    rng = random.Random(seed)
    runs = []
    for i in range(rng.randint(1, 8)):
        start = rng.uniform(0, 3 * 86400)
        end = None if rng.random() < 0.2 else start + rng.uniform(0, 86400)
        lost = None
        if end is not None and rng.random() < 0.5:
            lost = rng.uniform(start, end)
        runs.append(Run(i, start, end, rng.choice([1.0, 81920.0]), lost))
    until = 4 * 86400.0

    kept, lost_part = split_parts(runs, until)

    def total(part: dict[int, dict[date, float]]) -> float:
        return sum(s for days in part.values() for s in days.values())

    assert total(kept) + total(lost_part) == pytest.approx(union(runs, until))
    assert split(runs, until) == kept
    assert all(runs[i].lost_from is not None for i in lost_part)
    # Without lost work, the split is the one a run without it gets.
    plain = [Run(r.attempt_id, r.start, r.end, r.weight) for r in runs]
    merged = {
        i: total({i: kept.get(i, {})}) + total({i: lost_part.get(i, {})})
        for i in range(len(runs))
    }
    plain_split = split(plain, until)
    assert merged == pytest.approx(
        {i: total({i: plain_split.get(i, {})}) for i in range(len(runs))}
    )


def test_the_lost_part_starts_at_the_checkpoint_and_is_split_by_day() -> None:
    midnight = datetime(2027, 3, 2, tzinfo=UTC).timestamp()
    # A: midnight-100 to midnight+200, lost from midnight-40; B shares from
    # midnight-60 to midnight+100 with the same weight.
    a = Run(1, midnight - 100, midnight + 200, 1.0, lost_from=midnight - 40)
    b = Run(2, midnight - 60, midnight + 100, 1.0)

    kept, lost = split_parts([a, b], midnight + 500)

    day1, day2 = date(2027, 3, 1), date(2027, 3, 2)
    # A kept: 40 s alone + 20 s at half; lost: 40 s at half, then 100 s at half
    # and 100 s alone after midnight.
    assert kept[1] == {day1: pytest.approx(50)}
    assert lost[1] == {day1: pytest.approx(20), day2: pytest.approx(150)}
    # B is charged its half whatever A kept.
    assert kept[2] == {day1: pytest.approx(30), day2: pytest.approx(50)}
    assert 2 not in lost
