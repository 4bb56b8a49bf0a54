"""``opledger demo`` end to end, as a newcomer runs it, on topics and a database of its own: it
exits 0, its summary matches the projections, and the projections equal the independent fold."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import psycopg

from ledger.settings import Settings
from tests.support import assert_projection_matches, env_for, free_port, independent_fold

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = 40


def test_demo_runs_and_its_summary_matches_the_projections(isolated: Settings) -> None:
    port = free_port()
    settings = isolated.with_(projector_web_port=port)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "opledger.cli",
            "demo",
            "--operations",
            str(OPERATIONS),
            "--workers",
            "2",
        ],
        env=env_for(settings, PYTHONPATH=str(ROOT)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    out = result.stdout
    assert result.returncode == 0, f"stdout:\n{out}\nstderr:\n{result.stderr}"
    assert "max side effects per operation: 1" in out
    assert "projections agree with the executor's own reports: yes" in out
    assert "projector: stopped" in out, "the demo stops the projector it started"
    counts = re.search(
        r"operations executed: (\d+) \(succeeded (\d+), failed (\d+), unknown (\d+)\)", out
    )
    assert counts is not None, out
    total, succeeded, failed, unknown = map(int, counts.groups())
    assert total == OPERATIONS == succeeded + failed + unknown
    assert f"awaiting reconciliation (UNKNOWN): {unknown}" in out

    summary = assert_projection_matches(settings, independent_fold(settings))
    assert summary["operations"] == OPERATIONS
    assert summary["anomalies"] == 0
    with psycopg.connect(settings.dsn) as conn:
        by_state: dict[str, int] = dict(
            conn.execute(
                "SELECT execution_state, count(*) FROM agent_operations GROUP BY 1"
            ).fetchall()
        )
        # Every SUCCEEDED operation has a delivery per destination, each finished.
        open_deliveries = conn.execute(
            "SELECT count(*) FROM deliveries WHERE state NOT IN ('ACKED', 'DEAD_LETTERED')"
        ).fetchone()
        delivery_count = conn.execute("SELECT count(*) FROM deliveries").fetchone()
        # UNKNOWN operations were never dispatched twice: one attempt each.
        redispatched = conn.execute(
            "SELECT count(*) FROM agent_operations WHERE attempt > 1"
        ).fetchone()
    assert by_state.get("SUCCEEDED", 0) == succeeded
    assert by_state.get("FAILED", 0) == failed
    assert by_state.get("UNKNOWN", 0) == unknown
    assert open_deliveries == (0,)
    assert delivery_count == (2 * succeeded,)
    assert redispatched == (0,)
