"""Key formats are durable contracts: these tests pin them."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from ledger.domain.ids import (
    EVENT_ID_RE,
    OPERATION_ID_RE,
    SHA256_REF_RE,
    IdError,
    content_ref,
    event_id,
    idempotency_key,
    operation_id,
    request_hash,
    ulid,
)

CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
times = st.integers(min_value=0, max_value=2**48 - 1)
entropies = st.binary(min_size=10, max_size=10)


def _decode(text: str) -> tuple[int, bytes]:
    """Crockford base32 back to (milliseconds, entropy), written independently of ids.py."""
    value = 0
    for char in text:
        value = value * 32 + CROCKFORD.index(char)
    return value >> 80, (value & (2**80 - 1)).to_bytes(10, "big")


def test_known_ulids() -> None:
    assert ulid(0, bytes(10)) == "0" * 26
    assert ulid(2**48 - 1, b"\xff" * 10) == "7" + "Z" * 25
    # 1 ms and entropy 1: the time lives in the first 10 characters, entropy in the last 16.
    assert ulid(1, (1).to_bytes(10, "big")) == "0000000001" + "0" * 15 + "1"


@given(times, entropies)
def test_ulid_is_26_crockford_chars_and_decodes_back(now_ms: int, entropy: bytes) -> None:
    text = ulid(now_ms, entropy)
    assert len(text) == 26
    assert set(text) <= set(CROCKFORD)
    assert _decode(text) == (now_ms, entropy)


@given(times, entropies)
def test_operation_and_event_id_formats(now_ms: int, entropy: bytes) -> None:
    op = operation_id(now_ms, entropy)
    ev = event_id(now_ms, entropy)
    assert op == "op_" + ulid(now_ms, entropy)
    assert ev == "ev_" + ulid(now_ms, entropy)
    assert OPERATION_ID_RE.fullmatch(op) and not EVENT_ID_RE.fullmatch(op)
    assert EVENT_ID_RE.fullmatch(ev) and not OPERATION_ID_RE.fullmatch(ev)


@given(times, times, entropies, entropies)
def test_ids_sort_by_time_whatever_the_entropy(t1: int, t2: int, e1: bytes, e2: bytes) -> None:
    assume(t1 != t2)
    early, late = sorted((t1, t2))
    assert operation_id(early, e1) < operation_id(late, e2)
    assert event_id(early, e1) < event_id(late, e2)


@given(times, entropies, entropies)
def test_same_millisecond_sorts_by_entropy(now_ms: int, e1: bytes, e2: bytes) -> None:
    assume(e1 != e2)
    assert (ulid(now_ms, e1) < ulid(now_ms, e2)) == (e1 < e2)


@pytest.mark.parametrize("length", [0, 9, 11, 16])
def test_entropy_must_be_ten_bytes(length: int) -> None:
    with pytest.raises(IdError, match=f"got {length}"):
        ulid(0, bytes(length))


@pytest.mark.parametrize("now_ms", [-1, 2**48, 2**64])
def test_time_must_fit_48_bits(now_ms: int) -> None:
    with pytest.raises(IdError, match="out of ULID range"):
        operation_id(now_ms, bytes(10))


def test_id_error_is_a_value_error() -> None:
    assert issubclass(IdError, ValueError)


# --- request_hash -----------------------------------------------------------------------------


def test_request_hash_format_is_pinned() -> None:
    # The canonical body is sorted-key compact JSON of {"tool", "arguments"}; never change it.
    body = b'{"arguments":{"a":1,"b":[true,null,"\xc3\xa9"]},"tool":"search"}'
    expected = "sha256:" + hashlib.sha256(body).hexdigest()
    assert request_hash("search", {"b": [True, None, "é"], "a": 1}) == expected


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(st.dictionaries(st.text(max_size=8), json_values, max_size=6), st.randoms())
def test_request_hash_ignores_key_order(arguments: dict[str, object], rnd: object) -> None:
    items = list(arguments.items())
    rnd.shuffle(items)  # type: ignore[attr-defined]  # hypothesis' Random
    shuffled = dict(items)
    assert request_hash("t", shuffled) == request_hash("t", arguments)
    assert SHA256_REF_RE.fullmatch(request_hash("t", arguments))


@given(json_values, json_values)
def test_different_arguments_hash_differently(a: object, b: object) -> None:
    assume(json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True))
    assert request_hash("tool", a) != request_hash("tool", b)


def test_different_tools_hash_differently() -> None:
    assert request_hash("refund", {"id": 1}) != request_hash("charge", {"id": 1})


def test_request_hash_is_sha256_prefix_and_64_lower_hex() -> None:
    value = request_hash("x", [])
    assert value.startswith("sha256:")
    digest = value.removeprefix("sha256:")
    assert len(digest) == 64 and set(digest) <= set("0123456789abcdef")


def test_request_hash_refuses_nan() -> None:
    # NaN has no canonical JSON; hashing it would make equal requests hash differently.
    with pytest.raises(ValueError):
        request_hash("x", {"v": float("nan")})


# --- content_ref and idempotency_key ----------------------------------------------------------


@pytest.mark.parametrize("payload", [b"", b"hello", bytes(range(256))])
def test_content_ref_is_sha256_of_the_bytes(payload: bytes) -> None:
    assert content_ref(payload) == "sha256:" + hashlib.sha256(payload).hexdigest()


def test_content_ref_of_empty_bytes_is_pinned() -> None:
    assert content_ref(b"") == (
        "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )


def test_idempotency_key_is_the_operation_id_and_stable() -> None:
    op = operation_id(1_767_323_045_678, b"0123456789")
    assert idempotency_key(op) == op
    assert idempotency_key(op) == idempotency_key(operation_id(1_767_323_045_678, b"0123456789"))
    assert idempotency_key(op) != idempotency_key(operation_id(1_767_323_045_679, b"0123456789"))
