"""The call rule's judgement is one: the same provider answer is recorded the same way whether
the SDK's ``execute()`` called the tool or the recovery worker did (a resumed intent), against
the real broker and database. The two paths checked an answer's shape and size differently
before ``ledger.domain.call``: the worker took a result over the store's limit or an answer of
another shape as a success or a crash."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from ledger.domain.events import ExecutionTransitioned
from ledger.domain.policy import PolicyDecision, PolicyRequest
from ledger.domain.states import ExecutionState
from ledger.results import MAX_RESULT_BYTES
from ledger.settings import Settings
from ledger.tools import CallOutcome, ProviderTerms
from opledger.fakes.memory import MemoryProvider
from opledger.fakes.model import Mode
from producers import TransitionRecorder
from tests.integration.test_recovery import Rig

TOOL = "send_email"
TERMS = ProviderTerms(
    call_timeout=timedelta(seconds=2), key_retention=timedelta(hours=1), repeat_safe=True
)

ANSWERS: dict[str, Any] = {
    "not a CallOutcome": "ok",
    "succeeded is not a bool": CallOutcome("yes", result=b"r"),  # type: ignore[arg-type]
    "a result over the store's limit": CallOutcome(True, result=b"x" * (MAX_RESULT_BYTES + 1)),
    "a failure in unstorable words": CallOutcome(False, error="card\x00declined"),
    "a success with an odd label and id": CallOutcome(
        True, result=b"{}", content_type="not a type", provider_ref="id with spaces"
    ),
}


class _Answering(MemoryProvider):
    def __init__(self, answer: Any) -> None:
        super().__init__(TOOL, TERMS, mode=Mode.NON_IDEMPOTENT)
        self.answer = answer

    def call(self, request: Any, idempotency_key: str) -> Any:
        super().call(request, idempotency_key)  # counted as the provider saw it
        return self.answer


def _judged(events: list[Any]) -> tuple[ExecutionState, str | None, str | None]:
    """What was recorded right after the (first) dispatch: the judgement of the answer."""
    transitions = [e for e in events if isinstance(e, ExecutionTransitioned)]
    states = [e.state for e in transitions]
    judged = transitions[states.index(ExecutionState.DISPATCHED) + 1]
    succeeded = judged.state is ExecutionState.SUCCEEDED
    return judged.state, judged.error, judged.provider_ref if succeeded else None


def _allow(request: PolicyRequest) -> PolicyDecision:
    return PolicyDecision(True, "allowed by the test", None)


@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_an_answer_is_recorded_alike_by_the_sdk_and_the_recovery_worker(
    isolated: Settings, case: str
) -> None:
    rig = Rig(isolated, _Answering(ANSWERS[case]))
    try:
        # The SDK calls the tool itself...
        with TransitionRecorder.connect(isolated, providers=[rig.provider]) as service:
            service.collaborators.policy = _allow
            by_sdk = service.execute("acme", "agent-7", TOOL, {"to": "sdk@example.com"})
        # ... and the recovery worker calls it for an intent whose owner went away.
        abandoned = rig.abandoned()
        rig.recover(passes=1)
        sdk = _judged(rig.events(by_sdk.handle))
        worker = _judged(rig.events(abandoned))
    finally:
        rig.close()
    assert sdk[0] is worker[0], (case, sdk, worker)
    assert sdk[1] == worker[1], (case, sdk, worker)
    assert sdk[0] in (ExecutionState.SUCCEEDED, ExecutionState.FAILED, ExecutionState.UNKNOWN)
    if case in ("not a CallOutcome", "succeeded is not a bool", "a result over the store's limit"):
        assert sdk[0] is ExecutionState.UNKNOWN, (case, sdk)
    assert rig.provider.stats().calls == 2, "each path called once"
    if case == "a success with an odd label and id":
        assert sdk == worker == (ExecutionState.SUCCEEDED, None, None)
