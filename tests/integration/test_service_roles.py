"""Each service signs in to PostgreSQL as its own role and holds only the rights its work needs
(decision 034).

Real roles on the stack's server: the SDK, the projector, the recovery and the delivery worker
each connect with their own password file and try, by hand, what their work needs and what it
does not (a destination's secret, a signed grant's row, a projection written by anyone but the
projector, DDL). The stack's own workers are checked by the sessions the server shows.
"""

from __future__ import annotations

import os
import stat
import threading
from uuid import uuid4

import psycopg
import pytest
from psycopg import errors, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ledger.migrate import MigrationError
from ledger.settings import PG_SERVICE_ROLES, Settings, pg_role_name
from opledger import db
from producers import TransitionRecorder
from tests.support import project_in_process

#: (statement, may the role run it). Statements touch no row (``WHERE false``) or break a
#: constraint when allowed: the privilege check comes first either way.
RIGHTS: dict[str, list[tuple[str, bool]]] = {
    "sdk": [
        ("SELECT 1 FROM results LIMIT 1", True),
        ("INSERT INTO results DEFAULT VALUES", True),
        ("INSERT INTO operation_requests DEFAULT VALUES", True),
        ("UPDATE operation_leases SET owner = owner WHERE false", True),
        ("UPDATE results SET content_type = content_type WHERE false", False),
        ("DELETE FROM results WHERE false", False),
        ("UPDATE operation_requests SET body = body WHERE false", False),
        ("DELETE FROM operation_leases WHERE false", False),
        ("SELECT 1 FROM agent_operations LIMIT 1", True),
        ("SELECT 1 FROM policy_grants LIMIT 1", True),
        ("SELECT 1 FROM projector_offsets LIMIT 1", True),
        ("SELECT 1 FROM delivery_destinations LIMIT 1", False),
        ("UPDATE agent_operations SET execution_state = execution_state WHERE false", False),
        ("DELETE FROM policy_grants WHERE false", False),
        ("INSERT INTO policy_grants DEFAULT VALUES", False),
        ("UPDATE projector_offsets SET next_offset = 0 WHERE false", False),
        ("DELETE FROM dead_letters WHERE false", False),
        ("UPDATE schema_migrations SET checksum = NULL WHERE false", False),
    ],
    "projector": [
        ("INSERT INTO agent_operations DEFAULT VALUES", True),
        ("UPDATE policy_grants SET tool_name = tool_name WHERE false", True),
        ("UPDATE projector_offsets SET next_offset = next_offset WHERE false", True),
        ("DELETE FROM projector_offsets WHERE false", False),
        ("DELETE FROM agent_operations WHERE false", False),
        ("INSERT INTO dead_letters DEFAULT VALUES", True),
        ("SELECT 1 FROM results LIMIT 1", False),
        ("SELECT 1 FROM delivery_destinations LIMIT 1", False),
        ("SELECT 1 FROM operation_leases LIMIT 1", False),
        ("SELECT 1 FROM operation_requests LIMIT 1", False),
        ("SELECT 1 FROM analyst_tenants LIMIT 1", False),
    ],
    "recovery": [
        ("INSERT INTO results DEFAULT VALUES", True),
        ("UPDATE operation_leases SET owner = owner WHERE false", True),
        ("UPDATE results SET content_type = content_type WHERE false", False),
        ("DELETE FROM operation_leases WHERE false", False),
        ("SELECT 1 FROM reconciliations LIMIT 1", True),
        ("SELECT 1 FROM deliveries LIMIT 1", True),
        ("DELETE FROM results WHERE false", False),
        ("SELECT 1 FROM delivery_destinations LIMIT 1", False),
        ("UPDATE agent_operations SET execution_state = execution_state WHERE false", False),
        ("DELETE FROM policy_grants WHERE false", False),
        ("INSERT INTO reconciliations DEFAULT VALUES", False),
    ],
    "delivery": [
        ("SELECT 1 FROM delivery_destinations LIMIT 1", True),
        ("UPDATE delivery_destinations SET enabled = enabled WHERE false", True),
        ("UPDATE delivery_destinations SET gone = true, disabled_reason = 'x' WHERE false", True),
        ("UPDATE delivery_destinations SET target = target WHERE false", False),
        ("UPDATE delivery_destinations SET secret = secret WHERE false", False),
        ("UPDATE delivery_destinations SET tools = tools WHERE false", False),
        ("SELECT 1 FROM results LIMIT 1", True),
        ("SELECT 1 FROM deliveries LIMIT 1", True),
        ("INSERT INTO delivery_destinations DEFAULT VALUES", False),
        ("DELETE FROM delivery_destinations WHERE false", False),
        ("UPDATE results SET content_type = content_type WHERE false", False),
        ("SELECT 1 FROM operation_leases LIMIT 1", False),
        ("UPDATE deliveries SET state = state WHERE false", False),
        ("DELETE FROM policy_history WHERE false", False),
    ],
}
#: What no service may do, whichever it is.
NOBODY = [
    "CREATE TABLE public.intruder (x int)",
    "DROP TABLE results",
    "TRUNCATE agent_operations",
    "ALTER TABLE policy_grants DISABLE ROW LEVEL SECURITY",
    "ALTER ROLE CURRENT_USER BYPASSRLS",
    "SET ROLE opledger",
]


