"""The policy view's freshness (decision 022), with a scripted clock and probe: when a reader
may act on the projected policy, and when it must not."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ledger.policy_store import Offsets, PolicyFreshness
from ledger.settings import Settings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _freshness(probe: Callable[[], Offsets], clock: Clock) -> PolicyFreshness:
    return PolicyFreshness(
        Settings(home=Path("/nonexistent")),
        max_staleness_s=5.0,
        refresh_s=0.5,
        clock=clock,
        probe=probe,
    )


def test_a_view_folded_to_the_topic_end_is_current_and_one_with_a_change_unfolded_ages_out() -> (
    None
):
    clock, state = Clock(), {"ends": {0: 3}, "folded": {0: 3}}
    freshness = _freshness(lambda: (dict(state["ends"]), dict(state["folded"])), clock)
    assert freshness.stale_reason() is None
    state["ends"] = {0: 4}  # a revocation was appended; the projector has not folded it
    clock.now += 4.9
    assert freshness.stale_reason() is None  # within the bound: seen current 4.9 s ago
    clock.now += 0.2
    reason = freshness.stale_reason()
    assert reason is not None and "1 policy records behind" in reason
    state["folded"] = {0: 4}
    clock.now += 0.5
    assert freshness.stale_reason() is None


def test_a_stopped_projector_with_nothing_unfolded_stays_current() -> None:
    clock = Clock()
    freshness = _freshness(lambda: ({0: 7}, {0: 7}), clock)
    for _ in range(100):
        clock.now += 1.0
        assert freshness.stale_reason() is None


def test_nothing_folded_yet_is_never_current_but_an_empty_topic_is() -> None:
    assert _freshness(lambda: ({0: 1}, {}), Clock()).stale_reason() is not None
    assert _freshness(lambda: ({0: 0}, {}), Clock()).stale_reason() is None


def test_a_probe_that_fails_never_vouches_for_the_view() -> None:
    clock, failing = Clock(), {"on": False}

    def probe() -> Offsets:
        if failing["on"]:
            raise OSError("broker unreachable")
        return {0: 1}, {0: 1}

    freshness = _freshness(probe, clock)
    assert freshness.stale_reason() is None
    failing["on"] = True
    clock.now += 5.1
    reason = freshness.stale_reason()
    assert reason is not None and "broker unreachable" in reason
    assert _freshness(probe, Clock()).stale_reason() is not None  # never seen current


def test_the_probe_runs_at_most_once_per_refresh_interval() -> None:
    clock, calls = Clock(), []

    def probe() -> Offsets:
        calls.append(clock.now)
        return {0: 1}, {0: 1}

    freshness = _freshness(probe, clock)
    for _ in range(1000):
        assert freshness.stale_reason() is None
        clock.now += 0.001
    assert len(calls) == 2  # at 0 s and once 0.5 s had passed


def test_nonsense_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        PolicyFreshness(Settings(home=Path("/nonexistent")), max_staleness_s=0)
