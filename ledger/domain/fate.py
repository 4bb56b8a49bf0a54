"""What the log holds for an operation a call could not finish, and what happens to it next.

An error the SDK raises after an operation's intent may be on the log must say so: a caller
told "nothing was sent" when an intent is recorded would try again under a new operation id,
and the recovery worker would carry the first one on as well: the tool would run twice. This
module turns what the calling process knows (the last state the broker acknowledged, and the
states of appends whose acknowledgement was lost) into those two sentences. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ledger.domain.states import ExecutionState

_TERMINAL = (ExecutionState.SUCCEEDED, ExecutionState.FAILED)


@dataclass(frozen=True, slots=True)
class Fate:
    """``holds``: what the log holds for the operation, as far as this process knows;
    ``next_step``: what will happen to it and what the caller should do."""

    holds: str
    next_step: str
    #: whether anything of the operation may be on the log (a new id would then risk a repeat)
    on_the_log: bool


def fate(
    operation_id: str,
    acknowledged: ExecutionState | None,
    attempt: int,
    in_doubt: Collection[ExecutionState] = (),
    *,
    request_stored: bool = True,
) -> Fate:
    """The fate of ``operation_id`` whose last acknowledged execution state is ``acknowledged``
    (``None``: none acknowledged) at ``attempt``, with appends of ``in_doubt`` states that may
    or may not have been written; ``request_stored`` is False when its lease and request could
    not be committed (then only its writer could have dispatched it)."""
    ask_again = (
        f"ask for its outcome with the same operation id ({operation_id}: execute() again "
        "with operation_id=, which does not call the tool again, or load()); never retry it "
        "under a new operation id, or the tool may run twice"
    )
    if acknowledged is None:
        if not in_doubt:
            return Fate(
                f"nothing for {operation_id}",
                "nothing will happen to it; calling again is safe",
                on_the_log=False,
            )
        return Fate(
            f"perhaps the intent of {operation_id} (its acknowledgement was lost)",
            "if it was written, the recovery worker carries it on once this process's lease "
            f"runs out (the tool is called at most once); {ask_again}",
            on_the_log=True,
        )
    maybe = sorted(s.value for s in in_doubt if s is not acknowledged)
    perhaps = f", and perhaps {' and '.join(maybe)} (its acknowledgement was lost)" if maybe else ""
    holds = f"{operation_id} at {acknowledged.value} (attempt {attempt}){perhaps}"
    if acknowledged in _TERMINAL and not maybe:
        return Fate(holds, "it is finished: nothing more will happen to it", on_the_log=True)
    if acknowledged is ExecutionState.INTENT_RECORDED and not request_stored and not maybe:
        return Fate(
            f"{holds}, without a lease or a stored request (they could not be committed)",
            "this call did not call the tool, and no one else can dispatch it without its "
            "request: the recovery worker parks it for a person once "
            "OPLEDGER_RECOVERY_UNLEASED_GRACE_S has passed (see it with `opledger ops show "
            f"{operation_id}`); the tool is never called for it unless a person decides so",
            on_the_log=True,
        )
    if acknowledged is ExecutionState.INTENT_RECORDED:
        # The tool is called only once DISPATCHED is acknowledged: this call never called it.
        return Fate(
            holds,
            "this call did not call the tool; the recovery worker carries the operation on "
            "once this process's lease runs out (it dispatches it once, or, if a dispatch was "
            f"written, looks its idempotency key up with the provider); {ask_again}",
            on_the_log=True,
        )
    return Fate(
        holds,
        "the tool may have been called; the recovery worker reconciles it by looking its "
        f"idempotency key up with the provider (never by calling it blindly); {ask_again}",
        on_the_log=True,
    )
