"""One check for every name, whichever way it comes in (``ledger.domain.names``).

An outside probe found ``destinations add`` storing a tenant (``x'--``) and a tool (terminal
escapes) that the SDK refused, and an operation id with a trailing newline accepted by a query;
these hold every entry point to the same shapes."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from ledger.domain import events
from ledger.domain.names import PATTERNS, InvalidNameError, NameKind, check_name, is_name, quoted
from opledger import arguments
from opledger.cli import build_parser
from projections import queries

OP = "op_01J9ZQ4K8S2M3N4P5Q6R7S8T9V"

#: The probe's values and their kin: each is refused as every kind.
HOSTILE = [
    "x'--",
    "t\x1b[2J",
    "x\x1b]52;c;SGVsbG8=\x07\x1b[2J",
    "acme\n",
    "acme\r\nforged: line",
    " acme",
    "ac me",
    "\u0430cme",  # a Cyrillic a
    "acme\u200b",
    "",
    "a" * 300,
]


@pytest.mark.parametrize("kind", list(NameKind))
@pytest.mark.parametrize("value", HOSTILE)
def test_each_probe_value_is_refused_as_every_kind(kind: NameKind, value: str) -> None:
    with pytest.raises(InvalidNameError) as caught:
        check_name(kind, value)
    message = str(caught.value)
    assert message.isascii() and message.isprintable(), message


def test_a_trailing_newline_is_not_part_of_an_operation_id() -> None:
    assert is_name(NameKind.OPERATION_ID, OP)
    assert not is_name(NameKind.OPERATION_ID, OP + "\n")
    with pytest.raises(queries.QueryError):
        queries.check_operation_id(OP + "\n")


def test_a_credential_typed_into_a_name_is_not_quoted_back() -> None:
    key = "token=ghp_" + "x7Kq2mZ9pL4vN8rT1wY6bC3dF5gH0jS2aE4u"
    with pytest.raises(InvalidNameError) as caught:
        check_name(NameKind.TENANT, key)
    assert key not in str(caught.value) and "credential" in str(caught.value)
    assert quoted(7) == "a int"


_ADAPTERS: dict[NameKind, TypeAdapter[Any]] = {
    NameKind.TENANT: TypeAdapter(events.Identifier),
    NameKind.ACTOR: TypeAdapter(events.Identifier),
    NameKind.TOOL: TypeAdapter(events.ToolName),
    NameKind.OPERATION_ID: TypeAdapter(events.OperationId),
}


def _accepts(adapter: TypeAdapter[Any], value: str) -> bool:
    try:
        adapter.validate_python(value)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize("kind", list(_ADAPTERS))
@given(value=st.text(max_size=140) | st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,130}\n?"))
def test_the_event_contract_accepts_exactly_what_the_check_does(kind: NameKind, value: str) -> None:
    # The events anchor the shapes for pydantic's regex engine, the check for Python's: the two
    # must agree on every value, or a name could be stored that no event can carry.
    assert _accepts(_ADAPTERS[kind], value) == is_name(kind, value)


def test_every_shape_is_matched_whole() -> None:
    for kind, pattern in PATTERNS.items():
        assert pattern.fullmatch("x\n") is None, kind


# -- the CLI ------------------------------------------------------------------------------------

#: The options and positionals that take a name, and the kinds each may be.
_NAMED = {
    "tenant": {arguments.tenant},
    "operation_id": {arguments.operation_id},
    "actor": {arguments.actor, arguments.actor_or_wildcard},
    "tool": {arguments.tool, arguments.tool_or_wildcard},
    "by": {arguments.actor},
    "destination": {arguments.destination},
}


def _parsers(parser: argparse.ArgumentParser, path: str = "opledger") -> Any:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


#: Commands that check their names themselves, to report every problem of an input at once
#: (through the same shapes: ``opledger.policy._check`` and the policy record's model;
#: ``tests/unit/test_policy_evaluation.py`` tries each option with a bad value).
_REPORTS_ALL_AT_ONCE = ("opledger policy",)


def test_every_command_checks_the_names_it_takes() -> None:
    unchecked = []
    seen = 0
    for path, parser in _parsers(build_parser()):
        if path.startswith(_REPORTS_ALL_AT_ONCE):
            continue
        for action in parser._actions:
            allowed = _NAMED.get(action.dest)
            if allowed is None:
                continue
            seen += 1
            if action.type not in allowed:
                unchecked.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    assert seen >= 20, "the walk found the commands"
    assert not unchecked, unchecked


def test_the_walk_would_see_an_unchecked_option() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers()
    commands.add_parser("x").add_argument("--tenant")
    found = [
        a.dest
        for _p, sub in _parsers(parser)
        for a in sub._actions
        if a.dest in _NAMED and a.type not in _NAMED[a.dest]
    ]
    assert found == ["tenant"]


@pytest.mark.parametrize(
    "argv",
    [
        ["destinations", "add", "--tenant", "x'--", "--name", "crm", "--topic", "t", "--tool", "*"],
        [
            "destinations",
            "add",
            "--tenant",
            "acme",
            "--name",
            "crm",
            "--topic",
            "t",
            "--tool",
            "x\x1b]52;c;SGVsbG8=\x07\x1b[2J",
        ],
        ["destinations", "list", "--tenant", "t\x1b[2J"],
        ["ops", "show", OP + "\n", "--tenant", "acme"],
    ],
)
def test_the_cli_refuses_the_probes_values_before_running(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err and "not a" in err, err
    assert err.rstrip().endswith("nothing was recorded or changed"), err
