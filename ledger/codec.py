"""Avro single-object encoding of the two transition records, and the conversion between Avro
dicts and domain events. This is the only module that knows the wire format.

Wire format (Avro specification, "Single object encoding"): ``C3 01`` + the 8-byte little-endian
CRC-64-AVRO fingerprint of the writer schema's Parsing Canonical Form + the Avro binary body. Every
record therefore names its schema without a registry server; the reader resolves the fingerprint
against the schemas shipped in ``schemas/`` (current ones and ``schemas/archive/`` for older
versions) and reads with today's schema, so old events keep reading as fields are added.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, cast

import fastavro
from fastavro.schema import to_parsing_canonical_form
from pydantic import ValidationError

from ledger.avro_binary import CorruptBodyError, PlainRecord, utc_micros
from ledger.domain.events import (
    READING,
    DeliveryTransitioned,
    ExecutionTransitioned,
    LedgerEvent,
    OperationEvent,
    OwnershipTaken,
    PolicyChanged,
    ReconciliationDecided,
)

__all__ = [
    "DELIVERY_RECORD",
    "EXECUTION_RECORD",
    "Codec",
    "DecodeError",
    "crc64_avro",
    "default_codec",
    "utc_micros",
]

MARKER = b"\xc3\x01"
HEADER_LENGTH = len(MARKER) + 8
EXECUTION_RECORD = "opledger.v1.ExecutionTransitioned"
DELIVERY_RECORD = "opledger.v1.DeliveryTransitioned"
OWNERSHIP_RECORD = "opledger.v1.OwnershipTaken"
DECISION_RECORD = "opledger.v1.ReconciliationDecided"
POLICY_RECORD = "opledger.v1.PolicyChanged"

#: Every record the topics carry, by Avro full name, and the domain model it decodes to.
MODELS: dict[str, type[LedgerEvent]] = {
    EXECUTION_RECORD: ExecutionTransitioned,
    DELIVERY_RECORD: DeliveryTransitioned,
    OWNERSHIP_RECORD: OwnershipTaken,
    DECISION_RECORD: ReconciliationDecided,
    # Rare, and with arrays and a boolean: written and read by fastavro, not PlainRecord.
    POLICY_RECORD: PolicyChanged,
}
_RECORD_OF: dict[type, str] = {model: name for name, model in MODELS.items()}

_CRC64_EMPTY = 0xC15D213AA4D7A795


def _crc64_table() -> list[int]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (_CRC64_EMPTY & -(fp & 1))
        table.append(fp)
    return table


_CRC64_TABLE = _crc64_table()


def crc64_avro(data: bytes) -> int:
    """The Rabin fingerprint the Avro specification calls CRC-64-AVRO."""
    fp = _CRC64_EMPTY
    for byte in data:
        fp = (fp >> 8) ^ _CRC64_TABLE[(fp ^ byte) & 0xFF]
    return fp


class DecodeError(ValueError):
    """A record that is not a valid opledger event. ``reason`` goes into the dead-letter headers."""


@dataclass(frozen=True, slots=True)
class _Schema:
    name: str
    parsed: Any
    fingerprint: bytes
    source: Path
    #: the direct reader/writer when every field has a type it knows, else None (use fastavro).
    plain: PlainRecord | None = None
    #: how to find the ``state`` symbol in a body without decoding it (see Codec.peek_state)
    peek: _StatePeek | None = None


#: Field kinds the peek steps over: a string (length + bytes) or a varint (int, long, timestamp).
_SKIP_STRING, _SKIP_VARINT = 0, 1


@dataclass(frozen=True, slots=True)
class _StatePeek:
    """The fields before ``state`` (each a string or a varint, none nullable), and its symbols.
    ``symbols`` is empty for a record with no such field: its name alone is the answer."""

    skips: tuple[int, ...]
    symbols: tuple[str, ...]


def _state_peek(raw: dict[str, Any]) -> _StatePeek | None:
    skips: list[int] = []
    for field in raw.get("fields", ()):
        avro_type = field["type"]
        if field["name"] == "state":
            if isinstance(avro_type, dict) and avro_type.get("type") == "enum":
                return _StatePeek(tuple(skips), tuple(avro_type["symbols"]))
            return None
        if avro_type == "string":
            skips.append(_SKIP_STRING)
        elif avro_type in ("int", "long") or (
            isinstance(avro_type, dict)
            and avro_type.get("type") == "long"
            and avro_type.get("logicalType") == "timestamp-micros"
        ):
            skips.append(_SKIP_VARINT)
        else:
            # A field the peek does not step over comes before any state: if there is a
            # state, only a decode finds it; if there is none, the name is the answer.
            has_state = any(f["name"] == "state" for f in raw.get("fields", ()))
            return None if has_state else _StatePeek((), ())
    return _StatePeek((), ())


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """(zig-zag decoded value, next position); raises IndexError past the end."""
    byte = data[pos]
    pos += 1
    n, shift = byte & 0x7F, 7
    while byte & 0x80:
        if shift > 63:
            raise IndexError("varint longer than 10 bytes")
        byte = data[pos]
        pos += 1
        n |= (byte & 0x7F) << shift
        shift += 7
    return (n >> 1) ^ -(n & 1), pos


def schema_dirs() -> list[Path]:
    """Where the .avsc files live: the repository's ``schemas/`` or the copy inside the wheel."""
    here = Path(__file__).resolve()
    candidates = [here.parents[1] / "schemas", here.parent / "schemas"]
    return [p for p in candidates if p.is_dir()]


