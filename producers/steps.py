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

import asyncio
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ledger.call_rule import Interrupted
from ledger.log import OutgoingRecord
from ledger.tools import AsyncProvider, Provider
from producers.operation import TrackedOperation
from producers.planner import Plan

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Record:
    """Append what ``planner`` plans for ``handle`` and wait for the acknowledgement (the
    recorder's ``_run``); answers True, or False when the step was a repeat and nothing was sent
    (``alongside`` then runs alone). ``alongside`` is run as :class:`Send` runs it."""

    handle: TrackedOperation
    planner: Callable[[], Plan | None]
    alongside: Callable[[], None] | None = None


@dataclass(frozen=True, slots=True)
class Send:
    """Produce ``records`` and wait for the broker's acknowledgement of each; answers their
    positions.

    ``alongside`` is blocking work done while the acknowledgements are in flight: after the
    records are handed to the producer, before their acknowledgements are awaited (its answer
    is dropped: it keeps what it must). It runs once, whatever becomes of the records, and the
    step is done only when both are: if it raised, :class:`AlongsideError` is raised once the
    records' outcome is known, whatever that was. A recorder whose transport cannot hand records
    over without waiting (not a :class:`~ledger.log.SplitTransport`, or not yet ``warm``)
    runs it first and sends nothing if it raised (the steps ask for that:
    ``RecorderCore._append_steps``)."""

    records: Sequence[OutgoingRecord]
    alongside: Callable[[], None] | None = None


class AlongsideError(Exception):
    """A :class:`Send`'s ``alongside`` work raised ``error``; ``send_error`` is what the send
    raised, None when every record was acknowledged."""

    def __init__(self, error: Exception, send_error: Exception | None) -> None:
        super().__init__(f"the work beside the send failed: {error!r}")
        self.error = error
        self.send_error = send_error


def alongside_outcome(
    positions: Any, send_error: Exception | None, work_error: Exception | None
) -> Any:
    """What a :class:`Send` with ``alongside`` work answers, or raises, once both are done."""
    if work_error is not None:
        raise AlongsideError(work_error, send_error)
    if send_error is not None:
        raise send_error
    return positions


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
        it ends them where they stand (their ``finally`` blocks run), except during a
        :class:`Call`, where the tool may have acted: the steps get :class:`Interrupted`. Once
        the tool was called, a cancellation waits until the steps have recorded what became of
        it (their effects are bounded by the SDK's own timeouts) and is raised then."""
        called = False
        deferred: asyncio.CancelledError | None = None
        try:
            while (effect := self.effect) is not None:
                if called:
                    answer, error, cancelled = await _past_the_call(perform, effect)
                    deferred = deferred or cancelled
                else:
                    answer, error = await _outcome_async(perform, effect)
                called = called or isinstance(effect, Call)
                self._resume(answer, error)
            result = self._result
        finally:
            self._steps.close()
        if deferred is not None:
            operation = getattr(result, "operation_id", None)
            state = getattr(result, "state", None)
            deferred.add_note(
                f"opledger: cancelled after the tool was called; {operation} was recorded as "
                f"{state} first (Execution not returned: read it with recorder.load)"
            )
            raise deferred
        return result

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
    except BaseException as exc:
        if isinstance(effect, Call):
            # The tool may have acted: the steps must record that before the interrupt goes on.
            return None, Interrupted(exc)
        raise


async def _past_the_call(
    perform: Callable[[Effect], Awaitable[Any]], effect: Effect
) -> tuple[Any, Exception | None, asyncio.CancelledError | None]:
    """``effect`` performed to its end even if the task is cancelled meanwhile: after the call,
    stopping half way would leave the operation DISPATCHED (or its outcome in doubt) with a
    caller told only "cancelled". Answers the cancellation too, for the steps to raise last."""
    inner = asyncio.ensure_future(_outcome_async(perform, effect))
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            answer, error = await asyncio.shield(inner)
        except asyncio.CancelledError as exc:
            if inner.cancelled():  # the effect itself was cancelled (the loop is shutting down)
                raise
            cancelled = cancelled or exc
            continue
        return answer, error, cancelled


async def _outcome_async(
    perform: Callable[[Effect], Awaitable[Any]], effect: Effect
) -> tuple[Any, Exception | None]:
    try:
        return await perform(effect), None
    except Exception as exc:  # as _outcome
        return None, exc
    except BaseException as exc:  # a cancelled call too: as _outcome
        if isinstance(effect, Call):
            return None, Interrupted(exc)
        raise
