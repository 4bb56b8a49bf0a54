"""Deliveries, pure: the outbox's PENDINGs for a SUCCEEDED execution, a redrive, which due sends
get one of the sender's connections, and the verdict on one send (acknowledged, try again when,
give up, or stop sending to the destination at all). The caller passes the time and the random
jitter (``ledger.domain.schedule``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from enum import StrEnum
from typing import TypeVar

from ledger.domain.events import DeliveryTransitioned
from ledger.domain.fold import DeliveryRecord, ExecutionRecord
from ledger.domain.ids import derived_event_id
from ledger.domain.schedule import RetryPolicy
from ledger.domain.states import DeliveryState, ExecutionState

#: Statuses that say "slow down" rather than "this failed": the destination is overloaded.
THROTTLE_STATUSES = frozenset({429, 502, 504})
#: The destination is gone for good: stop sending to it.
GONE_STATUS = 410
#: The destination refuses the body as too large. Every send of a delivery carries the very
#: same bytes, so sending again cannot succeed until the destination's limit changes: dead-letter
#: at once, for a redrive after that, instead of retrying for the whole schedule.
TOO_LARGE_STATUS = 413


class Outcome(StrEnum):
    ACKED = "acked"  # 2xx (webhook), broker acknowledgement (queue)
    RETRY = "retry"  # failed, sent again later
    THROTTLED = "throttled"  # 429/502/504: sent again later, the destination waits too
    DEAD_LETTERED = "dead_lettered"  # attempts or horizon exhausted, or refused
    DISABLED = "disabled"  # 410 Gone: dead-lettered, and the destination disabled
    NOT_SENT = "not_sent"  # never left the worker (no connection): sent again at once


@dataclass(frozen=True, slots=True)
class SendResult:
    """What one send observed. ``status`` is None when no answer came (timeout, refused
    connection); ``retry_after`` is the destination's Retry-After, if it sent one."""

    status: int | None
    detail: str
    retry_after: timedelta | None = None
    #: not sent at all: the body is over what the way to the destination can carry (a queue
    #: record over the producer's limit); like a 413, no later send of the same bytes can pass
    too_large: bool = False
    #: not sent at all: no connection of the worker's came free for it before its deadline.
    #: The worker's own shortage, not the destination's answer: not an attempt (decision 026)
    no_connection: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    #: for RETRY/THROTTLED: when to send again
    next_attempt_at: datetime | None = None
    #: why (the error recorded with the transition); None when acknowledged
    reason: str | None = None


def judge(
    result: SendResult,
    *,
    round_attempts: int,
    round_start: datetime,
    now: datetime,
    policy: RetryPolicy,
    unit_random: float,
) -> Verdict:
    """The verdict on a send that was the ``round_attempts``-th of its round."""
    if result.no_connection:
        # Nothing reached the destination, so nothing of its budget is used: no backoff, no
        # throttle, no dead letter (the horizon and the attempts are judged on real answers).
        return Verdict(Outcome.NOT_SENT, next_attempt_at=now, reason=result.detail)
    status = result.status
    if status is not None and 200 <= status < 300:
        return Verdict(Outcome.ACKED)
    if status == GONE_STATUS:
        return Verdict(
            Outcome.DISABLED,
            reason=f"destination answered 410 Gone ({result.detail}); destination disabled",
        )
    if result.too_large:
        return Verdict(
            Outcome.DEAD_LETTERED,
            reason=f"the body is too large to send ({result.detail}); every send carries the "
            "same bytes, so redrive once the destination's limit allows them",
        )
    if status == TOO_LARGE_STATUS:
        return Verdict(
            Outcome.DEAD_LETTERED,
            reason=f"destination refused the body as too large (HTTP 413: {result.detail}); "
            "every send carries the same bytes, so redrive once the destination accepts them",
        )
    what = "no answer" if status is None else f"HTTP {status}"
    if status is not None and 300 <= status < 400:
        what += " (a redirect is not followed: a delivery goes where it was configured to go)"
    failure = f"{what}: {result.detail}" if result.detail else what
    throttled = status in THROTTLE_STATUSES
    wait = policy.delay(round_attempts, unit_random)
    if result.retry_after is not None:
        wait = max(wait, min(result.retry_after, policy.max_retry_after))
    next_at = now + wait
    if round_attempts >= policy.max_attempts:
        return Verdict(
            Outcome.DEAD_LETTERED,
            reason=f"gave up after {round_attempts} attempts; last: {failure}",
        )
    if next_at > round_start + policy.horizon:
        return Verdict(
            Outcome.DEAD_LETTERED,
            reason=f"gave up at the {policy.horizon} retry horizon after {round_attempts} "
            f"attempts; last: {failure}",
        )
    return Verdict(
        Outcome.THROTTLED if throttled else Outcome.RETRY, next_attempt_at=next_at, reason=failure
    )


_Due = TypeVar("_Due")


