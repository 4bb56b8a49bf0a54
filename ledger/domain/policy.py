"""Policy: who may run which tool, to which destinations, with which credential, until when, and
whether a call whose outcome is unknown may be repeated. Pure: the grants are folded from the
policy topic elsewhere (``projections``) and handed in, with the time.

Policy is checked when a call is dispatched and again when an UNKNOWN outcome is reconciled
(the seed's rule 3): a request allowed at dispatch may be forbidden by the time it is
investigated. A decision says what is *allowed*; it never rewrites what *happened*.

Matching is most-specific-first (an actor's own grant before the tenant's ``*`` actor grant,
a named tool before ``*``), and the most specific grant decides, even when it is revoked:
a revocation for ``(acme, agent-7, send_email)`` is not overridden by a broader grant for
``(acme, *, send_email)``. No grant at all is a refusal (default deny). Grants and credential
revocations of another tenant never count.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from ledger.domain.ids import canonical_json

WILDCARD = "*"


class PolicyChange(StrEnum):
    """What a policy record does (mirrors ``schemas/policy_changed.avsc``)."""

    #: sets the grant of (tenant, principal, tool), replacing whatever it was
    GRANT = "GRANT"
    #: marks the grant of (tenant, principal, tool) revoked (also when there was none: a revoked
    #: specific grant is a refusal that no broader grant overrides)
    REVOKE = "REVOKE"
    #: the tenant's credential is revoked: every grant that names it refuses from now on
    REVOKE_CREDENTIAL = "REVOKE_CREDENTIAL"


# The policy topic is compacted: Kafka keeps the last record per key, so the key *is* the
# subject a record decides, and the projected state of a subject must depend on its last record
# only. Canonical JSON keeps the parts apart whatever they contain (tenant and actor ids may hold
# "/", ":" and "@"), so two subjects can never share a key and erase each other.
# These formats are durable contracts: records already on the topic carry them, and compaction
# would keep a grant under its old key alive beside its replacement. Never change them.


def grant_key(tenant_id: str, principal: str, tool_name: str) -> bytes:
    """The policy-topic key of the grant (tenant, principal, tool). Never change this format."""
    return canonical_json(["grant", tenant_id, principal, tool_name])


def credential_key(tenant_id: str, credential_id: str) -> bytes:
    """The policy-topic key of a tenant's credential revocation. Never change this format."""
    return canonical_json(["credential", tenant_id, credential_id])


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
class CredentialRevocation:
    """A tenant's credential, revoked. Credential ids are the tenant's own names: another
    tenant's revocation of the same id says nothing about this one's."""

    tenant_id: str
    credential_id: str
    #: event id of the REVOKE_CREDENTIAL record: the version a refusal because of it cites
    version: str


@dataclass(frozen=True, slots=True)
class PolicyRequest:
    tenant_id: str
    actor_id: str
    tool_name: str
    purpose: Purpose
    #: timezone-aware; expiries are instants
    now: datetime
    destination: str | None = None
    #: the scope the tool's provider needs from the credential, if it declares one
    required_scope: str | None = None
    #: the operation was cancelled by a person (``opledger ops cancel``)
    cancelled: bool = False

    def __post_init__(self) -> None:
        # A naive time cannot be compared with an expiry: refuse it here, where the mistake is
        # made, rather than fail inside evaluate only when some grant happens to expire.
        if self.now.tzinfo is None or self.now.utcoffset() is None:
            raise ValueError("PolicyRequest.now must be timezone-aware")


@dataclass(frozen=True, slots=True)
class PolicyDecision:
    allowed: bool
    reason: str
    #: the deciding policy record's event id (the grant's, or the credential revocation's);
    #: None when no grant matched
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
    revoked_credentials: Iterable[CredentialRevocation] = (),
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
        revocation = next(
            (
                r
                for r in revoked_credentials
                if r.tenant_id == grant.tenant_id and r.credential_id == grant.credential_id
            ),
            None,
        )
        if revocation is not None:
            return refuse(f"credential {grant.credential_id} was revoked", revocation.version)
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
