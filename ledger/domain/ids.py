"""The one place each key is built. The formats here are durable contracts: operation ids and
request hashes are stored in topics that auditors replay for years, and consumers deduplicate on
them. Never change a format; add a new function instead."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
ULID_PATTERN = r"[0-9A-HJKMNP-TV-Z]{26}"
OPERATION_ID_SHAPE = rf"op_{ULID_PATTERN}"
EVENT_ID_SHAPE = rf"ev_{ULID_PATTERN}"
SHA256_REF_SHAPE = r"sha256:[0-9a-f]{64}"
# \Z, not $: "$" also matches before a final newline. Each pattern matches a whole id with
# .match as with .fullmatch; pydantic's fields anchor the shapes themselves (its regex engine
# has no \Z).
OPERATION_ID_RE = re.compile(rf"{OPERATION_ID_SHAPE}\Z")
EVENT_ID_RE = re.compile(rf"{EVENT_ID_SHAPE}\Z")
SHA256_REF_RE = re.compile(rf"{SHA256_REF_SHAPE}\Z")


class IdError(ValueError):
    """A clock reading or entropy that cannot make a valid id."""


def ulid(now_ms: int, entropy: bytes) -> str:
    """A ULID: 48-bit millisecond time, then 80 random bits, in Crockford base32; sorts by time."""
    if not 0 <= now_ms < 2**48:
        raise IdError(f"timestamp out of ULID range: {now_ms}")
    if len(entropy) != 10:
        raise IdError(f"ULID needs exactly 10 bytes of entropy, got {len(entropy)}")
    value = (now_ms << 80) | int.from_bytes(entropy, "big")
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def operation_id(now_ms: int, entropy: bytes) -> str:
    """``op_`` + ULID: the key providers and consumers dedupe on. Never change this format."""
    return f"op_{ulid(now_ms, entropy)}"


def event_id(now_ms: int, entropy: bytes) -> str:
    """``ev_`` + ULID; unique per appended event (a retried append gets a new one)."""
    return f"ev_{ulid(now_ms, entropy)}"


def derived_event_id(now_ms: int, *parts: str) -> str:
    """An event id that is the same every time it is derived from the same parts: what a
    processor uses for an event it may write again after a crash (the outbox's PENDINGs, a
    redrive), so that the repeat is recognised as the same event. Never change this format."""
    digest = hashlib.sha256("\x1f".join(parts).encode("utf-8")).digest()
    return event_id(now_ms, digest[:10])


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON: sorted keys, no whitespace, UTF-8, no NaN or infinity."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def request_hash(tool_name: str, arguments: Any) -> str:
    """``sha256:`` of the canonical request. Equal requests hash equal whatever their key order;
    this format is stored in every execution event, so never change it."""
    body = canonical_json({"tool": tool_name, "arguments": arguments})
    return "sha256:" + hashlib.sha256(body).hexdigest()


def content_ref(payload: bytes) -> str:
    """Content address of a stored result: ``sha256:`` + hex digest of its bytes."""
    return "sha256:" + hashlib.sha256(payload).hexdigest()


def idempotency_key(operation_id_: str) -> str:
    """The key sent to a provider with every dispatch of an operation. It is the operation id
    itself, so a reconciler can look the call up and the provider dedupes re-executions; this
    format must never change."""
    return operation_id_