def _may(conn: psycopg.Connection[tuple[object, ...]], statement: str) -> bool:
    """Whether the role may run ``statement`` (run in a savepoint, undone)."""
    try:
        with conn.transaction(force_rollback=True):
            conn.execute(statement)
    except errors.InsufficientPrivilege:
        return False
    except (psycopg.errors.IntegrityError, errors.DataException):
        return True  # past the privilege check, stopped by a constraint
    return True


def test_each_service_role_holds_only_the_rights_its_work_needs(isolated: Settings) -> None:
    wrong: list[str] = []
    for role in PG_SERVICE_ROLES:
        with psycopg.connect(isolated.as_pg_role(role).dsn) as conn:
            assert conn.info.user == pg_role_name(role)
            for statement, allowed in RIGHTS[role]:
                if _may(conn, statement) != allowed:
                    wrong.append(
                        f"{role}: {statement!r} should be {'allowed' if allowed else 'refused'}"
                    )
            for statement in NOBODY:
                if _may(conn, statement):
                    wrong.append(f"{role}: {statement!r} should be refused")
            # A grant without the grant option is refused, or a warning that granted nothing:
            # look at its effect.
            for table in ("delivery_destinations", "results"):
                try:
                    with conn.transaction(force_rollback=True):
                        conn.execute(f"GRANT SELECT ON {table} TO PUBLIC")
                        if conn.execute(
                            "SELECT has_table_privilege('opledger_analyst', %s, 'SELECT')",
                            (table,),
                        ).fetchone() != (False,):
                            wrong.append(f"{role}: could pass its rights on {table} to anyone")
                except errors.InsufficientPrivilege:
                    pass
    assert not wrong, "\n".join(wrong)
    # The owner may do what the services may not: the refusals are the roles', not the tables'.
    with psycopg.connect(isolated.dsn) as owner:
        assert owner.info.user == "opledger"
        assert _may(owner, "SELECT 1 FROM delivery_destinations LIMIT 1")
        assert _may(owner, "DELETE FROM policy_grants WHERE false")


def test_no_service_role_is_a_superuser_and_only_the_projector_passes_row_security(
    isolated: Settings,
) -> None:
    names = [pg_role_name(r) for r in PG_SERVICE_ROLES]
    with psycopg.connect(isolated.dsn) as owner:
        rows = owner.execute(
            "SELECT rolname, rolsuper, rolcreaterole, rolcreatedb, rolbypassrls, rolcanlogin "
            "FROM pg_roles WHERE rolname = ANY(%s) ORDER BY rolname",
            (names,),
        ).fetchall()
        members = owner.execute(
            "SELECT r.rolname FROM pg_auth_members m JOIN pg_roles r ON r.oid = m.member "
            "WHERE r.rolname = ANY(%s)",
            (names,),
        ).fetchall()
    assert [r[0] for r in rows] == sorted(names)
    for name, superuser, createrole, createdb, bypassrls, login in rows:
        assert (superuser, createrole, createdb, login) == (False, False, False, True), name
        assert bypassrls == (name == "opledger_projector"), name
    assert members == []  # no service inherits another role's rights


def test_services_read_every_tenants_rows_the_projector_writes_them(isolated: Settings) -> None:
    # The SDK records as opledger_sdk, the projector folds as opledger_projector (its COPY into
    # tables under row-level security), and the SDK then reads both tenants' rows back.
    with TransitionRecorder.connect(isolated) as recorder:
        for tenant in ("acme", "globex"):
            op = recorder.intent(tenant, "agent-7", "send_email", {"to": tenant})
            recorder.dispatched(op, provider_ref=op.operation_id)
            recorder.succeeded(op, b"sent")
    project_in_process(isolated.as_pg_role("projector"))
    for role in ("sdk", "recovery", "delivery"):
        with psycopg.connect(isolated.as_pg_role(role).dsn) as conn:
            seen = conn.execute(
                "SELECT tenant_id, execution_state FROM agent_operations ORDER BY tenant_id"
            ).fetchall()
        assert seen == [("acme", "SUCCEEDED"), ("globex", "SUCCEEDED")], role


