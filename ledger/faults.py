"""Named fault points: no-ops unless a test arms them (DBOS ``_debug_trigger.py``).

A chaos test starts a real process with ``OPLEDGER_FAULT_POINTS="projector.after_commit:kill@3"``;
the third time that point is reached the process SIGKILLs itself, exactly at the boundary the
name describes, with no chance to flush or clean up, as a crash would.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from dataclasses import dataclass


class FaultSpecError(ValueError):
    """OPLEDGER_FAULT_POINTS is malformed."""


@dataclass(frozen=True, slots=True)
class _Arm:
    action: str
    at: int


_armed: dict[str, _Arm] = {}
_reached: Counter[str] = Counter()


def arm(spec: str) -> None:
    """Arm fault points from ``name:kill[@N]`` items separated by commas (replaces earlier arms)."""
    _armed.clear()
    _reached.clear()
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, action = item.partition(":")
        action, _, at = action.partition("@")
        if not name or action != "kill":
            raise FaultSpecError(f"fault point {item!r}: expected name:kill or name:kill@N")
        try:
            count = int(at) if at else 1
        except ValueError:
            raise FaultSpecError(f"fault point {item!r}: N must be an integer") from None
        _armed[name] = _Arm(action, count)


def fault_point(name: str) -> None:
    """Mark a crash boundary. Does nothing unless ``name`` is armed."""
    if not _armed:
        return
    arm_ = _armed.get(name)
    if arm_ is None:
        return
    _reached[name] += 1
    if _reached[name] == arm_.at:
        os.kill(os.getpid(), signal.SIGKILL)
