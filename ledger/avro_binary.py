"""Avro binary bodies of flat records, read and written directly.

fastavro's generic reader and writer walk the schema for every record; for the two opledger
records (strings, ints, timestamps, enums and nullable ones of those) reading and writing the
fields directly is about three times faster, and decode and encode are the largest per-event
costs of the projector and the SDK. ``ledger.codec`` uses this for the current schemas and
fastavro for everything else; ``tests/unit/test_codec_equivalence.py`` holds the two to the same
bytes and the same refusals.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def utc_micros(value: datetime) -> int:
    """Microseconds since the epoch (what the Avro timestamp-micros fields carry)."""
    # Integer arithmetic: value.timestamp() * 1e6 goes through a float and comes out one
    # microsecond short for some instants
    # (2005-08-18T12:08:18.400133Z, 2040-06-05T01:15:58.685692Z).
    return (value.astimezone(UTC) - _EPOCH) // timedelta(microseconds=1)


# Field kinds of the direct reader/writer: the only Avro types the opledger records use.
_STRING, _INT, _TIMESTAMP, _ENUM, _BOOLEAN = 0, 1, 2, 3, 4
_VARINT_BYTE = [bytes((i,)) for i in range(128)]
_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1


class CorruptBodyError(ValueError):
    """The direct reader met bytes that are not a body of its schema."""


def _field_kind(avro_type: Any) -> tuple[int, tuple[str, ...]] | None:
    if avro_type == "string":
        return _STRING, ()
    if avro_type in ("int", "long"):
        return _INT, ()
    if avro_type == "boolean":
        return _BOOLEAN, ()
    if isinstance(avro_type, dict):
        if avro_type.get("type") == "long" and avro_type.get("logicalType") == "timestamp-micros":
            return _TIMESTAMP, ()
        if avro_type.get("type") == "enum":
            return _ENUM, tuple(avro_type["symbols"])
    return None


class PlainRecord:
    """Avro binary body of one flat record, read and written directly rather than through
    fastavro's generic, schema-walking reader (about 3x faster per record here; decode and
    encode are the largest per-event costs of the projector and the SDK).

    Only for a record whose fields are all string, int, long, boolean, timestamp-micros, enum or
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
    def of(cls, raw: dict[str, Any]) -> PlainRecord | None:
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
            elif kind == _BOOLEAN:
                if not isinstance(value, bool):
                    raise TypeError(f"{name}: expected bool, got {type(value).__name__}")
                out += b"\x01" if value else b"\x00"
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
        """(field values, position after the body); raises CorruptBodyError."""
        datum: dict[str, Any] = {}
        end = len(data)
        try:
            for name, kind, nullable, symbols in self._fields:
                if nullable:
                    branch = data[pos]
                    pos += 1
                    if branch & 0x80:  # a valid index written in a longer varint than needed
                        branch, pos = _read_varint_tail(data, pos, branch)
                    branch = (branch >> 1) ^ -(branch & 1)
                    if branch == 0:
                        datum[name] = None
                        continue
                    if branch != 1:
                        raise CorruptBodyError(f"{name}: union branch {branch} out of range")
                if kind == _BOOLEAN:
                    # One byte, 0 or 1 (fastavro reads any other byte as true; written back it
                    # would not be these bytes, which the fastavro path refuses as well).
                    flag = data[pos]
                    pos += 1
                    if flag > 1:
                        raise CorruptBodyError(f"{name}: boolean byte {flag} is neither 0 nor 1")
                    datum[name] = flag == 1
                    continue
                # Inline fast path for one-byte varints (lengths, attempts, enum indexes).
                n = data[pos]
                pos += 1
                if n & 0x80:
                    n, pos = _read_varint_tail(data, pos, n)
                n = (n >> 1) ^ -(n & 1)
                if kind == _STRING:
                    stop = pos + n
                    if n < 0 or stop > end:
                        raise CorruptBodyError(f"{name}: string of {n} bytes overruns the body")
                    datum[name] = data[pos:stop].decode()
                    pos = stop
                elif kind == _INT:
                    datum[name] = n
                elif kind == _TIMESTAMP:
                    datum[name] = _EPOCH + timedelta(microseconds=n)
                else:
                    if not 0 <= n < len(symbols):
                        raise CorruptBodyError(f"{name}: enum index {n} out of range")
                    datum[name] = symbols[n]
        except IndexError:
            raise CorruptBodyError("body ends early") from None
        except (UnicodeDecodeError, OverflowError) as exc:
            raise CorruptBodyError(f"{type(exc).__name__}: {exc}") from None
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
            raise CorruptBodyError("varint longer than 10 bytes")
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        shift += 7
    return n, pos
