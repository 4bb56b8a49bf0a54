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
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any, cast

import fastavro
from fastavro.schema import to_parsing_canonical_form
from pydantic import ValidationError

from ledger.domain.events import DeliveryTransitioned, ExecutionTransitioned, Transition

MARKER = b"\xc3\x01"
HEADER_LENGTH = len(MARKER) + 8
EXECUTION_RECORD = "opledger.v1.ExecutionTransitioned"
DELIVERY_RECORD = "opledger.v1.DeliveryTransitioned"

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
    plain: _PlainRecord | None = None


# Field kinds of the direct reader/writer: the only Avro types the opledger records use.
_STRING, _INT, _TIMESTAMP, _ENUM = 0, 1, 2, 3
_VARINT_BYTE = [bytes((i,)) for i in range(128)]
_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1


class _CorruptBodyError(ValueError):
    """The direct reader met bytes that are not a body of its schema."""


def _field_kind(avro_type: Any) -> tuple[int, tuple[str, ...]] | None:
    if avro_type == "string":
        return _STRING, ()
    if avro_type in ("int", "long"):
        return _INT, ()
    if isinstance(avro_type, dict):
        if avro_type.get("type") == "long" and avro_type.get("logicalType") == "timestamp-micros":
            return _TIMESTAMP, ()
        if avro_type.get("type") == "enum":
            return _ENUM, tuple(avro_type["symbols"])
    return None


class _PlainRecord:
    """Avro binary body of one flat record, read and written directly rather than through
    fastavro's generic, schema-walking reader (about 3x faster per record here; decode and
    encode are the largest per-event costs of the projector and the SDK).

    Only for a record whose fields are all string, int, long, timestamp-micros, enum or
    ``["null", one of those]``, read with the same schema that wrote it; anything else
    (archived writer schemas, other types) goes through fastavro. The bytes and the values are
    the ones fastavro writes and reads (checked against fastavro on random events and on
    truncated, bit-flipped and over-long bytes; the round-trip tests run through both paths).
    """

    __slots__ = ("_fields", "names")

    def __init__(self, fields: list[tuple[str, int, bool, tuple[str, ...]]]) -> None:
        # (name, kind, nullable, enum symbols)
        self._fields = fields
        self.names = tuple(name for name, *_ in fields)

    @classmethod
    def of(cls, raw: dict[str, Any]) -> _PlainRecord | None:
        if raw.get("type") != "record":
            return None
        fields = []
        for field in raw["fields"]:
            avro_type, nullable = field["type"], False
            if isinstance(avro_type, list):
                if len(avro_type) != 2 or avro_type[0] != "null":
                    return None
                avro_type, nullable = avro_type[1], True
            kind = _field_kind(avro_type)
            if kind is None:
                return None
            fields.append((field["name"], kind[0], nullable, kind[1]))
        return cls(fields)

    def write(self, out: bytearray, values: Iterable[Any]) -> None:
        """Append the body of a record whose field values come in schema order."""
        for (name, kind, nullable, symbols), value in zip(self._fields, values, strict=True):
            if nullable:
                if value is None:
                    out += b"\x00"
                    continue
                out += b"\x02"  # union branch 1, zig-zag encoded
            if kind == _STRING:
                if not isinstance(value, str):
                    raise TypeError(f"{name}: expected str, got {type(value).__name__}")
                encoded = value.encode()
                size = len(encoded)
                if size < 0x40:  # one-byte zig-zag varint
                    out.append(size << 1)
                else:
                    _write_long(out, size)
                out += encoded
            elif kind == _INT:
                if not isinstance(value, int):
                    raise TypeError(f"{name}: expected int, got {type(value).__name__}")
                if 0 <= value < 0x40:
                    out.append(value << 1)
                else:
                    _write_long(out, value)
            elif kind == _TIMESTAMP:
                if not isinstance(value, datetime) or value.tzinfo is None:
                    # fastavro reads a naive datetime as local time; events are always aware.
                    raise ValueError(f"{name}: expected a timezone-aware datetime")
                _write_long(out, utc_micros(value))
            else:
                try:
                    _write_long(out, symbols.index(value))
                except ValueError:
                    raise ValueError(f"{name}: {value!r} is not one of {symbols}") from None

    def read(self, data: bytes, pos: int) -> tuple[dict[str, Any], int]:
        """(field values, position after the body); raises _CorruptBodyError."""
        datum: dict[str, Any] = {}
        end = len(data)
        try:
            for name, kind, nullable, symbols in self._fields:
                if nullable:
                    branch = data[pos]
                    pos += 1
                    if branch == 0:
                        datum[name] = None
                        continue
                    if branch != 2:
                        raise _CorruptBodyError(f"{name}: union branch byte {branch}")
                # Inline fast path for one-byte varints (lengths, attempts, enum indexes).
                n = data[pos]
                pos += 1
                if n & 0x80:
                    n, pos = _read_varint_tail(data, pos, n)
                n = (n >> 1) ^ -(n & 1)
                if kind == _STRING:
                    stop = pos + n
                    if n < 0 or stop > end:
                        raise _CorruptBodyError(f"{name}: string of {n} bytes overruns the body")
                    datum[name] = data[pos:stop].decode()
                    pos = stop
                elif kind == _INT:
                    datum[name] = n
                elif kind == _TIMESTAMP:
                    datum[name] = _EPOCH + timedelta(microseconds=n)
                else:
                    if not 0 <= n < len(symbols):
                        raise _CorruptBodyError(f"{name}: enum index {n} out of range")
                    datum[name] = symbols[n]
        except IndexError:
            raise _CorruptBodyError("body ends early") from None
        except (UnicodeDecodeError, OverflowError) as exc:
            raise _CorruptBodyError(f"{type(exc).__name__}: {exc}") from None
        return datum, pos


