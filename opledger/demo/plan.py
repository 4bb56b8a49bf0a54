"""What the demo runs, as data: three tenants' tool calls split over three services, the crash
each service suffers, where results go, and how the fake provider behaves. Seeded; no I/O."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opledger.fakes.providers import DEMO_TOOLS

TENANTS = ("acme", "globex", "initech")
ACTORS = tuple(f"agent-{n}" for n in range(1, 9))
#: The demo's tools: whether the provider deduplicates a repeated key, which is also what the
#: grants say about repeating a call whose outcome was lost.
TOOLS: Mapping[str, bool] = DEMO_TOOLS
SERVICES = 3

#: Destination names, as events, grants and metrics show them.
WEBHOOK = "crm"  # every tool's results, POSTed to the reference consumer
QUEUE = "billing"  # QUEUE_TOOLS' results, appended to a Kafka topic read by `consumer queue`
UNPERMITTED = "archive"  # configured for initech's post_slack_message; no grant lists it
QUEUE_TOOLS = ("charge_card", "create_invoice")
#: The name the queue's consumer keeps its inbox under (the receiver's is OPLEDGER_CONSUMER_NAME).
QUEUE_CONSUMER = "billing"
#: A destination's request timeout: a send whose outcome was lost is sent again this long (plus
#: the delivery worker's margin) after it left.
DESTINATION_TIMEOUT_MS = 2000


def queue_topic(topic_prefix: str) -> str:
    return f"{topic_prefix}.demo-billing.v1"


@dataclass(frozen=True, slots=True)
class Route:
    """One configured destination of one tenant."""

    tenant_id: str
    name: str
    tools: tuple[str, ...]  # or ("*",)


ROUTES: tuple[Route, ...] = (
    *(Route(t, WEBHOOK, ("*",)) for t in TENANTS),
    *(Route(t, QUEUE, QUEUE_TOOLS) for t in TENANTS),
    Route("initech", UNPERMITTED, ("post_slack_message",)),
)


def routed(tenant_id: str, tool_name: str) -> set[str]:
    """The destinations the outbox opens a delivery to for a SUCCEEDED call."""
    return {
        r.name
        for r in ROUTES
        if r.tenant_id == tenant_id and ("*" in r.tools or tool_name in r.tools)
    }


def granted_destinations(tool_name: str) -> tuple[str, ...]:
    """What the grants let a tool's results be delivered to (never UNPERMITTED)."""
    return (WEBHOOK, QUEUE) if tool_name in QUEUE_TOOLS else (WEBHOOK,)


@dataclass(frozen=True, slots=True)
class ToolMix:
    """One tool's behaviour at the fake provider (``FakeProviderControl.configure``)."""

    mode: str = "idempotent"
    fail_rate: float = 0.0
    lose_response_rate: float = 0.0
    lookup_unavailable_rate: float = 0.0
    latency_ms: float = 0.0
    attachment_rate: float = 0.0


PROVIDER_MIX: Mapping[str, ToolMix] = {
    # One in ten carries a 600 KiB attachment: delivered by reference (decision 015).
    "send_email": ToolMix(fail_rate=0.08, lose_response_rate=0.06, attachment_rate=0.1),
    # The slow one: every call and lookup takes 400 ms, well inside the 5 s call timeout. One
    # invoice in ten carries a 600 KiB PDF: by reference to the webhook and, with its fetch
    # secret, to the billing queue too (decision 016).
    "create_invoice": ToolMix(
        fail_rate=0.05, lose_response_rate=0.05, latency_ms=400, attachment_rate=0.1
    ),
    # Its lookups are sometimes unavailable: reconciliation asks again later, never calls.
    "post_slack_message": ToolMix(
        fail_rate=0.05, lose_response_rate=0.08, lookup_unavailable_rate=0.25
    ),
    # Not idempotent: every call is a new charge, even with a key the provider saw before.
    "charge_card": ToolMix(mode="non_idempotent", fail_rate=0.10, lose_response_rate=0.06),
}


