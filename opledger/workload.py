"""Synthetic event streams for tests, benchmarks and the demo's bulk phase.

Each operation follows a realistic life: intent, dispatch, then success, failure, or a response
lost after dispatch (UNKNOWN, later reconciled); successful operations deliver to two
destinations with occasional retries and dead letters. A share of events is repeated, as a
service that retries its own append would, and the generator is seeded so runs are comparable.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from ledger.domain.events import DeliveryTransitioned, ExecutionTransitioned, Transition
from ledger.domain.ids import content_ref, event_id, operation_id, request_hash
from ledger.domain.states import DeliveryState, ExecutionState

DESTINATIONS = ("webhook:crm", "queue:billing")
TOOLS = ("send_email", "create_invoice", "charge_card", "post_slack_message")
TENANTS = ("acme", "globex", "initech")


@dataclass(frozen=True, slots=True)
class Mix:
    """Probabilities of each outcome; the rest succeed."""

    failed: float = 0.10
    unknown: float = 0.08
    delivery_retry: float = 0.15
    delivery_dead: float = 0.03
    duplicate_append: float = 0.05


class Workload:
    """Deterministic generator of valid event histories."""

    def __init__(self, seed: int = 7, mix: Mix = Mix(), start: datetime | None = None) -> None:
        self._rng = random.Random(seed)
        self._mix = mix
        self._now = start or datetime(2026, 1, 1, tzinfo=UTC)

    def _entropy(self) -> bytes:
        return self._rng.randbytes(10)

    def _tick(self) -> datetime:
        self._now += timedelta(microseconds=self._rng.randint(50, 5000))
        return self._now

    def _ms(self) -> int:
        return int(self._now.timestamp() * 1000)

    def _maybe_repeat(self, out: list[Transition]) -> None:
        """Sometimes append the last event again, identical (same event id), as a service that
        resends an append whose acknowledgement it lost does."""
        if self._rng.random() < self._mix.duplicate_append:
            out.append(out[-1])

    def operation(self) -> list[Transition]:
        """The events of one operation, in order (with occasional repeated appends)."""
        rng, mix = self._rng, self._mix
        op = operation_id(self._ms(), self._entropy())
        tenant = rng.choice(TENANTS)
        actor = f"agent-{rng.randint(1, 20)}"
        tool = rng.choice(TOOLS)
        rhash = request_hash(tool, {"n": rng.randint(0, 10**9), "to": f"user{rng.randint(1, 999)}"})
        out: list[Transition] = []

        def execution(state: ExecutionState, attempt: int, **extra: str | None) -> None:
            out.append(
                ExecutionTransitioned(
                    event_id=event_id(self._ms(), self._entropy()),
                    operation_id=op,
                    tenant_id=tenant,
                    actor_id=actor,
                    occurred_at=self._tick(),
                    attempt=attempt,
                    state=state,
                    tool_name=tool,
                    request_hash=rhash,
                    **extra,
                )
            )
            self._maybe_repeat(out)

        execution(ExecutionState.INTENT_RECORDED, 0)
        provider_ref = f"prov-{rng.randbytes(6).hex()}"
        execution(ExecutionState.DISPATCHED, 1, provider_ref=provider_ref)
        roll = rng.random()
        result = content_ref(rng.randbytes(16))
        if roll < mix.failed:
            execution(ExecutionState.FAILED, 1, error="provider rejected the request: 422")
            return out
        if roll < mix.failed + mix.unknown:
            execution(ExecutionState.UNKNOWN, 1, error="connection reset after dispatch")
            if rng.random() < 0.5:
                return out  # still awaiting reconciliation
            execution(ExecutionState.SUCCEEDED, 1, result_ref=result)
        else:
            execution(ExecutionState.SUCCEEDED, 1, result_ref=result)
        for destination in DESTINATIONS:
            out.extend(self._delivery(op, tenant, actor, destination, result))
        return out

    def _delivery(
        self, op: str, tenant: str, actor: str, destination: str, result: str
    ) -> list[Transition]:
        rng, mix = self._rng, self._mix
        out: list[Transition] = []

        def step(state: DeliveryState, attempt: int, **extra: object) -> None:
            out.append(
                DeliveryTransitioned(
                    event_id=event_id(self._ms(), self._entropy()),
                    operation_id=op,
                    tenant_id=tenant,
                    actor_id=actor,
                    occurred_at=self._tick(),
                    attempt=attempt,
                    destination=destination,
                    state=state,
                    result_ref=result,
                    **extra,
                )
            )
            self._maybe_repeat(out)

        step(DeliveryState.PENDING, 0)
        attempt = 1
        step(DeliveryState.SENT, attempt)
        while rng.random() < mix.delivery_retry and attempt < 4:
            step(
                DeliveryState.PENDING,
                attempt,
                error="HTTP 503 from destination",
                next_attempt_at=self._now + timedelta(seconds=2**attempt),
            )
            attempt += 1
            step(DeliveryState.SENT, attempt)
        if rng.random() < mix.delivery_dead:
            step(DeliveryState.DEAD_LETTERED, attempt, error="destination rejected payload: 400")
        else:
            step(DeliveryState.ACKED, attempt)
        return out

    def operations(self, count: int) -> Iterator[list[Transition]]:
        for _ in range(count):
            yield self.operation()
