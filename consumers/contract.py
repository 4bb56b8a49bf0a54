"""The ``POST /events`` contract as a receiver reads it: the idempotency key, the body, the
fingerprint, and the RFC 9457 problem documents every refusal is answered with.

Nothing here does I/O: the receiver and the queue consumer both convert what arrives into an
:class:`Event` (or a :class:`ProblemError`) with these functions, and the unit tests check them
without a server.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from ledger.domain.events import ContentRef, Identifier, OperationId, ToolName
from ledger.domain.ids import content_ref
from ledger.domain.names import SHAPES, NameKind, is_name
from ledger.result_fetch import MAX_RESULT_BYTES

#: Largest body a receiver reads; a longer one is refused (413) before it is read.
MAX_BODY_BYTES = 1024 * 1024
IDEMPOTENCY_HEADER = "Idempotency-Key"
WEBHOOK_ID_HEADER = "webhook-id"
PROBLEM_CONTENT_TYPE = "application/problem+json"
#: Problem ``type`` URIs are tag URIs (RFC 4151), which RFC 9457 suggests for types that are
#: identifiers, not documentation pages: a client matches on them and never fetches them.
PROBLEM_TYPE_PREFIX = "tag:opledger,2025:problem:"
#: The 202 body: receipt of the delivery. It never says whether the change was applied.
DELIVERY_ACCEPTED = "accepted"


@dataclass(frozen=True, slots=True)
class Problem:
    """An RFC 9457 problem: ``slug`` names the ``type`` and is the metrics ``reason`` label."""

    status: int
    slug: str
    title: str
    detail: str
    retry_after_s: int | None = None

    def document(self) -> dict[str, Any]:
        return {
            "type": PROBLEM_TYPE_PREFIX + self.slug,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }

    def body(self) -> bytes:
        return json.dumps(self.document(), separators=(",", ":")).encode("utf-8")


class ProblemError(Exception):
    """A request (or queue record) refused with ``problem``; nothing was changed."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(f"{problem.status} {problem.slug}: {problem.detail}")
        self.problem = problem


def _refuse(status: int, slug: str, title: str, detail: str) -> ProblemError:
    return ProblemError(Problem(status, slug, title, detail))


# The titles are fixed per type (RFC 9457: the title does not change between occurrences);
# details say what was wrong with this request, never echoing the body or a secret.
def missing_key(detail: str = f"the {IDEMPOTENCY_HEADER} header is required") -> ProblemError:
    return _refuse(400, "missing-idempotency-key", "Idempotency-Key missing", detail)


def malformed_key(detail: str) -> ProblemError:
    return _refuse(400, "malformed-idempotency-key", "Idempotency-Key malformed", detail)


def missing_signature(detail: str) -> ProblemError:
    return _refuse(401, "missing-signature", "Signature missing", detail)


def bad_signature(detail: str) -> ProblemError:
    return _refuse(401, "bad-signature", "Signature invalid", detail)


def stale_signature(detail: str) -> ProblemError:
    return _refuse(401, "stale-signature", "Signature timestamp outside tolerance", detail)


def unsupported_media_type(detail: str) -> ProblemError:
    return _refuse(415, "unsupported-media-type", "Unsupported media type", detail)


def body_too_large(limit: int) -> ProblemError:
    return _refuse(413, "body-too-large", "Body too large", f"the body exceeds {limit} bytes")


def malformed_body(detail: str) -> ProblemError:
    return _refuse(400, "malformed-body", "Body is not a JSON object", detail)


def invalid_event(detail: str) -> ProblemError:
    return _refuse(422, "invalid-event", "Event invalid", detail)


def key_mismatch(detail: str) -> ProblemError:
    return _refuse(422, "key-mismatch", "Event does not match its key", detail)


def key_reused(operation_id: str) -> ProblemError:
    return _refuse(
        422,
        "key-reused",
        "Idempotency-Key reused with a different body",
        f"{operation_id} was accepted earlier with a different body (fingerprint differs); "
        "it is not applied again",
    )


def in_progress(operation_id: str) -> ProblemError:
    problem = Problem(
        409,
        "in-progress",
        "Request with this Idempotency-Key in progress",
        f"{operation_id} is being processed by another request; retry later",
        retry_after_s=1,
    )
    return ProblemError(problem)


def not_ready(detail: str) -> ProblemError:
    return ProblemError(Problem(503, "not-ready", "Receiver not ready", detail, retry_after_s=1))


def unavailable(detail: str) -> ProblemError:
    return ProblemError(
        Problem(503, "unavailable", "Receiver cannot record deliveries now", detail, 5)
    )


def result_unavailable(detail: str) -> ProblemError:
    return ProblemError(
        Problem(503, "result-unavailable", "Result delivered by reference not fetched", detail, 5)
    )


def http_problem(status: int, reason: str) -> Problem:
    """A problem for what the HTTP layer refuses by itself (404, 405...)."""
    slug = reason.lower().replace(" ", "-") or str(status)
    return Problem(status, slug, reason, f"{status} {reason}")


