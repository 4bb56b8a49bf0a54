"""``processors.health``: a loop that stops turning is told apart from one that waits for work or
for a dependency, reported once per episode, and given up on only past the exit bound."""

from __future__ import annotations

import logging

import pytest

from processors.health import Health, LoopWatchdog, Verdict


class _Clock:
    def __init__(self, health: Health) -> None:
        self.now = health.turned_at

    def __call__(self) -> float:
        return self.now


def _watch(exit_after_s: float = 10.0) -> tuple[Health, LoopWatchdog, _Clock]:
    health = Health("projector", unit="batches")
    clock = _Clock(health)
    return health, LoopWatchdog(health, 3.0, exit_after_s, clock=clock), clock


def test_a_loop_that_keeps_turning_is_never_stuck() -> None:
    health, watchdog, clock = _watch()
    for _ in range(10):
        clock.now += 2.0
        health.turned_at = clock.now  # what beat() does at the loop's pace
        assert watchdog.check() is Verdict.TURNING
    assert health.snapshot()["status"] == "ok"


def test_a_stuck_loop_is_reported_once_then_exits_past_the_bound() -> None:
    health, watchdog, clock = _watch()
    clock.now += 2.9
    assert watchdog.check() is Verdict.TURNING
    clock.now += 0.2
    assert watchdog.check() is Verdict.NEWLY_STUCK
    snapshot = health.snapshot()
    assert snapshot["status"] == "stuck" and snapshot["progressing"] is False
    assert "has not turned for 3s" in snapshot["reason"]
    clock.now += 5.0
    assert watchdog.check() is Verdict.STILL_STUCK
    clock.now += 2.0
    assert watchdog.check() is Verdict.EXIT


def test_exit_zero_never_gives_up() -> None:
    _health, watchdog, clock = _watch(exit_after_s=0)
    clock.now += 3.5
    assert watchdog.check() is Verdict.NEWLY_STUCK
    clock.now += 1e6
    assert watchdog.check() is Verdict.STILL_STUCK


def test_a_loop_that_turns_again_is_healthy_and_a_new_episode_is_reported_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    health, watchdog, clock = _watch()
    clock.now += 4.0
    assert watchdog.check() is Verdict.NEWLY_STUCK
    with caplog.at_level(logging.WARNING, logger="opledger.health"):
        health.beat()
    assert "projector loop turned again" in caplog.text
    assert health.snapshot()["status"] == "ok"
    clock.now = health.turned_at + 4.0
    assert watchdog.check() is Verdict.NEWLY_STUCK


def test_a_stalled_loop_is_turning_not_stuck() -> None:
    """Waiting out PostgreSQL or the broker calls stalled() on every retry: 503 "stalled"
    with its reason, never "stuck"."""
    health, watchdog, clock = _watch()
    for _ in range(5):
        clock.now += 2.0
        health.stalled("SinkUnavailableError: connection refused")
        health.turned_at = clock.now
        assert watchdog.check() is Verdict.TURNING
    snapshot = health.snapshot()
    assert snapshot["status"] == "stalled"
    assert snapshot["reason"].startswith("SinkUnavailableError")