@dataclass(frozen=True, slots=True)
class Call:
    tenant_id: str
    actor_id: str
    tool_name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)

    @property
    def subject(self) -> tuple[str, str, str]:
        return (self.tenant_id, self.actor_id, self.tool_name)

    def to_json(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant_id,
            "actor": self.actor_id,
            "tool": self.tool_name,
            "arguments": dict(self.arguments),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Call:
        return cls(str(raw["tenant"]), str(raw["actor"]), str(raw["tool"]), raw["arguments"])


#: The grant revoked mid-run (seed row 6). Its actor appears only here and late in the plans.
REVOKED = ("globex", "agent-9", "send_email")


@dataclass(frozen=True, slots=True)
class Crash:
    """A service SIGKILLs itself the ``nth`` time it reaches fault point ``point``."""

    service: int  # 0-based
    point: str
    nth: int
    #: what the victim calls; placed where the crash happens, so it is known before the run
    victim: tuple[str, str, str] | None
    #: revoke the victim's grant once it is dead (before anyone reconciles it)
    revoke: bool
    #: what recovery should make of the victim (shown next to what it did)
    expect: str

    @property
    def fault(self) -> str:
        return f"{self.point}:kill@{self.nth}"


@dataclass(frozen=True, slots=True)
class Plan:
    services: tuple[tuple[Call, ...], ...]
    crashes: tuple[Crash, ...]

    @property
    def operations(self) -> int:
        return sum(len(s) for s in self.services)


def make_plan(operations: int, seed: int, nonce: int) -> Plan:
    """``operations`` calls over :data:`SERVICES` services, each service crashing once.

    ``nonce`` goes into every call's arguments, so the request hashes of two runs differ as
    real requests would (operation ids are fresh ULIDs anyway).
    """
    if operations < 10 * SERVICES:
        raise ValueError(f"the demo needs at least {10 * SERVICES} operations")
    rng = random.Random(seed)
    calls = [
        Call(
            rng.choice(TENANTS),
            rng.choice(ACTORS),
            rng.choice(list(TOOLS)),
            {
                "to": f"user{rng.randint(1, 999)}@example.com",
                "amount_cents": rng.randint(100, 100_000),
                "run": nonce,
                "n": n,
            },
        )
        for n in range(operations)
    ]
    shares = [calls[i::SERVICES] for i in range(SERVICES)]
    nth = max(2, len(shares[0]) // 5)
    crashes = (
        Crash(
            0,
            "execute.after_dispatch_before_call",
            nth,
            victim=("acme", "agent-3", "send_email"),
            revoke=False,
            expect="no call was made and the grant allows a repeat: NEW_ATTEMPT, one call",
        ),
        Crash(
            1,
            "producer.after_result_write_before_record",
            nth,
            victim=None,
            revoke=False,
            expect="the provider did it: the lookup finds it, MARK_SUCCEEDED, no second call",
        ),
        Crash(
            2,
            "execute.after_dispatch_before_call",
            nth,
            victim=REVOKED,
            revoke=True,
            expect="no call was made, but the grant is revoked now: REFUSE, parked, no call",
        ),
    )
    for crash in crashes:
        if crash.victim is not None:
            _place(shares[crash.service], crash.nth - 1, crash.victim)
    # Late calls of the revoked subject: refused at dispatch once the revocation is in effect.
    for share in shares:
        for at in (int(len(share) * 0.7), int(len(share) * 0.9)):
            _place(share, at, REVOKED)
    return Plan(tuple(tuple(s) for s in shares), crashes)


def _place(share: list[Call], index: int, subject: tuple[str, str, str]) -> None:
    tenant, actor, tool = subject
    share[index] = Call(tenant, actor, tool, share[index].arguments)


def crash_of(plan: Plan, service: int) -> Crash | None:
    return next((c for c in plan.crashes if c.service == service), None)