def test_the_sdk_and_the_stacks_workers_sign_in_as_their_own_roles(
    isolated: Settings, stack_settings: Settings
) -> None:
    with TransitionRecorder.connect(isolated) as recorder:
        op = recorder.intent("acme", "agent-7", "send_email", {"n": 1})
        recorder.dispatched(op, provider_ref=op.operation_id)
        recorder.succeeded(op, b"sent")
        with psycopg.connect(isolated.dsn) as owner:
            sdk = owner.execute(
                "SELECT DISTINCT usename FROM pg_stat_activity "
                "WHERE application_name = 'opledger-sdk' AND datname = %s",
                (isolated.pg_database,),
            ).fetchall()
    assert sdk == [("opledger_sdk",)]
    with psycopg.connect(stack_settings.dsn) as owner:
        workers: dict[object, object] = dict(
            owner.execute(
                "SELECT DISTINCT application_name, usename FROM pg_stat_activity "
                "WHERE datname = 'opledger' AND application_name = ANY(%s)",
                (["opledger-projector", "opledger-recovery", "opledger-delivery"],),
            ).fetchall()
        )
    assert workers == {
        "opledger-projector": "opledger_projector",
        "opledger-recovery": "opledger_recovery",
        "opledger-delivery": "opledger_delivery",
    }


def test_each_role_has_a_password_file_of_its_own(isolated: Settings) -> None:
    for role in PG_SERVICE_ROLES:
        user = pg_role_name(role)
        path = isolated.pg_passfile_path_of(user)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        lines = path.read_text().split()
        assert len(lines) == 1 and lines[0].split(":")[3] == user, path
        assert "password" not in conninfo_to_dict(isolated.as_pg_role(role).dsn)
    # One role's file does not open another role.
    borrowed = make_conninfo(
        isolated.as_pg_role("sdk").dsn,
        user="opledger_projector",
        passfile=str(isolated.pg_passfile_path_of("opledger_sdk")),
    )
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(borrowed, connect_timeout=5).close()


def test_a_service_refuses_to_start_on_tables_its_owner_has_not_migrated(
    stack_settings: Settings,
) -> None:
    database = f"opledger_t{uuid4().hex[:10]}"
    admin_dsn = make_conninfo(stack_settings.dsn, dbname="postgres")
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    try:
        settings = stack_settings.with_(pg_database=database)
        with pytest.raises(
            MigrationError, match="run `opledger db migrate` as the database's owner"
        ):
            db.migrate(settings.as_pg_role("sdk").dsn)
        applied = db.migrate(settings.dsn)  # the owner
        assert applied["ledger"] and applied["projections"]
        # Up to date: the service's start only reads, and finds nothing to do.
        assert db.migrate(settings.as_pg_role("sdk").dsn) == {"ledger": [], "projections": []}
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
            )


def test_databases_migrated_at_the_same_moment_all_end_up_migrated(
    stack_settings: Settings,
) -> None:
    """Roles belong to the cluster: every xdist worker's fresh database migrates at once, and a
    migration that changes a role's attributes on every run raced the others' (``tuple
    concurrently updated``, a CI run's failed setup)."""
    admin_dsn = make_conninfo(stack_settings.dsn, dbname="postgres")
    names = [f"opledger_race_{uuid4().hex[:8]}" for _ in range(6)]
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    start = threading.Barrier(len(names))
    failures: list[BaseException] = []

    def migrate(name: str) -> None:
        start.wait()
        try:
            db.migrate(make_conninfo(stack_settings.dsn, dbname=name))
        except BaseException as exc:
            failures.append(exc)

    try:
        for _round in range(3):
            threads = [threading.Thread(target=migrate, args=(n,)) for n in names]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            assert failures == []
            with psycopg.connect(admin_dsn, autocommit=True) as conn:
                for name in names:
                    conn.execute(
                        sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name))
                    )
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            start.reset()
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            for name in names:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
    with psycopg.connect(admin_dsn) as conn:
        bypass = conn.execute(
            "SELECT rolbypassrls FROM pg_roles WHERE rolname = 'opledger_projector'"
        ).fetchone()
    assert bypass == (True,)
