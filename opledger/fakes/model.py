"""The fake provider's values: modes, actions, settings, outcomes and the counts it reports.

Shared by the server, its HTTP client and :class:`MemoryProvider`; the counts travel as the JSON of
``GET /_control/stats`` (``to_json``/``from_json``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")
#: Printable ASCII without spaces, as HTTP header values and query strings carry it unescaped.
IDEMPOTENCY_KEY_RE = re.compile(r"^[\x21-\x7e]{1,255}$")


class FakeProviderError(ValueError):
    """A control request or call the fake cannot accept (bad name, key, rate or action)."""


class Mode(StrEnum):
    IDEMPOTENT = "idempotent"
    NON_IDEMPOTENT = "non_idempotent"


class Action(StrEnum):
    """What the fake does with the next call (or, ``unavailable``, lookup) of a key."""

    SUCCEED = "succeed"
    FAIL = "fail"
    #: perform the effect, then drop the connection without a response
    LOSE_RESPONSE = "lose_response"
    #: perform the effect, then hold the response for ``seconds`` (None: until released)
    HANG = "hang"
    #: hold first, then perform the effect, whether or not the caller still waits
    HANG_BEFORE_EFFECT = "hang_before_effect"
    #: lookups only: answer "unavailable"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class Step:
    """One scripted action; ``seconds`` is the hold of ``hang``/``hang_before_effect``."""

    action: Action
    seconds: float | None = None

    @classmethod
    def parse(cls, raw: object) -> Step:
        """``"fail"`` or ``{"action": "hang", "seconds": 2}``."""
        if isinstance(raw, Step):
            return raw
        if isinstance(raw, str):
            raw = {"action": raw}
        if not isinstance(raw, Mapping) or set(raw) - {"action", "seconds"}:
            raise FakeProviderError(f"a step is an action name or {{action, seconds}}: {raw!r}")
        try:
            action = Action(str(raw.get("action")))
        except ValueError:
            raise FakeProviderError(f"unknown action {raw.get('action')!r}") from None
        seconds = raw.get("seconds")
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0
        ):
            raise FakeProviderError(f"seconds must be a non-negative number: {seconds!r}")
        return cls(action, None if seconds is None else float(seconds))

    def to_json(self) -> dict[str, Any]:
        return {"action": str(self.action), "seconds": self.seconds}


@dataclass(frozen=True, slots=True)
class ToolConfig:
    mode: Mode = Mode.IDEMPOTENT
    #: share of new calls that fail (confirmed, no side effect)
    fail_rate: float = 0.0
    #: share of new calls whose effect is performed and whose response is then lost
    lose_response_rate: float = 0.0
    #: share of lookups answered "unavailable"
    lookup_unavailable_rate: float = 0.0
    #: delay before every call and lookup is handled
    latency_ms: float = 0.0
    #: seeds the tool's generators, so the drawn outcomes repeat run after run
    seed: int = 0
    #: share of effects whose result carries a rendered attachment of ATTACHMENT_BYTES (chosen
    #: by the idempotency key, so every answer for one key is the same result)
    attachment_rate: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "fail_rate",
            "lose_response_rate",
            "lookup_unavailable_rate",
            "attachment_rate",
        ):
            rate = getattr(self, name)
            if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
                raise FakeProviderError(f"{name} must be between 0 and 1: {rate!r}")
        if self.fail_rate + self.lose_response_rate > 1:
            raise FakeProviderError("fail_rate + lose_response_rate must not exceed 1")
        if not isinstance(self.latency_ms, int | float) or self.latency_ms < 0:
            raise FakeProviderError(f"latency_ms must be non-negative: {self.latency_ms!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise FakeProviderError(f"seed must be an integer: {self.seed!r}")

    def with_changes(self, changes: Mapping[str, Any]) -> ToolConfig:
        unknown = set(changes) - set(self.__dataclass_fields__)
        if unknown:
            raise FakeProviderError(f"unknown settings: {sorted(unknown)}")
        values = dict(changes)
        if "mode" in values:
            try:
                values["mode"] = Mode(values["mode"])
            except ValueError:
                raise FakeProviderError(f"unknown mode {values['mode']!r}") from None
        return replace(self, **values)

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__} | {
            "mode": str(self.mode)
        }


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a call's effect came to; ``result`` is JSON. Replayed and looked up as is."""

    succeeded: bool
    provider_ref: str
    result: Any = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class KeyStats:
    calls: int = 0
    side_effects: int = 0
    #: calls whose key this tool had received before (whatever it did with them)
    duplicate_keys: int = 0


