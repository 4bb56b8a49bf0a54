"""The I/O a recorder's multi-step calls ask for, so that one piece of code decides for both the
threaded and the asyncio recorder.

An append, ``intent`` and ``execute`` are written once, as generators (``RecorderCore`` and
``producers.execution``): each ``yield`` hands the recorder an *effect* (append a planned step,
send records, run blocking PostgreSQL work, pause, call a tool) and receives its answer, or has
the effect's exception raised at that ``yield``, exactly where the plain call would have raised
it. The threaded recorder performs each effect in the calling thread; the asyncio recorder
awaits it, running blocking work on its thread pool so the event loop is never blocked. What is
decided, in which order, and which fault points are passed is therefore the same for both by
construction.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ledger.tools import AsyncProvider, Provider
from ledger.transport import OutgoingRecord
from producers.operation import TrackedOperation

if TYPE_CHECKING:
    from producers.recorder import Plan

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Record:
    """Append what ``planner`` plans for ``handle`` and wait for the acknowledgement (the
    recorder's ``_run``); answers True, or False when the step was a repeat and nothing was sent."""

    handle: TrackedOperation
    planner: Callable[[], Plan | None]


@dataclass(frozen=True, slots=True)
class Send:
    """Produce ``records`` and wait for the broker's acknowledgement of each; answers their
    positions."""

    records: Sequence[OutgoingRecord]


@dataclass(frozen=True, slots=True)
class Blocking:
    """Blocking work (PostgreSQL, the history reader); answers what ``work`` returns."""

    work: Callable[[], Any]


@dataclass(frozen=True, slots=True)
class Pause:
    seconds: float


@dataclass(frozen=True, slots=True)
class Call:
    """Call the tool once under ``key``; answers its :class:`~ledger.tools.CallOutcome`, or
    raises what the call raised (:class:`~ledger.tools.ContactLost` when its time ran out)."""

    provider: Provider | AsyncProvider
    request: Any
    key: str


Effect = Record | Send | Blocking | Pause | Call
Steps = Generator[Effect, Any, T]
"""A multi-step call: yields effects, receives their answers, returns its result."""


class Stepper(Generic[T]):
    """Runs :data:`Steps` with a recorder's way of performing effects."""

    __slots__ = ("_result", "_steps", "effect")

    def __init__(self, steps: Steps[T]) -> None:
        self._steps = steps
        self.effect: Effect | None = None
        self._advance(steps.__next__)

    def run(self, perform: Callable[[Effect], Any]) -> T:
        """Perform every effect in this thread; returns the result."""
        try:
            while (effect := self.effect) is not None:
                self._resume(*_outcome(perform, effect))
            return self._result
        finally:
            self._steps.close()

    async def run_async(self, perform: Callable[[Effect], Awaitable[Any]]) -> T:
        """Await every effect; returns the result. A cancellation is not raised into the steps:
        it ends them where they stand (their ``finally`` blocks run)."""
        try:
            while (effect := self.effect) is not None:
                self._resume(*await _outcome_async(perform, effect))
            return self._result
        finally:
            self._steps.close()

    def _resume(self, answer: Any, error: Exception | None) -> None:
        if error is None:
            self._advance(lambda: self._steps.send(answer))
        else:
            self._advance(lambda: self._steps.throw(error))

    def _advance(self, step: Callable[[], Effect]) -> None:
        try:
            self.effect = step()
        except StopIteration as stop:
            self.effect = None
            self._result: T = stop.value


def _outcome(perform: Callable[[Effect], Any], effect: Effect) -> tuple[Any, Exception | None]:
    try:
        return perform(effect), None
    except Exception as exc:  # raised into the steps, where the plain call would have raised
        return None, exc


async def _outcome_async(
    perform: Callable[[Effect], Awaitable[Any]], effect: Effect
) -> tuple[Any, Exception | None]:
    try:
        return await perform(effect), None
    except Exception as exc:  # as _outcome
        return None, exc
