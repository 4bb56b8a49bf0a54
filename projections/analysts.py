"""Analysts' database roles, each bound to the tenants it may read (decision 030).

A role made here is a member of ``opledger_analyst`` and nothing else: row-level security on the
projections (migration ``007_analyst_access``) shows it the rows of the tenants
``analyst_tenants`` binds it to, whatever SQL it writes, and it has no right on the destinations,
the result store, leases, requests or dead letters. Roles belong to the PostgreSQL cluster; a
binding belongs to one database.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from ledger.domain.names import NameKind, check_name

#: The group role every analyst role is a member of (created by the migration).
ANALYST_GROUP = "opledger_analyst"
#: A role name that needs no quoting anywhere (psql, a DSN, pg_hba.conf).
ROLE_RE = re.compile(r"[a-z][a-z0-9_]{0,62}")


class AnalystError(ValueError):
    """A role cannot be made or bound as asked; the message says why."""


@dataclass(frozen=True, slots=True)
class Binding:
    role: str
    tenant_id: str
    bound_by: str
    bound_at: datetime


def check_role(role: str) -> str:
    """``role`` if it can name an analyst's role, else :class:`AnalystError`."""
    if not isinstance(role, str) or not ROLE_RE.fullmatch(role):
        raise AnalystError(f"not a role name: {role!r} (1-63 of a-z 0-9 _, starting with a letter)")
    if role == ANALYST_GROUP or role.startswith("pg_"):
        raise AnalystError(f"{role} is reserved")
    return role


def add_analyst(
    conn: psycopg.Connection[Any],
    *,
    role: str,
    tenants: Sequence[str],
    password: str | None,
    bound_by: str,
) -> bool:
    """Bind ``role`` to ``tenants`` in this database, creating it (a login role in
    ``opledger_analyst`` with ``password``) if it does not exist. Returns whether it was
    created. A role that exists must already be an analyst's: a service's or an administrator's
    role (which row-level security does not hold) is refused, never given tenants."""
    check_role(role)
    for tenant in tenants:
        check_name(NameKind.TENANT, tenant)
    check_name(NameKind.ACTOR, bound_by)
    if not tenants:
        raise AnalystError("bind the role to at least one tenant")
    with conn.transaction():
        row = conn.execute(
            "SELECT rolsuper, rolbypassrls, pg_has_role(oid, %s, 'MEMBER') "
            "FROM pg_roles WHERE rolname = %s",
            (ANALYST_GROUP, role),
        ).fetchone()
        created = row is None
        if row is None:
            if password is None:
                raise AnalystError("a new role needs a password")
            # Hashed here (SCRAM-SHA-256, as libpq's PQencryptPasswordConn does), so the
            # statement, which the server may log, never holds the password itself.
            verifier = conn.pgconn.encrypt_password(
                password.encode(), role.encode(), b"scram-sha-256"
            ).decode()
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                    sql.Identifier(role), sql.Literal(verifier), sql.Identifier(ANALYST_GROUP)
                )
            )
        elif row[0] or row[1] or not row[2]:
            raise AnalystError(
                f"role {role} exists and is not an analyst's (a superuser, a role that bypasses "
                f"row-level security, or one outside {ANALYST_GROUP}): choose another name"
            )
        conn.cursor().executemany(
            "INSERT INTO analyst_tenants (role_name, tenant_id, bound_by) VALUES (%s, %s, %s) "
            "ON CONFLICT DO NOTHING",
            [(role, tenant, bound_by) for tenant in tenants],
        )
    return created


def unbind_analyst(
    conn: psycopg.Connection[Any], *, role: str, tenants: Sequence[str] | None = None
) -> int:
    """Unbind ``role`` from ``tenants`` (every tenant when None) in this database; returns how
    many bindings went. The role itself stays: it may be bound in another database."""
    check_role(role)
    if tenants is None:
        done = conn.execute("DELETE FROM analyst_tenants WHERE role_name = %s", (role,))
    else:
        done = conn.execute(
            "DELETE FROM analyst_tenants WHERE role_name = %s AND tenant_id = ANY(%s)",
            (role, list(tenants)),
        )
    return done.rowcount


def bindings(conn: psycopg.Connection[Any]) -> list[Binding]:
    """Every binding of this database, by role then tenant."""
    rows = conn.execute(
        "SELECT role_name, tenant_id, bound_by, bound_at FROM analyst_tenants "
        "ORDER BY role_name, tenant_id"
    ).fetchall()
    return [Binding(*row) for row in rows]
