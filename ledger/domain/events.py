"""Events are values: frozen pydantic models, validated where they enter the system.

One record type per state machine, with the state it moved to. Field names and meanings follow
``schemas/*.avsc``; new fields must get defaults in both places so old events still read.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from ledger.domain.ids import EVENT_ID_SHAPE, SHA256_REF_SHAPE, canonical_json
from ledger.domain.names import SHAPES, NameKind
from ledger.domain.policy import WILDCARD, PolicyChange, credential_key, grant_key
from ledger.domain.reconcile import Decision, LookupStatus
from ledger.domain.redact import looks_secret
from ledger.domain.states import DeliveryState, ExecutionState

MAX_ERROR_LENGTH = 1000


#: The validation context a reader of the topics passes (``ledger.codec``): history is what it
#: is, and the credential check is the writers' job. Refusing an old event on replay would not
#: take a secret back; it would copy it to the dead letters.
READING = {"reading": True}


def _reading(info: ValidationInfo) -> bool:
    context = info.context
    return isinstance(context, dict) and bool(context.get("reading"))


def _no_secret(value: str | None, info: ValidationInfo) -> str | None:
    # Events are kept forever: a credential in an error text could never be taken back, so the
    # contract refuses it when the event is written.
    if value is not None and not _reading(info) and _holds_a_secret(value):
        raise ValueError("looks like it holds a credential; redact it before recording")
    return value


#: Texts up to this long have their verdict remembered (workers repeat the same reasons).
_REMEMBERED_TEXT = 512


def _holds_a_secret(text: str) -> bool:
    if len(text) <= _REMEMBERED_TEXT:
        return _remembered_verdict(text)
    return looks_secret(text)


@functools.lru_cache(maxsize=4096)
def _remembered_verdict(text: str) -> bool:
    return looks_secret(text)


def _no_named_secret(value: str | None, info: ValidationInfo) -> str | None:
    # Identifiers (a provider's call id, a destination) are random by nature, so only the shapes
    # that name a credential (keys, tokens, URLs with a password...) are refused in them.
    if value is not None and not _reading(info) and _names_a_secret(value):
        raise ValueError("looks like it holds a credential; redact it before recording")
    return value


@functools.lru_cache(maxsize=4096)
def _names_a_secret(identifier: str) -> bool:
    # A worker writes the same few destinations in every event: each is checked once.
    return looks_secret(identifier, heuristic=False)


Identifier = Annotated[str, StringConstraints(pattern=f"^{SHAPES[NameKind.TENANT]}$")]
ToolName = Annotated[str, StringConstraints(pattern=f"^{SHAPES[NameKind.TOOL]}$")]
Destination = Annotated[
    str,
    StringConstraints(pattern=f"^{SHAPES[NameKind.DESTINATION]}$"),
    AfterValidator(_no_named_secret),
]
OperationId = Annotated[str, StringConstraints(pattern=f"^{SHAPES[NameKind.OPERATION_ID]}$")]
EventId = Annotated[str, StringConstraints(pattern=f"^{EVENT_ID_SHAPE}$")]
ContentRef = Annotated[str, StringConstraints(pattern=f"^{SHA256_REF_SHAPE}$")]
ProviderRef = Annotated[
    str,
    StringConstraints(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@=+-]*$"),
    AfterValidator(_no_named_secret),
]


_PROVIDER_REF: TypeAdapter[str] = TypeAdapter(ProviderRef)
_DESTINATION: TypeAdapter[str] = TypeAdapter(Destination)


def recordable_destination(name: str) -> bool:
    """Whether a delivery event can carry ``name`` as its destination (the registry refuses
    what the contract would: a destination no event can name would wedge every outbox)."""
    try:
        _DESTINATION.validate_python(name)
    except ValidationError:
        return False
    return True


def recordable_provider_ref(ref: str | None) -> str | None:
    """A provider's own id for a call if an event can carry it, else None.

    The id comes from outside: one the contract refuses (a space, 300 characters, a credential's
    shape) must not make the call's outcome unrecordable once the effect has happened; the
    operation keeps the idempotency key it was dispatched with as its reference instead.
    """
    if ref is None:
        return None
    try:
        return _PROVIDER_REF.validate_python(ref)
    except ValidationError:
        return None


def storable_text(value: str) -> str:
    """``value`` with what no store can hold (U+0000, lone surrogates) replaced by U+FFFD.

    For text from outside that a worker records as it was said (a destination's answer, a
    provider's reason): the contract refuses such text in an event, and a worker that passed it
    on would fail on it at every attempt instead of recording it.
    """
    if storable_text_problem(value) is None:
        return value
    value = value.replace("\x00", "\ufffd")
    return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def storable_text_problem(value: str) -> str | None:
    """Why PostgreSQL (or any UTF-8 store) could never hold ``value``, or None if it can.

    PostgreSQL's ``text`` refuses U+0000, and a lone surrogate has no UTF-8 encoding; an event
    carrying either could be written to a topic but never projected, so the contract refuses it.
    """
    if "\x00" in value:
        return "text contains NUL (U+0000), which PostgreSQL cannot store"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "text contains a lone surrogate, which has no UTF-8 encoding"
    return None


def _storable(value: str) -> str:
    problem = storable_text_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


ErrorText = Annotated[
    str,
    StringConstraints(max_length=MAX_ERROR_LENGTH),
    AfterValidator(_storable),
    AfterValidator(_no_secret),
]


#: The instants an event may carry: those every reader can hold, whatever its time zone.
#: PostgreSQL stores far more, but returns a timestamptz in the session's zone (up to a day from
#: UTC), and Python's datetime ends at years 1 and 9999: an instant within a day of either end
#: is stored, then cannot be read back (psycopg refuses it), and the projector refuses every
#: later event of that operation.
EARLIEST = datetime.min.replace(tzinfo=UTC) + timedelta(days=1)
LATEST = datetime.max.replace(tzinfo=UTC) - timedelta(days=1)


def _aware(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("occurred_at must be timezone-aware")
    try:
        utc = value.astimezone(UTC)
    except OverflowError:  # not a ValueError: pydantic would let it escape unreported
        raise ValueError("timestamp outside the range of datetime in UTC") from None
    if not EARLIEST <= utc <= LATEST:
        raise ValueError(f"timestamp must lie between {EARLIEST} and {LATEST}")
    return utc


Timestamp = Annotated[datetime, AfterValidator(_aware)]


LeaseToken = Annotated[int, Field(ge=1, le=2**62)]


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", str_strip_whitespace=False)

    event_id: EventId
    operation_id: OperationId
    tenant_id: Identifier
    actor_id: Identifier
    occurred_at: Timestamp
    attempt: int = Field(ge=0, le=1_000_000)


class ExecutionTransitioned(_Event):
    """The execution of ``operation_id`` entered ``state``."""

    kind: Literal["execution"] = "execution"
    state: ExecutionState
    tool_name: ToolName
    request_hash: ContentRef
    provider_ref: ProviderRef | None = None
    result_ref: ContentRef | None = None
    error: ErrorText | None = None
    #: the writer's lease (fencing) token; None from writers that hold no lease
    lease_token: LeaseToken | None = None
    #: the ReconciliationDecided this transition carries out (its evidence)
    decision_id: EventId | None = None

    @model_validator(mode="after")
    def _state_needs(self) -> ExecutionTransitioned:
        if self.state is ExecutionState.INTENT_RECORDED and self.attempt != 0:
            raise ValueError("INTENT_RECORDED is attempt 0")
        # FAILED at attempt 0 is a refusal before any dispatch (INTENT_RECORDED -> FAILED in the
        # transition table); every other state belongs to a dispatch.
        refused = self.state is ExecutionState.FAILED and self.attempt == 0
        if self.state is not ExecutionState.INTENT_RECORDED and self.attempt < 1 and not refused:
            raise ValueError(f"{self.state} needs attempt >= 1 (the dispatch it belongs to)")
        if self.state is ExecutionState.SUCCEEDED and self.result_ref is None:
            raise ValueError("SUCCEEDED needs result_ref: the durable result must exist first")
        if self.state in (ExecutionState.FAILED, ExecutionState.UNKNOWN) and not self.error:
            raise ValueError(f"{self.state} needs an error saying why")
        return self


class DeliveryTransitioned(_Event):
    """The delivery of ``operation_id``'s result to ``destination`` entered ``state``."""

    kind: Literal["delivery"] = "delivery"
    destination: Destination
    state: DeliveryState
    result_ref: ContentRef | None = None
    next_attempt_at: Timestamp | None = None
    error: ErrorText | None = None

    @model_validator(mode="after")
    def _state_needs(self) -> DeliveryTransitioned:
        if self.state is DeliveryState.SENT and self.attempt < 1:
            raise ValueError("SENT needs attempt >= 1 (the send it records)")
        if self.state is DeliveryState.DEAD_LETTERED and not self.error:
            raise ValueError("DEAD_LETTERED needs an error saying why")
        return self


class OwnershipTaken(_Event):
    """A process took over ``operation_id`` under a new lease (``lease_token``). Appended before
    the new owner reads the operation's history: events with a lower token that come after it
    in the log are fenced, never applied."""

    kind: Literal["ownership"] = "ownership"
    lease_token: LeaseToken
    reason: ErrorText


class ReconciliationDecided(_Event):
    """A decision about an operation whose outcome was not known (or whose owner went away),
    with its evidence: what the provider lookup said, which policy version decided and why.
    ``attempt`` is the attempt the decision is about."""

    kind: Literal["decision"] = "decision"
    lease_token: LeaseToken | None = None
    decision: Decision
    lookup: LookupStatus
    provider_ref: ProviderRef | None = None
    result_ref: ContentRef | None = None
    policy_version: EventId | None = None
    policy_allowed: bool = False
    #: what the provider's terms declared: a repeat under the same key makes no second effect
    #: (None in decisions written before it was recorded)
    provider_repeat_safe: bool | None = None
    reason: ErrorText

    @model_validator(mode="after")
    def _decision_needs(self) -> ReconciliationDecided:
        if self.decision is Decision.MARK_SUCCEEDED and self.result_ref is None:
            raise ValueError("MARK_SUCCEEDED needs the recovered result_ref, stored first")
        if self.decision is Decision.NEW_ATTEMPT and not self.policy_allowed:
            raise ValueError("NEW_ATTEMPT needs policy_allowed: only policy permits a repeat")
        if self.decision is Decision.NEW_ATTEMPT and self.provider_repeat_safe is False:
            raise ValueError(
                "NEW_ATTEMPT needs a repeat-safe provider: a not-found can be overtaken by the "
                "call still in flight, and only the provider's deduplication makes that one effect"
            )
        return self


Transition = ExecutionTransitioned | DeliveryTransitioned
#: What the execution topic carries besides transitions: who owns an operation, and decisions.
Control = OwnershipTaken | ReconciliationDecided
#: Everything keyed by operation_id on the execution and delivery topics.
OperationEvent = Transition | Control


#: Most destinations or credential scopes one grant may list: a grant is read on every dispatch,
#: and a list this long is a sign of a mistake, not of a policy.
MAX_POLICY_LIST = 64

Principal = Annotated[
    str,
    StringConstraints(pattern=f"^(?:\\*|{SHAPES[NameKind.ACTOR]})$"),
]
ToolOrWildcard = Annotated[str, StringConstraints(pattern=f"^(?:\\*|{SHAPES[NameKind.TOOL]})$")]
#: A credential's name in the tenant's secret store, never the secret itself.
CredentialId = Annotated[
    str,
    StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/-]*$"),
    AfterValidator(_no_named_secret),
]
Scope = Annotated[
    str,
    StringConstraints(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]*$"),
    AfterValidator(_no_named_secret),
]


