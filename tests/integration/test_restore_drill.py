"""The restore drill, against the real broker, PostgreSQL and the stack's supervised workers: a
demo run, `opledger backup`, the database dropped while the workers run, `opledger restore`,
then `opledger replay` proves every projection equal to the log. What the log cannot give back
(results, leases, the consumer's inbox) comes back from the backup, and the workers carry on
on the restored database."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ledger.domain.policy import PolicyDecision, PolicyRequest
from ledger.settings import Settings
from ledger.tools import ProviderTerms
from opledger import stack
from opledger.fakes.memory import MemoryProvider
from opledger.fakes.model import Mode
from producers import TransitionRecorder
from tests.demo_support import private_demo_settings, supervised
from tests.process_support import run_cli

pytestmark = pytest.mark.integration

OPERATIONS = 30
#: What a restore must give back, each as its rows (order-independent).
KEPT = {
    "results": "SELECT tenant_id, result_ref, sha256(payload) FROM results",
    "operation_requests": "SELECT operation_id, tenant_id, request_hash, body FROM "
    "operation_requests",
    "delivery_destinations": "SELECT * FROM delivery_destinations",
    "consumer_inbox": "SELECT consumer, operation_id, fingerprint, outcome FROM consumer_inbox",
    "consumer_applied_changes": "SELECT change_id, consumer, operation_id, result_ref FROM "
    "consumer_applied_changes",
}


def _database(dsn: str) -> str:
    return str(conninfo_to_dict(dsn)["dbname"])


def _rows(settings: Settings) -> dict[str, list[str]]:
    found = {}
    for name, query in KEPT.items():
        dsn = settings.consumer_dsn if name.startswith("consumer_") else settings.dsn
        with psycopg.connect(dsn) as conn:
            # As text: a destination's row holds lists, which do not hash.
            found[name] = sorted(repr(row) for row in conn.execute(query).fetchall())
    return found


def _allow(request: PolicyRequest) -> PolicyDecision:
    return PolicyDecision(True, "allowed by the test", None)


def test_drop_the_database_restore_replay_and_prove_equal(
    isolated: Settings, tmp_path: Path
) -> None:
    # The reference consumer's database of its own, as on the local stack.
    admin = make_conninfo(isolated.dsn, dbname="postgres")
    consumer_db = f"{isolated.pg_database}_consumer"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(consumer_db)))
    try:
        _drill(
            private_demo_settings(isolated, tmp_path).with_(
                consumer_pg_dsn=make_conninfo(isolated.dsn, dbname=consumer_db)
            ),
            tmp_path,
        )
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(consumer_db)
                )
            )


def _drill(settings: Settings, tmp_path: Path) -> None:
    backup_dir = tmp_path / "backup"
    terms = ProviderTerms(
        call_timeout=timedelta(seconds=2), key_retention=timedelta(hours=1), repeat_safe=True
    )
    provider = MemoryProvider("send_email", terms, mode=Mode.NON_IDEMPOTENT)
    with supervised(settings, tmp_path) as env:
        assert stack.wait_workers_ready(settings, lambda _line: None, timeout=120)
        ran = run_cli(env, "demo", "--operations", str(OPERATIONS), timeout=420)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        # An operation held by this process, its lease (token 1) in the backup.
        with TransitionRecorder.connect(settings, providers=[provider]) as recorder:
            held = recorder.intent(
                "acme", "agent-7", "send_email", {"held": 1}, lease_ttl=timedelta(hours=1)
            ).operation_id
        before = _rows(settings)
        assert before["results"] and before["consumer_inbox"], before
        with psycopg.connect(settings.dsn) as conn:
            tokens = dict(
                conn.execute("SELECT operation_id, lease_token FROM agent_operations").fetchall()
            )
        assert max(tokens.values()) >= 2, "the demo's crashes took leases over"

        made = run_cli(env, "backup", "--out", str(backup_dir), timeout=120)
        assert made.returncode == 0, made.stdout + made.stderr
        manifest = json.loads((backup_dir / "backup.json").read_text())
        assert manifest["tables"]["ledger.dump"]["results"] == len(before["results"])
        assert manifest["tables"]["consumer.dump"]["consumer_inbox"] == len(
            before["consumer_inbox"]
        )
        again = run_cli(env, "backup", "--out", str(backup_dir), timeout=60)
        assert again.returncode == 2 and "exists" in again.stderr

        # After the backup, the held operation is taken over twice: the log records token 3,
        # the backup's lease says 1.
        with TransitionRecorder.connect(settings, providers=[provider]) as recorder:
            for _ in range(2):
                recorder.take_over(held, "acme", reason="the drill", force=True)

        # Both databases are lost while every worker runs.
        admin = make_conninfo(settings.dsn, dbname="postgres")
        with psycopg.connect(admin, autocommit=True) as conn:
            for database in (settings.pg_database, _database(settings.consumer_dsn)):
                conn.execute(
                    sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(database))
                )

        # A backup altered on disk is refused before anything is built.
        tampered = tmp_path / "tampered"
        tampered.mkdir()
        for path in backup_dir.iterdir():
            (tampered / path.name).write_bytes(path.read_bytes())
        dump = tampered / "ledger.dump"
        dump.write_bytes(dump.read_bytes()[:-16] + b"\0" * 16)
        refused = run_cli(env, "restore", str(tampered), timeout=60)
        assert refused.returncode == 2 and "not the file the backup wrote" in refused.stderr

        # A restore of the same database already running: a second one changes nothing.
        with psycopg.connect(admin, autocommit=True) as holder:
            holder.execute(
                "SELECT pg_advisory_lock(hashtext(%s))",
                (f"opledger-restore:{settings.pg_database}",),
            )
            busy = run_cli(env, "restore", str(backup_dir), timeout=60)
        assert busy.returncode == 2 and "another restore" in busy.stderr, busy.stderr

        restored = run_cli(env, "restore", str(backup_dir), "--json", timeout=600)
        assert restored.returncode == 0, restored.stdout + restored.stderr
        report = json.loads(restored.stdout)
        assert report["whole"] and report["results_checked"] > 0, report
        assert report["leases_raised"] >= 1, report
        assert report["consumer_database"] == _database(settings.consumer_dsn), report
        # A restore never overwrites a database that exists.
        twice = run_cli(env, "restore", str(backup_dir), timeout=60)
        assert twice.returncode == 2 and "exists" in twice.stderr

        # Every projection equals the log, with the live projector running again.
        replayed = run_cli(env, "replay", "--json", timeout=300)
        assert replayed.returncode == 0, replayed.stdout + replayed.stderr
        replay = json.loads(replayed.stdout)
        assert replay["equal"] is True
        rows = {t["table"]: t["replay_rows"] for t in replay["tables"]}
        assert rows["agent_operations"] == OPERATIONS + 1, replay
        assert replay["results_checked"] > 0 and replay["results_wrong"] == []
        # Every row the backup held is back; what is new since is the held operation's, which
        # the recovery worker took over once its restored lease had expired.
        after = _rows(settings)
        for table, rows_before in before.items():
            assert set(rows_before) <= set(after[table]), table
        assert after["operation_requests"] == before["operation_requests"]
        for table in ("consumer_inbox", "consumer_applied_changes"):
            new = set(after[table]) - set(before[table])
            assert all(repr(held) in row for row in new), (table, new)

        # No lease's token is below one the log records: a take-over goes above it.
        with psycopg.connect(settings.dsn) as conn:
            (token,) = conn.execute(
                "SELECT token FROM operation_leases WHERE operation_id = %s", (held,)
            ).fetchone() or (0,)
            assert token >= 3, token
            low = conn.execute(
                "SELECT o.operation_id, o.lease_token, l.token FROM agent_operations o "
                "LEFT JOIN operation_leases l USING (operation_id) "
                "WHERE o.lease_token > 0 AND (l.token IS NULL OR l.token < o.lease_token)"
            ).fetchall()
        assert low == []

        # The workers carry on: a new operation is projected on the restored database.
        with TransitionRecorder.connect(settings, providers=[provider]) as recorder:
            recorder.collaborators.policy = _allow
            op = recorder.execute("acme", "agent-7", "send_email", {"after": "restore"})
        deadline = time.monotonic() + 60
        state = None
        while time.monotonic() < deadline:
            with psycopg.connect(settings.dsn) as conn:
                found = conn.execute(
                    "SELECT execution_state FROM agent_operations WHERE operation_id = %s",
                    (op.operation_id,),
                ).fetchone()
            if found is not None and (state := found[0]) == "SUCCEEDED":
                break
            time.sleep(0.2)
        assert state == "SUCCEEDED"
