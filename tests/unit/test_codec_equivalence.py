"""The codec's hand-written Avro reader and writer for the current schemas must agree with
fastavro, the reference implementation, byte for byte and error for error: same bytes out for
every valid event, the same datum (or a refusal) for every well-formed, truncated, altered or
over-long input."""

from __future__ import annotations

import io
import random
import re
from typing import Any

import fastavro
import pytest
from factories import decided, decision_events, delivery_events, execution_events
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.codec import (
    DECISION_RECORD,
    DELIVERY_RECORD,
    EXECUTION_RECORD,
    HEADER_LENGTH,
    DecodeError,
    default_codec,
)
from ledger.domain.events import ExecutionTransitioned, ReconciliationDecided, Transition
from ledger.domain.reconcile import Decision

CODEC = default_codec()


def _reference_encode(event: Transition) -> tuple[bytes, str]:
    name = EXECUTION_RECORD if isinstance(event, ExecutionTransitioned) else DELIVERY_RECORD
    buffer = io.BytesIO()
    buffer.write(data_header(name))
    fastavro.schemaless_writer(
        buffer, CODEC.writer_schema(name), event.model_dump(exclude={"kind"})
    )
    return buffer.getvalue(), name


def data_header(name: str) -> bytes:
    return b"\xc3\x01" + CODEC.fingerprint(name)


def _reference_decode(data: bytes, name: str) -> tuple[Any, ...]:
    schema = CODEC.writer_schema(name)
    body = io.BytesIO(data)
    body.seek(HEADER_LENGTH)
    try:
        datum = fastavro.schemaless_reader(body, schema, schema)
    except Exception:  # fastavro raises many types for corrupt input; any of them is a refusal
        return ("refused",)
    if body.tell() != len(data):
        return ("refused",)
    return ("ok", datum)


# fastavro indexes a union's branches and an enum's symbols with whatever int it reads, so a
# negative index silently picks from the end (-1 -> the last symbol, -2 -> "null"). The Avro
# specification makes both non-negative indexes; the codec refuses them. These are the only
# disagreements allowed, and only in that direction.
_NEGATIVE_INDEX = re.compile(r"(union branch|enum index) -\d+ out of range")


def _agree(ours: tuple[Any, ...], reference: tuple[Any, ...]) -> bool:
    if ours[0] == reference[0] == "refused":
        return True
    if ours[0] == reference[0] == "ok":
        return bool(ours[1] == reference[1])
    return ours[0] == "refused" and reference[0] == "ok" and bool(_NEGATIVE_INDEX.search(ours[1]))


def _codec_decode(data: bytes) -> tuple[Any, ...]:
    try:
        return ("ok", CODEC.decode_datum(data)[1])
    except DecodeError as exc:
        return ("refused", str(exc))


def _mutations(data: bytes, rnd: random.Random) -> list[bytes]:
    out = []
    for _ in range(6):
        b = bytearray(data)
        kind = rnd.randrange(3)
        if kind == 0:
            b = b[: rnd.randrange(HEADER_LENGTH, len(b))]
        elif kind == 1:
            i = rnd.randrange(HEADER_LENGTH, len(b))
            b[i] = rnd.randrange(256)
        else:
            b += bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 4)))
        out.append(bytes(b))
    return out


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(execution_events(), delivery_events()), st.randoms(use_true_random=False))
def test_codec_matches_fastavro(event: Transition, rnd: random.Random) -> None:
    reference, name = _reference_encode(event)
    assert CODEC.encode(event) == reference
    assert _codec_decode(reference) == _reference_decode(reference, name)
    assert CODEC.decode(reference) == event
    for mutated in _mutations(reference, rnd):
        ours, theirs = _codec_decode(mutated), _reference_decode(mutated, name)
        assert _agree(ours, theirs), (mutated.hex(), ours, theirs)


def test_a_negative_enum_index_is_refused_where_fastavro_would_wrap_it() -> None:
    # Found by the test above: a DeliveryTransitioned body whose state index is -1.
    data = bytes.fromhex(
        "c3017e44c0f6d6a36de53a65765f3030303030303030303030303030303030303030303030303030"
        "3a6f705f303030303030303030303030303030303030303030303030303002300430308080bfb3a7"
        "c0ae03001830303030303030303030303001000000"
    )
    schema = CODEC.writer_schema(DELIVERY_RECORD)
    body = io.BytesIO(data)
    body.seek(HEADER_LENGTH)
    assert fastavro.schemaless_reader(body, schema, schema)["state"] == "DEAD_LETTERED"
    assert _codec_decode(data) == ("refused", _codec_decode(data)[1])
    assert "enum index -1 out of range" in _codec_decode(data)[1]


def test_a_negative_union_branch_is_refused_and_a_long_varint_branch_is_read() -> None:
    # Found by the property test: result_ref's branch byte 0x03 is the varint -2, which fastavro
    # reads as branch "null"; the codec refuses it.
    data = bytes.fromhex(
        "c3017e44c0f6d6a36de53a65765f3030303030303030303030303030303030303030303030303030"
        "3a6f705f3030303030303030303030303030303030303030303030303030023002308080bfb3a7c0"
        "ae0300023000030000"
    )
    ours = _codec_decode(data)
    assert ours[0] == "refused" and "union branch -2 out of range" in ours[1]
    # The same record with that branch written as 0x80 0x00 (index 0 in a two-byte varint)
    # is valid Avro: both read it, as null.
    padded = data[:-3] + b"\x80\x00" + data[-2:]
    assert _codec_decode(padded) == _reference_decode(padded, DELIVERY_RECORD)
    assert _codec_decode(padded)[1]["next_attempt_at"] is None


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(event=decision_events())
def test_decisions_are_written_and_read_as_fastavro_does(event: ReconciliationDecided) -> None:
    name = DECISION_RECORD
    assert CODEC._current[name].plain is not None, "decisions take the direct path"
    data = CODEC.encode(event)
    reference = io.BytesIO()
    reference.write(data_header(name))
    fastavro.schemaless_writer(
        reference, CODEC.writer_schema(name), event.model_dump(exclude={"kind"})
    )
    assert data == reference.getvalue()
    assert CODEC.decode(data) == event
    assert _reference_decode(data, name)[0] == "ok"


def test_a_boolean_byte_other_than_0_or_1_is_refused() -> None:
    event = decided(1, Decision.NEW_ATTEMPT)
    assert event.policy_allowed
    assert CODEC.decode(_with_flag(event, b"\x01")) == event
    with pytest.raises(DecodeError, match="NEW_ATTEMPT needs policy_allowed"):
        CODEC.decode(_with_flag(event, b"\x00"))  # read as false: the model's rule refuses it
    # fastavro would read 2 as true; written back it is 1, so not these bytes: refused.
    with pytest.raises(DecodeError, match="boolean byte 2"):
        CODEC.decode(_with_flag(event, b"\x02"))


def _with_flag(event: ReconciliationDecided, flag: bytes) -> bytes:
    """``event`` encoded with ``flag`` as the policy_allowed byte (written by hand: the field
    comes right before provider_repeat_safe, here null (union branch 0, one byte), and the
    last one, the reason)."""
    assert event.provider_repeat_safe is None
    reason = event.reason.encode()
    size = len(reason)
    assert size < 0x40, "a one-byte length keeps the arithmetic simple"
    tail = b"\x00" + bytes([size << 1]) + reason
    data = CODEC.encode(event)
    assert data.endswith(b"\x01" + tail)
    return data[: -len(tail) - 1] + flag + tail
