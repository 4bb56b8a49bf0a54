"""Whether a worker is doing its job, for ``/healthz`` (``processors.host``): a loop that is alive
but not progressing (its database or broker away) says so, with the reason and for how long; a
loop that stopped turning altogether (blocked in a call that never returns) is found by
:class:`LoopWatchdog`, which no heartbeat of the process itself could see."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("opledger.health")


class Health:
    """Whether the worker is doing its job, for ``/healthz``. ``unit`` names what ``ok`` counts
    (a recovery or delivery pass, a projector batch).

    Every call of :meth:`ok`, :meth:`stalled` or :meth:`beat` says the loop turned; a loop
    that waits for work calls :meth:`beat` on each idle turn."""

    def __init__(self, worker: str = "worker", unit: str = "passes") -> None:
        self._lock = threading.Lock()
        self._worker = worker
        self._unit = unit
        self.progressing = True
        self.reason: str | None = None
        self.since = time.monotonic()
        self.done = 0
        self.partitions: tuple[int, ...] = ()
        self.turned_at = time.monotonic()
        self.stuck: str | None = None

    def beat(self) -> None:
        """The loop turned (an idle turn: nothing to do, nothing wrong)."""
        self.turned_at = time.monotonic()
        if self.stuck is not None:
            self._unstick()

    def ok(self, done: int = 1) -> None:
        self.beat()
        with self._lock:
            self.done += done
            if not self.progressing:
                log.info(
                    "%s progressing again after %.1fs", self._worker, time.monotonic() - self.since
                )
                self.progressing, self.reason, self.since = True, None, time.monotonic()

    def stalled(self, reason: str) -> None:
        self.beat()
        with self._lock:
            if self.progressing:
                self.progressing, self.since = False, time.monotonic()
            self.reason = reason

    def idle_s(self) -> float:
        """Seconds since the loop last turned."""
        return time.monotonic() - self.turned_at

    def mark_stuck(self, reason: str) -> None:
        with self._lock:
            self.stuck = reason

    def _unstick(self) -> None:
        with self._lock:
            if self.stuck is None:
                return
            self.stuck = None
        log.warning("%s loop turned again", self._worker)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            stuck = self.stuck
            return {
                "status": "stuck" if stuck else "ok" if self.progressing else "stalled",
                "progressing": self.progressing and not stuck,
                "reason": stuck or self.reason,
                "for_s": round(time.monotonic() - self.since, 1),
                "loop_idle_s": round(time.monotonic() - self.turned_at, 1),
                self._unit: self.done,
                "partitions": list(self.partitions),
            }


class Verdict(enum.Enum):
    TURNING = "turning"
    #: past ``stuck_after_s`` for the first time in this episode: say where the loop is
    NEWLY_STUCK = "newly stuck"
    STILL_STUCK = "still stuck"
    #: past ``exit_after_s``: the process should exit for its supervisor to start a fresh one
    EXIT = "exit"


class LoopWatchdog:
    """Decides, from how long a loop has not turned, whether it is stuck and whether its process
    should give up. Every call a loop makes has a bound of its own (client timeouts, the
    sink's); a loop past ``stuck_after_s`` is in a call whose bound failed, which only a look at
    where it is can explain, and past ``exit_after_s`` (0: never) a fresh process is the only
    remedy left."""

    def __init__(
        self,
        health: Health,
        stuck_after_s: float,
        exit_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._health = health
        self._stuck_after_s = stuck_after_s
        self._exit_after_s = exit_after_s
        self._clock = clock
        self._reported_turn: float | None = None

    def check(self) -> Verdict:
        turned_at = self._health.turned_at
        idle = self._clock() - turned_at
        if idle < self._stuck_after_s:
            return Verdict.TURNING
        if self._exit_after_s and idle >= self._exit_after_s:
            return Verdict.EXIT
        if self._reported_turn == turned_at:
            return Verdict.STILL_STUCK
        self._reported_turn = turned_at
        self._health.mark_stuck(f"loop has not turned for {idle:.0f}s")
        return Verdict.NEWLY_STUCK
