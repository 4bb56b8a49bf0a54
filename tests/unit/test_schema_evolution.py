"""Old writers read under new readers, and the single-object framing is the standard one.

The "old" schema is derived here from today's by dropping its defaulted fields, which is what an
earlier version of the contract looked like before those fields were added. It lives in a
temporary directory: shipping a fake ``schemas/archive/`` file would make production accept a
fingerprint no producer ever wrote.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import fastavro
import pytest
from factories import OP, REQUEST, T0, TENANT, TOOL, fresh_event_id
from fastavro.schema import fingerprint, to_parsing_canonical_form
from hypothesis import given
from hypothesis import strategies as st

from ledger.codec import (
    EXECUTION_RECORD,
    MARKER,
    Codec,
    DecodeError,
    crc64_avro,
    default_codec,
)
from ledger.domain.events import ExecutionTransitioned
from ledger.domain.states import ExecutionState

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"
EXECUTION_AVSC = SCHEMAS / "execution_transition.avsc"
DELIVERY_AVSC = SCHEMAS / "delivery_transition.avsc"
#: Every current schema except the execution one (a Codec needs all the records it serves).
OTHERS = sorted(p for p in SCHEMAS.glob("*.avsc") if p != EXECUTION_AVSC)
#: The execution schema producers wrote before leases and decisions (kept in the archive).
ARCHIVED_V1 = SCHEMAS / "archive" / "execution_transition.v1.avsc"


def _schema(path: Path) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return raw


def _without(schema: dict[str, Any], names: set[str]) -> dict[str, Any]:
    return {**schema, "fields": [f for f in schema["fields"] if f["name"] not in names]}


def _defaulted(schema: dict[str, Any]) -> set[str]:
    return {f["name"] for f in schema["fields"] if "default" in f}


def _write(tmp_path: Path, name: str, schema: dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(schema), encoding="utf-8")
    return path


def _our_fingerprint(schema: dict[str, Any]) -> bytes:
    canonical = to_parsing_canonical_form(schema).encode("utf-8")
    return crc64_avro(canonical).to_bytes(8, "little")


def _single_object(schema: dict[str, Any], datum: dict[str, Any]) -> bytes:
    """Single-object encoding built with fastavro alone (plus our CRC), independent of Codec."""
    buffer = io.BytesIO()
    buffer.write(MARKER + _our_fingerprint(schema))
    fastavro.schemaless_writer(buffer, fastavro.parse_schema(schema), datum)
    return buffer.getvalue()


def _old_datum(state: ExecutionState, attempt: int) -> dict[str, Any]:
    return {
        "event_id": fresh_event_id(),
        "operation_id": OP,
        "tenant_id": TENANT,
        "actor_id": "svc-old",
        "occurred_at": T0,
        "attempt": attempt,
        "state": state.value,
        "tool_name": TOOL,
        "request_hash": REQUEST,
    }


@pytest.fixture
def v0(tmp_path: Path) -> dict[str, Any]:
    """The execution schema before any defaulted field existed."""
    current = _schema(EXECUTION_AVSC)
    old = _without(current, _defaulted(current))
    assert _defaulted(current) == {
        "provider_ref",
        "result_ref",
        "error",
        "lease_token",
        "decision_id",
    }, "update this test"
    return old


def _reader(tmp_path: Path, *archived: dict[str, Any]) -> Codec:
    paths = [_write(tmp_path, f"archived_{i}.avsc", s) for i, s in enumerate(archived)]
    return Codec([EXECUTION_AVSC, *OTHERS], paths)


def test_v0_writer_read_by_current_reader_gets_defaults(tmp_path: Path, v0: dict[str, Any]) -> None:
    # The old producer: a Codec whose *current* schema is v0.
    old_writer = Codec([_write(tmp_path, "v0.avsc", v0), *OTHERS])
    data = old_writer.encode_datum(EXECUTION_RECORD, _old_datum(ExecutionState.DISPATCHED, 1))
    assert data[2:10] != default_codec().fingerprint(EXECUTION_RECORD)

    event = _reader(tmp_path, v0).decode(data)

    assert isinstance(event, ExecutionTransitioned)
    assert event.state is ExecutionState.DISPATCHED
    assert event.attempt == 1
    assert event.actor_id == "svc-old"
    assert event.occurred_at == T0
    assert (event.provider_ref, event.result_ref, event.error) == (None, None, None)


def test_the_archived_v1_writer_reads_under_todays_schema() -> None:
    """schemas/archive/ keeps what producers wrote before leases and decisions: their events
    still decode, and the new fields read as their defaults (no lease, no decision)."""
    v1 = _schema(ARCHIVED_V1)
    assert {f["name"] for f in v1["fields"]} == {
        f["name"] for f in _schema(EXECUTION_AVSC)["fields"]
    } - {"lease_token", "decision_id"}
    datum = {**_old_datum(ExecutionState.DISPATCHED, 1), "provider_ref": "prov-9"}
    datum.update(result_ref=None, error=None)
    data = _single_object(v1, datum)
    assert data[2:10] != default_codec().fingerprint(EXECUTION_RECORD)

    event = default_codec().decode(data)  # the shipped codec knows the archived fingerprint

    assert isinstance(event, ExecutionTransitioned)
    assert event.provider_ref == "prov-9"
    assert (event.lease_token, event.decision_id) == (None, None)


def test_writer_one_field_behind_keeps_the_fields_it_had(
    tmp_path: Path, v0: dict[str, Any]
) -> None:
    before_error = _without(_schema(EXECUTION_AVSC), {"error"})
    datum = {**_old_datum(ExecutionState.DISPATCHED, 1), "provider_ref": "prov-123"}
    datum["result_ref"] = None
    data = _single_object(before_error, datum)

    event = _reader(tmp_path, v0, before_error).decode(data)

    assert isinstance(event, ExecutionTransitioned)
    assert event.provider_ref == "prov-123"
    assert event.error is None


def test_hand_built_single_object_matches_codec_output() -> None:
    # Our framing is the spec's: fastavro body + CRC-64-AVRO of the canonical form.
    datum = _old_datum(ExecutionState.INTENT_RECORDED, 0)
    datum.update(provider_ref=None, result_ref=None, error=None, lease_token=None, decision_id=None)
    by_hand = _single_object(_schema(EXECUTION_AVSC), datum)
    assert by_hand == default_codec().encode_datum(EXECUTION_RECORD, datum)
    assert default_codec().decode(by_hand) == ExecutionTransitioned.model_validate(datum)


def test_archived_schema_not_known_to_the_reader_names_the_fingerprint(
    v0: dict[str, Any],
) -> None:
    data = _single_object(v0, _old_datum(ExecutionState.INTENT_RECORDED, 0))
    with pytest.raises(DecodeError, match=_our_fingerprint(v0).hex()):
        default_codec().decode(data)


def test_archived_schema_of_a_record_with_no_current_schema(tmp_path: Path) -> None:
    stranger = {**_schema(EXECUTION_AVSC), "name": "RetiredRecord"}
    data = _single_object(stranger, {**_old_datum(ExecutionState.INTENT_RECORDED, 0)})
    with pytest.raises(
        DecodeError, match=r"no current schema for record opledger\.v1\.RetiredRecord"
    ):
        _reader(tmp_path, stranger).decode(data)


def _valid_bytes() -> bytes:
    datum = _old_datum(ExecutionState.INTENT_RECORDED, 0)
    datum.update(provider_ref="p-1", result_ref=None, error=None, lease_token=7, decision_id=None)
    return default_codec().encode_datum(EXECUTION_RECORD, datum)


def test_valid_bytes_decode() -> None:
    # The baseline the corruption tests below mutate.
    assert default_codec().decode(_valid_bytes()).operation_id == OP


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc3", b"\xc3\x01", b"\x00\x01" + b"\x00" * 40, b'{"operation_id": "op_x"}'],
    ids=["empty", "half-marker", "marker-only", "wrong-marker", "json"],
)
def test_payload_without_marker_or_header_is_rejected(data: bytes) -> None:
    with pytest.raises(DecodeError, match="C3 01"):
        default_codec().decode(data)


def test_wrong_marker_on_an_otherwise_valid_record() -> None:
    data = _valid_bytes()
    with pytest.raises(DecodeError, match="C3 01"):
        default_codec().decode(b"\xc3\x00" + data[2:])


@pytest.mark.parametrize("cut", [1, 2, 5, 20])
def test_truncated_body_is_rejected(cut: int) -> None:
    data = _valid_bytes()
    with pytest.raises(DecodeError, match="corrupt Avro body"):
        default_codec().decode(data[:-cut])


def test_header_only_is_rejected() -> None:
    with pytest.raises(DecodeError):
        default_codec().decode(_valid_bytes()[:10])


@pytest.mark.parametrize("extra", [b"\x00", b"\x00\x00\x00", b"trailing"])
def test_trailing_bytes_are_rejected(extra: bytes) -> None:
    with pytest.raises(DecodeError, match=f"{len(extra)} trailing bytes"):
        default_codec().decode(_valid_bytes() + extra)


# --- the fingerprint ------------------------------------------------------------------------


def _fastavro_fp(canonical: str) -> str:
    result: str = fingerprint(canonical, "CRC-64-AVRO")
    return result


def test_crc64_of_the_null_schema_matches_fastavro() -> None:
    # The Avro specification's first test vector: the canonical form "null".
    ours = crc64_avro(b'"null"').to_bytes(8, "little").hex()
    assert ours == _fastavro_fp('"null"')
    # ... and pinned, so both cannot drift together.
    assert ours == "8a8f25cce724dd63"


@pytest.mark.parametrize("path", [EXECUTION_AVSC, DELIVERY_AVSC], ids=lambda p: p.name)
def test_codec_fingerprints_are_crc64_avro_of_the_canonical_form(path: Path) -> None:
    schema = _schema(path)
    canonical = to_parsing_canonical_form(schema)
    name = f"{schema['namespace']}.{schema['name']}"
    assert default_codec().fingerprint(name).hex() == _fastavro_fp(canonical)


@given(st.text(max_size=300))
def test_crc64_matches_fastavro_on_any_text(text: str) -> None:
    assert crc64_avro(text.encode("utf-8")).to_bytes(8, "little").hex() == _fastavro_fp(text)


def test_archive_directory_holds_only_schemas_the_current_reader_can_resolve() -> None:
    # Every shipped archived writer must resolve against today's reader (fields added with
    # defaults only); resolving a minimal datum proves the pair is compatible.
    current = {}
    for path in sorted(SCHEMAS.glob("*.avsc")):
        schema = _schema(path)
        current[schema["name"]] = fastavro.parse_schema(schema)
    for path in sorted((SCHEMAS / "archive").glob("*.avsc")):
        writer = _schema(path)
        assert writer["name"] in current, path.name
        new_only = {f["name"] for f in current[writer["name"]]["fields"]} - {
            f["name"] for f in writer["fields"]
        }
        for field in current[writer["name"]]["fields"]:
            if field["name"] in new_only:
                assert "default" in field, f"{path.name}: {field['name']} added without default"


def test_an_archived_writer_cannot_smuggle_a_negative_enum_index() -> None:
    """fastavro (which reads archived writers) counts a negative enum index from the end of the
    symbols: written as -1, FAILED would read as UNKNOWN. Such a body is refused."""
    v1 = _schema(ARCHIVED_V1)
    datum = {**_old_datum(ExecutionState.FAILED, 1), "error": "x", "provider_ref": None}
    datum["result_ref"] = None
    failed = _single_object(v1, datum)
    other = _single_object(v1, {**datum, "state": ExecutionState.DISPATCHED.value})
    (at,) = [i for i, (a, b) in enumerate(zip(failed, other, strict=True)) if a != b]
    assert failed[at] == 3 << 1  # FAILED's index, zig-zag encoded
    smuggled = failed[:at] + bytes([0x01]) + failed[at + 1 :]  # zig-zag -1
    with pytest.raises(DecodeError, match="canonical"):
        default_codec().decode(smuggled)
    assert default_codec().decode(failed).state is ExecutionState.FAILED  # type: ignore[union-attr]
