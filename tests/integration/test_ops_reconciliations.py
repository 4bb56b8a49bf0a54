"""``opledger ops show`` shows each reconciliation of an operation, from the ``reconciliations``
table: what the provider lookup said, the policy version that decided (with the grant or the
revocation it names, and who made it), whether policy allowed going on, who decided and why.

Before, decisions appeared only as history rows, without any of that. The operation here is
left UNKNOWN as a service that lost contact after dispatch leaves it, then reconciled twice, as
the recovery worker does: the provider could not be asked (policy allowed), then it had no
record of the key but the grant had been revoked (refused).
"""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

from ledger.codec import default_codec
from ledger.domain.events import ExecutionTransitioned, ReconciliationDecided
from ledger.domain.ids import event_id, operation_id, request_hash
from ledger.domain.policy import PolicyChange
from ledger.domain.reconcile import Decision, LookupStatus
from ledger.domain.states import ExecutionState
from ledger.settings import Settings
from projections import queries
from tests.support import (
    env_for,
    grant,
    policy_change,
    produce,
    producer,
    project_in_process,
    signed,
)

ROOT = Path(__file__).resolve().parents[2]
TENANT = "acme"
#: Words from outside (a person's reason for a revocation, a provider's for a decision) that
#: would clear the screen, write the clipboard and overwrite the line if printed as they are.
SAID = "fraud\x1b[2J\x1b]52;c;ZXZpbA==\x07\rall good\u202e"
X = ExecutionState
#: The recovery worker's identity, as it signs its decisions.
WORKER = "recover@host:1/abc"


def _revoke(
    settings: Settings, *, tenant_id: str, actor_id: str, at: datetime, **fields: Any
) -> str:
    change = policy_change(
        PolicyChange.REVOKE,
        tenant_id=tenant_id,
        actor_id=actor_id,
        principal="agent-7",
        tool_name="send_email",
        occurred_at=at,
        **fields,
    )
    change = signed(settings, change)
    p = producer(settings)
    p.produce(settings.policy_topic, key=change.subject_key(), value=default_codec().encode(change))
    assert p.flush(30) == 0
    return change.event_id


def _reconciled(settings: Settings) -> tuple[str, str, str, str]:
    """An UNKNOWN operation of TENANT reconciled three times; its id, the grant, the revocation
    and another tenant's policy version its last decision cites."""
    at = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
    granted = grant(settings, TENANT, actor="agent-7", tool="send_email")
    revoked = _revoke(settings, tenant_id=TENANT, actor_id="alice", at=at, reason=SAID)
    # A policy version only another tenant holds: a decision of TENANT citing it must not be
    # shown with that tenant's record (policy records are looked up within the decision's).
    foreign = _revoke(settings, tenant_id="globex", actor_id="mallory", at=at)
    op = operation_id(int(at.timestamp() * 1000), b"reconciled")
    ids = (event_id(int(at.timestamp() * 1000), bytes([n]) * 10) for n in range(1, 100))
    common: dict[str, Any] = {"operation_id": op, "tenant_id": TENANT}
    step: dict[str, Any] = {
        **common,
        "actor_id": "agent-7",
        "tool_name": "send_email",
        "request_hash": request_hash("send_email", {"to": "a@example.com"}),
    }
    decided: dict[str, Any] = {**common, "actor_id": WORKER, "attempt": 1}
    produce(
        settings,
        [
            ExecutionTransitioned(
                **step, event_id=next(ids), occurred_at=at, attempt=0, state=X.INTENT_RECORDED
            ),
            ExecutionTransitioned(
                **step,
                event_id=next(ids),
                occurred_at=at + timedelta(seconds=1),
                attempt=1,
                state=X.DISPATCHED,
                provider_ref=op,
            ),
            ExecutionTransitioned(
                **step,
                event_id=next(ids),
                occurred_at=at + timedelta(seconds=2),
                attempt=1,
                state=X.UNKNOWN,
                error="connection reset",
            ),
            ReconciliationDecided(
                **decided,
                event_id=next(ids),
                occurred_at=at + timedelta(seconds=3),
                decision=Decision.RETRY_LOOKUP,
                lookup=LookupStatus.UNAVAILABLE,
                provider_ref=op,
                policy_version=granted,
                policy_allowed=True,
                reason="the provider could not be asked; asking again later",
            ),
            ReconciliationDecided(
                **decided,
                event_id=next(ids),
                occurred_at=at + timedelta(seconds=4),
                decision=Decision.REFUSE,
                lookup=LookupStatus.NOT_FOUND,
                provider_ref=op,
                policy_version=revoked,
                policy_allowed=False,
                reason=f"no new attempt: the grant was revoked ({SAID})",
            ),
            ReconciliationDecided(
                **decided,
                event_id=next(ids),
                occurred_at=at + timedelta(seconds=5),
                decision=Decision.PARK,
                lookup=LookupStatus.NOT_FOUND,
                policy_version=foreign,
                reason="a person decides",
            ),
        ],
    )
    project_in_process(settings)
    return op, granted, revoked, foreign


