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
from ledger.policy_store import PolicyFreshness
from ledger.settings import Settings
from producers import TransitionRecorder
from tests.support import grant, project_in_process, read_all

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


def test_a_locked_offsets_table_makes_the_policy_view_stale_not_a_hung_caller(
    isolated: Settings,
) -> None:
    """The SDK's and the workers' policy freshness look reads the projector's offsets; behind
    another session's lock it now gives up within its probe timeout and says the view cannot be
    vouched for (dispatches refused, reconciliations and deliveries held) instead of holding its
    caller for as long as the lock is held."""
    grant(isolated, TENANT, actor=ACTOR, tool=TOOL)
    project_in_process(isolated)
    quick = isolated.with_(policy_max_staleness_ms=300, policy_freshness_refresh_ms=50)
    freshness = PolicyFreshness(quick)
    try:
        assert freshness.stale_reason() is None
        with psycopg.connect(isolated.dsn) as analyst:
            analyst.execute("LOCK TABLE projector_offsets IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            reason = None
            while reason is None and time.monotonic() - started < 20:
                reason = freshness.stale_reason()
                time.sleep(0.05)
            took = time.monotonic() - started
            analyst.rollback()
        assert reason is not None and "lock timeout" in reason, reason
        assert took < 10, f"held its caller {took:.1f}s"
        deadline = time.monotonic() + 10
        while freshness.stale_reason() is not None:
            assert time.monotonic() < deadline, "never current again"
            time.sleep(0.05)
    finally:
        freshness.close()
