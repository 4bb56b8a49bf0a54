"""A broker that stops answering in the middle of ``execute()`` (SIGSTOP between the intent and
the dispatch, the way a restart or a long GC pause looks to a caller): the error the caller gets
says that the intent is on the log and what will happen to it, never "nothing was sent"; the
operation is then carried on by the recovery worker and the tool runs once, counted by the
provider itself; asking again with the same operation id gives the outcome without a call.

(An outside soak raised "LeaseLostError: ... the lease (token 1) ran out ... nothing was sent"
13 times while the intent was on the log: a caller who believed it and tried again under a new
id would have paid twice.)
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import psycopg
import pytest

from ledger.domain.policy import PolicyDecision, PolicyRequest
from ledger.domain.states import ExecutionState
from ledger.settings import Settings
from ledger.tools import ProviderTerms
from opledger import stack
from opledger.fakes.memory import MemoryProvider
from opledger.fakes.model import Mode
from producers import RecordError, TransitionRecorder
from producers import execution as execution_module
from tests.support import project_in_process, recovery_worker

TERMS = ProviderTerms(
    call_timeout=timedelta(seconds=1), key_retention=timedelta(hours=1), repeat_safe=True
)


def _allow(request: PolicyRequest) -> PolicyDecision:
    return PolicyDecision(True, "allowed by the test", None)


def test_a_broker_pause_mid_call_names_the_recorded_intent_and_its_fate(
    private_stack: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = private_stack
    broker = stack.kafka_pid(settings)
    assert broker is not None
    provider = MemoryProvider("send_email", TERMS, mode=Mode.NON_IDEMPOTENT)
    paused: list[float] = []

    def pause_the_broker(name: str) -> None:
        if name == "execute.after_intent_before_dispatch" and not paused:
            os.kill(broker, signal.SIGSTOP)
            paused.append(time.monotonic())

    monkeypatch.setattr(execution_module, "fault_point", pause_the_broker)
    recorder = TransitionRecorder.connect(settings, providers=[provider], delivery_timeout_s=2.0)
    recorder.collaborators.policy = _allow
    try:
        try:
            with pytest.raises(RecordError) as raised:
                recorder.execute("acme", "agent-7", "send_email", {"to": "a@example.com"})
        finally:
            os.kill(broker, signal.SIGCONT)
        error = raised.value
        message = str(error)
        assert paused, "the broker was never paused: the test did not test anything"
        assert error.operation_id is not None, message
        op_id = error.operation_id
        # What the log holds, and its fate, in the words the caller reads.
        assert error.log_holds is not None and "INTENT_RECORDED" in error.log_holds, message
        assert "this call did not call the tool" in message, message
        assert "recovery worker" in message, message
        assert f"same operation id ({op_id}" in message, message
        assert "nothing was sent" not in message, message
        assert provider.stats().calls == 0

        # The fate it named: the recovery worker carries it on once the lease ran out, and the
        # tool runs once.
        _recover_until_finished(settings, provider, op_id)
        assert provider.stats().calls == 1 and provider.stats().side_effects == 1

        # Asked again with the same id: the outcome, without a call.
        again = recorder.execute(
            "acme", "agent-7", "send_email", {"to": "a@example.com"}, operation_id=op_id
        )
        assert again.repeat and again.state is ExecutionState.SUCCEEDED, again
        assert provider.stats().calls == 1
    finally:
        recorder.close()


def _recover_until_finished(settings: Settings, provider: MemoryProvider, op_id: str) -> None:
    with recovery_worker(settings, [provider], _allow) as worker:
        deadline = time.monotonic() + 120
        state = None
        while time.monotonic() < deadline:
            project_in_process(settings)
            worker.run_once(range(settings.partitions))
            project_in_process(settings)
            with psycopg.connect(settings.dsn) as conn:
                row = conn.execute(
                    "SELECT execution_state FROM agent_operations WHERE operation_id = %s",
                    (op_id,),
                ).fetchone()
            state = None if row is None else row[0]
            if state == "SUCCEEDED":
                return
            time.sleep(1.0)
        raise AssertionError(f"{op_id} not carried on by the recovery worker: {state}")
