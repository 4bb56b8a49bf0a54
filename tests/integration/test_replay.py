"""``opledger replay`` against the real broker and database: a rebuild from offset 0 that
agrees with the live projections says so, and one that does not names the rows and the
offsets that should have made them.

The live projections here are made by the projector itself (in this process); the replay runs
as the operator runs it, ``python -m opledger.cli replay``, in a process of its own. What is
altered afterwards is altered by hand in the live database, as a careless or hostile hand would.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from ledger.domain.policy import PolicyDecision, PolicyRequest
from ledger.log import end_offsets
from ledger.settings import Settings
from ledger.tools import ProviderTerms
from opledger.fakes.memory import MemoryProvider
from opledger.fakes.model import Mode
from producers import TransitionRecorder
from tests.process_support import ROOT, kill, run_cli, start_cli
from tests.support import (
    env_for,
    free_port,
    produce,
    project_in_process,
    read_all,
    wait_caught_up,
    workload_events,
)

pytestmark = pytest.mark.integration

TERMS = ProviderTerms(
    call_timeout=timedelta(seconds=2), key_retention=timedelta(hours=1), repeat_safe=True
)


def _allow(request: PolicyRequest) -> PolicyDecision:
    return PolicyDecision(True, "allowed by the test", None)


def _calls(settings: Settings, count: int) -> list[str]:
    """``count`` real calls through the SDK (their results in the result store)."""
    provider = MemoryProvider("send_email", TERMS, mode=Mode.NON_IDEMPOTENT)
    with TransitionRecorder.connect(settings, providers=[provider]) as recorder:
        recorder.collaborators.policy = _allow
        return [
            recorder.execute("acme", "agent-7", "send_email", {"n": n}).operation_id
            for n in range(count)
        ]


def _replay(settings: Settings) -> tuple[int, dict[str, Any], str]:
    result = run_cli(env_for(settings), "replay", "--json")
    assert result.returncode in (0, 1), result.stdout + result.stderr
    return result.returncode, json.loads(result.stdout), result.stderr


def _tables(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["table"]: t for t in report["tables"]}


def test_a_replay_reproduces_every_projection_and_checks_the_result_store(
    isolated: Settings,
) -> None:
    ops = _calls(isolated, 12)
    project_in_process(isolated)
    code, report, progress = _replay(isolated)
    assert code == 0, json.dumps(report, indent=1)
    assert report["equal"] is True
    tables = _tables(report)
    assert tables["agent_operations"]["live_rows"] == len(ops)
    assert tables["agent_operations"]["replay_rows"] == len(ops)
    events = len(read_all(isolated, isolated.execution_topic))
    assert tables["operation_history"]["replay_rows"] == events
    assert report["results_checked"] == len(ops)
    assert report["results_wrong"] == []
    assert "results (the result store" in " ".join(report["not_history"])
    assert "replay: [" in progress and "ETA" in progress
    # The cut names every partition of the three topics, and the replay's database is gone.
    topics = [isolated.execution_topic, isolated.delivery_topic, isolated.policy_topic]
    ends = end_offsets(isolated, topics)
    assert report["cut"] == {f"{t}[{p}]": o for (t, p), o in sorted(ends.items())}
    with psycopg.connect(isolated.dsn) as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_database WHERE datname = %s", (report["database"],)
        ).fetchone()
    assert left == (0,)
    plain = run_cli(env_for(isolated), "replay")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert (
        "agent_operations" in plain.stdout and "every projection equal at the cut" in plain.stdout
    )


def test_altered_rows_are_named_with_the_offsets_that_should_have_made_them(
    isolated: Settings,
) -> None:
    ops = _calls(isolated, 6)
    produce(isolated, workload_events(40, seed=7))
    project_in_process(isolated)
    changed, removed = ops[0], ops[1]
    with psycopg.connect(isolated.dsn) as conn:
        conn.execute(
            "UPDATE agent_operations SET execution_state = 'FAILED' WHERE operation_id = %s",
            (changed,),
        )
        conn.execute("DELETE FROM agent_operations WHERE operation_id = %s", (removed,))
        history = conn.execute(
            'SELECT topic, partition, "offset" FROM operation_history WHERE operation_id = %s '
            'ORDER BY "offset" LIMIT 1',
            (ops[2],),
        ).fetchone()
        assert history is not None
        conn.execute(
            'DELETE FROM operation_history WHERE topic = %s AND partition = %s AND "offset" = %s',
            history,
        )
        refs = dict(
            conn.execute(
                "SELECT operation_id, result_ref FROM agent_operations "
                "WHERE operation_id = ANY(%s)",
                (ops,),
            ).fetchall()
        )
        conn.execute(
            "UPDATE results SET payload = payload || '\\x00'::bytea WHERE result_ref = %s",
            (refs[ops[3]],),
        )
    code, report, _progress = _replay(isolated)
    assert code == 1 and report["equal"] is False
    tables = _tables(report)

    # Where the log put each of the altered operation's events: read independently.
    offsets = {
        op: [
            f"{isolated.execution_topic}[{p}]@{o}"
            for p, o, k, _v in read_all(isolated, isolated.execution_topic)
            if k == op.encode()
        ]
        for op in ops
    }
    operations = {tuple(d["key"]): d for d in tables["agent_operations"]["differences"]}
    assert set(operations) == {(changed,), (removed,)}
    assert operations[(changed,)]["what"] == "differs"
    assert operations[(removed,)]["what"] == "missing from the live projections"
    assert operations[(changed,)]["log_offsets"] == offsets[changed]
    assert operations[(removed,)]["log_offsets"] == offsets[removed]
    assert tables["agent_operations"]["mismatches"] == 2

    gone = [d for d in tables["operation_history"]["differences"]]
    assert [(d["key"], d["what"]) for d in gone] == [
        ([history[0], str(history[1]), str(history[2])], "missing from the live projections")
    ]
    problems = {w["result_ref"]: w["problem"] for w in report["results_wrong"]}
    assert problems.pop(refs[ops[3]]) == "stored bytes do not hash to it"
    assert not set(problems) & set(refs.values()), "the other calls' results are intact"
    # The workload's events name results nobody stored: the replay says so of each.
    assert problems and set(problems.values()) == {"not in the result store"}
    # Nothing else differs: the workload's 40 operations and the other calls are equal.
    others = {
        name: t["mismatches"]
        for name, t in tables.items()
        if name not in ("agent_operations", "operation_history")
    }
    assert set(others.values()) == {0}, others


def test_a_replay_under_traffic_compares_at_its_cut_and_counts_what_moved_on(
    isolated: Settings, tmp_path: Path
) -> None:
    """Services keep appending and the live projector (a process of its own) keeps folding
    while the replay runs: it still finds everything equal, and says how many operations
    changed after its cut, rather than reading the live side's progress as differences."""
    produce(isolated, workload_events(3000, seed=3))
    port = free_port()
    env = env_for(isolated, PYTHONPATH=str(ROOT), OPLEDGER_PROJECTOR_WEB_PORT=str(port))
    projector = start_cli(["projector", "run"], env, tmp_path / "projector.log")
    stop = threading.Event()
    later = workload_events(3000, seed=4)

    def keep_appending() -> None:
        # New operations, appended before and after the replay takes its cut, in the order
        # real writers append them: a delivery only once its execution is acknowledged (the
        # delivery worker reads it from the log first). A delivery raced ahead of its
        # execution is folded by the live projector as it arrived, and a rebuild, which finds
        # both on the log, folds it otherwise: the replay reports that as a difference (it did,
        # in a clean-clone run, before the writer kept this order).
        for start in range(0, len(later), 50):
            if stop.is_set():
                return
            chunk = later[start : start + 50]
            produce(isolated, [e for e in chunk if e.kind != "delivery"])
            produce(isolated, [e for e in chunk if e.kind == "delivery"])
            time.sleep(0.05)

    writer = threading.Thread(target=keep_appending)
    try:
        wait_caught_up(isolated, timeout=120)
        writer.start()
        code, report, _progress = _replay(isolated)
    finally:
        stop.set()
        writer.join(timeout=60)
        kill(projector)
    tables = _tables(report)
    assert {name: t["mismatches"] for name, t in tables.items()} == dict.fromkeys(tables, 0), (
        json.dumps(report, indent=1)
    )
    # Compared: everything below the cut, which holds at least the first 3,000 operations.
    assert tables["agent_operations"]["replay_rows"] >= 3000
    cut = sum(report["cut"].values())
    assert tables["operation_history"]["replay_rows"] == cut
    # The made-up workload's results are the only findings beside the tables.
    assert {w["problem"] for w in report["results_wrong"]} <= {"not in the result store"}
    assert code == (1 if report["results_wrong"] else 0)
