"""Round trips through the shipped codec, and domain validation at the decoding edge."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import fastavro
import pytest
from factories import (
    OP,
    RESULT,
    T0,
    delivery,
    delivery_events,
    execution,
    execution_events,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ledger.codec import (
    DELIVERY_RECORD,
    EXECUTION_RECORD,
    HEADER_LENGTH,
    MARKER,
    DecodeError,
    default_codec,
    delivery_to_avro,
    execution_to_avro,
    utc_micros,
)
from ledger.domain.events import DeliveryTransitioned, ExecutionTransitioned
from ledger.domain.states import DeliveryState, ExecutionState

X = ExecutionState
D = DeliveryState


def _roundtrip(event: ExecutionTransitioned | DeliveryTransitioned) -> None:
    codec = default_codec()
    data = codec.encode(event)
    record = EXECUTION_RECORD if isinstance(event, ExecutionTransitioned) else DELIVERY_RECORD
    assert data[:2] == MARKER
    assert data[2:HEADER_LENGTH] == codec.fingerprint(record)
    decoded = codec.decode(data)
    assert type(decoded) is type(event)
    assert decoded == event
    # Same instant and UTC on the way out, whatever offset the writer used.
    assert decoded.occurred_at.utcoffset() == timedelta(0)
    assert decoded.model_dump() == event.model_dump()


@settings(max_examples=150)
@given(execution_events())
def test_any_execution_event_round_trips(event: ExecutionTransitioned) -> None:
    _roundtrip(event)


@settings(max_examples=150)
@given(delivery_events())
def test_any_delivery_event_round_trips(event: DeliveryTransitioned) -> None:
    _roundtrip(event)


@pytest.mark.parametrize(
    "event",
    [
        execution(X.INTENT_RECORDED, 0),
        execution(X.DISPATCHED, 1, provider_ref="prov-1", result_ref=RESULT, error="slow"),
        execution(X.SUCCEEDED, 3, provider_ref="prov-1"),
        execution(X.FAILED, 0, error="refused by policy"),
        execution(X.UNKNOWN, 2),
    ],
    ids=["intent-all-unset", "dispatched-all-set", "succeeded", "refused", "unknown"],
)
def test_execution_examples_round_trip(event: ExecutionTransitioned) -> None:
    _roundtrip(event)


@pytest.mark.parametrize(
    "event",
    [
        delivery(D.PENDING, 0, result_ref=None),
        delivery(
            D.PENDING, 2, next_attempt_at=T0 + timedelta(minutes=5), error="503 from destination"
        ),
        delivery(D.SENT, 1),
        delivery(D.ACKED, 1),
        delivery(D.DEAD_LETTERED, 7),
    ],
    ids=["pending-all-unset", "pending-all-set", "sent", "acked", "dead-lettered"],
)
def test_delivery_examples_round_trip(event: DeliveryTransitioned) -> None:
    _roundtrip(event)


def test_offset_timestamps_keep_their_instant_and_microseconds() -> None:
    local = datetime(2026, 3, 4, 5, 6, 7, 999_999, tzinfo=timezone(timedelta(hours=-7)))
    event = execution(X.INTENT_RECORDED, 0, occurred_at=local)
    decoded = default_codec().decode(default_codec().encode(event))
    assert decoded.occurred_at == local
    assert decoded.occurred_at == datetime(2026, 3, 4, 12, 6, 7, 999_999, tzinfo=UTC)


def test_the_two_record_types_have_different_fingerprints() -> None:
    codec = default_codec()
    assert codec.fingerprint(EXECUTION_RECORD) != codec.fingerprint(DELIVERY_RECORD)
    assert codec.encode(delivery(D.SENT, 1))[2:HEADER_LENGTH] == codec.fingerprint(DELIVERY_RECORD)


def test_to_avro_dicts_have_exactly_the_schema_fields() -> None:
    codec = default_codec()
    for record, datum in [
        (EXECUTION_RECORD, execution_to_avro(execution(X.INTENT_RECORDED, 0))),
        (DELIVERY_RECORD, delivery_to_avro(delivery(D.PENDING, 0))),
    ]:
        names = [f["name"] for f in codec.writer_schema(record)["fields"]]
        assert sorted(datum) == sorted(names)


def _datum(**changes: Any) -> dict[str, Any]:
    datum = execution_to_avro(execution(X.INTENT_RECORDED, 0))
    datum.update(changes)
    return datum


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"operation_id": "nope"}, "operation_id"),
        ({"event_id": "ev_lowercase0000000000000000"}, "event_id"),
        ({"request_hash": "md5:abc"}, "request_hash"),
        ({"tenant_id": ""}, "tenant_id"),
        ({"attempt": -1}, "attempt"),
        ({"error": "boom\x00"}, "error"),
    ],
)
def test_well_formed_avro_with_invalid_content_names_the_field(
    changes: dict[str, Any], field: str
) -> None:
    data = default_codec().encode_datum(EXECUTION_RECORD, _datum(**changes))
    with pytest.raises(DecodeError, match=field) as info:
        default_codec().decode(data)
    assert "invalid opledger.v1.ExecutionTransitioned" in str(info.value)


def test_a_credential_already_on_a_topic_is_read_as_it_is_but_never_written() -> None:
    """The writers refuse credentials (the contract's validator). A record that holds one
    anyway is history: refusing it on read would not take it back, would copy it to the dead
    letters, and would make a replay differ from the first reading whenever the detector grows."""
    data = default_codec().encode_datum(EXECUTION_RECORD, _datum(error="password=hunter2"))
    assert default_codec().decode(data).error == "password=hunter2"  # type: ignore[union-attr]
    with pytest.raises(ValidationError, match="credential"):
        execution(X.FAILED, 0, error="password=hunter2")


def test_cross_field_rule_violation_is_a_decode_error() -> None:
    # SUCCEEDED without result_ref is valid Avro but not a valid event.
    data = default_codec().encode_datum(
        EXECUTION_RECORD, _datum(state="SUCCEEDED", attempt=1, result_ref=None)
    )
    with pytest.raises(DecodeError, match="result_ref"):
        default_codec().decode(data)


def test_avro_that_does_not_fit_the_schema_is_not_encoded() -> None:
    with pytest.raises((ValueError, TypeError)):
        default_codec().encode_datum(EXECUTION_RECORD, _datum(state="NOT_A_STATE"))


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@given(st.integers(min_value=0, max_value=2**62 // 1000))
def test_utc_micros_is_exact(micros: int) -> None:
    value = _EPOCH + timedelta(microseconds=micros)
    assert utc_micros(value) == micros
    assert utc_micros(value.astimezone(timezone(timedelta(hours=5, minutes=30)))) == micros


@pytest.mark.parametrize(
    "value",
    [
        T0,
        # Instants where value.timestamp() * 1e6 (a float) comes out one microsecond short.
        datetime(2005, 8, 18, 12, 8, 18, 400133, tzinfo=UTC),
        datetime(2040, 6, 5, 1, 15, 58, 685692, tzinfo=UTC),
    ],
)
def test_utc_micros_agrees_with_what_fastavro_writes(value: datetime) -> None:
    schema = fastavro.parse_schema({"type": "long", "logicalType": "timestamp-micros"})
    buffer = io.BytesIO()
    fastavro.schemaless_writer(buffer, schema, value)
    buffer.seek(0)
    written = fastavro.schemaless_reader(buffer, {"type": "long"})
    assert utc_micros(value) == written == (value - _EPOCH) // timedelta(microseconds=1)


def test_operation_id_survives_byte_for_byte() -> None:
    assert (
        default_codec().decode(default_codec().encode(execution(X.INTENT_RECORDED, 0))).operation_id
        == OP
    )
