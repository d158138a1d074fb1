"""The token bucket both websockets share: an agent's frames wait (``delay``),
a browser's messages are refused (``take``)."""

from __future__ import annotations

from scheduler.throttle import TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_take_refuses_past_the_burst_and_a_refusal_takes_nothing() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=5.0, burst_s=4.0, clock=clock)  # 20 saved up

    assert [bucket.take() for _ in range(21)] == [True] * 20 + [False]
    clock.now += 0.2  # one token's worth
    assert bucket.take()
    assert not bucket.take()  # the refusal before left no debt to pay back


def test_the_bucket_refills_at_its_rate_up_to_its_capacity() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=5.0, burst_s=4.0, clock=clock)
    for _ in range(20):
        assert bucket.take()

    clock.now += 1.0
    assert [bucket.take() for _ in range(6)] == [True] * 5 + [False]
    clock.now += 3600.0
    assert sum(bucket.take() for _ in range(30)) == 20


def test_delay_is_the_time_the_allowance_needs() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=10.0, burst_s=1.0, clock=clock)  # 10 saved up

    assert bucket.delay(10) == 0.0
    assert bucket.delay(5) == 0.5  # in debt: waits for it
    clock.now += 0.5
    assert bucket.delay(1) == 0.1