def take_connections(
    due: Iterable[_Due], free: int, needs_connection: Callable[[_Due], bool]
) -> tuple[list[_Due], list[_Due]]:
    """``due`` (in the order it fell due) split into the sends that go now and those that wait.

    A send is recorded SENT only with a connection to leave on (decision 026): each one that
    needs a connection (a webhook) takes one of the ``free`` ones, in order; once none is left,
    the others wait as they are, with nothing recorded and no attempt spent, for a pass with a
    connection free. A send that needs none (a queue append) always goes.
    """
    going: list[_Due] = []
    waiting: list[_Due] = []
    left = free
    for send in due:
        if not needs_connection(send):
            going.append(send)
        elif left > 0:
            left -= 1
            going.append(send)
        else:
            waiting.append(send)
    return going, waiting


#: The longest delay a ``Retry-After`` may ask for: a destination's answer is input from outside,
#: and any longer wait is past every retry horizon anyway (the schedule's horizon then decides).
MAX_RETRY_AFTER = timedelta(days=365)
#: Longest header value read: delay-seconds and an HTTP-date are both far shorter.
_MAX_RETRY_AFTER_CHARS = 64
_ASCII_DIGITS = frozenset("0123456789")


def parse_retry_after(value: str | None, now: datetime) -> timedelta | None:
    """A ``Retry-After`` header (delay-seconds or an HTTP-date, RFC 9110) as a delay from
    ``now``, at most :data:`MAX_RETRY_AFTER`; None if absent or unreadable (then the schedule
    alone decides). The value comes from the destination: nothing in it may raise."""
    if value is None:
        return None
    text = value.strip()
    if not text or len(text) > _MAX_RETRY_AFTER_CHARS:
        return None
    # ASCII digits only: str.isdigit() is true for "²" or "٣", which int() refuses or reads
    # as another number.
    if set(text) <= _ASCII_DIGITS:
        return min(timedelta(seconds=min(int(text), 10**10)), MAX_RETRY_AFTER)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # an HTTP-date is always GMT
        when = when.replace(tzinfo=UTC)
    try:
        return min(max(when - now, timedelta(0)), MAX_RETRY_AFTER)
    except (OverflowError, TypeError):
        return None


#: Who appends the outbox's PENDINGs and the delivery worker's transitions.
DELIVERY_WORKER = "delivery-worker"


def _millis(when: datetime) -> int:
    return int(when.timestamp() * 1000)


def outbox_pendings(
    execution: ExecutionRecord, destinations: Iterable[str]
) -> list[DeliveryTransitioned]:
    """One PENDING per destination for a SUCCEEDED execution: the outbox.

    Everything in them is derived from the execution's SUCCEEDED step (its event id, its time)
    and the destination, so whoever derives them again after a crash writes the very same events,
    and the fold counts the repeat as a duplicate: every destination gets one delivery.
    """
    if execution.state is not ExecutionState.SUCCEEDED or execution.result_ref is None:
        raise ValueError("the outbox opens deliveries only for a SUCCEEDED execution")
    succeeded = execution.seen.get((ExecutionState.SUCCEEDED, execution.attempt), "")
    return [
        DeliveryTransitioned(
            event_id=derived_event_id(
                _millis(execution.state_entered_at),
                "outbox",
                execution.operation_id,
                destination,
                succeeded,
            ),
            operation_id=execution.operation_id,
            tenant_id=execution.tenant_id,
            actor_id=DELIVERY_WORKER,
            occurred_at=execution.state_entered_at,
            attempt=0,
            destination=destination,
            state=DeliveryState.PENDING,
            result_ref=execution.result_ref,
        )
        for destination in sorted(set(destinations))
    ]


def redrive(
    record: DeliveryRecord, *, actor_id: str, reason: str, now: datetime
) -> DeliveryTransitioned:
    """The event that sends a dead-lettered delivery again (a new round of sends).

    Its id is derived from the dead letter it answers: two people redriving the same dead
    letter write the same event, and the second is a duplicate (the delivery is sent once).
    """
    if record.state is not DeliveryState.DEAD_LETTERED:
        raise ValueError(f"only a DEAD_LETTERED delivery can be redriven, not {record.state}")
    if not reason.strip():
        raise ValueError("a redrive needs a reason")
    dead_letter = record.seen.get((DeliveryState.DEAD_LETTERED, record.attempts), "")
    return DeliveryTransitioned(
        event_id=derived_event_id(
            _millis(record.state_entered_at),
            "redrive",
            record.operation_id,
            record.destination,
            dead_letter,
        ),
        operation_id=record.operation_id,
        tenant_id=record.tenant_id,
        actor_id=actor_id,
        occurred_at=now,
        attempt=record.attempts,
        destination=record.destination,
        state=DeliveryState.PENDING,
        result_ref=record.result_ref,
        error=f"redriven by {actor_id}: {reason}",
    )
