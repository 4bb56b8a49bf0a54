"""What the fake provider knows and counts, shared by the HTTP server and :class:`MemoryProvider`.

Per tool: a mode, scripted or drawn outcomes, the outcome remembered per idempotency key, and
honest counts. ``calls`` is every call that arrived with a key; ``side_effects`` every time the
effect was performed. In ``idempotent`` mode a repeated key replays the first outcome (a call,
not an effect); in ``non_idempotent`` mode every call is a new effect, so "at most one side effect
per key" fails when such a tool is called twice. Counts survive :meth:`ProviderState.forget` (the
world saw those effects) and are cleared only by :meth:`ProviderState.reset`.

Nothing here waits: latency and held responses are the transport's job, so the same state serves
an asyncio server and threads. Every method is thread-safe.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from ledger.domain.ids import request_hash
from opledger.fakes.model import (
    Action,
    KeyStats,
    Mode,
    Outcome,
    Stats,
    Step,
    ToolConfig,
    ToolStats,
    check_key,
    check_tool,
)

#: What a result with an attachment carries: over the delivery workers' 512 KiB inline limit,
#: so its webhook deliveries go by reference (decision 015).
ATTACHMENT_BYTES = 600 * 1024
ATTACHMENT = ("A rendered copy of the message, attachments included. " * 20_000)[:ATTACHMENT_BYTES]


def _attached(key: str, rate: float) -> bool:
    # From the key, not a generator: the draws of outcomes stay what they were without it.
    if rate <= 0:
        return False
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < rate * 2**64


class CallKind(StrEnum):
    #: perform ``step`` (then :meth:`ProviderState.complete`)
    NEW = "new"
    #: idempotent repeat: answer ``outcome`` again, no effect
    REPLAY = "replay"
    #: idempotent repeat while the first call with the key is still running: outcome unknown
    IN_FLIGHT = "in_flight"
    #: the key was used for a different request (a caller bug)
    CONFLICT = "conflict"


@dataclass(frozen=True, slots=True)
class CallPlan:
    kind: CallKind
    tool: str
    key: str
    fingerprint: str
    latency_s: float
    step: Step = field(default_factory=lambda: Step(Action.SUCCEED))
    outcome: Outcome | None = None
    generation: int = 0


@dataclass(slots=True)
class _KeyCounts:
    calls: int = 0
    side_effects: int = 0


@dataclass(slots=True)
class _Tool:
    config: ToolConfig
    call_rng: random.Random = field(init=False)
    lookup_rng: random.Random = field(init=False)
    #: key -> (request fingerprint, outcome): what a repeat or a lookup gets back
    outcomes: dict[str, tuple[str, Outcome]] = field(default_factory=dict)
    #: provider_ref -> key, to look a call up by the provider's own id
    refs: dict[str, str] = field(default_factory=dict)
    #: key -> fingerprint of an idempotent call whose outcome is not known yet
    in_flight: dict[str, str] = field(default_factory=dict)
    call_scripts: dict[str, deque[Step]] = field(default_factory=dict)
    lookup_scripts: dict[str, deque[Step]] = field(default_factory=dict)
    counts: dict[str, _KeyCounts] = field(default_factory=dict)
    received: list[str] = field(default_factory=list)
    effects: int = 0
    failures: int = 0
    lost_responses: int = 0
    lookups: int = 0
    lookups_unavailable: int = 0

    def __post_init__(self) -> None:
        self.reseed()

    def reseed(self) -> None:
        # Separate generators: how many lookups happen must not change which calls fail.
        self.call_rng = random.Random(f"{self.config.seed}:call")
        self.lookup_rng = random.Random(f"{self.config.seed}:lookup")

    def draw(self) -> Step:
        roll = self.call_rng.random()
        if roll < self.config.fail_rate:
            return Step(Action.FAIL)
        if roll < self.config.fail_rate + self.config.lose_response_rate:
            return Step(Action.LOSE_RESPONSE)
        return Step(Action.SUCCEED)

    def stats(self) -> ToolStats:
        keys = {
            k: KeyStats(c.calls, c.side_effects, c.calls - 1 if c.calls else 0)
            for k, c in self.counts.items()
        }
        return ToolStats(
            mode=self.config.mode,
            calls=len(self.received),
            side_effects=self.effects,
            duplicate_keys=sum(s.duplicate_keys for s in keys.values()),
            failures=self.failures,
            lost_responses=self.lost_responses,
            lookups=self.lookups,
            lookups_unavailable=self.lookups_unavailable,
            max_side_effects_per_key=max((s.side_effects for s in keys.values()), default=0),
            keys=keys,
            received_keys=tuple(self.received),
        )


class ProviderState:
    """Every tool's behaviour, remembered outcomes and counts. Thread-safe, never blocks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tools: dict[str, _Tool] = {}
        self._received: list[tuple[str, str]] = []
        # A call planned before a reset must not count into the stats after it.
        self._generation = 0

    def _tool(self, tool: str) -> _Tool:
        found = self._tools.get(tool)
        if found is None:
            found = self._tools[check_tool(tool)] = _Tool(ToolConfig())
        return found

    def configure(self, tool: str, **changes: Any) -> ToolConfig:
        """Change a tool's settings (creating it); a new ``seed`` restarts its generators."""
        with self._lock:
            state = self._tool(tool)
            state.config = state.config.with_changes(changes)
            if "seed" in changes:
                state.reseed()
            return state.config

    def config(self, tool: str) -> ToolConfig:
        with self._lock:
            return self._tool(tool).config

    def script(self, tool: str, key: str, steps: Iterable[object]) -> None:
        """Queue the next actions for ``key``: ``unavailable`` for its lookups, the rest for its
        calls; once a queue is empty the tool's rates decide again."""
        parsed = [Step.parse(s) for s in steps]
        check_key(key)
        with self._lock:
            state = self._tool(tool)
            for step in parsed:
                scripts = (
                    state.lookup_scripts
                    if step.action is Action.UNAVAILABLE
                    else state.call_scripts
                )
                scripts.setdefault(key, deque()).append(step)

    def forget(self, tool: str | None = None, keys: Iterable[str] | None = None) -> int:
        """The provider's key retention expired: lookups say not found and calls are new effects
        again. ``tool`` None: every tool; ``keys`` None: every key. Counts are kept."""
        wanted = None if keys is None else set(keys)
        with self._lock:
            tools = self._tools.values() if tool is None else [self._tool(tool)]
            forgotten = 0
            for state in tools:
                for key in list(state.outcomes) if wanted is None else wanted:
                    known = state.outcomes.pop(key, None)
                    if known is not None:
                        state.refs.pop(known[1].provider_ref, None)
                        forgotten += 1
            return forgotten

    def reset(self, *, keep_config: bool = False) -> None:
        """Forget every key, script and count, and (unless ``keep_config``) every tool."""
        with self._lock:
            configs = {name: t.config for name, t in self._tools.items()} if keep_config else {}
            self._tools = {name: _Tool(config) for name, config in configs.items()}
            self._received.clear()
            self._generation += 1

    def tool_stats(self, tool: str) -> ToolStats:
        with self._lock:
            return self._tool(tool).stats()

    def stats(self) -> Stats:
        with self._lock:
            return Stats(
                tools={name: t.stats() for name, t in self._tools.items()},
                received=tuple(self._received),
            )

    def begin_call(self, tool: str, key: str, request: Any) -> CallPlan:
        """Count the call and say what to do with it."""
        check_key(key)
        fingerprint = request_hash(tool, request)
        with self._lock:
            state = self._tool(tool)
            counts = state.counts.setdefault(key, _KeyCounts())
            counts.calls += 1
            state.received.append(key)
            self._received.append((tool, key))
            plan = CallPlan(
                CallKind.NEW,
                tool,
                key,
                fingerprint,
                state.config.latency_ms / 1000,
                generation=self._generation,
            )
            if state.config.mode is Mode.IDEMPOTENT:
                pending = state.in_flight.get(key)
                known = state.outcomes.get(key)
                first = pending if pending is not None else known[0] if known else None
                if first is not None and first != fingerprint:
                    return replace(plan, kind=CallKind.CONFLICT)
                if pending is not None:
                    return replace(plan, kind=CallKind.IN_FLIGHT)
                if known is not None:
                    return replace(plan, kind=CallKind.REPLAY, outcome=known[1])
                state.in_flight[key] = fingerprint
            queued = state.call_scripts.get(key)
            step = queued.popleft() if queued else state.draw()
            if queued is not None and not queued:
                del state.call_scripts[key]
            return replace(plan, step=step)

    def complete(self, plan: CallPlan) -> Outcome:
        """Perform a NEW plan's effect (unless it fails) and remember its outcome."""
        with self._lock:
            if plan.generation != self._generation:
                # Reset while this call ran: answer, but leave the new counts alone.
                return Outcome(False, "pr_stale", error="the fake provider was reset meanwhile")
            state = self._tool(plan.tool)
            state.in_flight.pop(plan.key, None)
            if plan.step.action is Action.FAIL:
                state.failures += 1
                ref = f"pr_{plan.tool}_f{state.failures}"
                outcome = Outcome(False, ref, error=f"{plan.tool} rejected the request")
            else:
                state.effects += 1
                state.counts[plan.key].side_effects += 1
                ref = f"pr_{plan.tool}_{state.effects}"
                result: dict[str, Any] = {
                    "tool": plan.tool,
                    "idempotency_key": plan.key,
                    "side_effect": state.effects,
                    "status": "done",
                }
                if _attached(plan.key, state.config.attachment_rate):
                    result["attachment"] = ATTACHMENT
                outcome = Outcome(True, ref, result=result)
                if plan.step.action is Action.LOSE_RESPONSE:
                    state.lost_responses += 1
            previous = state.outcomes.get(plan.key)
            if previous is not None:
                state.refs.pop(previous[1].provider_ref, None)
            state.outcomes[plan.key] = (plan.fingerprint, outcome)
            state.refs[ref] = plan.key
            return outcome

    def lookup_latency(self, tool: str) -> float:
        return self.config(tool).latency_ms / 1000

    def lookup(self, tool: str, key: str, provider_ref: str | None = None) -> Outcome | None:
        """The remembered outcome of ``key`` (or of ``provider_ref``), or None: never seen,
        forgotten, or still before its effect. Raises :class:`Unavailable` (scripted or drawn)."""
        check_key(key)
        with self._lock:
            state = self._tool(tool)
            state.lookups += 1
            queued = state.lookup_scripts.get(key)
            if queued:
                queued.popleft()
                if not queued:
                    del state.lookup_scripts[key]
                state.lookups_unavailable += 1
                raise Unavailable(f"{tool}: lookups are unavailable (scripted)")
            if state.lookup_rng.random() < state.config.lookup_unavailable_rate:
                state.lookups_unavailable += 1
                raise Unavailable(f"{tool}: lookups are unavailable")
            known = state.outcomes.get(key)
            if known is None and provider_ref is not None and provider_ref in state.refs:
                known = state.outcomes.get(state.refs[provider_ref])
            return None if known is None else known[1]


class Unavailable(Exception):  # noqa: N818  # named for the provider's answer
    """The provider cannot answer a lookup now."""