def _distinct(values: tuple[str, ...]) -> tuple[str, ...]:
    if len(set(values)) != len(values):
        raise ValueError("lists each value more than once")
    return values


#: ``ed25519:`` and the first 16 bytes of SHA-256 of the raw public key, in hex.
SigningKeyId = Annotated[str, StringConstraints(pattern=r"^ed25519:[0-9a-f]{32}$")]
#: An Ed25519 signature (64 bytes) as unpadded URL-safe base64.
SignatureText = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{86}$")]


def _micros(moment: datetime | None) -> int | None:
    if moment is None:
        return None
    return (moment - _EPOCH) // timedelta(microseconds=1)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def policy_signed_bytes(
    *,
    event_id: str,
    tenant_id: str,
    actor_id: str,
    occurred_at: datetime,
    change: str,
    principal: str,
    tool_name: str,
    destinations: Sequence[str],
    repeat_safe: bool,
    expires_at: datetime | None,
    credential_id: str | None,
    credential_scopes: Sequence[str],
    credential_expires_at: datetime | None,
    reason: str | None,
    signed_by: str | None,
) -> bytes:
    """The bytes a policy change's signature covers, from its fields: the record's, or a
    projected row's (``ledger.policy_store`` checks those again). Instants count in
    microseconds, as Avro and PostgreSQL keep them. Never change this format."""
    return canonical_json(
        [
            "opledger.policy.v1",
            event_id,
            tenant_id,
            actor_id,
            _micros(occurred_at),
            change,
            principal,
            tool_name,
            list(destinations),
            repeat_safe,
            _micros(expires_at),
            credential_id,
            list(credential_scopes),
            _micros(credential_expires_at),
            reason,
            signed_by,
        ]
    )