def _write_long(out: bytearray, value: int) -> None:
    """Zig-zag varint of a 64-bit signed integer (Avro int and long)."""
    if not _LONG_MIN <= value <= _LONG_MAX:
        raise ValueError(f"{value} does not fit an Avro long")
    n = (value << 1) ^ (value >> 63)
    if n < 0x80:
        out += _VARINT_BYTE[n]
        return
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _read_varint_tail(data: bytes, pos: int, first: int) -> tuple[int, int]:
    """The rest of a varint whose first byte had the continuation bit (raises IndexError)."""
    n, shift, b = first & 0x7F, 7, first
    while b & 0x80:
        if shift > 63:
            raise _CorruptBodyError("varint longer than 10 bytes")
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        shift += 7
    return n, pos


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
        plain=_PlainRecord.of(raw),
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
        missing = {EXECUTION_RECORD, DELIVERY_RECORD} - self._current.keys()
        if missing:
            raise RuntimeError(f"schemas missing from {list(schema_dirs())}: {sorted(missing)}")

    def writer_schema(self, record_name: str) -> Any:
        return self._current[record_name].parsed

    def fingerprint(self, record_name: str) -> bytes:
        return self._current[record_name].fingerprint

    def encode(self, event: Transition) -> bytes:
        """One event as a single-object-encoded Avro record."""
        schema = self._current[
            EXECUTION_RECORD if isinstance(event, ExecutionTransitioned) else DELIVERY_RECORD
        ]
        if schema.plain is None:
            datum = (
                execution_to_avro(event)
                if isinstance(event, ExecutionTransitioned)
                else delivery_to_avro(event)
            )
            return self.encode_datum(schema.name, datum)
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
            except _CorruptBodyError as exc:
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
        if end != len(data):
            raise DecodeError(f"{len(data) - end} trailing bytes after the {writer.name} body")
        return writer.name, datum

    def decode(self, data: bytes) -> Transition:
        """Bytes from a topic -> a validated domain event; raises DecodeError with the reason."""
        name, datum = self.decode_datum(data)
        try:
            if name == EXECUTION_RECORD:
                return ExecutionTransitioned.model_validate(datum)
            return DeliveryTransitioned.model_validate(datum)
        except ValidationError as exc:
            raise DecodeError(f"invalid {name}: {_summarise(exc)}") from exc


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


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def utc_micros(value: datetime) -> int:
    """Microseconds since the epoch (what the Avro timestamp-micros fields carry)."""
    # Integer arithmetic: value.timestamp() * 1e6 goes through a float and comes out one
    # microsecond short for some instants
    # (2005-08-18T12:08:18.400133Z, 2040-06-05T01:15:58.685692Z).
    return (value.astimezone(UTC) - _EPOCH) // timedelta(microseconds=1)
