"""The waiting jobs' order keys (scheduler.queue_order): keys increase along each
pass's order, and a pass changes as few as it can."""

from __future__ import annotations

import itertools
from bisect import bisect_left

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.queue_order import LIMIT, STEP, assign


def applied(order: list[int], stored: dict[int, int | None]) -> list[int]:
    """The keys along ``order`` once ``assign``'s changes are stored."""
    new = assign(order, stored)
    keys = {**stored, **new}
    got = [keys[job] for job in order]
    assert all(k is not None for k in got)
    return got  # type: ignore[return-value]


def increasing(keys: list[int]) -> bool:
    return all(a < b for a, b in itertools.pairwise(keys))


def longest_increasing(keys: list[int | None]) -> int:
    tails: list[int] = []
    for k in keys:
        if k is None:
            continue
        at = bisect_left(tails, k)
        tails[at : at + 1] = [k]
    return len(tails)


@pytest.mark.parametrize(
    ("order", "stored", "changed"),
    [
        # a first pass: every job gets a key, STEP apart
        ([7, 3, 9], {}, {7: STEP, 3: 2 * STEP, 9: 3 * STEP}),
        # the head started: nothing moves
        ([3, 9], {7: STEP, 3: 2 * STEP, 9: 3 * STEP}, {}),
        # a new job at the end: after the last
        ([7, 3, 5], {7: STEP, 3: 2 * STEP}, {5: 3 * STEP}),
        # a new job first: before the first
        ([5, 7, 3], {7: STEP, 3: 2 * STEP}, {5: 0}),
        # a new job between two: halfway
        ([7, 5, 3], {7: STEP, 3: 2 * STEP}, {5: STEP + STEP // 2}),
        # two new jobs between two: a third of the gap apart
        ([7, 5, 6, 3], {7: 0, 3: 3 * STEP}, {5: STEP, 6: 2 * STEP}),
        # the last overtakes the two before it: only it moves
        ([9, 7, 3], {7: STEP, 3: 2 * STEP, 9: 3 * STEP}, {9: 0}),
        # a stale key (a job held then released) is replaced
        ([7, 3], {7: STEP, 3: None}, {3: 2 * STEP}),
    ],
)
def test_it_changes_only_the_jobs_whose_order_changed(
    order: list[int], stored: dict[int, int | None], changed: dict[int, int]
) -> None:
    assert assign(order, stored) == changed


def test_a_reversed_queue_keeps_one_key() -> None:
    stored: dict[int, int | None] = {j: (j + 1) * STEP for j in range(6)}
    order = list(reversed(range(6)))
    assert len(assign(order, stored)) == 5
    assert increasing(applied(order, stored))


def test_a_gap_too_small_spreads_out_its_neighbourhood_only() -> None:
    stored: dict[int, int | None] = {1: 10, 2: 11, 4: 10 * STEP}
    order = [1, 3, 2, 4]  # nothing fits between 10 and 11
    # one job on each side joins it, spread out below the next kept key
    assert assign(order, stored) == {1: 7 * STEP, 3: 8 * STEP, 2: 9 * STEP}
    # twenty jobs STEP apart but 6 and 7 packed behind 5; job 100 goes between 5
    # and 6: 5 and 6 are spread out with it below 7, the rest keep their keys
    stored = {j: j * STEP for j in range(20)} | {6: 5 * STEP + 1, 7: 5 * STEP + 2}
    order = [*range(6), 100, *range(6, 20)]
    new = assign(order, stored)
    assert set(new) == {5, 100, 6}
    assert increasing(applied(order, stored))


def test_keys_near_the_end_of_the_range_are_numbered_afresh() -> None:
    stored: dict[int, int | None] = {1: LIMIT - 1}
    assert assign([1, 2], stored) == {1: STEP, 2: 2 * STEP}
    # a key outside the range is not kept
    assert assign([1], {1: LIMIT + 5}) == {1: STEP}


def test_a_thousand_insertions_at_one_spot_rewrite_few_keys() -> None:
    order = list(range(100))
    stored: dict[int, int | None] = {}
    written = 0
    for new in range(100, 1100):
        changes = assign(order, stored)
        written += len(changes)
        stored.update(changes)
        assert increasing([stored[j] for j in order])  # type: ignore[misc]
        order.insert(50, new)  # always at the middle of the queue
    # each insertion writes its own key and, now and then, a neighbourhood's:
    # not the queue behind it (that would be ~500 each, 500,000 in all)
    assert written < 4 * 1100


@settings(max_examples=300, deadline=None)
@given(
    jobs=st.lists(st.integers(0, 60), unique=True, max_size=40),
    keys=st.lists(st.one_of(st.none(), st.integers(-(10**6), 10**6)), max_size=40),
    data=st.data(),
)
def test_keys_increase_along_any_order(
    jobs: list[int], keys: list[int | None], data: st.DataObject
) -> None:
    stored = dict(zip(jobs, keys, strict=False))
    order = data.draw(st.permutations(jobs))

    new = assign(order, stored)
    got = applied(order, stored)

    assert increasing(got)
    assert all(-LIMIT < k < LIMIT for k in got)
    assert set(new) <= set(order)
    old = [stored.get(j) for j in order]
    # at least the jobs outside a longest run already in order (more where the
    # keys left no room between them)
    assert len(new) >= len(order) - longest_increasing(old)


@settings(max_examples=300, deadline=None)
@given(
    jobs=st.lists(st.integers(0, 60), unique=True, max_size=40),
    keys=st.lists(st.one_of(st.none(), st.integers(-1000, 1000)), max_size=40),
    data=st.data(),
)
def test_keys_spaced_as_stored_change_fewest(
    jobs: list[int], keys: list[int | None], data: st.DataObject
) -> None:
    stored = {
        j: None if k is None else k * STEP for j, k in zip(jobs, keys, strict=False)
    }
    order = data.draw(st.permutations(jobs))

    new = assign(order, stored)

    old = [stored.get(j) for j in order]
    assert len(new) == len(order) - longest_increasing(old)
    assert increasing(applied(order, stored))
