"""``opledger audit`` against the real broker and database: the timeline is the topics' own
records of the operation, the projection's account of them is checked, and another tenant's
operation reads as no operation."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from ledger.domain.policy import PolicyDecision, PolicyRequest
from ledger.settings import Settings
from ledger.tools import ProviderTerms
from opledger.fakes.memory import MemoryProvider
from opledger.fakes.model import Mode
from producers import TransitionRecorder
from tests.process_support import run_cli
from tests.support import env_for, project_in_process, read_all

pytestmark = pytest.mark.integration

TERMS = ProviderTerms(
    call_timeout=timedelta(seconds=2), key_retention=timedelta(hours=1), repeat_safe=True
)


def _allow(request: PolicyRequest) -> PolicyDecision:
    return PolicyDecision(True, "allowed by the test", None)


def _audit(settings: Settings, op: str, tenant: str) -> tuple[int, Any, str]:
    result = run_cli(env_for(settings), "audit", op, "--tenant", tenant, "--json")
    body = json.loads(result.stdout) if result.stdout.strip() else None
    return result.returncode, body, result.stderr


def test_the_timeline_is_the_topics_records_and_a_tampered_history_is_reported(
    isolated: Settings,
) -> None:
    provider = MemoryProvider("send_email", TERMS, mode=Mode.NON_IDEMPOTENT)
    with TransitionRecorder.connect(isolated, providers=[provider]) as recorder:
        recorder.collaborators.policy = _allow
        ops = [
            recorder.execute("acme", "agent-7", "send_email", {"n": n}).operation_id
            for n in range(3)
        ]
        # Not projected yet: the audit reads it from the log's tail.
        project_in_process(isolated)
        late = recorder.execute("acme", "agent-7", "send_email", {"n": 9}).operation_id
    op = ops[0]
    code, audit, err = _audit(isolated, op, "acme")
    assert code == 0, err
    on_topic = [
        (isolated.execution_topic, p, o)
        for p, o, k, _v in read_all(isolated, isolated.execution_topic)
        if k == op.encode()
    ]
    assert [
        (line["topic"], line["partition"], line["offset"]) for line in audit["lines"]
    ] == on_topic
    assert [line["text"].split(" ")[0] for line in audit["lines"]] == [
        "INTENT_RECORDED",
        "DISPATCHED",
        "SUCCEEDED",
    ]
    assert {line["writer"] for line in audit["lines"]} == {"sdk"}
    assert audit["retries"] == [
        "no retry: the tool was called at most once, and each destination was sent to once"
    ]
    assert audit["disagreements"] == [] and audit["unprojected"] == 0

    # Another tenant asking, and an operation nobody has: the same answer.
    other, _body, other_err = _audit(isolated, op, "globex")
    nobody, _body2, nobody_err = _audit(isolated, "op_01JZZZZZZZZZZZZZZZZZZZZZZZ", "globex")
    assert other == nobody == 1
    assert other_err.replace(op, "OP") == nobody_err.replace("op_01JZZZZZZZZZZZZZZZZZZZZZZZ", "OP")

    # The late call is not projected: read from the log's tail, each line saying so.
    code, tail, err = _audit(isolated, late, "acme")
    assert code == 0, err
    assert [line["projected"] for line in tail["lines"]] == [False, False, False]
    assert tail["unprojected"] == 3 and tail["disagreements"] == []
    assert _audit(isolated, late, "globex")[0] == 1

    with psycopg.connect(isolated.dsn) as conn:
        conn.execute(
            "UPDATE operation_history SET state = 'FAILED' WHERE operation_id = %s "
            "AND state = 'SUCCEEDED'",
            (op,),
        )
    code, audit, _err = _audit(isolated, op, "acme")
    succeeded_at = on_topic[2]
    assert code == 1
    assert audit["disagreements"] == [
        f"{succeeded_at[0]}[{succeeded_at[1]}]@{succeeded_at[2]}: the projection says FAILED "
        "attempt 1, the log says SUCCEEDED attempt 1"
    ]
