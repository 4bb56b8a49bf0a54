"""Which database role a process signs in as (decision 034), without a server: the settings
and the command line (the server's own answers are ``tests/integration/test_service_roles.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict

from ledger.settings import PG_SERVICE_ROLES, Settings, SettingsError
from opledger.cli import build_parser


def test_a_component_takes_its_own_role_and_everything_else_the_owner() -> None:
    settings = Settings(home=Path("/x"))
    assert settings.pg_user == "opledger"
    for role in PG_SERVICE_ROLES:
        dsn = conninfo_to_dict(settings.as_pg_role(role).dsn)
        assert dsn["user"] == f"opledger_{role}"
        assert dsn["passfile"] == f"/x/keys/pgpass-opledger_{role}"
        assert "password" not in dsn
    assert conninfo_to_dict(settings.dsn)["passfile"] == "/x/keys/pgpass"


def test_one_role_named_for_the_environment_is_every_process_s() -> None:
    forced = Settings.from_env({"OPLEDGER_HOME": "/x", "OPLEDGER_PG_ROLE": "sdk"})
    assert forced.as_pg_role("projector").pg_user == "opledger_sdk"
    assert forced.pg_user == "opledger_sdk"


def test_a_dsn_of_the_users_is_used_as_given() -> None:
    given = "postgresql://billing@db.internal:5432/ledger"
    settings = Settings(home=Path("/x"), pg_dsn=given)
    assert settings.as_pg_role("projector").dsn == given


def test_the_database_and_the_password_directory_are_the_settings() -> None:
    settings = Settings(home=Path("/x"), pg_database="opledger_t1", pg_password_dir="/keys")
    dsn = conninfo_to_dict(settings.as_pg_role("delivery").dsn)
    assert (dsn["dbname"], dsn["passfile"]) == ("opledger_t1", "/keys/pgpass-opledger_delivery")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OPLEDGER_PG_ROLE", "superuser"),
        ("OPLEDGER_PG_ROLE", "opledger_sdk"),
        ("OPLEDGER_PG_DATABASE", "x; DROP"),
        ("OPLEDGER_PG_DATABASE", "Opledger"),
    ],
)
def test_bad_database_settings_are_refused_naming_the_variable(variable: str, value: str) -> None:
    with pytest.raises(SettingsError, match=variable):
        Settings.from_env({"OPLEDGER_HOME": "/x", variable: value})


@pytest.mark.parametrize(
    ("argv", "role"),
    [
        (["projector", "run"], "projector"),
        (["recover", "run"], "recovery"),
        (["deliver", "run"], "delivery"),
        (["db", "migrate"], None),
        (["destinations", "list", "--tenant", "acme"], None),
        (["policy", "show", "--tenant", "acme"], None),
    ],
)
def test_each_worker_command_names_its_role_and_admin_commands_none(
    argv: list[str], role: str | None
) -> None:
    assert getattr(build_parser().parse_args(argv), "pg_role", None) == role
