"""Versioned SQL migrations. Each component owns a directory of ``NNN_name.sql`` files and
applies them at start-up; applied versions are recorded per component, so the producer's result
store and the projector's tables evolve independently in one database.

Each applied migration's SHA-256 is recorded with it, and every start compares the files with
what the database was built from: a file edited after it was applied, or a version the database
has and the code does not (a newer opledger migrated it), refuses the start with the reason
rather than running code against tables it does not describe (decision 024). Versions applied
before checksums were recorded take the file's checksum at their first check."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg

from ledger.errors import RecordError

_FILE = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")

# A fixed advisory lock id: concurrent starters (projector + SDK + tests) serialise here instead
# of racing to create the same tables.
_LOCK_ID = 0x6F706C6564676572  # "opledger"


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        # Line endings normalised: a checkout with CRLF is the same migration.
        return hashlib.sha256(self.sql.replace("\r\n", "\n").encode("utf-8")).hexdigest()

    @property
    def file_name(self) -> str:
        return f"{self.version:03d}_{self.name}.sql"


@dataclass(frozen=True, slots=True)
class Applied:
    """A migration as the database recorded it."""

    version: int
    name: str
    checksum: str | None
    applied_at: str


class MigrationError(RecordError):
    """The migration files are inconsistent (duplicate or malformed versions), or they are not
    what the database was migrated with; the message says which and what to do."""


def verify(
    component: str, applied: Sequence[Applied], files: Mapping[int, Migration]
) -> list[Migration]:
    """Check what the database applied against the files; returns the applied migrations whose
    checksum is still to be recorded. Raises :class:`MigrationError` on any difference."""
    adopt: list[Migration] = []
    for row in applied:
        migration = files.get(row.version)
        if migration is None:
            raise MigrationError(
                f"the database has {component} migration {row.version:03d}_{row.name} (applied "
                f"{row.applied_at}), which this opledger does not have: a newer version migrated "
                "it. Run that version, or restore the database from before it; refusing to start"
            )
        if row.name != migration.name or (
            row.checksum is not None and row.checksum != migration.checksum
        ):
            was = f"{row.version:03d}_{row.name}.sql"
            raise MigrationError(
                f"{component} migration {migration.file_name} is not what this database was "
                f"migrated with ({was} applied {row.applied_at}, sha256 "
                f"{(row.checksum or 'not recorded')[:12]}; the file's {migration.checksum[:12]}): "
                "an applied migration is never edited. Restore the file and put the change in a "
                "new migration; refusing to start"
            )
        if row.checksum is None:
            adopt.append(migration)
    return adopt


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


def _has_checksums(conn: psycopg.Connection[object]) -> bool:
    return (
        conn.execute(
            "SELECT 1 FROM pg_attribute WHERE attrelid = 'schema_migrations'::regclass "
            "AND attname = 'checksum' AND NOT attisdropped"
        ).fetchone()
        is not None
    )


def _applied(conn: psycopg.Connection[object], component: str) -> list[Applied]:
    rows = conn.execute(
        "SELECT version, name, checksum, applied_at::text FROM schema_migrations "
        "WHERE component = %s ORDER BY version",
        (component,),
    ).fetchall()
    return [Applied(int(r[0]), str(r[1]), r[2], str(r[3])) for r in rows]  # type: ignore[index]


def _up_to_date(
    conn: psycopg.Connection[object], component: str, files: Mapping[int, Migration]
) -> bool:
    """Whether the database holds exactly ``files``, checksums recorded: read only, so a
    service's role that may change no table starts on tables the owner migrated."""
    with conn.transaction():
        if conn.execute("SELECT to_regclass('schema_migrations')").fetchone() in (None, (None,)):
            return False
        if not _has_checksums(conn):
            return False
        applied = _applied(conn, component)
    return not verify(component, applied, files) and {a.version for a in applied} == set(files)


def apply(conn: psycopg.Connection[object], component: str, directory: Path) -> list[int]:
    """Check the component's applied migrations against its files, then apply the pending ones,
    in one transaction; returns the versions run. A database already up to date is only read:
    the services' roles may check it, only its owner can migrate it (decision 034)."""
    files = {m.version: m for m in load(directory)}
    try:
        if _up_to_date(conn, component, files):
            return []
        return _apply(conn, component, files)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise MigrationError(
            f"{component} migrations are pending and {conn.info.user!r} may not apply them "
            f"({exc.diag.message_primary}): run `opledger db migrate` as the database's owner "
            "first; refusing to start"
        ) from None


def _apply(
    conn: psycopg.Connection[object], component: str, files: Mapping[int, Migration]
) -> list[int]:
    applied_now: list[int] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_ID,))
        conn.execute(
            """CREATE TABLE IF NOT EXISTS schema_migrations (
                   component TEXT NOT NULL,
                   version INTEGER NOT NULL,
                   name TEXT NOT NULL,
                   applied_at TIMESTAMPTZ NOT NULL DEFAULT now(),
                   checksum TEXT,
                   PRIMARY KEY (component, version))"""
        )
        # A table made before checksums: one ALTER, once (it would take an exclusive lock on
        # every start otherwise).
        if not _has_checksums(conn):
            conn.execute("ALTER TABLE schema_migrations ADD COLUMN checksum TEXT")
        applied = _applied(conn, component)
        for migration in verify(component, applied, files):
            conn.execute(
                "UPDATE schema_migrations SET checksum = %s WHERE component = %s AND version = %s",
                (migration.checksum, component, migration.version),
            )
        done = {row.version for row in applied}
        for version, migration in sorted(files.items()):
            if version in done:
                continue
            conn.execute(migration.sql.encode("utf-8"))
            conn.execute(
                "INSERT INTO schema_migrations (component, version, name, checksum) "
                "VALUES (%s, %s, %s, %s)",
                (component, version, migration.name, migration.checksum),
            )
            applied_now.append(version)
    return applied_now