def _load(path: Path) -> _Schema:
    raw = json.loads(path.read_text(encoding="utf-8"))
    parsed = cast(dict[str, Any], fastavro.parse_schema(raw))  # a record schema parses to a dict
    canonical = to_parsing_canonical_form(raw).encode("utf-8")
    fingerprint = crc64_avro(canonical).to_bytes(8, "little")
    return _Schema(
        name=parsed["name"],
        parsed=parsed,
        fingerprint=fingerprint,
        source=path,
        plain=PlainRecord.of(raw),
        peek=_state_peek(raw),
    )


class Codec:
    """Encodes domain events and decodes any known writer version of them."""

    def __init__(self, current: Iterable[Path], archived: Iterable[Path] = ()) -> None:
        self._current: dict[str, _Schema] = {}
        self._by_fingerprint: dict[bytes, _Schema] = {}
        for path in current:
            schema = _load(path)
            self._current[schema.name] = schema
            self._by_fingerprint[schema.fingerprint] = schema
        for path in archived:
            schema = _load(path)
            self._by_fingerprint.setdefault(schema.fingerprint, schema)
        missing = MODELS.keys() - self._current.keys()
        if missing:
            raise RuntimeError(f"schemas missing from {list(schema_dirs())}: {sorted(missing)}")

    def writer_schema(self, record_name: str) -> Any:
        return self._current[record_name].parsed

    def fingerprint(self, record_name: str) -> bytes:
        return self._current[record_name].fingerprint

    def encode(self, event: LedgerEvent) -> bytes:
        """One event as a single-object-encoded Avro record."""
        schema = self._current[_RECORD_OF[type(event)]]
        if schema.plain is None:
            return self.encode_datum(schema.name, event.model_dump(exclude={"kind"}))
        # The model's attributes, read directly: the same values model_dump would give
        # (every schema field is a model field; a unit test proves it) without building a dict.
        out = bytearray(MARKER)
        out += schema.fingerprint
        values = event.__dict__
        schema.plain.write(out, [values[name] for name in schema.plain.names])
        return bytes(out)

    def encode_datum(self, record_name: str, datum: dict[str, Any]) -> bytes:
        schema = self._current[record_name]
        buffer = io.BytesIO()
        buffer.write(MARKER)
        buffer.write(schema.fingerprint)
        fastavro.schemaless_writer(buffer, schema.parsed, datum)
        return buffer.getvalue()

    def decode_datum(self, data: bytes) -> tuple[str, dict[str, Any]]:
        """(record name, Avro dict read with the current schema); raises DecodeError."""
        if len(data) < HEADER_LENGTH or data[:2] != MARKER:
            raise DecodeError("not Avro single-object encoding (missing C3 01 marker)")
        writer = self._by_fingerprint.get(data[2:HEADER_LENGTH])
        if writer is None:
            raise DecodeError(f"unknown schema fingerprint {data[2:HEADER_LENGTH].hex()}")
        reader = self._current.get(writer.name)
        if reader is None:
            raise DecodeError(f"no current schema for record {writer.name}")
        datum: dict[str, Any]
        if writer is reader and writer.plain is not None:
            try:
                datum, end = writer.plain.read(data, HEADER_LENGTH)
            except CorruptBodyError as exc:
                raise DecodeError(f"corrupt Avro body for {writer.name}: {exc}") from exc
        else:
            body = io.BytesIO(data)
            body.seek(HEADER_LENGTH)
            try:
                datum = fastavro.schemaless_reader(body, writer.parsed, reader.parsed)  # type: ignore[assignment]  # a record schema reads as a dict
            except Exception as exc:  # fastavro raises many types for corrupt bodies
                raise DecodeError(
                    f"corrupt Avro body for {writer.name}: {type(exc).__name__}: {exc}"
                ) from exc
            end = body.tell()
            if end == len(data):
                _require_canonical(writer, datum, data[HEADER_LENGTH:end])
        if end != len(data):
            raise DecodeError(f"{len(data) - end} trailing bytes after the {writer.name} body")
        return writer.name, datum

    def peek_state(self, data: bytes) -> tuple[str, str | None] | None:
        """``(record name, state symbol)`` of a record written with a *current* schema, read
        from the first fields of its body without decoding the rest (the symbol is None for a
        record that has no ``state``). None when that cannot be told this cheaply (an archived
        writer schema, an unknown fingerprint, bytes that end early or hold an impossible
        length or symbol): then :meth:`decode` it.

        A peek validates nothing: it only says which records a reader may skip unread
        (``tests/unit/test_codec_peek.py`` holds it to :meth:`decode` for every state). A
        record the reader acts on, it decodes.
        """
        if len(data) < HEADER_LENGTH or data[:2] != MARKER:
            return None
        writer = self._by_fingerprint.get(data[2:HEADER_LENGTH])
        if writer is None or writer.peek is None or self._current.get(writer.name) is not writer:
            return None
        peek = writer.peek
        if not peek.symbols:
            return writer.name, None
        pos = HEADER_LENGTH
        try:
            for skip in peek.skips:
                n = data[pos]
                if n & 0x80:
                    n, pos = _varint(data, pos)
                else:  # one byte: ids' lengths, small attempts
                    n = (n >> 1) ^ -(n & 1)
                    pos += 1
                if skip == _SKIP_STRING:
                    if n < 0:
                        return None
                    pos += n
            index, pos = _varint(data, pos)
        except IndexError:
            return None
        if not 0 <= index < len(peek.symbols):
            return None
        return writer.name, peek.symbols[index]

    def decode(self, data: bytes) -> LedgerEvent:
        """Bytes from a topic -> a validated domain event; raises DecodeError with the reason."""
        name, datum = self.decode_datum(data)
        model = MODELS.get(name)
        if model is None:
            raise DecodeError(f"{name} is not a record the opledger topics carry")
        try:
            return model.model_validate(datum, context=READING)
        except ValidationError as exc:
            raise DecodeError(f"invalid {name}: {_summarise(exc)}") from exc

    def decode_operation(self, data: bytes) -> OperationEvent:
        """:meth:`decode` for the operation topics: a policy change there is a DecodeError."""
        event = self.decode(data)
        if isinstance(event, PolicyChanged):
            raise DecodeError("a policy change is not an event of the operation topics")
        return event


