"""The fake provider in-process: :class:`MemoryProvider` is a ``ledger.tools.Provider`` with the
server's modes, scripts and counts (both run on :class:`ProviderState`), for unit tests and
benchmarks. A lost response or a hold past ``call_timeout`` raises :class:`ContactLost` as the HTTP
adapter would; latency and holds really sleep.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ledger.domain.ids import canonical_json
from ledger.tools import CallOutcome, ContactLost, LookupResult, LookupStatus, ProviderTerms
from opledger.fakes.model import Action, Mode, Outcome, Step, ToolConfig, ToolStats
from opledger.fakes.state import CallKind, CallPlan, ProviderState, Unavailable

#: A hold "until released" still ends, so a forgotten test cannot pin a thread for good.
MAX_HOLD_S = 600.0


def default_terms(mode: Mode) -> ProviderTerms:
    return ProviderTerms(
        call_timeout=timedelta(seconds=5),
        key_retention=timedelta(days=1),
        repeat_safe=mode is Mode.IDEMPOTENT,
    )


@dataclass(eq=False)
class _Hold:
    key: str
    deadline: float
    released: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout: float | None) -> bool:
        """True once released or over; False when ``timeout`` ran out first."""
        left = self.deadline - time.monotonic()
        if timeout is not None and timeout < left:
            return self.released.wait(timeout)
        self.released.wait(max(left, 0.0))
        return True


def _call_outcome(outcome: Outcome) -> CallOutcome:
    if outcome.succeeded:
        return CallOutcome(
            True, result=canonical_json(outcome.result), provider_ref=outcome.provider_ref
        )
    return CallOutcome(False, error=outcome.error, provider_ref=outcome.provider_ref)


class MemoryProvider:
    """One fake tool in this process. Several may share a :class:`ProviderState` (one per tool
    name). Thread-safe."""

    def __init__(
        self,
        tool_name: str = "fake_tool",
        terms: ProviderTerms | None = None,
        *,
        mode: Mode = Mode.IDEMPOTENT,
        fail_rate: float = 0.0,
        lose_response_rate: float = 0.0,
        lookup_unavailable_rate: float = 0.0,
        latency_s: float = 0.0,
        seed: int = 0,
        state: ProviderState | None = None,
    ) -> None:
        self.tool_name = tool_name
        self.terms = terms or default_terms(mode)
        self.state = state or ProviderState()
        self.state.configure(
            tool_name,
            mode=mode,
            fail_rate=fail_rate,
            lose_response_rate=lose_response_rate,
            lookup_unavailable_rate=lookup_unavailable_rate,
            latency_ms=latency_s * 1000,
            seed=seed,
        )
        self._holds_lock = threading.Lock()
        self._holds: set[_Hold] = set()

    # -- ledger.tools.Provider --------------------------------------------------------------

    def call(self, request: Any, idempotency_key: str) -> CallOutcome:
        """See :class:`ledger.tools.Provider`."""
        plan = self.state.begin_call(self.tool_name, idempotency_key, request)
        if plan.latency_s:
            time.sleep(plan.latency_s)
        if plan.kind in (CallKind.CONFLICT, CallKind.IN_FLIGHT):
            raise ContactLost(f"{self.tool_name}: key {idempotency_key} {plan.kind}")
        if plan.kind is CallKind.REPLAY:
            assert plan.outcome is not None
            return _call_outcome(plan.outcome)
        timeout = self.terms.call_timeout.total_seconds()
        if plan.step.action is Action.HANG_BEFORE_EFFECT:
            hold = self._hold(idempotency_key, plan.step.seconds)
            if not hold.wait(timeout):
                # The caller gives up; the provider still performs the effect when the hold ends.
                threading.Thread(target=self._finish_late, args=(plan, hold), daemon=True).start()
                raise ContactLost(f"{self.tool_name}: no answer within {timeout}s")
            self._unhold(hold)
        outcome = self.state.complete(plan)
        if plan.step.action is Action.LOSE_RESPONSE:
            raise ContactLost(f"{self.tool_name}: connection lost after the request was sent")
        if plan.step.action is Action.HANG:
            hold = self._hold(idempotency_key, plan.step.seconds)
            answered = hold.wait(timeout)
            self._unhold(hold)
            if not answered:
                raise ContactLost(f"{self.tool_name}: no answer within {timeout}s")
        return _call_outcome(outcome)

    def lookup(self, idempotency_key: str, provider_ref: str | None) -> LookupResult:
        """See :class:`ledger.tools.Provider`; never raises for an unavailable provider."""
        latency = self.state.lookup_latency(self.tool_name)
        if latency:
            time.sleep(latency)
        try:
            outcome = self.state.lookup(self.tool_name, idempotency_key, provider_ref)
        except Unavailable as exc:
            return LookupResult(LookupStatus.UNAVAILABLE, reason=str(exc))
        if outcome is None:
            return LookupResult(LookupStatus.NOT_FOUND)
        if outcome.succeeded:
            return LookupResult(
                LookupStatus.FOUND_SUCCEEDED,
                result=canonical_json(outcome.result),
                provider_ref=outcome.provider_ref,
            )
        return LookupResult(
            LookupStatus.FOUND_FAILED, reason=outcome.error, provider_ref=outcome.provider_ref
        )

    # -- control -----------------------------------------------------------------------------

    def configure(self, **changes: Any) -> ToolConfig:
        """As the server's ``/_control/configure`` for this tool (``latency_ms``, not seconds)."""
        return self.state.configure(self.tool_name, **changes)

    def script(self, idempotency_key: str, actions: Iterable[str | Step | dict[str, Any]]) -> None:
        self.state.script(self.tool_name, idempotency_key, actions)

    def forget(self, keys: Iterable[str] | None = None) -> int:
        return self.state.forget(self.tool_name, keys)

    def release(self, idempotency_key: str | None = None) -> int:
        """End held responses now (all, or those of one key)."""
        with self._holds_lock:
            held = [h for h in self._holds if idempotency_key in (None, h.key)]
        for hold in held:
            hold.released.set()
        return len(held)

    def stats(self) -> ToolStats:
        return self.state.tool_stats(self.tool_name)

    def reset(self) -> None:
        """Forget every key, script and count of the shared state; configurations stay."""
        self.release()
        self.state.reset(keep_config=True)

    # -- holds -------------------------------------------------------------------------------

    def _hold(self, key: str, seconds: float | None) -> _Hold:
        hold = _Hold(key, time.monotonic() + (MAX_HOLD_S if seconds is None else seconds))
        with self._holds_lock:
            self._holds.add(hold)
        return hold

    def _unhold(self, hold: _Hold) -> None:
        with self._holds_lock:
            self._holds.discard(hold)

    def _finish_late(self, plan: CallPlan, hold: _Hold) -> None:
        hold.wait(None)
        self._unhold(hold)
        self.state.complete(plan)
