"""A stalled append outlasting the lease (a broker fenced after a SIGKILL takes longer than a
short lease) no longer costs the caller its call while nobody else touched the operation: the
SDK reclaims its lease (same token, same owner) and goes on, and the tool runs once. When another
process did take the operation over meanwhile, the SDK calls nothing and says so. Against the
real broker and database; the stall is a transport that holds the intent's send."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import pytest

from ledger.domain.policy import PolicyDecision, PolicyRequest
from ledger.domain.states import ExecutionState
from ledger.leases import LeaseStore
from ledger.log import OutgoingRecord, Positions, Transport
from ledger.pg import open_pool
from ledger.settings import Settings
from ledger.tools import ProviderTerms
from opledger.fakes.memory import MemoryProvider
from opledger.fakes.model import Mode
from producers import LeaseLostError, TransitionRecorder

#: call timeout 0.5 s + the SDK's 5 s margin: the lease an execute() takes
TERMS = ProviderTerms(
    call_timeout=timedelta(milliseconds=500), key_retention=timedelta(hours=1), repeat_safe=True
)
STALL_S = 6.5


def _allow(request: PolicyRequest) -> PolicyDecision:
    return PolicyDecision(True, "allowed by the test", None)


class _StallFirst:
    """Holds the first send (the intent's) for STALL_S, running ``during`` meanwhile."""

    def __init__(self, inner: Transport, during: list[object]) -> None:
        self.inner = inner
        self.during = during
        self.stalled = False

    def send(self, records: Sequence[OutgoingRecord]) -> Positions | None:
        positions = self.inner.send(records)
        if not self.stalled:
            self.stalled = True
            started = time.monotonic()
            for action in self.during:
                action()  # type: ignore[operator]
            time.sleep(max(0.0, STALL_S - (time.monotonic() - started)))
        return positions

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("taken_over", [False, True])
def test_a_stall_past_the_lease_is_ridden_out_unless_someone_took_over(
    isolated: Settings, taken_over: bool
) -> None:
    provider = MemoryProvider("send_email", TERMS, mode=Mode.NON_IDEMPOTENT)
    op_ids: list[str] = []
    during: list[object] = []
    if taken_over:
        pool = open_pool(isolated.dsn, name="test-rival")
        rival = LeaseStore(pool, "rival")

        def take_over() -> None:
            # Another process takes the operation over once the caller's lease expired.
            time.sleep(TERMS.call_timeout.total_seconds() + 5.5)
            taken = rival.take_over([(op_ids[0], "acme")], timedelta(minutes=1))
            assert taken, "the rival could not take the expired lease"

        during.append(lambda: threading.Thread(target=take_over).start())
    stalls: list[_StallFirst] = []

    def wrap(inner: Transport) -> Transport:
        stalls.append(_StallFirst(inner, during))
        return stalls[0]

    with TransitionRecorder.connect(isolated, providers=[provider], wrap_transport=wrap) as sdk:
        sdk.collaborators.policy = _allow
        op_id = sdk.new_operation_id()
        op_ids.append(op_id)
        sdk.new_operation_id = lambda: op_id  # type: ignore[method-assign]
        if not taken_over:
            done = sdk.execute("acme", "agent-7", "send_email", {"to": "a@example.com"})
            assert done.state is ExecutionState.SUCCEEDED, done
            assert provider.stats().calls == 1
        else:
            with pytest.raises(LeaseLostError, match="took the operation over") as raised:
                sdk.execute("acme", "agent-7", "send_email", {"to": "a@example.com"})
            assert provider.stats().calls == 0, "a caller that lost its lease calls nothing"
            assert raised.value.operation_id == op_id
            pool.close()
    assert stalls and stalls[0].stalled, "the intent's send was never held: nothing was tested"
