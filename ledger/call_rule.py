"""The call rule, performed once: dispatch → the lease still mine → call → judge → record.

It is the system's central safety rule, and every path that calls a tool runs this one function:
the SDK's ``execute()`` and its resume of an intent taken over (``producers.execution``), and
the recovery worker's resume of an orphaned intent and a reconciliation's new attempt
(``processors.recovery``). What an answer *means* is decided by the pure
``ledger.domain.call``; *in which order* the steps happen, and what stops a call, is decided
here. The paths differ only in how a step is done (a threaded or an asyncio recorder appending
one event and waiting for it; a worker queueing its pass's records), which each says through a
:class:`CallPort`:

1. the lease is reclaimed if a stalled earlier append ate into it (``keep_lease``);
2. DISPATCHED is recorded, durably, before anything is called (``record_dispatch``);
3. the last moment to find out that someone else owns the operation: a lease that is not held
   any more is reclaimed only if nobody took the operation over, else ``LeaseLostError`` and
   no call (``keep_lease(now=True)``);
4. the provider is called once, under the operation's idempotency key (``call``);
5. whatever came back is judged (``judge_answer``; an exception or a time-out is UNKNOWN,
   ``judge_raised``), never retried here: only reconciliation, by lookup, may decide;
6. the outcome is recorded (``record_outcome``), the lease checked once more first.

A port's steps are generators, so that the SDK's recorders can perform them as effects
(``producers.steps``); a port that does its work in the calling thread returns plain values
from its steps (:func:`immediately`) and the rule is run with :func:`run_now`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from typing import Any, NoReturn, ParamSpec, Protocol, TypeVar

from ledger.domain import ids
from ledger.domain.call import Judged, judge_answer, judge_raised
from ledger.faults import fault_point
from ledger.results import MAX_RESULT_BYTES
from ledger.tools import ContactLost

T = TypeVar("T")
P = ParamSpec("P")
#: What a port's step may ask of whoever drives the rule (the SDK's effects; nothing, for a
#: port that works in the calling thread).
Step = Generator[Any, Any, T]


class Interrupted(Exception):  # noqa: N818  # what happened to the call, not a bug of ours
    """A call was ended by a ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``, a
    cancelled task...): raised into the rule in its place, so that it records what is now
    unknown before ``original`` is raised on to the caller."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"the call was interrupted: {type(original).__name__}")
        self.original = original


class CallPort(Protocol):
    """How one path performs the rule's steps for one operation."""

    def keep_lease(self, *, now: bool) -> Step[None]:
        """Keep the operation's lease: reclaim it when little of it is left (``now``: when it
        is not held at this moment, asked of the lease store). Raises ``LeaseLostError`` when
        another process has taken the operation over."""
        ...

    def record_dispatch(self, provider_ref: str) -> Step[None]:
        """Record DISPATCHED under ``provider_ref`` (the idempotency key), durably: the call
        comes after it."""
        ...

    def call(self, key: str) -> Step[object]:
        """Call the provider once under ``key``; returns whatever it answered, raises what it
        raised (``ContactLost`` for no answer in time; :class:`Interrupted`)."""
        ...

    def record_outcome(self, judged: Judged) -> Step[None]:
        """Record what ``judged`` says (SUCCEEDED with its result stored first, FAILED or
        UNKNOWN with its reason)."""
        ...


def perform_call(port: CallPort, operation_id: str, *, stage: str) -> Step[Judged]:
    """Perform the rule for ``operation_id`` through ``port``; returns what was recorded.

    ``stage`` names the fault points passed on the way (``{stage}.after_dispatch_before_call``,
    ``{stage}.after_response_before_result``), which the chaos tests kill processes at."""
    key = ids.idempotency_key(operation_id)
    yield from port.keep_lease(now=False)  # an earlier append may have stalled
    yield from port.record_dispatch(key)
    # The last moment to find out that someone else owns the operation now: past this point
    # the provider is called.
    yield from port.keep_lease(now=True)
    fault_point(f"{stage}.after_dispatch_before_call")
    try:
        answer = yield from port.call(key)
    except Interrupted as exc:
        yield from _interrupted(port, operation_id, exc.original)
    except Exception as exc:  # any unconfirmed outcome is UNKNOWN, by design
        judged = judge_raised(
            type(exc).__name__, str(exc), contact_lost=isinstance(exc, ContactLost)
        )
        yield from port.keep_lease(now=False)
        yield from port.record_outcome(judged)
        return judged
    fault_point(f"{stage}.after_response_before_result")
    yield from port.keep_lease(now=False)
    judged = judge_answer(answer, max_result_bytes=MAX_RESULT_BYTES)
    yield from port.record_outcome(judged)
    return judged


def _interrupted(port: CallPort, operation_id: str, interrupted: BaseException) -> Step[NoReturn]:
    """The interrupt (Ctrl-C, SystemExit, a cancelled task) goes on to the caller, but only once
    the log says the call may have happened: a caller who is never told could call again under
    a new id."""
    judged = judge_raised(
        type(interrupted).__name__,
        f"the call was interrupted ({interrupted!r})",
        contact_lost=True,
    )
    try:
        yield from port.record_outcome(judged)
    except Exception as failure:
        interrupted.add_note(
            f"opledger: {operation_id} was dispatched when its call was interrupted, and "
            f"UNKNOWN could not be recorded ({failure}): it may have happened. Do not call it "
            "again; the recovery worker reconciles it once its lease runs out"
        )
        raise interrupted from failure
    interrupted.add_note(
        f"opledger: {operation_id} was dispatched when its call was interrupted: it is recorded "
        "UNKNOWN and the recovery worker reconciles it. Do not call it again"
    )
    raise interrupted from None


def immediately(step: Callable[P, T]) -> Callable[P, Step[T]]:
    """A port's step that does its work in the calling thread and asks nothing of a driver."""

    @functools.wraps(step)
    def performed(*args: P.args, **kwargs: P.kwargs) -> Step[T]:
        return step(*args, **kwargs)
        yield  # pragma: no cover  # makes this a generator: the rule yields from it

    return performed


def run_now(rule: Step[T]) -> T:
    """Run ``rule`` whose port works in the calling thread (every step :func:`immediately`)."""
    try:
        effect = next(rule)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]  # the generator's declared return
    rule.close()
    raise TypeError(f"a port run now asked its driver for {effect!r}")