def _cli(settings: Settings, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "opledger.cli", *argv],
        env=env_for(settings, PYTHONPATH=str(ROOT)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_ops_show_shows_each_reconciliation_of_an_unknown_operation(isolated: Settings) -> None:
    op, granted, revoked, foreign = _reconciled(isolated)
    with psycopg.connect(isolated.dsn) as conn:
        detail = queries.show_operation(conn, TENANT, op)
        theirs = conn.execute(
            "SELECT tenant_id FROM policy_history WHERE event_id = %s", (foreign,)
        ).fetchall()
    assert theirs == [("globex",)], "the other tenant's record is projected"
    assert detail is not None and detail.operation is not None
    assert detail.operation.execution_state is X.UNKNOWN
    assert [
        (
            r.attempt,
            r.decision,
            r.lookup,
            r.policy_version,
            r.policy_allowed,
            r.policy_change,
            r.policy_changed_by,
            r.actor_id,
        )
        for r in detail.reconciliations
    ] == [
        (1, "RETRY_LOOKUP", "UNAVAILABLE", granted, True, "GRANT", "test-operator", WORKER),
        (1, "REFUSE", "NOT_FOUND", revoked, False, "REVOKE", "alice", WORKER),
        (1, "PARK", "NOT_FOUND", foreign, False, None, None, WORKER),
    ]  # fmt: skip
    assert detail.reconciliations[1].policy_reason == SAID  # stored as it was said

    shown = _cli(isolated, "ops", "show", op, "--tenant", TENANT)
    assert shown.returncode == 0, shown.stderr
    printed = shown.stdout
    assert "reconciliations (3)" in printed
    for word in (
        "RETRY_LOOKUP",
        "UNAVAILABLE",
        "allowed",
        "REFUSE",
        "NOT_FOUND",
        "refused",
        "PARK",
    ):
        assert word in printed, word
    assert granted in printed and revoked in printed and foreign in printed
    assert "GRANT by test-operator" in printed
    assert "REVOKE by alice" in printed, "who revoked"
    assert "mallory" not in printed, "another tenant's policy record"
    # Outside words are shown as visible escapes, never acted on.
    assert "\x1b" not in printed and "\r" not in printed and "\u202e" not in printed
    assert "fraud\\x1b[2J" in printed

    # Tenant-scoped like the rest of ops: another tenant sees nothing of it.
    hidden = _cli(isolated, "ops", "show", op, "--tenant", "globex")
    assert hidden.returncode == 2
    assert f"no operation {op} for tenant globex" in hidden.stderr


def test_ops_show_says_when_an_operation_was_never_reconciled(isolated: Settings) -> None:
    at = datetime.now(UTC)
    op = operation_id(int(at.timestamp() * 1000), b"not-reconc")
    produce(
        isolated,
        [
            ExecutionTransitioned(
                event_id=event_id(int(at.timestamp() * 1000), b"\x01" * 10),
                operation_id=op,
                tenant_id=TENANT,
                actor_id="agent-7",
                occurred_at=at,
                attempt=0,
                state=X.INTENT_RECORDED,
                tool_name="send_email",
                request_hash=request_hash("send_email", {}),
            )
        ],
    )
    project_in_process(isolated)
    shown = _cli(isolated, "ops", "show", op, "--tenant", TENANT)
    assert shown.returncode == 0, shown.stderr
    assert "reconciliations: none" in shown.stdout
