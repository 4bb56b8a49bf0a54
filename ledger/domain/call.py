"""The call rule's decisions, written once: what a provider's answer means and what is recorded.

The rule is "dispatch → check the lease is still mine → call → judge the answer → record the
outcome"; its order is performed once, by ``ledger.call_rule.perform_call``, for the SDK
(``execute()`` and the resume of an intent taken over) and the recovery worker (a resumed
intent, a reconciliation's new attempt). *What an answer means* is decided here:

- an answer that is not a :class:`CallOutcome` of the declared shape cannot say whether the call
  happened: UNKNOWN (left to reconciliation, never an exception a caller could retry);
- a confirmed success whose result is larger than the result store takes: UNKNOWN (the effect
  happened but cannot be recorded as a result; reconciliation parks it, nobody calls again);
- a confirmed failure: FAILED, with the provider's words made storable;
- a success: SUCCEEDED, with its result, a content type a store takes (else "unlabelled") and
  the provider's own reference if an event can carry it;
- a call that raised or timed out: UNKNOWN, saying why (:func:`judge_lost`).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ledger.domain.events import recordable_provider_ref, storable_text
from ledger.domain.states import ExecutionState

#: What a result is labelled when the label it came with cannot be stored: its bytes, unnamed.
UNLABELLED = "application/octet-stream"

# type/subtype with optional parameters (RFC 9110 token characters), kept deliberately strict:
# the value is echoed in HTTP headers by the delivery worker.
_CONTENT_TYPE = re.compile(
    r"^[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*"
    r"(\s*;\s*[A-Za-z0-9!#$&^_.+-]+=(\"[^\"\r\n]*\"|[A-Za-z0-9!#$&^_.+-]+))*$"
)


def storable_content_type(content_type: object) -> bool:
    """Whether a result store takes ``content_type`` as a label."""
    return (
        isinstance(content_type, str)
        and len(content_type) <= 255
        and _CONTENT_TYPE.match(content_type) is not None
    )


def recordable_content_type(content_type: str) -> str:
    """``content_type`` if the store takes it, else :data:`UNLABELLED`: for a label from outside
    (a provider's answer), which must not make a result that exists unstorable."""
    return content_type if storable_content_type(content_type) else UNLABELLED


@dataclass(frozen=True, slots=True)
class CallOutcome:
    """A confirmed outcome. ``succeeded`` False is a *confirmed* failure: the provider says the
    side effect did not happen. An unknown outcome raises ``ledger.tools.ContactLost`` instead."""

    succeeded: bool
    result: bytes | None = None
    content_type: str = "application/json"
    error: str | None = None
    #: the provider's own id for the call, when it has one
    provider_ref: str | None = None


@dataclass(frozen=True, slots=True)
class Judged:
    """What to record for a call: ``state`` is SUCCEEDED, FAILED or UNKNOWN."""

    state: ExecutionState
    #: SUCCEEDED: the result to store, labelled ``content_type``
    result: bytes | None = None
    content_type: str = UNLABELLED
    #: SUCCEEDED: the provider's own id for the call, if an event can carry it
    provider_ref: str | None = None
    #: FAILED: the provider's words; UNKNOWN: why the outcome is not known
    error: str | None = None


def judge_answer(answer: object, *, max_result_bytes: int) -> Judged:
    """What ``answer`` (whatever the provider returned) means; see the module's list."""
    outcome = _checked(answer)
    if isinstance(outcome, str):
        return Judged(
            ExecutionState.UNKNOWN,
            error=f"the provider {outcome}: whether the call happened cannot be told from it; "
            "left for reconciliation (it is not called again)",
        )
    if not outcome.succeeded:
        words = storable_text(outcome.error or "the provider reported a failure")
        return Judged(ExecutionState.FAILED, error=words)
    result = outcome.result if outcome.result is not None else b""
    if len(result) > max_result_bytes:
        return Judged(
            ExecutionState.UNKNOWN,
            error=f"the provider succeeded, but its result is {len(result)} bytes, over the "
            f"result store's limit of {max_result_bytes}: left for reconciliation (it is not "
            "called again)",
        )
    return Judged(
        ExecutionState.SUCCEEDED,
        result=result,
        content_type=recordable_content_type(outcome.content_type),
        provider_ref=recordable_provider_ref(
            outcome.provider_ref if isinstance(outcome.provider_ref, str) else None
        ),
    )


def judge_raised(kind: str, said: str, *, contact_lost: bool) -> Judged:
    """A call that raised an exception of type ``kind`` saying ``said``, or gave no answer in
    time (``contact_lost``: the provider's adapter said so, or the call was interrupted):
    UNKNOWN, never a failure and never a reason to call again; reconciliation looks the key up."""
    if contact_lost:
        return Judged(ExecutionState.UNKNOWN, error=f"contact lost after dispatch: {said}")
    return Judged(ExecutionState.UNKNOWN, error=f"{kind}: {said}")


def _checked(answer: object) -> CallOutcome | str:
    """``answer`` as a :class:`CallOutcome` of the declared shape, or what is wrong with it."""
    if not isinstance(answer, CallOutcome):
        return f"answered with {type(answer).__name__}, not a CallOutcome"
    if not isinstance(answer.succeeded, bool):
        return f"answered succeeded={type(answer.succeeded).__name__}, not a bool"
    if isinstance(answer.result, bytearray | memoryview):
        return replace(answer, result=bytes(answer.result))
    if answer.result is not None and not isinstance(answer.result, bytes):
        return f"answered a result of type {type(answer.result).__name__}, not bytes"
    if answer.error is not None and not isinstance(answer.error, str):
        return f"answered an error of type {type(answer.error).__name__}, not str"
    return answer
