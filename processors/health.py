"""Whether a worker is doing its job, for ``/healthz`` (``processors.app``): a loop that is alive
but not progressing (its database or broker away) says so, with the reason and for how long."""

from __future__ import annotations

import threading
import time
from typing import Any


class Health:
    """Whether the worker is doing its job, for ``/healthz``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.progressing = True
        self.reason: str | None = None
        self.since = time.monotonic()
        self.passes = 0
        self.partitions: tuple[int, ...] = ()

    def ok(self) -> None:
        with self._lock:
            self.passes += 1
            if not self.progressing:
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
                "passes": self.passes,
                "partitions": list(self.partitions),
            }
