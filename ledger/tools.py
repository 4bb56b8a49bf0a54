"""Tools as adapters: what the SDK and the recovery worker need from a provider.

A :class:`Provider` wraps one side-effecting tool behind an idempotency key. The key is the
operation id (``ledger.domain.ids.idempotency_key``) and is passed on every call and lookup, so a
provider that deduplicates keys turns a repeated call into a no-op and can be asked what became of
a call whose response was lost. What the provider promises is declared in its
:class:`ProviderTerms`; reconciliation relies on it (a not-found older than ``key_retention``
proves nothing).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeGuard, runtime_checkable

from ledger.domain.call import CallOutcome
from ledger.domain.reconcile import LookupStatus

__all__ = [
    "AsyncProvider",
    "CallOutcome",
    "ContactLost",
    "LookupResult",
    "LookupStatus",
    "Provider",
    "ProviderTerms",
    "is_async",
]


class ContactLost(Exception):  # noqa: N818  # named for what happened, not for a bug of ours
    """The call was (or may have been) made, and its outcome is unknown: a timeout, a reset, a
    response that never came or could not be read. The caller records UNKNOWN and reconciles;
    it never calls again on its own."""


@dataclass(frozen=True, slots=True)
class ProviderTerms:
    """What a provider promises, which reconciliation and leases rely on."""

    #: how long a call may take; the caller gives up (outcome unknown) after it, and the lease
    #: and the UNKNOWN detector are sized from it
    call_timeout: timedelta
    #: how long the provider remembers an idempotency key: a lookup that finds nothing proves
    #: the call did not happen only within this window
    key_retention: timedelta
    #: a repeat with the same key is deduplicated by the provider (no second side effect); the
    #: recovery worker makes a new attempt after a not-found only when this and the policy
    #: grant's ``repeat_safe`` both say so, and records both in its decision
    #: (``ledger.domain.reconcile.decide``)
    repeat_safe: bool
    #: the credential scope this tool needs (checked against the policy grant), if any
    required_scope: str | None = None


@dataclass(frozen=True, slots=True)
class LookupResult:
    """What the provider knows about an idempotency key."""

    status: LookupStatus
    result: bytes | None = None
    content_type: str = "application/json"
    #: why it failed (FOUND_FAILED) or could not answer (UNAVAILABLE)
    reason: str | None = None
    provider_ref: str | None = None


@runtime_checkable
class Provider(Protocol):
    """One tool behind an idempotency key (synchronous)."""

    tool_name: str
    terms: ProviderTerms

    def call(self, request: Any, idempotency_key: str) -> CallOutcome:
        """Make the call once per key. Raise :class:`ContactLost` when the outcome is unknown
        (any other exception after the request may have left is treated the same way)."""
        ...

    def lookup(self, idempotency_key: str, provider_ref: str | None) -> LookupResult:
        """What became of the call with this key. Never raises for "I cannot tell": that is
        ``UNAVAILABLE``."""
        ...


@runtime_checkable
class AsyncProvider(Protocol):
    """:class:`Provider` for asyncio runtimes: the same promises, awaited. The asyncio recorder
    bounds each ``call`` by ``terms.call_timeout`` itself (an unanswered call is
    :class:`ContactLost`)."""

    tool_name: str
    terms: ProviderTerms

    async def call(self, request: Any, idempotency_key: str) -> CallOutcome: ...

    async def lookup(self, idempotency_key: str, provider_ref: str | None) -> LookupResult: ...


def is_async(provider: Provider | AsyncProvider) -> TypeGuard[AsyncProvider]:
    """Whether ``provider`` is an :class:`AsyncProvider` (its ``call`` is a coroutine function).
    ``isinstance`` cannot tell: a runtime-checkable protocol checks only that the names exist."""
    return inspect.iscoroutinefunction(provider.call)