@dataclass(frozen=True, slots=True)
class ToolStats:
    mode: Mode
    calls: int
    side_effects: int
    duplicate_keys: int
    failures: int
    lost_responses: int
    lookups: int
    lookups_unavailable: int
    max_side_effects_per_key: int
    keys: Mapping[str, KeyStats]
    #: every key received, in arrival order, repeats included
    received_keys: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        plain = {
            name: getattr(self, name)
            for name in self.__dataclass_fields__
            if name not in ("mode", "keys", "received_keys")
        }
        return plain | {
            "mode": str(self.mode),
            "keys": {k: _key_json(v) for k, v in self.keys.items()},
            "received_keys": list(self.received_keys),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ToolStats:
        counts: dict[str, int] = {}
        for name in cls.__dataclass_fields__:
            if name not in ("mode", "keys", "received_keys"):
                counts[name] = int(raw[name])
        return cls(
            mode=Mode(raw["mode"]),
            keys={k: KeyStats(**{n: int(c) for n, c in v.items()}) for k, v in raw["keys"].items()},
            received_keys=tuple(str(k) for k in raw["received_keys"]),
            **counts,
        )


@dataclass(frozen=True, slots=True)
class Stats:
    tools: Mapping[str, ToolStats]
    #: every (tool, key) received, in arrival order
    received: tuple[tuple[str, str], ...]

    @property
    def calls(self) -> int:
        return sum(t.calls for t in self.tools.values())

    @property
    def side_effects(self) -> int:
        return sum(t.side_effects for t in self.tools.values())

    @property
    def duplicate_keys(self) -> int:
        return sum(t.duplicate_keys for t in self.tools.values())

    @property
    def lookups(self) -> int:
        return sum(t.lookups for t in self.tools.values())

    @property
    def max_side_effects_per_key(self) -> int:
        """The seed's invariant: at most 1 when every operation had at most one effect."""
        return max((t.max_side_effects_per_key for t in self.tools.values()), default=0)

    def to_json(self) -> dict[str, Any]:
        return {
            "tools": {name: t.to_json() for name, t in self.tools.items()},
            "totals": {
                "calls": self.calls,
                "side_effects": self.side_effects,
                "duplicate_keys": self.duplicate_keys,
                "lookups": self.lookups,
                "max_side_effects_per_key": self.max_side_effects_per_key,
            },
            "received": [list(pair) for pair in self.received],
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Stats:
        return cls(
            tools={name: ToolStats.from_json(t) for name, t in raw["tools"].items()},
            received=tuple((str(tool), str(key)) for tool, key in raw["received"]),
        )


def _key_json(stats: KeyStats) -> dict[str, int]:
    return {n: getattr(stats, n) for n in KeyStats.__dataclass_fields__}


def check_tool(tool: str) -> str:
    if not isinstance(tool, str) or not TOOL_NAME_RE.match(tool):
        raise FakeProviderError(f"tool names are 1-100 of [A-Za-z0-9_.:-]: {tool!r}")
    return tool


def check_key(key: str) -> str:
    if not isinstance(key, str) or not IDEMPOTENCY_KEY_RE.match(key):
        raise FakeProviderError("an idempotency key is 1-255 printable ASCII characters")
    return key
