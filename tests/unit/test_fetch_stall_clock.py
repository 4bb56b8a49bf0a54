"""``ledger.kafka.FetchStallClock``: a consumer that fetches nothing looks at most once per
bound, records reset it, and a remedy that brought nothing makes it wait longer (to 10 min)."""

from __future__ import annotations

import time

import pytest

from ledger.kafka import FetchStallClock


class _Now:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def now(monkeypatch: pytest.MonkeyPatch) -> _Now:
    clock = _Now()
    monkeypatch.setattr(time, "monotonic", clock)
    return clock


def test_one_look_per_bound_without_records_and_none_while_records_arrive(now: _Now) -> None:
    clock = FetchStallClock(20.0)
    now.t += 19.9
    assert not clock.look_due()
    now.t += 0.2
    assert clock.look_due()
    assert not clock.look_due(), "once per bound"
    now.t += 15.0
    clock.arrived()
    now.t += 19.0
    assert not clock.look_due(), "records reset the clock"


def test_a_remedy_that_brought_nothing_doubles_the_bound_until_records_arrive(now: _Now) -> None:
    clock = FetchStallClock(20.0)
    for expected in (40.0, 80.0, 160.0, 320.0, 600.0, 600.0):
        clock.remedied()
        assert clock.bound_s == expected
    now.t += 599.0
    assert not clock.look_due()
    clock.arrived()
    assert clock.bound_s == 20.0
