"""Policy: who may run which tool, to which destinations, with which credential, until when, and
whether a call whose outcome is unknown may be repeated. Pure: the grants are folded from the
policy topic elsewhere and handed in, with the time.

Policy is checked when a call is dispatched and again when an UNKNOWN outcome is reconciled
(the seed's rule 3): a request allowed at dispatch may be forbidden by the time it is
investigated. A decision says what is *allowed*; it never rewrites what *happened*.

Matching is most-specific-first, and the most specific grant decides, even when it is revoked:
a revocation for ``(acme, agent-7, send_email)`` is not overridden by a broader grant for
``(acme, *, send_email)``. No grant at all is a refusal (default deny).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

WILDCARD = "*"


class Purpose(StrEnum):
    """What the caller wants to do, which decides what is checked."""

    DISPATCH = "dispatch"  # a first call of the tool
    NEW_ATTEMPT = "new_attempt"  # calling again after the outcome of an earlier call was lost
    DELIVER = "deliver"  # sending a result to a destination


@dataclass(frozen=True, slots=True)
class Grant:
    """The current state of one grant (tenant, principal, tool), as the policy topic left it."""

    tenant_id: str
    principal: str  # an actor id, or "*"
    tool_name: str  # a tool name, or "*"
    revoked: bool
    #: event id of the policy record that set this state: the "policy version" a decision cites
    version: str
    destinations: frozenset[str] = frozenset()
    #: the tenant says a call that may or may not have happened can be made again
    repeat_safe: bool = False
    expires_at: datetime | None = None
    credential_id: str | None = None
    credential_scopes: frozenset[str] = frozenset()
    credential_expires_at: datetime | None = None

    def specificity(self) -> int:
        return (self.principal != WILDCARD) * 2 + (self.tool_name != WILDCARD)


@dataclass(frozen=True, slots=True)
class PolicyRequest:
    tenant_id: str
    actor_id: str
    tool_name: str
    purpose: Purpose
    now: datetime
    destination: str | None = None
    #: the scope the tool's provider needs from the credential, if it declares one
    required_scope: str | None = None
    #: the operation was cancelled by a person (``opledger ops cancel``)
    cancelled: bool = False


@dataclass(frozen=True, slots=True)
class PolicyDecision:
    allowed: bool
    reason: str
    #: the deciding grant's version (a policy event id); None when no grant matched
    version: str | None = None
    checks: tuple[str, ...] = field(default=())


def matching_grant(grants: Iterable[Grant], request: PolicyRequest) -> Grant | None:
    """The most specific grant for the request's tenant, actor and tool."""
    best: Grant | None = None
    for grant in grants:
        if grant.tenant_id != request.tenant_id:
            continue
        if grant.principal not in (request.actor_id, WILDCARD):
            continue
        if grant.tool_name not in (request.tool_name, WILDCARD):
            continue
        if best is None or grant.specificity() > best.specificity():
            best = grant
    return best


def evaluate(
    grants: Iterable[Grant],
    request: PolicyRequest,
    revoked_credentials: frozenset[str] = frozenset(),
) -> PolicyDecision:
    """Whether ``request`` is allowed now, and why (the reason names the failing check)."""
    checks: list[str] = []

    def refuse(reason: str, version: str | None) -> PolicyDecision:
        return PolicyDecision(False, reason, version, tuple(checks))

    if request.cancelled:
        return refuse("the operation was cancelled", None)
    grant = matching_grant(grants, request)
    if grant is None:
        return refuse(f"no grant lets actor {request.actor_id} use tool {request.tool_name}", None)
    checks.append("tenant, actor and tool")
    if grant.revoked:
        return refuse("the grant for this actor and tool was revoked", grant.version)
    if grant.expires_at is not None and request.now >= grant.expires_at:
        return refuse(f"the grant expired at {grant.expires_at.isoformat()}", grant.version)
    checks.append("grant not expired")
    if grant.credential_id is not None:
        if grant.credential_id in revoked_credentials:
            return refuse(f"credential {grant.credential_id} was revoked", grant.version)
        if grant.credential_expires_at is not None and request.now >= grant.credential_expires_at:
            return refuse(f"credential {grant.credential_id} expired", grant.version)
        checks.append("credential valid")
    if request.required_scope is not None:
        if request.required_scope not in grant.credential_scopes:
            return refuse(
                f"the credential does not carry scope {request.required_scope}", grant.version
            )
        checks.append("credential scope")
    if request.purpose is Purpose.DELIVER:
        if request.destination is None or request.destination not in grant.destinations:
            return refuse(
                f"destination {request.destination} is not allowed for this tool", grant.version
            )
        checks.append("destination")
    if request.purpose is Purpose.NEW_ATTEMPT:
        if not grant.repeat_safe:
            return refuse(
                "policy does not say a repeat of this tool is safe (grant without repeat_safe)",
                grant.version,
            )
        checks.append("repeat allowed")
    return PolicyDecision(True, "allowed by " + ", ".join(checks), grant.version, tuple(checks))