def parse_idempotency_key(values: Sequence[str]) -> str:
    """The operation id an ``Idempotency-Key`` carries: the Structured-Field string form
    (``"op_..."``, RFC 8941) or the bare form (``op_...``). Raises :class:`ProblemError`."""
    if not values or not "".join(values).strip(" \t"):
        raise missing_key()
    if len(values) > 1:
        raise malformed_key(f"{len(values)} {IDEMPOTENCY_HEADER} headers; send exactly one")
    raw = values[0].strip(" \t")  # RFC 8941 parsers drop surrounding spaces
    if raw.startswith('"'):
        inner = raw[1:-1] if len(raw) >= 2 and raw.endswith('"') else None
        # An operation id never needs an escape, so a backslash or inner quote means the
        # string is not one (and parameters after the closing quote are not accepted either).
        if inner is None or '"' in inner or "\\" in inner:
            raise malformed_key(
                f"{IDEMPOTENCY_HEADER} is not a Structured-Field string holding an operation id"
            )
        raw = inner
    if not is_name(NameKind.OPERATION_ID, raw):
        raise malformed_key(f"{IDEMPOTENCY_HEADER} is not an operation id (op_ + ULID)")
    return raw


def fingerprint(body: bytes) -> bytes:
    """sha256 of the raw body bytes: "same body" means these bytes, not the same JSON value."""
    return hashlib.sha256(body).digest()


def fingerprint_text(digest: bytes) -> str:
    return "sha256:" + digest.hex()


_ContentType = Annotated[
    str,
    StringConstraints(
        max_length=255,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*"
        r"(\s*;\s*[A-Za-z0-9!#$&^_.+-]+=(\"[^\"\r\n]*\"|[A-Za-z0-9!#$&^_.+-]+))*$",
    ),
]


#: The events' destination shape without their writer-side credential check: a receiver cannot
#: take a delivered value back, and the check showed up in profiles of the receiver's path.
_Destination = Annotated[
    str,
    StringConstraints(pattern=f"^{SHAPES[NameKind.DESTINATION]}$"),
]


_ResultUrl = Annotated[str, StringConstraints(max_length=2048, pattern=r"^https?://[!-~]+$")]


class EventBody(BaseModel):
    """The JSON object of ``POST /events`` (and of a queue record). Unknown members are
    ignored, so the sender may add fields without breaking receivers."""

    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)

    operation_id: OperationId
    tenant_id: Identifier
    tool_name: ToolName
    destination: _Destination
    result_ref: ContentRef
    content_type: _ContentType
    #: the result, inline; or, when it is too large to carry (decision 015), none of it here:
    #: ``result_url`` says where to fetch it and ``result_size`` how long it is.
    result_b64: str | None = None
    result_url: _ResultUrl | None = None
    result_size: Annotated[int, Field(ge=0, le=MAX_RESULT_BYTES)] | None = None


@dataclass(frozen=True, slots=True)
class Event:
    """One delivery as received: the checked body, its raw bytes' fingerprint, the result
    (None until a result delivered by reference is fetched: :meth:`with_result`)."""

    body: EventBody
    fingerprint: bytes
    result: bytes | None

    @property
    def operation_id(self) -> str:
        return self.body.operation_id

    def with_result(self, result: bytes) -> Event:
        """This event with its fetched result, checked against ``result_ref`` and the size.
        Raises :class:`ProblemError` (422): the bytes are not the result the event names."""
        if len(result) != self.body.result_size or content_ref(result) != self.body.result_ref:
            raise invalid_event("the fetched result is not the one result_ref names")
        return Event(self.body, self.fingerprint, result)


def _first_errors(exc: ValidationError, limit: int = 3) -> str:
    # loc and msg only: pydantic's "input" would echo the body.
    parts = []
    for error in exc.errors(include_url=False, include_input=False)[:limit]:
        where = ".".join(str(p) for p in error["loc"]) or "body"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def parse_event(
    raw: bytes, key: str, webhook_id: str | None, *, by_reference: bool = False
) -> Event:
    """The event ``raw`` carries, checked against its key (and ``webhook-id``, when the
    transport has one). Raises :class:`ProblemError`: 400 when it is not a JSON object,
    422 when it is one but not a valid event, or not the event its key names. A result by
    reference is accepted only where ``by_reference`` (its :attr:`Event.result` is None)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise malformed_body("the body is not UTF-8") from None
    try:
        body = EventBody.model_validate_json(text)
    except ValidationError as exc:
        kinds = {e["type"] for e in exc.errors()}
        if kinds & {"json_invalid", "json_type", "model_type", "model_attributes_type"}:
            raise malformed_body("the body is not a JSON object") from None
        raise invalid_event(_first_errors(exc)) from None
    if body.operation_id != key:
        raise key_mismatch(f"the body's operation_id is not the {IDEMPOTENCY_HEADER}")
    if webhook_id is not None and webhook_id != f"{key}:{body.destination}":
        raise key_mismatch(f"{WEBHOOK_ID_HEADER} is not '<operation_id>:<destination>' of the body")
    if body.result_url is not None:
        if not by_reference:
            raise invalid_event("result_url: results by reference are not taken here")
        if body.result_b64 is not None or body.result_size is None:
            raise invalid_event("result_url comes with result_size and without result_b64")
        return Event(body, fingerprint(raw), None)
    if body.result_b64 is None:
        raise invalid_event("result_b64: field required (or result_url and result_size)")
    if body.result_size is not None:
        raise invalid_event("result_size comes only with result_url")
    try:
        result = base64.b64decode(body.result_b64, validate=True)
    except (binascii.Error, ValueError):
        raise invalid_event("result_b64: not base64") from None
    if content_ref(result) != body.result_ref:
        raise invalid_event("result_ref is not the sha256 of the result")
    return Event(body, fingerprint(raw), result)


def accepted_document(operation_id: str) -> dict[str, str]:
    """The 202 body, the same for the first receipt and every duplicate."""
    return {"operation_id": operation_id, "delivery": DELIVERY_ACCEPTED}
