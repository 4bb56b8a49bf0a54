"""The names every entry point accepts, checked by one function.

A tenant, an actor, a tool, a destination or an operation id reaches opledger through the SDK,
the CLI, an HTTP request or a record on a topic. Each is checked here, with the same shape
whichever way it came, so a value one entry point refuses is never stored by another (an outside
probe found ``destinations add --tenant "x'--"`` accepted while the SDK refused it, and a tool
name holding terminal escapes stored and printed back raw). The event contract
(:mod:`ledger.domain.events`) is built from the same shapes.

Shapes are matched whole (:meth:`re.Pattern.fullmatch`): ``$`` would also accept a trailing
newline, which a log line or a database check would then meet.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Final

from ledger.domain.ids import OPERATION_ID_SHAPE
from ledger.domain.redact import looks_secret


class NameKind(StrEnum):
    """What a name names; its value is what an error message calls it."""

    TENANT = "tenant id"
    ACTOR = "actor id"
    TOOL = "tool name"
    #: a destination as a delivery event names it
    DESTINATION = "destination"
    #: a destination's name in the registry: a metric label and part of every webhook-id
    DESTINATION_NAME = "destination name"
    OPERATION_ID = "operation id"


#: Each kind's shape, unanchored: :data:`PATTERNS` anchors it for Python, and the event models
#: anchor it for pydantic's own regex engine.
SHAPES: Final[dict[NameKind, str]] = {
    NameKind.TENANT: r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}",
    NameKind.ACTOR: r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}",
    NameKind.TOOL: r"[A-Za-z][A-Za-z0-9._-]{0,127}",
    NameKind.DESTINATION: r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,255}",
    NameKind.DESTINATION_NAME: r"[a-z0-9][a-z0-9._-]{0,63}",
    NameKind.OPERATION_ID: OPERATION_ID_SHAPE,
}

#: What each shape allows, for the error message.
_ALLOWED: Final[dict[NameKind, str]] = {
    NameKind.TENANT: "1-128 of A-Z a-z 0-9 . _ : @ / -, starting with a letter or digit",
    NameKind.ACTOR: "1-128 of A-Z a-z 0-9 . _ : @ / -, starting with a letter or digit",
    NameKind.TOOL: "1-128 of A-Z a-z 0-9 . _ -, starting with a letter",
    NameKind.DESTINATION: "1-256 of A-Z a-z 0-9 . _ : / @ -, starting with a letter or digit",
    NameKind.DESTINATION_NAME: "1-64 of a-z 0-9 . _ -, starting with a letter or digit",
    NameKind.OPERATION_ID: "op_ and a 26-character ULID",
}

PATTERNS: Final[dict[NameKind, re.Pattern[str]]] = {
    kind: re.compile(shape) for kind, shape in SHAPES.items()
}

#: The most of a refused value an error message quotes.
_QUOTED = 80


class InvalidNameError(ValueError):
    """A value is not a name of its kind. The message quotes the value made safe to print
    (:func:`ledger.domain.display.displayable`) and says what the kind allows."""

    def __init__(self, kind: NameKind, value: object) -> None:
        self.kind = kind
        article = "an" if kind.value[0] in "aeiou" else "a"
        super().__init__(f"not {article} {kind}: {quoted(value)} ({_ALLOWED[kind]})")


def quoted(value: object) -> str:
    """``value`` as an error message may quote it: a non-string by its type, a credential's
    shape not at all (a token pasted into the wrong field must not reach a log), else cut to a
    length a line can hold, with every character that is not printable ASCII escaped."""
    if not isinstance(value, str):
        return f"a {type(value).__name__}"
    if looks_secret(value, heuristic=False):
        return "a value shaped like a credential (not shown)"
    cut = value if len(value) <= _QUOTED else value[:_QUOTED] + "..."
    # Every name is ASCII: a Cyrillic a (U+0430) in a tenant is shown escaped, not as a lookalike.
    return ascii(cut)


def is_name(kind: NameKind, value: object) -> bool:
    """Whether ``value`` is a string of ``kind``'s shape."""
    return isinstance(value, str) and PATTERNS[kind].fullmatch(value) is not None


def check_name(kind: NameKind, value: object) -> str:
    """``value`` if it is a name of ``kind``, else :class:`InvalidNameError`."""
    if not is_name(kind, value):
        raise InvalidNameError(kind, value)
    assert isinstance(value, str)  # is_name said so
    return value


def check_tools(tools: object, *, wildcard: str | None = None) -> tuple[str, ...]:
    """``tools`` as a tuple when it is a non-empty sequence of tool names (``wildcard``, if
    given, stands for every tool), else :class:`InvalidNameError` for the first that is not."""
    if isinstance(tools, str) or not isinstance(tools, list | tuple) or not tools:
        raise InvalidNameError(NameKind.TOOL, tools)
    for tool in tools:
        if tool != wildcard or wildcard is None:
            check_name(NameKind.TOOL, tool)
    return tuple(tools)
