"""The codec's hand-written Avro reader and writer for the current schemas must agree with
fastavro, the reference implementation, byte for byte and error for error: same bytes out for
every valid event, the same datum (or a refusal) for every well-formed, truncated, altered or
over-long input."""

from __future__ import annotations

import io
import random
from typing import Any

import fastavro
from factories import delivery_events, execution_events
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.codec import (
    DELIVERY_RECORD,
    EXECUTION_RECORD,
    HEADER_LENGTH,
    DecodeError,
    default_codec,
)
from ledger.domain.events import ExecutionTransitioned, Transition

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


def _codec_decode(data: bytes) -> tuple[Any, ...]:
    try:
        return ("ok", CODEC.decode_datum(data)[1])
    except DecodeError:
        return ("refused",)


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
        assert _codec_decode(mutated) == _reference_decode(mutated, name), mutated.hex()