def _require_canonical(writer: _Schema, datum: dict[str, Any], body: bytes) -> None:
    """Refuse a body fastavro reads but would not write: its reader is lenient where ours is not
    (a negative enum index, counted from the end of the symbols, reads as another symbol)."""
    again = io.BytesIO()
    try:
        fastavro.schemaless_writer(again, writer.parsed, datum)
    except Exception as exc:  # a datum its own schema cannot write back is not a valid one
        raise DecodeError(f"corrupt Avro body for {writer.name}: {exc}") from exc
    if again.getvalue() != body:
        raise DecodeError(f"corrupt Avro body for {writer.name}: not in canonical encoding")


def _summarise(exc: ValidationError) -> str:
    parts = [f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors()[:3]]
    return "; ".join(parts)


def execution_to_avro(event: ExecutionTransitioned) -> dict[str, Any]:
    return event.model_dump(exclude={"kind"})


def delivery_to_avro(event: DeliveryTransitioned) -> dict[str, Any]:
    return event.model_dump(exclude={"kind"})


def _avsc(names: Iterable[Path]) -> list[Path]:
    return sorted(p for p in names if p.suffix == ".avsc")


@cache
def default_codec() -> Codec:
    """The codec over the shipped schemas (built once per process)."""
    dirs = schema_dirs()
    if not dirs:
        raise RuntimeError("schemas/ directory not found next to the ledger package")
    root = dirs[0]
    archive = root / "archive"
    return Codec(_avsc(root.iterdir()), _avsc(archive.iterdir()) if archive.is_dir() else [])
