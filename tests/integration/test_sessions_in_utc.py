"""Every session from ``ledger.pg`` runs in UTC on a database whose default zone is not UTC,
and with a client whose ``PGTZ`` names another zone (libpq sends it after the start-up options).

``opledger ops``, ``policy show`` and the demo's report once opened their own sessions without
the options and printed times in the server's zone; the unit tier checks that no module opens a
session beside the factory (``tests/unit/test_pg_sessions.py``), this one what the factory gives.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from ledger import pg
from ledger.domain.events import ExecutionTransitioned
from ledger.domain.ids import content_ref, event_id, operation_id, request_hash
from ledger.domain.states import ExecutionState
from ledger.settings import Settings
from tests.support import env_for, produce, project_in_process

ROOT = Path(__file__).resolve().parents[2]
#: Never UTC, summer or winter: a time printed in it cannot pass for UTC.
DATABASE_ZONE = "America/New_York"
CLIENT_ZONE = "Asia/Tokyo"


@pytest.fixture
def elsewhere(isolated: Settings) -> Iterator[Settings]:
    """The isolated database, with a default time zone that is not UTC."""
    with psycopg.connect(isolated.dsn, autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE \"{conn.info.dbname}\" SET timezone TO '{DATABASE_ZONE}'")
    yield isolated


def _zone(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SHOW TimeZone").fetchone()
    assert row is not None
    return str(row[0])


def _factory_zones(dsn: str) -> dict[str, str]:
    zones: dict[str, str] = {}
    with pg.connect(dsn, name="test-utc") as conn:
        zones["connect"] = _zone(conn)
        name = conn.execute("SHOW application_name").fetchone()
        assert name is not None and name[0] == "test-utc"
    with pg.connect(dsn, name="test-utc", read_only=True) as conn:
        zones["connect read-only"] = _zone(conn)
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            conn.execute("CREATE TABLE refused (x int)")
    with pg.open_pool(dsn, name="test-utc", max_size=1) as pool, pool.connection() as conn:
        zones["open_pool"] = _zone(conn)

    async def from_the_async_pool() -> str:
        pool = pg.open_async_pool(dsn, name="test-utc", max_size=1)
        await pool.open()
        try:
            async with pool.connection() as conn:
                cur = await conn.execute("SHOW TimeZone")
                row = await cur.fetchone()
                assert row is not None
                return str(row[0])
        finally:
            await pool.close()

    zones["open_async_pool"] = asyncio.run(from_the_async_pool())
    return zones


def test_every_factory_session_runs_in_utc_where_the_database_does_not(
    elsewhere: Settings,
) -> None:
    with psycopg.connect(elsewhere.dsn) as plain:
        assert _zone(plain) == DATABASE_ZONE, "the database's own default must not be UTC"
    assert set(_factory_zones(elsewhere.dsn).values()) == {"UTC"}


def test_every_factory_session_runs_in_utc_whatever_the_clients_pgtz(
    elsewhere: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGTZ", CLIENT_ZONE)
    with psycopg.connect(elsewhere.dsn) as plain:
        assert _zone(plain) == CLIENT_ZONE, "libpq sends PGTZ: a plain session is in it"
    assert set(_factory_zones(elsewhere.dsn).values()) == {"UTC"}


def _an_operation(settings: Settings) -> str:
    """One operation that succeeded, its events on the topics and projected."""
    op = operation_id(1_767_225_600_000, b"utc-sessio")
    at = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    common: dict[str, Any] = {
        "operation_id": op,
        "tenant_id": "acme",
        "actor_id": "agent-7",
        "tool_name": "send_email",
        "request_hash": request_hash("send_email", {"to": "a@example.com"}),
    }
    produce(
        settings,
        [
            ExecutionTransitioned(
                **common,
                event_id=event_id(1_767_225_600_000 + n, bytes([n]) * 10),
                occurred_at=at + timedelta(seconds=n),
                attempt=min(n, 1),
                state=state,
                provider_ref=op if n else None,
                result_ref=content_ref(b"sent") if state is ExecutionState.SUCCEEDED else None,
            )
            for n, state in enumerate(
                (
                    ExecutionState.INTENT_RECORDED,
                    ExecutionState.DISPATCHED,
                    ExecutionState.SUCCEEDED,
                )
            )
        ],
    )
    project_in_process(settings)
    return op


def test_ops_show_prints_times_in_utc_on_a_database_that_is_not(elsewhere: Settings) -> None:
    op = _an_operation(elsewhere)
    done = subprocess.run(
        [sys.executable, "-m", "opledger.cli", "ops", "show", op, "--tenant", "acme"],
        env=env_for(elsewhere, PYTHONPATH=str(ROOT), COLUMNS="240", PGTZ=CLIENT_ZONE),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    printed = re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}([+-]\d\d:\d\d)", done.stdout)
    # created, updated and the three history rows
    assert len(printed) >= 5, done.stdout
    assert set(printed) == {"+00:00"}, done.stdout
    assert "2026-01-01 12:00:00.000+00:00" in done.stdout
