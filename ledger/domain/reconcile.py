"""What to do with an operation whose outcome is not known, given what the provider says and what
policy allows now. Pure: the lookup, the policy decision and the clock are handed in.

The seed's rules, as one table (``decide``):

=================  ==========================================  ===============================
lookup             and                                         decision
=================  ==========================================  ===============================
found, succeeded   (whatever policy says now)                  MARK_SUCCEEDED: it happened
found, failed      (whatever policy says now)                  MARK_FAILED: it did not happen
unavailable                                                    RETRY_LOOKUP, never a new call
not found          dispatched longer ago than the provider     PARK: a not-found proves nothing
                   keeps idempotency keys                      once the key may be forgotten
not found          policy refuses a new attempt now            REFUSE (revoked, expired,
                                                               cancelled, not repeat-safe...)
not found          policy allows a repeat, but the provider    PARK: the call in flight could
                   does not declare repeats safe               still land after the lookup
not found          policy explicitly allows a repeat and the   NEW_ATTEMPT, same key, attempt+1
                   provider deduplicates the key
=================  ==========================================  ===============================

A new attempt needs two facts, both recorded in the decision (``policy_allowed`` with
``policy_version``, and ``provider_repeat_safe``): a person's grant that says a repeat of this tool
is allowed (``repeat_safe`` on the grant), and the provider's own terms saying a repeat under the
same key is deduplicated (``ProviderTerms.repeat_safe``). A not-found proves the call did not
happen only as of the lookup: the original request may still be on its way to the provider, and
only the provider's deduplication turns it and the new attempt into one effect
(docs/decisions/027-what-permits-a-new-attempt.md).

A found outcome is recorded even when policy now refuses: the outcome records what happened, the
refusal what is allowed, and a successful lookup never turns a refusal into permission.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from ledger.domain.policy import PolicyDecision


class LookupStatus(StrEnum):
    """What a provider says about an idempotency key (mirrors reconciliation_decided.avsc)."""

    FOUND_SUCCEEDED = "FOUND_SUCCEEDED"
    FOUND_FAILED = "FOUND_FAILED"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    NOT_LOOKED_UP = "NOT_LOOKED_UP"


class Decision(StrEnum):
    """What is done next. Mirrors ``schemas/reconciliation_decided.avsc``."""

    MARK_SUCCEEDED = "MARK_SUCCEEDED"
    MARK_FAILED = "MARK_FAILED"
    NEW_ATTEMPT = "NEW_ATTEMPT"
    #: an intent whose owner went away before dispatching: dispatch it (once)
    RESUME = "RESUME"
    #: stop and wait for a person (the evidence cannot decide)
    PARK = "PARK"
    #: policy forbids going on
    REFUSE = "REFUSE"
    #: the provider could not answer; ask again later, never call
    RETRY_LOOKUP = "RETRY_LOOKUP"
    #: a person cancelled the operation
    CANCEL = "CANCEL"


#: Decisions after which the operation waits for a person (it is "parked").
PARKING = frozenset({Decision.PARK, Decision.REFUSE})


@dataclass(frozen=True, slots=True)
class Verdict:
    decision: Decision
    reason: str


def decide(
    lookup: LookupStatus,
    policy: PolicyDecision,
    *,
    dispatched_at: datetime,
    now: datetime,
    key_retention: timedelta,
    provider_repeat_safe: bool,
) -> Verdict:
    """The reconciliation of one UNKNOWN attempt (see the module's table)."""
    if lookup is LookupStatus.FOUND_SUCCEEDED:
        note = "" if policy.allowed else f"; policy now refuses more: {policy.reason}"
        return Verdict(Decision.MARK_SUCCEEDED, f"the provider confirms it succeeded{note}")
    if lookup is LookupStatus.FOUND_FAILED:
        return Verdict(Decision.MARK_FAILED, "the provider confirms it failed")
    if lookup in (LookupStatus.UNAVAILABLE, LookupStatus.NOT_LOOKED_UP):
        return Verdict(Decision.RETRY_LOOKUP, "the provider could not be asked; asking again later")
    age = now - dispatched_at
    if age > key_retention:
        return Verdict(
            Decision.PARK,
            f"the provider has no record of the key, but the call was dispatched {age} ago, "
            f"past its key retention of {key_retention}: not-found proves nothing once the key "
            "may be forgotten; a person decides",
        )
    if not policy.allowed:
        return Verdict(Decision.REFUSE, f"no new attempt: {policy.reason}")
    if not provider_repeat_safe:
        return Verdict(
            Decision.PARK,
            "the provider has no record of the key and policy allows a repeat, but the "
            "provider does not declare a repeat under the same key safe: the call in flight "
            "could still land after the lookup, and a new attempt would be a second effect; a "
            "person decides",
        )
    return Verdict(
        Decision.NEW_ATTEMPT,
        f"the provider has no record of the key within its {key_retention} retention, "
        f"deduplicates a repeat of it, and policy allows a repeat ({policy.reason})",
    )
