"""``Codec.peek_state`` lets a reader skip records it has no use for without decoding them (the
delivery worker's outbox skips every execution record that is not SUCCEEDED). It may say "I
cannot tell" (None) whenever it likes, but whenever it names a record and a state, a full decode
of the same bytes must name the same ones."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

import fastavro
from factories import (
    OP,
    REQUEST,
    T0,
    TENANT,
    TOOL,
    decided,
    delivery,
    delivery_events,
    execution,
    execution_events,
    fresh_event_id,
    owned,
)
from fastavro.schema import to_parsing_canonical_form
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.codec import (
    DELIVERY_RECORD,
    EXECUTION_RECORD,
    HEADER_LENGTH,
    MARKER,
    MODELS,
    DecodeError,
    crc64_avro,
    default_codec,
)
from ledger.domain.events import DeliveryTransitioned, ExecutionTransitioned, Transition
from ledger.domain.states import DeliveryState, ExecutionState

CODEC = default_codec()
SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"
ARCHIVED_V1 = SCHEMAS / "archive" / "execution_transition.v1.avsc"


def _name_of(event: Transition) -> str:
    return EXECUTION_RECORD if isinstance(event, ExecutionTransitioned) else DELIVERY_RECORD


def _agrees_with_decode(data: bytes) -> bool:
    """The peek's promise for one input: silent, or the same record and state as a decode."""
    peeked = CODEC.peek_state(data)
    if peeked is None:
        return True
    try:
        event = CODEC.decode(data)
    except DecodeError:
        return True  # nothing decodes, so a reader that skipped it lost nothing
    state = getattr(event, "state", None)
    name = next(name for name, model in MODELS.items() if type(event) is model)
    return peeked == (name, None if state is None else state.value)


def test_every_execution_state_is_peeked_as_decode_reads_it() -> None:
    for state in ExecutionState:
        attempt = 0 if state is ExecutionState.INTENT_RECORDED else 2
        data = CODEC.encode(execution(state, attempt))
        assert CODEC.peek_state(data) == (EXECUTION_RECORD, state.value)
        decoded = CODEC.decode(data)
        assert isinstance(decoded, ExecutionTransitioned) and decoded.state is state


def test_every_delivery_state_is_peeked_as_decode_reads_it() -> None:
    for state in DeliveryState:
        data = CODEC.encode(
            delivery(state, 1, error="x" if state is DeliveryState.DEAD_LETTERED else None)
        )
        assert CODEC.peek_state(data) == (DELIVERY_RECORD, state.value)
        decoded = CODEC.decode(data)
        assert isinstance(decoded, DeliveryTransitioned) and decoded.state is state


def test_records_without_a_state_are_named_only() -> None:
    ownership = CODEC.encode(owned(3))
    assert CODEC.peek_state(ownership) == ("opledger.v1.OwnershipTaken", None)
    # A decision's first non-string, non-varint field (a nullable lease token) comes before
    # anything a peek could read; it has no state either, so its name is the whole answer.
    decision = CODEC.encode(decided(1))
    assert CODEC.peek_state(decision) == ("opledger.v1.ReconciliationDecided", None)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(execution_events(), delivery_events()))
def test_any_valid_event_is_peeked_as_decode_reads_it(event: Transition) -> None:
    data = CODEC.encode(event)
    assert CODEC.peek_state(data) == (_name_of(event), event.state.value)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(execution_events(), delivery_events()), st.randoms(use_true_random=False))
def test_damaged_bytes_are_never_peeked_as_something_decode_disagrees_with(
    event: Transition, rnd: random.Random
) -> None:
    data = CODEC.encode(event)
    for _ in range(8):
        damaged = bytearray(data)
        kind = rnd.randrange(3)
        if kind == 0:
            damaged = damaged[: rnd.randrange(0, len(damaged))]
        elif kind == 1:
            i = rnd.randrange(HEADER_LENGTH, len(damaged))
            damaged[i] = rnd.randrange(256)
        else:
            damaged += bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 4)))
        assert _agrees_with_decode(bytes(damaged)), bytes(damaged).hex()


def test_an_archived_writer_is_not_peeked_but_decoded() -> None:
    """Old writers lay their fields out differently: the peek leaves them to the decoder."""
    v1: dict[str, Any] = json.loads(ARCHIVED_V1.read_text(encoding="utf-8"))
    fingerprint = crc64_avro(to_parsing_canonical_form(v1).encode()).to_bytes(8, "little")
    datum = {
        "event_id": fresh_event_id(),
        "operation_id": OP,
        "tenant_id": TENANT,
        "actor_id": "svc-old",
        "occurred_at": T0,
        "attempt": 1,
        "state": "SUCCEEDED",
        "tool_name": TOOL,
        "request_hash": REQUEST,
        "provider_ref": None,
        "result_ref": "sha256:" + "0" * 64,
        "error": None,
    }
    body = io.BytesIO()
    body.write(MARKER + fingerprint)
    fastavro.schemaless_writer(body, fastavro.parse_schema(v1), datum)
    data = body.getvalue()

    assert CODEC.peek_state(data) is None
    event = CODEC.decode(data)
    assert isinstance(event, ExecutionTransitioned) and event.state is ExecutionState.SUCCEEDED


def test_what_is_not_single_object_avro_is_not_peeked() -> None:
    assert CODEC.peek_state(b"") is None
    assert CODEC.peek_state(b'{"state": "SUCCEEDED"}') is None
    assert CODEC.peek_state(MARKER + b"\x00" * 8 + b"\x02") is None  # unknown fingerprint
    header = MARKER + CODEC.fingerprint(EXECUTION_RECORD)
    assert CODEC.peek_state(header) is None  # no body
    assert CODEC.peek_state(header + b"\x01") is None  # a negative string length
