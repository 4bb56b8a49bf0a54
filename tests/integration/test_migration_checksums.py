"""``ledger.migrate`` against the real PostgreSQL: every start compares the migration files with
what the database was migrated with (decision 024). An applied file that changed, or a version
only a newer opledger has, refuses the start with the reason and changes nothing; a database
migrated before checksums were recorded takes the files' checksums once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from ledger import migrate
from ledger.settings import Settings
from tests.support import env_for

COMPONENT = "checksum_test"


def _write(directory: Path, files: dict[str, str]) -> Path:
    directory.mkdir(exist_ok=True)
    for name, sql in files.items():
        (directory / name).write_text(sql)
    return directory


def _recorded(conn: psycopg.Connection[tuple[object, ...]]) -> dict[int, object]:
    rows = conn.execute(
        "SELECT version, checksum FROM schema_migrations WHERE component = %s", (COMPONENT,)
    ).fetchall()
    return {int(str(v)): c for v, c in rows}


def test_an_edited_applied_migration_refuses_and_changes_nothing(
    isolated: Settings, tmp_path: Path
) -> None:
    directory = _write(
        tmp_path / "m",
        {"001_a.sql": "CREATE TABLE ck_a (x INT);", "002_b.sql": "CREATE TABLE ck_b (x INT);"},
    )
    with psycopg.connect(isolated.dsn, autocommit=True) as conn:
        assert migrate.apply(conn, COMPONENT, directory) == [1, 2]
        files = {m.version: m.checksum for m in migrate.load(directory)}
        assert _recorded(conn) == files
        assert migrate.apply(conn, COMPONENT, directory) == []

        _write(directory, {"002_b.sql": "CREATE TABLE ck_b (x INT, y INT);"})
        _write(directory, {"003_c.sql": "CREATE TABLE ck_c (x INT);"})
        with pytest.raises(migrate.MigrationError, match=r"002_b.sql is not what this database"):
            migrate.apply(conn, COMPONENT, directory)
        assert _recorded(conn) == files, "nothing recorded"
        assert conn.execute("SELECT to_regclass('ck_c')").fetchone() == (None,), "003 not run"


def test_a_database_from_a_newer_opledger_refuses(isolated: Settings, tmp_path: Path) -> None:
    newer = _write(tmp_path / "newer", {"001_a.sql": "SELECT 1;", "002_b.sql": "SELECT 2;"})
    older = _write(tmp_path / "older", {"001_a.sql": "SELECT 1;"})
    with psycopg.connect(isolated.dsn, autocommit=True) as conn:
        migrate.apply(conn, COMPONENT, newer)
        with pytest.raises(migrate.MigrationError, match=r"002_b .* a newer version migrated it"):
            migrate.apply(conn, COMPONENT, older)


def test_a_table_from_before_checksums_adopts_the_files_once(
    isolated: Settings, tmp_path: Path
) -> None:
    directory = _write(tmp_path / "m", {"001_a.sql": "SELECT 1;", "002_b.sql": "SELECT 2;"})
    with psycopg.connect(isolated.dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS schema_migrations")
        conn.execute(
            """CREATE TABLE schema_migrations (
                   component TEXT NOT NULL, version INTEGER NOT NULL, name TEXT NOT NULL,
                   applied_at TIMESTAMPTZ NOT NULL DEFAULT now(),
                   PRIMARY KEY (component, version))"""
        )
        conn.execute(
            "INSERT INTO schema_migrations (component, version, name) VALUES (%s, 1, 'a')",
            (COMPONENT,),
        )
        assert migrate.apply(conn, COMPONENT, directory) == [2]
        files = {m.version: m.checksum for m in migrate.load(directory)}
        assert _recorded(conn) == files
        _write(directory, {"001_a.sql": "SELECT 10;"})
        with pytest.raises(migrate.MigrationError, match=r"001_a.sql is not what"):
            migrate.apply(conn, COMPONENT, directory)


def _db_migrate(settings: Settings) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "opledger.cli", "db", "migrate"],
        env=env_for(settings),
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )


def test_db_migrate_says_why_it_refuses(isolated: Settings) -> None:
    migrated = _db_migrate(isolated)
    assert migrated.returncode == 0, migrated.stderr
    with psycopg.connect(isolated.dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE schema_migrations SET checksum = repeat('0', 64) "
            "WHERE component = 'projections' AND version = 1"
        )
    refused = _db_migrate(isolated)
    assert refused.returncode == 2, refused.stderr
    assert "projections migration 001_projections.sql is not what" in refused.stderr
    assert "Traceback" not in refused.stderr