class PolicyChanged(BaseModel):
    """A change of a tenant's policy, keyed on the compacted policy topic by its subject
    (:meth:`subject_key`): a grant of ``tool_name`` to ``principal`` (GRANT), its revocation
    (REVOKE), or the revocation of a credential (REVOKE_CREDENTIAL, principal and tool ``*``).

    A record states the whole new state of its subject, never a difference from the previous
    one: compaction keeps only the last record per key, and a replay of the compacted topic must
    rebuild the same policy.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", str_strip_whitespace=False)

    kind: Literal["policy"] = "policy"
    event_id: EventId
    tenant_id: Identifier
    #: who changed the policy (a person or a process), not whom it is about
    actor_id: Identifier
    occurred_at: Timestamp
    change: PolicyChange
    principal: Principal
    tool_name: ToolOrWildcard
    destinations: Annotated[
        tuple[Destination, ...], Field(max_length=MAX_POLICY_LIST), AfterValidator(_distinct)
    ] = ()
    repeat_safe: bool = False
    expires_at: Timestamp | None = None
    credential_id: CredentialId | None = None
    credential_scopes: Annotated[
        tuple[Scope, ...], Field(max_length=MAX_POLICY_LIST), AfterValidator(_distinct)
    ] = ()
    credential_expires_at: Timestamp | None = None
    reason: ErrorText | None = None
    #: the id of the operator key that signed the change (decision 032); None: unsigned, refused
    signed_by: SigningKeyId | None = None
    #: the key's Ed25519 signature over :meth:`signed_bytes`, unpadded URL-safe base64
    signature: SignatureText | None = None

    @model_validator(mode="after")
    def _change_needs(self) -> PolicyChanged:
        grant_content = {
            "destinations": bool(self.destinations),
            "repeat_safe": self.repeat_safe,
            "expires_at": self.expires_at is not None,
            "credential_scopes": bool(self.credential_scopes),
            "credential_expires_at": self.credential_expires_at is not None,
        }
        if self.change is PolicyChange.GRANT:
            if self.credential_id is None:
                for name in ("credential_scopes", "credential_expires_at"):
                    if grant_content[name]:
                        raise ValueError(f"{name} needs credential_id (the credential it is of)")
            return self
        # A revocation carries nothing of a grant: it would be ignored, and a reader could take
        # it for part of the policy.
        present = [name for name, given in grant_content.items() if given]
        if present:
            raise ValueError(f"{self.change} carries no grant content, got {', '.join(present)}")
        if self.change is PolicyChange.REVOKE:
            if self.credential_id is not None:
                raise ValueError("REVOKE names no credential (REVOKE_CREDENTIAL revokes one)")
            return self
        if self.credential_id is None:
            raise ValueError("REVOKE_CREDENTIAL needs credential_id")
        if self.principal != WILDCARD or self.tool_name != WILDCARD:
            raise ValueError("REVOKE_CREDENTIAL applies to every grant: principal and tool '*'")
        return self

    def signed_bytes(self) -> bytes:
        """What the operator's key signs: every field of the change but the signature, the key id
        included (a signature cannot be moved to another key's name). Never change this format:
        changes on the topic were signed over it."""
        return policy_signed_bytes(
            event_id=self.event_id,
            tenant_id=self.tenant_id,
            actor_id=self.actor_id,
            occurred_at=self.occurred_at,
            change=self.change.value,
            principal=self.principal,
            tool_name=self.tool_name,
            destinations=self.destinations,
            repeat_safe=self.repeat_safe,
            expires_at=self.expires_at,
            credential_id=self.credential_id,
            credential_scopes=self.credential_scopes,
            credential_expires_at=self.credential_expires_at,
            reason=self.reason,
            signed_by=self.signed_by,
        )

    def subject_key(self) -> bytes:
        """The record's key on the policy topic: the subject it decides."""
        if self.change is PolicyChange.REVOKE_CREDENTIAL:
            assert self.credential_id is not None  # the model validator guarantees it
            return credential_key(self.tenant_id, self.credential_id)
        return grant_key(self.tenant_id, self.principal, self.tool_name)


#: Every record a topic of opledger carries: operation events, and policy changes.
LedgerEvent = OperationEvent | PolicyChanged
