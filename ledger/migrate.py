"""Versioned SQL migrations. Each component owns a directory of ``NNN_name.sql`` files and
applies them at start-up; applied versions are recorded per component, so the producer's result
store and the projector's tables evolve independently in one database."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import psycopg

_FILE = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")

# A fixed advisory lock id: concurrent starters (projector + SDK + tests) serialise here instead
# of racing to create the same tables.
_LOCK_ID = 0x6F706C6564676572  # "opledger"


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str


class MigrationError(RuntimeError):
    """The migration files are inconsistent (duplicate or malformed versions)."""


def load(directory: Path) -> list[Migration]:
    migrations: dict[int, Migration] = {}
    for path in sorted(directory.glob("*.sql")):
        match = _FILE.match(path.name)
        if match is None:
            raise MigrationError(f"{path.name}: migration files are named NNN_name.sql")
        version = int(match.group(1))
        if version in migrations:
            raise MigrationError(f"{path.name}: version {version} appears twice")
        migrations[version] = Migration(version, match.group(2), path.read_text(encoding="utf-8"))
    return [migrations[v] for v in sorted(migrations)]


def apply(conn: psycopg.Connection[object], component: str, directory: Path) -> list[int]:
    """Apply the component's pending migrations in one transaction; returns the versions run."""
    applied_now: list[int] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_ID,))
        conn.execute(
            """CREATE TABLE IF NOT EXISTS schema_migrations (
                   component TEXT NOT NULL,
                   version INTEGER NOT NULL,
                   name TEXT NOT NULL,
                   applied_at TIMESTAMPTZ NOT NULL DEFAULT now(),
                   PRIMARY KEY (component, version))"""
        )
        rows = conn.execute(
            "SELECT version FROM schema_migrations WHERE component = %s", (component,)
        ).fetchall()
        done = {int(r[0]) for r in rows}  # type: ignore[index]  # row factory is the default tuple one
        for migration in load(directory):
            if migration.version in done:
                continue
            conn.execute(migration.sql.encode("utf-8"))
            conn.execute(
                "INSERT INTO schema_migrations (component, version, name) VALUES (%s, %s, %s)",
                (component, migration.version, migration.name),
            )
            applied_now.append(migration.version)
    return applied_now
