"""A lock another session holds (an analyst's ``LOCK TABLE`` in an open transaction, a session
left in a transaction) never makes an SDK call or a worker wait for ever (decision 025): each
statement waits at most OPLEDGER_PG_LOCK_TIMEOUT_MS, the call fails with a sentence naming the
lock, nothing is written, and the same recorder works once the lock is released. Before, the
call waited as long as the lock was held. (The projector's side is in
``test_projector_silent_stalls.py``.)"""

from __future__ import annotations

import time

import psycopg
import pytest

from ledger.pg import DatabaseUnavailableError
from ledger.settings import Settings
from producers import TransitionRecorder
from tests.support import read_all

TENANT, ACTOR, TOOL = "acme", "agent-7", "send_email"


def test_an_sdk_call_behind_a_locked_table_fails_in_bounded_time_and_writes_nothing(
    isolated: Settings,
) -> None:
    quick = isolated.with_(pg_lock_timeout_ms=200)
    with TransitionRecorder.connect(quick) as recorder:
        recorder.intent(TENANT, ACTOR, TOOL, {"n": 0})  # migrated, the pool open
        op_id = recorder.new_operation_id()
        with psycopg.connect(isolated.dsn) as analyst:
            analyst.execute("LOCK TABLE operation_leases IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailableError, match="another session held a lock"):
                recorder.intent(TENANT, ACTOR, TOOL, {"n": 1}, operation_id=op_id)
            took = time.monotonic() - started
            analyst.rollback()
        assert took < 20, f"waited {took:.1f}s"
        keys = {k for _p, _o, k, _v in read_all(isolated, isolated.execution_topic)}
        assert op_id.encode() not in keys, "nothing is sent without the lease"
        handle = recorder.intent(TENANT, ACTOR, TOOL, {"n": 1}, operation_id=op_id)
        assert handle.operation_id == op_id
