"""``opledger demo`` end to end, as `make demo` runs it, but on a supervisor of its own: a
private OPLEDGER_HOME, topics, database and ports on the shared broker and PostgreSQL, so the
demo runs against supervised workers (projector, recovery, delivery, fake provider, reference
consumer) that see nothing else. It must exit 0, and what it claims is checked here again from
the sources themselves: the fake provider's own counts, the consumer's table, the projections
(which must equal an independent fold of every record on the topics), and the supervisor's
record of the delivery worker's SIGKILL and restart."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import psycopg

from ledger.codec import default_codec
from ledger.settings import Settings
from opledger import stack, supervisor
from opledger.fakes.http_provider import FakeProviderControl
from tests.demo_support import private_demo_settings, supervised
from tests.process_support import run_cli
from tests.support import (
    assert_projection_matches,
    independent_fold,
    read_with_headers,
)

OPERATIONS = 60


def test_the_demo_runs_the_real_workers_and_every_invariant_holds(
    isolated: Settings, tmp_path: Path
) -> None:
    settings = private_demo_settings(isolated, tmp_path)
    with supervised(settings, tmp_path) as env:
        assert stack.wait_workers_ready(settings, lambda _line: None, timeout=120)
        result = run_cli(env, "demo", "--operations", str(OPERATIONS), timeout=420)
        out = result.stdout
        assert result.returncode == 0, f"stdout:\n{out}\nstderr:\n{result.stderr}"
        stats = FakeProviderControl.of(settings).stats()
        delivery = supervisor.read_status(settings)["workers"]["delivery"]
        # The auditor's check of the same run: every projection rebuilt from the log equals
        # the live one, with the live projector still running.
        replayed = run_cli(env, "replay", "--json", timeout=300)
        assert replayed.returncode == 0, replayed.stdout + replayed.stderr
        replay = json.loads(replayed.stdout)
        assert replay["equal"] is True
        compared = {t["table"]: t["replay_rows"] for t in replay["tables"]}
        assert compared["agent_operations"] == OPERATIONS, replay
        assert compared["deliveries"] and compared["reconciliations"], replay
        assert replay["results_checked"] > 0 and replay["results_wrong"] == []

    # What the demo says.
    for line in (
        "max side effects per operation: 1",
        "provider calls beyond what reconciliation allowed: 0",
        "max applied changes per operation at a consumer: 1",
        f"operations lost or unfinished: 0 of {OPERATIONS}",
        "projections agree with the provider (SUCCEEDED: one side effect, FAILED: none): yes",
        "every invariant held",
    ):
        assert line in out, out
    assert len(re.findall(r"service-\d killed at ", out)) == 3, out
    assert "delivery worker SIGKILLed" in out, out

    # The supervisor restarted the delivery worker the demo killed.
    assert delivery["restarts"] >= 1 and delivery["last_exit_signal"] == "SIGKILL", delivery

    # The provider's own counts (it served only this run): nothing happened twice, and the
    # non-idempotent tool would have shown a second call as a second charge.
    assert stats.tools["charge_card"].mode.value == "non_idempotent"
    assert max(t.max_side_effects_per_key for t in stats.tools.values()) == 1
    keys = {k: c for t in stats.tools.values() for k, c in t.keys.items()}

    with psycopg.connect(settings.dsn) as conn:
        ops = conn.execute(
            "SELECT operation_id, execution_state, attempt, parked FROM agent_operations"
        ).fetchall()
        decisions = Counter(
            dict(conn.execute("SELECT decision, count(*) FROM reconciliations GROUP BY 1"))
        )
        new_attempts = Counter(
            op
            for (op,) in conn.execute(
                "SELECT operation_id FROM reconciliations WHERE decision = 'NEW_ATTEMPT'"
            )
        )
        deliveries = conn.execute("SELECT destination, state FROM deliveries").fetchall()
        refused = conn.execute(
            "SELECT count(*) FROM deliveries WHERE state = 'DEAD_LETTERED' "
            "AND error LIKE '%%refused network%%'"
        ).fetchone()
        applied = conn.execute(
            "SELECT consumer, operation_id, count(*) FROM consumer_applied_changes GROUP BY 1, 2"
        ).fetchall()
    assert len(ops) == OPERATIONS
    for op, state, _attempt, parked in ops:
        assert state in ("SUCCEEDED", "FAILED") or parked is not None, (op, state)
        counts = keys.get(op)
        calls = 0 if counts is None else counts.calls
        effects = 0 if counts is None else counts.side_effects
        assert calls <= 1 + new_attempts[op], (op, calls)
        assert effects == {"SUCCEEDED": 1, "FAILED": 0}.get(state, effects), (op, state, effects)
    # The three crashes: a new attempt allowed, a result found by lookup, a refusal (row 6).
    assert decisions["NEW_ATTEMPT"] >= 1 and decisions["MARK_SUCCEEDED"] >= 1, decisions
    assert decisions["REFUSE"] == 1, decisions
    assert sum(1 for _op, state, attempt, _p in ops if state == "FAILED" and attempt == 0) >= 1
    assert {state for _d, state in deliveries} <= {"ACKED", "DEAD_LETTERED"}
    assert {count for _c, _op, count in applied} == {1}
    acked = Counter(d for d, state in deliveries if state == "ACKED")
    by_consumer = Counter(c for c, _op, _n in applied)
    assert by_consumer["reference"] == acked["crm"] and by_consumer["billing"] == acked["billing"]
    # The webhooks reached the reference consumer on loopback: the stack's delivery worker
    # allows it (decision 019). Without that allowance every crm delivery was dead-lettered
    # and the demo still held every invariant (a dead letter is a final state).
    assert acked["crm"] > 0, deliveries
    assert refused == (0,), "a webhook to the local consumer was refused as a private address"

    # The projections equal an independent fold of everything on the topics.
    summary = assert_projection_matches(settings, independent_fold(settings))
    assert summary["operations"] == OPERATIONS
    assert summary["anomalies"] == 0

    # Every record of the execution, delivery and policy topics carries the same headers,
    # whichever process wrote it: the services' SDK, the recovery and delivery workers, the
    # demo's policy set-up.
    writers: Counter[tuple[str, str]] = Counter()
    tenants: Counter[str] = Counter()
    codec = default_codec()
    for topic in (settings.execution_topic, settings.delivery_topic, settings.policy_topic):
        records = read_with_headers(settings, topic)
        assert records, f"no records on {topic}"
        for _partition, _offset, key, value, headers in records:
            event = codec.decode(value or b"")
            assert [name for name, _v in headers] == [
                "opledger-schema",
                "opledger-tenant",
                "opledger-writer",
            ], (topic, key, headers)
            found = dict(headers)
            assert found["opledger-schema"] == type(event).__name__.encode(), (topic, key)
            assert found["opledger-tenant"] == event.tenant_id.encode(), (topic, key)
            writers[(topic, found["opledger-writer"].decode())] += 1
            tenants[event.tenant_id] += 1
    assert {w for _t, w in writers} == {"sdk", "recovery", "delivery", "demo"}, writers
    assert {t for t, w in writers if w == "delivery"} == {settings.delivery_topic}, writers
    assert {t for t, w in writers if w == "recovery"} == {settings.execution_topic}, writers
    assert {t for t, w in writers if w == "demo"} == {settings.policy_topic}, writers

    # Each tenant's export holds its records on the three topics, and is verified.
    assert len(tenants) >= 2, tenants
    for tenant, count in tenants.items():
        out_dir = tmp_path / f"export-{tenant}"
        made = run_cli(env, "audit", "export", "--tenant", tenant, "--out", str(out_dir))
        assert made.returncode == 0, made.stderr
        verified = run_cli(env, "audit", "verify", str(out_dir), "--json", timeout=120)
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert json.loads(verified.stdout)["records"] == count, tenant

    # The auditor's question, "execution or delivery?", for every retry of the run, answered
    # from the topics: each audit's timeline is exactly the operation's records there.
    on_topics: dict[str, list[tuple[str, int, int]]] = {}
    for topic in (settings.execution_topic, settings.delivery_topic):
        for partition, offset, key, _value, _headers in read_with_headers(settings, topic):
            on_topics.setdefault((key or b"").decode(), []).append((topic, partition, offset))
    with psycopg.connect(settings.dsn) as conn:
        retried = conn.execute(
            "SELECT o.operation_id, o.tenant_id, o.attempt > 1, "
            "coalesce(bool_or(d.attempts > 1), false) FROM agent_operations o "
            "LEFT JOIN deliveries d USING (operation_id) GROUP BY 1, 2, 3 "
            "HAVING o.attempt > 1 OR bool_or(d.attempts > 1)"
        ).fetchall()
    assert any(executed for _op, _t, executed, _resent in retried), retried
    for op, tenant, executed, resent in retried:
        answered = run_cli(env, "audit", op, "--tenant", tenant, "--json", timeout=60)
        assert answered.returncode == 0, answered.stdout + answered.stderr
        audit = json.loads(answered.stdout)
        timeline = [(line["topic"], line["partition"], line["offset"]) for line in audit["lines"]]
        assert sorted(timeline) == sorted(on_topics[op]), op
        assert audit["disagreements"] == [], audit
        sentences = " ".join(audit["retries"])
        assert ("was an execution retry" in sentences) == executed, (op, audit["retries"])
        assert ("were delivery retries" in sentences) == resent, (op, audit["retries"])
