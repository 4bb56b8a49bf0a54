"""``opledger db migrate``: every component's tables, in one place.

The SDK creates no tables when it connects (a service's credentials need not own DDL);
migrations are this command, a start-up step of the workers, and part of ``opledger stack up``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import psycopg

from ledger import migrate as migrations
from ledger import pg
from ledger.domain.redact import redact
from ledger.leases import COMPONENT as LEDGER_COMPONENT
from ledger.leases import MIGRATIONS as LEDGER_MIGRATIONS
from ledger.settings import Settings

#: Exit code for errors whose message says how to fix them (same as ``opledger.cli``).
EXIT_USAGE = 2


def migrate(dsn: str) -> dict[str, list[int]]:
    """Apply every component's pending migrations to ``dsn``; returns what was applied now."""
    from projections.schema import apply_migrations  # noqa: PLC0415  # keeps `stack` import light

    # Unbounded lock waits: starters migrating at once queue on the migrations' lock.
    with pg.connect(dsn, name="opledger-migrate", connect_timeout=10, lock_timeout_ms=None) as conn:
        return {
            LEDGER_COMPONENT: migrations.apply(conn, LEDGER_COMPONENT, LEDGER_MIGRATIONS),
            "projections": apply_migrations(conn),
        }


def migrate_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger db migrate``."""
    try:
        applied = migrate(settings.dsn)
    except psycopg.OperationalError as exc:
        print(
            f"opledger: cannot reach PostgreSQL at {redact(settings.dsn)}: {exc}", file=sys.stderr
        )
        return EXIT_USAGE
    except migrations.MigrationError as exc:
        print(f"opledger: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for component, versions in applied.items():
        done = ", ".join(f"{v:03d}" for v in versions) or "nothing (up to date)"
        print(f"{component}: applied {done}")
    return 0


def register(commands: Any) -> None:
    """``opledger db migrate``."""
    parser = commands.add_parser("db", help="the database: migrations")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    run = actions.add_parser("migrate", help="create or upgrade every table (idempotent)")
    run.set_defaults(handler="opledger.db:migrate_command")
