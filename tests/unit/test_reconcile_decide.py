"""``ledger.domain.reconcile.decide``, row by row of its table: what the lookup says, what policy
allows now, what the provider's terms declare, and how old the attempt is."""

from __future__ import annotations

from datetime import timedelta

import pytest

from ledger.domain.policy import PolicyDecision
from ledger.domain.reconcile import Decision, LookupStatus, decide
from tests.unit.factories import T0

ALLOWED = PolicyDecision(True, "grant g-1 allows a repeat", "ev_1")
REFUSED = PolicyDecision(False, "revoked by r-1", "ev_2")
RETENTION = timedelta(hours=1)


def _decide(
    lookup: LookupStatus,
    policy: PolicyDecision = ALLOWED,
    *,
    age: timedelta = timedelta(minutes=5),
    repeat_safe: bool = True,
) -> Decision:
    verdict = decide(
        lookup,
        policy,
        dispatched_at=T0,
        now=T0 + age,
        key_retention=RETENTION,
        provider_repeat_safe=repeat_safe,
    )
    assert verdict.reason
    return verdict.decision


@pytest.mark.parametrize("policy", [ALLOWED, REFUSED])
@pytest.mark.parametrize("repeat_safe", [True, False])
def test_a_found_outcome_is_recorded_whatever_policy_and_terms_say(
    policy: PolicyDecision, repeat_safe: bool
) -> None:
    found = LookupStatus.FOUND_SUCCEEDED
    assert _decide(found, policy, repeat_safe=repeat_safe) is Decision.MARK_SUCCEEDED
    failed = LookupStatus.FOUND_FAILED
    assert _decide(failed, policy, repeat_safe=repeat_safe) is Decision.MARK_FAILED


@pytest.mark.parametrize("lookup", [LookupStatus.UNAVAILABLE, LookupStatus.NOT_LOOKED_UP])
def test_no_answer_is_asked_again_never_called(lookup: LookupStatus) -> None:
    assert _decide(lookup) is Decision.RETRY_LOOKUP


def test_not_found_past_the_retention_is_parked_even_when_everything_allows() -> None:
    assert _decide(LookupStatus.NOT_FOUND, age=RETENTION * 2) is Decision.PARK


def test_not_found_under_a_refusing_policy_is_refused() -> None:
    assert _decide(LookupStatus.NOT_FOUND, REFUSED) is Decision.REFUSE
    assert _decide(LookupStatus.NOT_FOUND, REFUSED, repeat_safe=False) is Decision.REFUSE


def test_not_found_needs_both_the_grant_and_the_providers_terms_for_a_new_attempt() -> None:
    assert _decide(LookupStatus.NOT_FOUND, repeat_safe=True) is Decision.NEW_ATTEMPT
    assert _decide(LookupStatus.NOT_FOUND, repeat_safe=False) is Decision.PARK
