"""Argument types the CLI's subcommands share: each turns a bad value into argparse's usage
error (exit 2, the value named) before any command runs."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from ledger.domain.names import InvalidNameError, NameKind, check_name
from ledger.domain.policy import WILDCARD

#: What ``ledger.destinations.MAX_ROTATION_OVERLAP`` allows, in hours.
MAX_OVERLAP_HOURS = 720


def tcp_port(raw: str) -> int:
    """A TCP port, 0 to 65535 (0: the system picks a free one)."""
    try:
        port = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a TCP port: {raw!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {raw}")
    return port


def overlap_hours(raw: str) -> float:
    """Hours a rotated-out secret still signs: finite, 0 to 720 (30 days)."""
    try:
        hours = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of hours: {raw!r}") from None
    if not math.isfinite(hours) or not 0 <= hours <= MAX_OVERLAP_HOURS:
        raise argparse.ArgumentTypeError(f"not between 0 and {MAX_OVERLAP_HOURS} hours: {raw}")
    return hours


def _name(kind: NameKind, *, wildcard: bool = False) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if wildcard and raw == WILDCARD:
            return raw
        try:
            return check_name(kind, raw)
        except InvalidNameError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = kind.value  # argparse names the type in its "invalid ... value" message
    return parse


#: Argument types of the names every command takes, checked as the SDK, HTTP and the event
#: contract check them (:mod:`ledger.domain.names`).
tenant = _name(NameKind.TENANT)
actor = _name(NameKind.ACTOR)
actor_or_wildcard = _name(NameKind.ACTOR, wildcard=True)
tool = _name(NameKind.TOOL)
tool_or_wildcard = _name(NameKind.TOOL, wildcard=True)
destination = _name(NameKind.DESTINATION)
destination_name = _name(NameKind.DESTINATION_NAME)
operation_id = _name(NameKind.OPERATION_ID)
