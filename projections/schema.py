"""The projection tables' migrations (``projections/migrations/NNN_*.sql``)."""

from __future__ import annotations

from pathlib import Path

import psycopg

from ledger import migrate

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
COMPONENT = "projections"


def apply_migrations(conn: psycopg.Connection[object]) -> list[int]:
    """Bring the projection tables up to date; returns the versions applied now."""
    return migrate.apply(conn, COMPONENT, MIGRATIONS)
