"""The retry schedule of deliveries: how long to wait before each send, how many sends, until
when. Standard Webhooks' example (immediately, then 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h),
configurable. Each wait is spread by a jitter so that deliveries that failed together (a
destination that went down) do not all come back at the same instant. Pure: the caller passes
the random number.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

#: Standard Webhooks' example schedule: the delay before the 2nd, 3rd, ... send.
DEFAULT_SCHEDULE: tuple[timedelta, ...] = (
    timedelta(seconds=5),
    timedelta(minutes=5),
    timedelta(minutes=30),
    timedelta(hours=2),
    timedelta(hours=5),
    timedelta(hours=10),
    timedelta(hours=10),
)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long and how often a delivery is tried."""

    schedule: tuple[timedelta, ...] = DEFAULT_SCHEDULE
    #: sends per round, the first included (a redrive starts a new round)
    max_attempts: int = len(DEFAULT_SCHEDULE) + 1
    #: no send is scheduled later than this after the round began
    horizon: timedelta = timedelta(days=3)
    #: each delay is multiplied by a factor in [1 - jitter, 1 + jitter]
    jitter: float = 0.2
    #: a Retry-After longer than this is capped (a destination cannot park us for a month)
    max_retry_after: timedelta = timedelta(hours=24)

    def __post_init__(self) -> None:
        if not self.schedule or any(d <= timedelta(0) for d in self.schedule):
            raise ValueError("the retry schedule needs at least one positive delay")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.horizon <= timedelta(0):
            raise ValueError("the horizon must be positive")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must be in [0, 1)")

    def delay(self, attempts: int, unit_random: float) -> timedelta:
        """The wait after the ``attempts``-th send of a round failed (``unit_random`` in
        [0, 1) spreads it by the jitter). Past the end of the schedule its last delay repeats."""
        base = self.schedule[min(max(attempts, 1), len(self.schedule)) - 1]
        factor = 1 + self.jitter * (2 * unit_random - 1)
        return base * factor


def parse_schedule(text: str) -> tuple[timedelta, ...]:
    """``"5s,5m,30m,2h"`` -> delays (units ms, s, m, h, d)."""
    units = {
        "ms": timedelta(milliseconds=1),
        "s": timedelta(seconds=1),
        "m": timedelta(minutes=1),
        "h": timedelta(hours=1),
        "d": timedelta(days=1),
    }
    delays = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        number = item.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = item[len(number) :] or "s"
        if unit not in units:
            raise ValueError(f"retry schedule item {item!r}: unit must be one of {sorted(units)}")
        try:
            value = float(number)
        except ValueError:
            raise ValueError(f"retry schedule item {item!r} is not a number with a unit") from None
        if value <= 0:
            raise ValueError(f"retry schedule item {item!r} must be positive")
        delays.append(units[unit] * value)
    if not delays:
        raise ValueError("the retry schedule is empty")
    return tuple(delays)
