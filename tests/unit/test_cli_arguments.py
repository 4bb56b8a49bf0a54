"""The CLI's shared argument types refuse bad values with argparse's usage error."""

from __future__ import annotations

import pytest

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
