"""What the reference executor talks to: a tool provider and downstream destinations, as
protocols, with in-memory fakes that count side effects.

The fakes are the seed's test harness: "a fake tool that records every received idempotency
key", so a run can assert that one logical operation produced at most one side effect, and a
destination that deduplicates on ``operation_id`` ("make the consumer idempotent too").
"""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from ledger.domain.ids import request_hash


class ResponseLost(Exception):  # noqa: N818  # named for what happened; it is not a bug of ours
    """The request reached the provider but its response never came back.

    The side effect may (and in :class:`FakeProvider` does) have happened: the caller must
    record UNKNOWN and reconcile, never call again blindly.
    """


class IdempotencyConflictError(ValueError):
    """A known idempotency key arrived with a different request (a caller bug, never retried)."""


@dataclass(frozen=True, slots=True)
class ProviderResponse:
    """What the provider confirmed about one call.

    ``succeeded`` False is a *confirmed* failure: the provider says the side effect did not
    happen. A call whose outcome is not known raises instead of returning.
    """

    idempotency_key: str
    succeeded: bool
    result: bytes | None = None
    error: str | None = None
    content_type: str = "application/json"


class ToolProvider(Protocol):
    """A side-effecting tool behind an idempotency key."""

    def call(self, tool_name: str, arguments: Any, idempotency_key: str) -> ProviderResponse:
        """Perform the call once per key; a repeated key returns the first outcome.

        Raises :class:`ResponseLost` (or any other exception) when the outcome is unknown.
        """
        ...

    def lookup(self, idempotency_key: str) -> ProviderResponse | None:
        """What the provider knows about ``idempotency_key`` (None: it never saw it).

        Reconciliation of an UNKNOWN operation starts here.
        """
        ...


@dataclass(frozen=True, slots=True)
class DeliveryReceipt:
    """A destination's answer: an HTTP-like status and whether it had seen the operation."""

    status: int
    duplicate: bool = False

    @property
    def accepted(self) -> bool:
        """2xx: the destination acknowledged receipt (not execution - that is already known)."""
        return 200 <= self.status < 300


class Destination(Protocol):
    """A downstream consumer of results, deduplicating on ``operation_id``."""

    name: str

    def deliver(self, operation_id: str, result_ref: str) -> DeliveryReceipt:
        """Hand over the result reference; raise or return non-2xx when not acknowledged."""
        ...


class Outcome(Enum):
    """What the fake provider does with a new key."""

    SUCCEED = "succeed"
    FAIL = "fail"
    #: the side effect happens, then the response is lost
    LOSE_RESPONSE = "lose_response"


class FakeProvider:
    """An in-memory idempotent provider that counts side effects per idempotency key.

    New keys succeed, fail (confirmed, no side effect) or lose their response after the side
    effect, by the given rates, drawn from a seeded generator. A repeated key with the same
    request replays the first outcome without a second side effect (and is counted in
    ``duplicate_keys_seen``). Thread-safe.
    """

    def __init__(
        self, *, failure_rate: float = 0.10, lost_rate: float = 0.08, seed: int = 0
    ) -> None:
        if failure_rate < 0 or lost_rate < 0 or failure_rate + lost_rate > 1:
            raise ValueError("rates must be non-negative and add up to at most 1")
        self._failure_rate = failure_rate
        self._lost_rate = lost_rate
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        # key -> (request hash, response): what a lookup or a repeated key gets back
        self._known: dict[str, tuple[str, ProviderResponse]] = {}
        self._side_effects: Counter[str] = Counter()
        self._received: list[str] = []
        self.duplicate_keys_seen = 0

    def _draw(self) -> Outcome:
        roll = self._rng.random()
        if roll < self._failure_rate:
            return Outcome.FAIL
        if roll < self._failure_rate + self._lost_rate:
            return Outcome.LOSE_RESPONSE
        return Outcome.SUCCEED

    def call(self, tool_name: str, arguments: Any, idempotency_key: str) -> ProviderResponse:
        """See :meth:`ToolProvider.call`."""
        fingerprint = request_hash(tool_name, arguments)
        with self._lock:
            self._received.append(idempotency_key)
            known = self._known.get(idempotency_key)
            if known is not None:
                self.duplicate_keys_seen += 1
                if known[0] != fingerprint:
                    raise IdempotencyConflictError(
                        f"idempotency key {idempotency_key} was used for another request"
                    )
                return known[1]
            outcome = self._draw()
            if outcome is Outcome.FAIL:
                response = ProviderResponse(
                    idempotency_key, succeeded=False, error=f"{tool_name} rejected: HTTP 422"
                )
            else:
                self._side_effects[idempotency_key] += 1
                body = {"tool": tool_name, "idempotency_key": idempotency_key, "status": "done"}
                response = ProviderResponse(
                    idempotency_key,
                    succeeded=True,
                    result=json.dumps(body, sort_keys=True).encode("utf-8"),
                )
            self._known[idempotency_key] = (fingerprint, response)
        if outcome is Outcome.LOSE_RESPONSE:
            raise ResponseLost(f"connection reset after dispatch of {tool_name}")
        return response

    def lookup(self, idempotency_key: str) -> ProviderResponse | None:
        """See :meth:`ToolProvider.lookup`."""
        with self._lock:
            known = self._known.get(idempotency_key)
        return None if known is None else known[1]

    @property
    def received_keys(self) -> list[str]:
        """Every idempotency key received, in arrival order, repeats included."""
        with self._lock:
            return list(self._received)

    def side_effects(self) -> dict[str, int]:
        """Side effects performed per idempotency key (keys without one are absent)."""
        with self._lock:
            return dict(self._side_effects)

    def max_side_effects_per_key(self) -> int:
        """The seed's invariant: this must never exceed 1."""
        with self._lock:
            return max(self._side_effects.values(), default=0)


class FakeDestination:
    """An in-memory downstream consumer that deduplicates on ``operation_id``.

    Each delivery fails with 503 at ``failure_rate`` (nothing accepted). At ``ack_lost_rate``
    the result is accepted but the acknowledgement is lost (504): the sender retries, and the
    retry is recognised as a duplicate - the consumer-side half of "at most one change".
    Thread-safe.
    """

    def __init__(
        self, name: str, failure_rate: float = 0.1, *, ack_lost_rate: float = 0.0, seed: int = 0
    ) -> None:
        if failure_rate < 0 or ack_lost_rate < 0 or failure_rate + ack_lost_rate > 1:
            raise ValueError("rates must be non-negative and add up to at most 1")
        self.name = name
        self._failure_rate = failure_rate
        self._ack_lost_rate = ack_lost_rate
        self._rng = random.Random(f"{seed}:{name}")
        self._lock = threading.Lock()
        self._accepted: dict[str, str] = {}
        self.attempts = 0
        self.duplicates_seen = 0

    def deliver(self, operation_id: str, result_ref: str) -> DeliveryReceipt:
        """See :meth:`Destination.deliver`."""
        with self._lock:
            self.attempts += 1
            roll = self._rng.random()
            if roll < self._failure_rate:
                return DeliveryReceipt(503)
            duplicate = operation_id in self._accepted
            if duplicate:
                self.duplicates_seen += 1
            else:
                # Persist the key before applying the change (here both are this one write).
                self._accepted[operation_id] = result_ref
            if roll < self._failure_rate + self._ack_lost_rate:
                return DeliveryReceipt(504, duplicate)
            return DeliveryReceipt(202, duplicate)

    @property
    def accepted(self) -> dict[str, str]:
        """operation_id -> result_ref of everything accepted (each once)."""
        with self._lock:
            return dict(self._accepted)
