"""A queue consumer takes the tenants it is told to, and must be told: no default scope."""

from __future__ import annotations

import pytest

from consumers.queue import EVERY_TENANT, tenant_scope
from opledger.cli import build_parser


def test_a_named_scope_is_the_set_of_its_tenants() -> None:
    assert tenant_scope(["acme", "globex", "acme"]) == frozenset({"acme", "globex"})


def test_every_tenant_is_said_on_purpose_and_means_no_check() -> None:
    assert tenant_scope(EVERY_TENANT) is None


def test_a_scope_that_takes_nothing_is_refused_not_read_as_every_tenant() -> None:
    with pytest.raises(ValueError, match="EVERY_TENANT"):
        tenant_scope([])


def test_one_string_is_refused_rather_than_read_as_its_letters() -> None:
    with pytest.raises(TypeError, match="collection of tenant ids"):
        tenant_scope("acme")


def test_the_cli_refuses_a_queue_consumer_without_a_scope(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["consumer", "queue", "--topic", "t"])
    assert exited.value.code == 2
    assert "--tenant" in capsys.readouterr().err


def test_the_cli_refuses_both_scopes_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["consumer", "queue", "--topic", "t", "--tenant", "acme", "--every-tenant"]
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "tenants", "every"),
    [
        (["--tenant", "acme", "--tenant", "globex"], ["acme", "globex"], False),
        (["--every-tenant"], None, True),
    ],
)
def test_the_cli_passes_the_scope_it_was_given(
    argv: list[str], tenants: list[str] | None, every: bool
) -> None:
    args = build_parser().parse_args(["consumer", "queue", "--topic", "t", *argv])
    assert args.tenant == tenants
    assert args.every_tenant is every
