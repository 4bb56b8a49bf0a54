"""The CLI's shared argument types refuse bad values with argparse's usage error."""

from __future__ import annotations

from datetime import timedelta

import pytest

from ledger.destinations import MAX_ROTATION_OVERLAP
from opledger.arguments import MAX_OVERLAP_HOURS
from opledger.cli import build_parser

PORTED_COMMANDS = [
    ["consumer", "run", "--port"],
    ["consumer", "queue", "--topic", "t", "--every-tenant", "--metrics-port"],
    ["fake-provider", "run", "--port"],
]


@pytest.mark.parametrize("command", PORTED_COMMANDS)
@pytest.mark.parametrize("raw", ["abc", "-1", "65536", "8080.5", ""])
def test_a_port_that_is_not_one_is_a_usage_error_naming_it(
    command: list[str], raw: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*command, raw])
    assert exited.value.code == 2
    assert "not a TCP port" in capsys.readouterr().err


@pytest.mark.parametrize("command", PORTED_COMMANDS)
@pytest.mark.parametrize("raw", ["0", "1", "16068", "65535"])
def test_every_port_from_0_to_65535_is_taken(command: list[str], raw: str) -> None:
    option = command[-1].lstrip("-").replace("-", "_")
    assert getattr(build_parser().parse_args([*command, raw]), option) == int(raw)


ROTATE = ["destinations", "rotate-secret", "--tenant", "acme", "--name", "crm", "--overlap-hours"]


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "-1", "720.5", "1e10", "a day", ""])
def test_an_overlap_that_is_not_0_to_720_hours_is_a_usage_error(
    raw: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*ROTATE, raw])
    assert exited.value.code == 2
    assert "hours" in capsys.readouterr().err


@pytest.mark.parametrize("raw", ["0", "0.5", "24", "720"])
def test_an_overlap_from_0_to_720_hours_is_taken(raw: str) -> None:
    assert build_parser().parse_args([*ROTATE, raw]).overlap_hours == float(raw)


def test_the_cli_bound_is_the_registrys() -> None:
    assert timedelta(hours=MAX_OVERLAP_HOURS) == MAX_ROTATION_OVERLAP


def test_a_refused_command_line_says_nothing_was_recorded(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A missing option, not a bad value (test_names covers those): the same last line.
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["ops", "list"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "usage: opledger" in err and "--tenant" in err
    assert err.rstrip().endswith("nothing was recorded or changed")
