"""Whether a worker is doing its job, for ``/healthz`` (``processors.app``): a loop that is alive
but not progressing (its database or broker away) says so, with the reason and for how long."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("opledger.health")


class Health:
    """Whether the worker is doing its job, for ``/healthz``. ``unit`` names what ``ok`` counts
    (a recovery or delivery pass, a projector batch)."""

    def __init__(self, worker: str = "worker", unit: str = "passes") -> None:
        self._lock = threading.Lock()
        self._worker = worker
        self._unit = unit
        self.progressing = True
        self.reason: str | None = None
        self.since = time.monotonic()
        self.done = 0
        self.partitions: tuple[int, ...] = ()

    def ok(self, done: int = 1) -> None:
        with self._lock:
            self.done += done
            if not self.progressing:
                log.info(
                    "%s progressing again after %.1fs", self._worker, time.monotonic() - self.since
                )
                self.progressing, self.reason, self.since = True, None, time.monotonic()

    def stalled(self, reason: str) -> None:
        with self._lock:
            if self.progressing:
                self.progressing, self.since = False, time.monotonic()
            self.reason = reason

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "status": "ok" if self.progressing else "stalled",
                "progressing": self.progressing,
                "reason": self.reason,
                "for_s": round(time.monotonic() - self.since, 1),
                self._unit: self.done,
                "partitions": list(self.partitions),
            }
