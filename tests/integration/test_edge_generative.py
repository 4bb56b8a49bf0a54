"""Hypothesis at the edge: generated events and raw records go through the real codec, the real
broker and the real projector (``BatchProjector`` + ``PostgresProjection``, in this process)
into the real PostgreSQL, and afterwards:

1. the projector never raised out of its loop and caught up (it may dead-letter);
2. every record on the execution and delivery topics is in exactly one of ``operation_history``
   and ``dead_letters``;
3. the tables equal the independent fold of the records the contract accepts, and no record the
   contract accepts was dead-lettered: the contract (the pydantic events) must refuse whatever
   the projection cannot store, so anything that decodes is stored.

Design, for speed on two shared cores: one ``isolated`` topic set and database, one producer and
one projector for the whole test, and hypothesis examples that append to them. Each example is
a round in two phases (most operations' histories are cut between them, so the second phase's
batch loads rows the first one stored, as in production where an intent and its outcome are
seconds apart); in each phase executions are acknowledged before deliveries are appended, as
whatever causes a delivery is appended before it. After each phase the projector catches up;
after the round, its own records are checked (1, 2, "accepted implies stored", and what each
record was built to be), so a failure names the records at fault. Rounds never share an
operation (every operation id is made fresh), so a replayed round does not depend on earlier
ones. Property 3 over every record read back is checked once at the end, over the cumulative
state. Volume comes from ``Workload`` histories seeded by hypothesis; the edge cases (both
transition records field by field, reconciliation decisions, records of an archived writer
schema, raw bytes) are drawn. A few large records (~1 MB) are appended in harness rounds
between hypothesis runs: they are slow, and need no search.

Not derandomized: each CI run explores new inputs, which is what a generative test at an edge
is for. Each run prints its base seed and is reproduced with ``--hypothesis-seed=<seed>``; a
failing round also prints hypothesis's reproduction blob. No shrinking (see ``_HYPOTHESIS``).

The database's time zone is Europe/Madrid, a zone outside which both ends of Python's datetime
range fall (its historical offset is -00:14:44, today's +01:00): a server's zone is whatever its
``initdb`` saw, and a UTC one would hide a whole class of refusals. Volume: ``--edge-records N``
(default and CI minimum 10,000; a soak run raises it).
"""

from __future__ import annotations

import io
import itertools
import json
import math
import operator
import random
import string
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from enum import Enum
from typing import Any

import fastavro
import psycopg
import pytest
from confluent_kafka import KafkaError, Message, Producer
from fastavro.schema import to_parsing_canonical_form
from hypothesis import HealthCheck, Phase, given, note, seed, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from ledger.avro_binary import utc_micros
from ledger.codec import (
    DELIVERY_RECORD,
    EXECUTION_RECORD,
    MARKER,
    crc64_avro,
    default_codec,
    schema_dirs,
)
from ledger.dead_letters import DLQ_INLINE_LIMIT
from ledger.domain.events import (
    READING,
    DeliveryTransitioned,
    ExecutionTransitioned,
    OperationEvent,
    OwnershipTaken,
    ReconciliationDecided,
    Transition,
)
from ledger.domain.ids import OPERATION_ID_RE, content_ref
from ledger.domain.reconcile import Decision, LookupStatus
from ledger.domain.states import DeliveryState, ExecutionState
from ledger.kafka import connection_config
from ledger.metrics import Metrics
from ledger.settings import Settings
from opledger.workload import Workload
from processors.batch_reader import BatchProjector
from projections.writer import PostgresProjection
from tests.support import (
    Expected,
    accepted_event,
    assert_projection_matches,
    independent_fold,
    read_all,
)
from tests.unit.factories import event_ids, operation_ids, sha_refs

#: Records per CI run, at least; ``--edge-records`` can only raise it.
MIN_RECORDS = 10_000
#: Hypothesis runs at most this many rounds at a time (sized to what is left to append).
MAX_ROUNDS_PER_RUN = 60
#: A round of large records at the start and then every this many records.
LARGE_EVERY = 6_000
LARGEST_RECORD = 1_040_000
DATABASE_TIME_ZONE = "Europe/Madrid"

CODEC = default_codec()
_RECORD_NAMES = {"execution": EXECUTION_RECORD, "delivery": DELIVERY_RECORD}
_MODELS: dict[str, type[OperationEvent]] = {
    "execution": ExecutionTransitioned,
    "delivery": DeliveryTransitioned,
    "ownership": OwnershipTaken,
    "decision": ReconciliationDecided,
}
#: The topic (named by its machine) each kind of event travels on.
_TOPIC_OF = {
    "execution": "execution",
    "ownership": "execution",
    "decision": "execution",
    "delivery": "delivery",
}


def _text_fields(record_name: str) -> tuple[str, ...]:
    """Every string field of a record, optional ones included, as the .avsc lists them."""
    return tuple(
        f["name"]
        for f in CODEC.writer_schema(record_name)["fields"]
        if f["type"] == "string" or (isinstance(f["type"], list) and "string" in f["type"])
    )


_TEXT_FIELDS = {machine: _text_fields(name) for machine, name in _RECORD_NAMES.items()}
_NULLABLE = {
    machine: {f["name"] for f in CODEC.writer_schema(name)["fields"] if isinstance(f["type"], list)}
    for machine, name in _RECORD_NAMES.items()
}
_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1


# --- values at the edge ----------------------------------------------------------------------

_ALNUM = string.ascii_letters + string.digits
#: Replaced by the bytes of a lone surrogate after encoding (same UTF-8 length: 3 bytes).
PLACEHOLDER = "\ue000"
_SURROGATES = (b"\xed\xa0\x80", b"\xed\xb0\x80", b"\xed\xaf\xbf", b"\xed\xbf\xbf")
#: Byte sequences that are not UTF-8 (and that PostgreSQL refuses too).
_NOT_UTF8 = (
    b"\xc0\x80",  # Java's "modified UTF-8" NUL
    b"\xed\xa0\xbd\xed\xb8\x80",  # CESU-8: a surrogate pair encoded separately
    b"\xc0\xaf",  # overlong "/"
    b"\xff",
    b"\xf4\x90\x80\x80",  # beyond U+10FFFF
    b"\xe2\x82",  # a sequence cut short
    b"\x80",  # a lone continuation byte
    b"\xf8\x88\x80\x80\x80",  # the 5-byte form
)
_EDGE_CHARS = (
    "\U0001f600",  # astral: 4 UTF-8 bytes, a surrogate pair in JSON and UTF-16
    "\U0010ffff",  # the last code point
    "\U000e0001",  # language tag
    "e\u0301",  # combining acute accent
    "\u0915\u094d\u0937",  # Devanagari conjunct
    "\u200f\u05d0\u05d1",  # RTL mark and Hebrew
    "\u202e",  # right-to-left override
    "\u0627\u0644",  # Arabic
    "\ufeff",  # byte order mark
    "\ufffe",  # noncharacters and the replacement character
    "\uffff",
    "\ufffd",
    "\x01",  # C0 and C1 controls (not NUL)
    "\x1b[31m",
    "\x7f",
    "\x85",
    "\x9f",
    "\u2028",
    "\r\n",
    "\t",
    "\\",
    "\\u0000",  # an escaped NUL as text, not a NUL
    '"',
    "'",
    "%s",
)
_text_chars = st.characters(codec="utf-8", exclude_characters="\x00" + PLACEHOLDER)
error_texts = st.one_of(
    st.text(_text_chars, min_size=1, max_size=300),
    st.lists(st.sampled_from(_EDGE_CHARS), min_size=1, max_size=60).map(
        lambda parts: ("".join(parts) * 20)[:1000]
    ),
    # Exactly the limit, in characters that take 1 to 4 bytes each.
    st.sampled_from([c for c in _EDGE_CHARS if len(c) == 1]).map(lambda c: c * 1000),
)


def _names(first: str, rest: str, limit: int) -> st.SearchStrategy[str]:
    short = st.builds(operator.add, st.sampled_from(first), st.text(rest, max_size=12))
    # Exactly at the limit. A short word repeated: a long random run looks like a key to the
    # secret check, which would make nearly every such value invalid.
    longest = st.builds(
        lambda f, word: (f + word * limit)[:limit],
        st.sampled_from(first),
        st.text(rest, min_size=1, max_size=9),
    )
    return st.one_of(short, longest)


identifiers = _names(_ALNUM, _ALNUM + "._:@/-", 128)
tool_names = _names(string.ascii_letters, _ALNUM + "._-", 128)
destinations = _names(_ALNUM, _ALNUM + "._:/@-", 256)
provider_refs = _names(_ALNUM, _ALNUM + "._:/@=+-", 256)
_US = timedelta(microseconds=1)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_PY_MIN = datetime.min.replace(tzinfo=UTC)
_PY_MAX = datetime.max.replace(tzinfo=UTC)
_PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
EDGE_TIMES = (
    _PY_MIN,
    _PY_MIN + timedelta(minutes=14, seconds=43),  # still before year 1 in Madrid's LMT
    _PY_MIN + timedelta(days=1),
    _PY_MIN + timedelta(days=1) - _US,
    _EPOCH - _US,
    _EPOCH,
    _EPOCH + _US,
    _PG_EPOCH - _US,
    _PG_EPOCH,
    datetime(1582, 10, 15, tzinfo=UTC),  # the Gregorian switch
    datetime(2038, 1, 19, 3, 14, 7, tzinfo=UTC),  # the 32-bit time_t limit
    datetime(2038, 1, 19, 3, 14, 8, tzinfo=UTC),
    _PY_MAX - timedelta(days=1),
    _PY_MAX - timedelta(days=1) + _US,
    _PY_MAX - timedelta(hours=1),  # already year 10000 in Madrid
    _PY_MAX,
)
_offsets = st.one_of(
    st.just(UTC),
    st.timedeltas(
        min_value=-timedelta(hours=23, minutes=59), max_value=timedelta(hours=23, minutes=59)
    ).map(timezone),
)
timestamps = st.one_of(
    st.sampled_from(EDGE_TIMES),
    st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30), timezones=_offsets),
)
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
op_ids = st.one_of(
    st.sampled_from(["op_00000000000000000000000000", "op_7ZZZZZZZZZZZZZZZZZZZZZZZZZ"]),
    operation_ids,
)
EDGE_ATTEMPTS = (0, 1, 2, 999_999, 1_000_000, 1_000_001, 2**31 - 1, 2**31, -1)
EDGE_LEASES = (None, 0, 1, 2, 2**31, 2**62, 2**62 + 1, 2**63 - 1, -1)


# --- what hypothesis draws -------------------------------------------------------------------

EventSpec = dict[str, Any]  # the fields of one event, as model_dump gives them (with "kind")


@st.composite
def extreme_histories(draw: st.DrawFn) -> list[EventSpec]:
    """One operation's legal history with every field drawn at its edge: longest identifiers,
    unicode error texts, timestamps at the ends of the ranges, reconciliation rounds, delivery
    retries. Whether each event is valid is left to the contract (the harness asks it)."""
    op = draw(op_ids)
    tenant, tool, request = draw(identifiers), draw(tool_names), draw(sha_refs)
    result = draw(sha_refs)
    # Small pools drawn once and picked from per event: hypothesis gives up on (and stops
    # drawing) examples whose draws exceed its buffer, and a history of fresh 1000-character
    # texts for every event would.
    actors = draw(st.lists(identifiers, min_size=1, max_size=3))
    errors = draw(st.lists(error_texts, min_size=1, max_size=2))
    refs = draw(st.lists(st.none() | provider_refs, min_size=1, max_size=2))
    times = draw(st.lists(timestamps, min_size=1, max_size=4))
    lease = draw(st.sampled_from([None, 1, 2**31, 2**62]))
    first_event = draw(event_ids)
    numbers = itertools.count()
    out: list[EventSpec] = []

    def error() -> str:
        return draw(st.sampled_from(errors))

    def common(attempt: int) -> EventSpec:
        return {
            "event_id": first_event[:-4] + _crockford(next(numbers), 4),
            "operation_id": op,
            "tenant_id": tenant,
            "actor_id": draw(st.sampled_from(actors)),
            "occurred_at": draw(st.sampled_from(times)),
            "attempt": attempt,
        }

    def execution(state: ExecutionState, attempt: int, **extra: Any) -> None:
        out.append(
            {
                **common(attempt),
                "kind": "execution",
                "state": state,
                "tool_name": tool,
                "request_hash": request,
                "provider_ref": draw(st.sampled_from(refs)),
                "result_ref": None,
                "error": None,
                "lease_token": lease,
                "decision_id": None,
                **extra,
            }
        )

    def new_attempt_decided(attempt: int) -> str:
        """The reconciliation decision a new attempt after UNKNOWN needs; its event id."""
        decision = {
            **common(attempt),
            "kind": "decision",
            "lease_token": lease,
            "decision": Decision.NEW_ATTEMPT,
            "lookup": LookupStatus.NOT_FOUND,
            "provider_ref": draw(st.sampled_from(refs)),
            "result_ref": None,
            "policy_version": None,
            "policy_allowed": True,
            "reason": error(),
        }
        out.append(decision)
        return str(decision["event_id"])

    def delivery(destination: str, state: DeliveryState, attempt: int, **extra: Any) -> None:
        out.append(
            {
                **common(attempt),
                "kind": "delivery",
                "destination": destination,
                "state": state,
                "result_ref": draw(st.sampled_from([None, result])),
                "next_attempt_at": None,
                "error": None,
                **extra,
            }
        )

    execution(ExecutionState.INTENT_RECORDED, 0)
    if draw(st.integers(0, 9)) == 9:  # refused before any dispatch
        execution(ExecutionState.FAILED, 0, error=error())
        return out
    attempt = 1
    execution(ExecutionState.DISPATCHED, attempt)
    for _ in range(draw(st.integers(0, 2))):  # contact lost, reconciled, dispatched again
        execution(ExecutionState.UNKNOWN, attempt, error=error())
        decision = new_attempt_decided(attempt)
        attempt += 1
        execution(ExecutionState.DISPATCHED, attempt, decision_id=decision)
    end = draw(st.sampled_from(["succeeded", "succeeded", "failed", "unknown", "dispatched"]))
    if end == "failed":
        execution(ExecutionState.FAILED, attempt, error=error())
    elif end == "unknown":
        execution(ExecutionState.UNKNOWN, attempt, error=error())
    elif end == "succeeded":
        execution(ExecutionState.SUCCEEDED, attempt, result_ref=result)
        for destination in draw(st.lists(destinations, max_size=2, unique=True)):
            sends = 0
            delivery(
                destination,
                DeliveryState.PENDING,
                0,
                next_attempt_at=draw(st.sampled_from([None, *times])),
                error=draw(st.sampled_from([None, *errors])),
            )
            for _ in range(draw(st.integers(0, 2))):  # sent, failed, scheduled again
                sends += 1
                delivery(destination, DeliveryState.SENT, sends)
                delivery(
                    destination,
                    DeliveryState.PENDING,
                    sends,
                    next_attempt_at=draw(st.sampled_from(times)),
                    error=error(),
                )
            sends += 1
            delivery(destination, DeliveryState.SENT, sends)
            final = draw(st.sampled_from(["acked", "dead", "open"]))
            if final == "acked":
                delivery(destination, DeliveryState.ACKED, sends)
            elif final == "dead":
                delivery(destination, DeliveryState.DEAD_LETTERED, sends, error=error())
    return out


#: Illegal and duplicate transitions made from legal histories: they must become duplicates
#: and anomalies in the history (or dead letters, when the contract refuses the result).
MUTATIONS = (
    "repeat",
    "drop",
    "swap",
    "foreign",
    "request",
    "orphan",
    "attempt",
    "state",
    "time",
    "lease",
)
#: Text no UTF-8 store can hold (NUL, lone surrogates, bytes that are not UTF-8), values past
#: the contract's limits, and credentials (whether a reader refuses those is the contract's
#: call; the record must then be stored or dead-lettered accordingly).
POISONS = ("nul", "surrogate", "not_utf8", "too_long", "secret")
#: Records a foreign producer could write.
RAWS = (
    "noise",
    "fingerprint",
    "short_header",
    "truncated",
    "trailing",
    "cross_topic",
    "key",
    "empty",
    "overlong",
    "varint",
    "old_schema",
)
_index = st.integers(0, 2**16)


@dataclass(frozen=True)
class Plan:
    """One round, as hypothesis draws it (compact, so a failing round prints readably)."""

    workload_seed: int
    workload_ops: int
    workload_start: datetime
    extreme: list[list[EventSpec]]
    mutations: list[tuple[str, int, int]]
    poisons: list[tuple[str, int, int, int]]
    raws: list[tuple[str, int, int, bytes]]
    #: where each operation's history is cut between the round's two phases
    split: int


plans = st.builds(
    Plan,
    split=_index,
    workload_seed=st.integers(0, 2**32 - 1),
    workload_ops=st.integers(1, 30),
    workload_start=st.one_of(
        st.sampled_from(
            [
                datetime(1970, 1, 1, tzinfo=UTC),
                datetime(1970, 1, 2, tzinfo=UTC),
                datetime(9999, 12, 29, tzinfo=UTC),
            ]
        ),
        st.datetimes(
            min_value=datetime(1970, 1, 2),
            max_value=datetime(9999, 12, 29),
            timezones=st.just(UTC),
        ),
    ),
    extreme=st.lists(extreme_histories(), min_size=1, max_size=3),
    mutations=st.lists(st.tuples(st.sampled_from(MUTATIONS), _index, _index), max_size=8),
    poisons=st.lists(st.tuples(st.sampled_from(POISONS), _index, _index, _index), max_size=8),
    raws=st.lists(
        st.tuples(st.sampled_from(RAWS), _index, _index, st.binary(max_size=64)), max_size=12
    ),
)


# --- turning a plan into records -------------------------------------------------------------


class Expect(Enum):
    STORED = "stored"  # in operation_history (applied, duplicate or anomaly)
    DEAD = "dead"  # in dead_letters


@dataclass(frozen=True, slots=True)
class Record:
    machine: str  # the topic it is written to
    key: bytes | None
    value: bytes | None
    expect: Expect
    kind: str  # what the generator meant it to be, for counts and messages
    detail: str = ""


def _zigzag(n: int) -> int:
    return n * 2 if n >= 0 else -n * 2 - 1


def varint(unsigned: int, width: int = 0) -> bytes:
    """``unsigned`` as an Avro varint, padded with continuation bytes to ``width`` bytes (a
    longer encoding than needed is still valid Avro)."""
    out = bytearray()
    while True:
        byte, unsigned = unsigned & 0x7F, unsigned >> 7
        out.append(byte)
        if not unsigned and len(out) >= width:
            break
        out[-1] |= 0x80
    return bytes(out)


def avro_body(
    machine: str, values: dict[str, Any], pad: int = 0, raw: dict[str, bytes] | None = None
) -> bytes:
    """An independent writer of the two records: each varint ``pad`` bytes longer than needed
    (at most 10 bytes, the longest a 64-bit varint may take), and ``raw`` bytes in place of a
    field's whole encoding. With neither it writes the codec's bytes (checked by the caller)."""
    raw = raw or {}
    out = bytearray()

    def number(n: int) -> bytes:
        natural = len(varint(_zigzag(n)))
        return varint(_zigzag(n), min(10, natural + pad) if pad else 0)

    for spec in CODEC.writer_schema(_RECORD_NAMES[machine])["fields"]:
        name, avro_type = spec["name"], spec["type"]
        if name in raw:
            out += raw[name]
            continue
        value = values[name]
        if isinstance(avro_type, list):
            if value is None:
                out += number(0)
                continue
            out += number(1)
            avro_type = avro_type[1]
        if avro_type == "string":
            encoded = str(value).encode()
            out += number(len(encoded)) + encoded
        elif avro_type == "boolean":
            out += b"\x01" if value else b"\x00"
        elif avro_type in ("int", "long"):
            out += number(int(value))
        elif avro_type.get("logicalType") == "timestamp-micros":
            out += number(utc_micros(value))
        else:
            out += number(avro_type["symbols"].index(str(value)))
    return bytes(out)


@dataclass(frozen=True)
class Archived:
    """A writer schema kept in schemas/archive: events it wrote must still read."""

    name: str
    parsed: Any
    fingerprint: bytes
    fields: frozenset[str]
    source: str


def _archived() -> list[Archived]:
    out = []
    for path in sorted((schema_dirs()[0] / "archive").glob("*.avsc")):
        raw = json.loads(path.read_text(encoding="utf-8"))
        canonical = to_parsing_canonical_form(raw).encode()
        out.append(
            Archived(
                name=f"{raw['namespace']}.{raw['name']}",
                parsed=fastavro.parse_schema(raw),
                fingerprint=crc64_avro(canonical).to_bytes(8, "little"),
                fields=frozenset(f["name"] for f in raw["fields"]),
                source=path.name,
            )
        )
    return out


ARCHIVED = _archived()


def _header(machine: str) -> bytes:
    return MARKER + CODEC.fingerprint(_RECORD_NAMES[machine])


def build(fields: EventSpec) -> tuple[OperationEvent, bool]:
    """The event, and whether the contract accepts it from the topics (as the projector reads
    it); if not, it is built without validation, as a producer that bypasses the SDK would."""
    model = _MODELS[fields["kind"]]
    try:
        return model.model_validate(fields, context=READING), True
    except ValidationError:
        return model.model_construct(**fields), False


def _crockford(n: int, width: int) -> str:
    return "".join(_CROCKFORD[(n >> (5 * i)) & 31] for i in reversed(range(width)))


class FreshIds:
    """Operation ids no earlier round used: the drawn id's time part (which holds the edge
    values) with a counter as its random part."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)

    def remap(self, histories: list[list[EventSpec]]) -> None:
        mapping: dict[str, str] = {}
        for history in histories:
            for spec in history:
                drawn = spec["operation_id"]
                if drawn not in mapping:
                    mapping[drawn] = f"{drawn[:13]}{_crockford(next(self._counter), 16)}"
                    assert OPERATION_ID_RE.match(mapping[drawn])
                spec["operation_id"] = mapping[drawn]


def _mutate(histories: list[list[EventSpec]], mutation: tuple[str, int, int]) -> None:
    kind, a, b = mutation
    history = histories[a % len(histories)]
    if not history:
        return
    i = b % len(history)
    event = history[i]
    if kind == "repeat":  # a service retrying its append, possibly much later
        history.insert(i + 1 + a % (len(history) - i), dict(event))
    elif kind == "drop":
        del history[i]
    elif kind == "swap" and i + 1 < len(history):
        history[i], history[i + 1] = history[i + 1], history[i]
    elif kind == "foreign":
        history[i] = {**event, "tenant_id": f"intruder-{a % 7}"}
    elif kind == "request" and event["kind"] != "ownership":
        changed = "request_hash" if event["kind"] == "execution" else "result_ref"
        history[i] = {**event, changed: content_ref(b"another %d" % a)}
    elif kind == "orphan":  # an event for an operation with no (valid) start
        history[i] = {**event, "operation_id": f"op_7ZZZZZZZZZ{_crockford(a, 16)}"}
    elif kind == "attempt":
        history[i] = {**event, "attempt": EDGE_ATTEMPTS[a % len(EDGE_ATTEMPTS)]}
    elif kind == "state" and event["kind"] in ("execution", "delivery"):
        states = list(ExecutionState if event["kind"] == "execution" else DeliveryState)
        history[i] = {**event, "state": states[a % len(states)]}
    elif kind == "state" and event["kind"] == "decision":
        history[i] = {**event, "decision": list(Decision)[a % len(Decision)]}
    elif kind == "lease" and "lease_token" in event:
        history[i] = {**event, "lease_token": EDGE_LEASES[a % len(EDGE_LEASES)]}
    elif kind == "time":
        history[i] = {**event, "occurred_at": EDGE_TIMES[a % len(EDGE_TIMES)]}


#: The fields the secret check guards, with a credential shaped for each.
_SECRETS = {
    "error": "login failed for user=bob password=hunter2!",
    "provider_ref": "sk-proj-AbCdEfGhIjKlMnOp1234",
    "destination": "https://admin:s3cr3t@db.internal:5432/x",
}
_LIMITS = {"error": 1000, "destination": 256, "provider_ref": 256}


def poisoned(spec: EventSpec, poison: tuple[str, int, int, int]) -> Record:
    """A valid event with one text field made unstorable, too long, or a credential."""
    kind, _, pick, where = poison
    machine = spec["kind"]
    fields = [f for f in _TEXT_FIELDS[machine] if kind != "secret" or f in _SECRETS]
    name = fields[pick % len(fields)]
    text = spec.get(name) or "x"
    cut = where % (len(text) + 1)
    key = spec["operation_id"].encode()
    label = f"poison {kind}"
    detail = f"{machine}.{name}"
    if kind == "surrogate":
        event = _MODELS[machine].model_construct(
            **{**spec, name: text[:cut] + PLACEHOLDER + text[cut:]}
        )
        body = CODEC.encode(event)
        assert body.count(PLACEHOLDER.encode()) == 1
        value = body.replace(PLACEHOLDER.encode(), _SURROGATES[where % len(_SURROGATES)])
        return Record(machine, key, value, Expect.DEAD, label, detail)
    if kind == "not_utf8":
        encoded = text.encode()
        bad = encoded[:cut] + _NOT_UTF8[where % len(_NOT_UTF8)] + encoded[cut:]
        union = b"\x02" if name in _NULLABLE[machine] else b""
        body = avro_body(machine, spec, raw={name: union + varint(_zigzag(len(bad))) + bad})
        return Record(machine, key, _header(machine) + body, Expect.DEAD, label, detail)
    if kind == "nul":
        changed = ("\x00", text[:cut] + "\x00" + text[cut:], text + "\x00")[where % 3]
    elif kind == "too_long":
        limit = _LIMITS.get(name, 128)
        changed = (text * (limit + 1))[: limit + 1]
    else:
        changed = _SECRETS[name]
    # Built without validation when the contract refuses it; what it accepts must be stored.
    event, valid = build({**spec, name: changed})
    if name == "operation_id":
        key = event.operation_id.encode()
    expect = Expect.STORED if valid else Expect.DEAD
    return Record(machine, key, CODEC.encode(event), expect, label, detail)


_LAST = "the last field"
_VARINT_CORRUPTIONS: tuple[tuple[str, bytes, str], ...] = (
    ("attempt", b"\xff" * 10 + b"\x01", "11-byte varint"),
    ("attempt", b"\xff" * 9 + b"\x7f", "10-byte varint beyond 64 bits"),
    ("attempt", varint(_zigzag(2**31)), "attempt 2^31, beyond an Avro int"),
    ("attempt", varint(_zigzag(_LONG_MAX)), "attempt 2^63-1"),
    ("attempt", varint(_zigzag(-1)), "attempt -1"),
    ("attempt", varint(_zigzag(1_000_001)), "attempt past the contract's limit"),
    ("occurred_at", varint(_zigzag(_LONG_MAX)), "timestamp at the Avro long maximum"),
    ("occurred_at", varint(_zigzag(_LONG_MIN)), "timestamp at the Avro long minimum"),
    ("occurred_at", varint(_zigzag(utc_micros(_PY_MAX) + 1)), "timestamp after year 9999"),
    ("occurred_at", varint(_zigzag(utc_micros(_PY_MIN) - 1)), "timestamp before year 1"),
    ("occurred_at", varint(_zigzag(-210_866_803_200_000_000)), "PostgreSQL's 4713 BC"),
    ("tenant_id", varint(_zigzag(-1)), "negative string length"),
    ("tenant_id", varint(_zigzag(2**40)) + b"abc", "string longer than the body"),
    ("state", varint(_zigzag(7)), "enum index out of range"),
    ("state", varint(_zigzag(-1)), "negative enum index"),
    ("error", varint(_zigzag(2)), "union branch 2"),
    ("error", varint(_zigzag(-1)), "negative union branch"),
    (_LAST, b"\x82", "varint cut off by the end of the body"),
    ("lease_token", b"\x02" + varint(_zigzag(2**62 + 1)), "lease token past the contract's limit"),
    ("lease_token", b"\x02" + varint(_zigzag(-1)), "negative lease token"),
)


def raw_records(
    raw: tuple[str, int, int, bytes], bases: Sequence[Transition]
) -> tuple[str | None, list[Record]]:
    """What a foreign producer could write, most of it derived from one of this round's valid
    events; with the operation that event belongs to (None when none)."""
    kind, a, b, payload = raw
    machine = ("execution", "delivery")[b % 2]
    label = f"raw {kind}"
    if kind == "noise":
        key = (None, payload[:8], b"op_noise")[a % 3]
        return None, [Record(machine, key, payload, Expect.DEAD, label)]
    if kind == "fingerprint":
        fingerprint = (payload + bytes(8))[:8]
        if fingerprint in (CODEC.fingerprint(EXECUTION_RECORD), CODEC.fingerprint(DELIVERY_RECORD)):
            return None, []
        value = MARKER + fingerprint + payload[8:]
        return None, [Record(machine, b"op_x", value, Expect.DEAD, label)]
    if kind == "short_header":
        return None, [Record(machine, b"op_x", _header(machine)[: 2 + a % 8], Expect.DEAD, label)]
    if kind == "empty":
        return None, [Record(machine, b"op_x", (None, b"")[a % 2], Expect.DEAD, label)]
    if not bases:
        return None, []
    event = bases[a % len(bases)]
    machine, key = event.kind, event.operation_id.encode()
    operation = event.operation_id
    encoded = CODEC.encode(event)
    if kind == "truncated":
        return operation, [Record(machine, key, encoded[: b % len(encoded)], Expect.DEAD, label)]
    if kind == "trailing":
        return operation, [Record(machine, key, encoded + (payload or b"\x00"), Expect.DEAD, label)]
    if kind == "cross_topic":
        other = "delivery" if machine == "execution" else "execution"
        return operation, [Record(other, key, encoded, Expect.DEAD, label, f"{machine} event")]
    if kind == "key":
        wrong = (
            None,
            b"",
            key.lower(),
            key + b"\x00",
            key[:-1],
            b"op_" + bytes(26),
            payload,
            key.decode().encode("utf-16-le"),
        )[b % 8]
        if wrong == key:
            return operation, []
        return operation, [Record(machine, wrong, encoded, Expect.DEAD, label, repr(wrong)[:40])]
    if kind == "old_schema":  # written by an archived writer schema: read by evolution
        archived = [a for a in ARCHIVED if a.name == _RECORD_NAMES[machine]]
        if not archived:
            return operation, []
        old = archived[a % len(archived)]
        datum = {k: v for k, v in event.model_dump().items() if k in old.fields}
        body = io.BytesIO()
        fastavro.schemaless_writer(body, old.parsed, datum)
        value = MARKER + old.fingerprint + body.getvalue()
        return operation, [Record(machine, key, value, Expect.STORED, label, old.source)]
    values = event.__dict__
    assert _header(machine) + avro_body(machine, values) == encoded, "test writer = codec"
    if kind == "overlong":  # valid Avro: varints longer than needed still read the same
        value = _header(machine) + avro_body(machine, values, pad=1 + b % 9)
        return operation, [Record(machine, key, value, Expect.STORED, label)]
    last = CODEC.writer_schema(_RECORD_NAMES[machine])["fields"][-1]["name"]
    fields = set(values) | {_LAST}
    corruptions = [c for c in _VARINT_CORRUPTIONS if c[0] in fields]
    name, encoding, what = corruptions[b % len(corruptions)]
    name = last if name == _LAST else name
    value = _header(machine) + avro_body(machine, values, raw={name: encoding})
    return operation, [Record(machine, key, value, Expect.DEAD, label, what)]


def materialize(plan: Plan, ids: FreshIds) -> tuple[list[Record], list[Record]]:
    """The round's records in two phases, projected one after the other, so that most
    operations span two projector batches (as in production, where an intent and its outcome
    are seconds apart): the second batch loads the rows the first one stored."""
    histories = [
        [e.model_dump() for e in op]
        for op in Workload(seed=plan.workload_seed, start=plan.workload_start).operations(
            plan.workload_ops
        )
    ]
    histories += [[dict(spec) for spec in history] for history in plan.extreme]
    for mutation in plan.mutations:
        _mutate(histories, mutation)
    ids.remap(histories)
    # Per operation (histories may share one), in the order they are made.
    operations: dict[str | None, list[Record]] = {}
    valid: list[Transition] = []
    for history in histories:
        for spec in history:
            event, ok = build(spec)
            operations.setdefault(event.operation_id, []).append(
                Record(
                    _TOPIC_OF[event.kind],
                    event.operation_id.encode(),
                    CODEC.encode(event),
                    Expect.STORED if ok else Expect.DEAD,
                    "event" if ok else "event the contract refuses",
                    f"{spec['kind']} {spec.get('state', spec.get('decision'))} "
                    f"attempt {spec['attempt']}",
                )
            )
            if ok and isinstance(event, ExecutionTransitioned | DeliveryTransitioned):
                valid.append(event)
    for poison in plan.poisons:
        if valid:
            base = valid[poison[1] % len(valid)]
            operations.setdefault(base.operation_id, []).append(poisoned(base.model_dump(), poison))
    for raw in plan.raws:
        operation, records = raw_records(raw, valid)
        operations.setdefault(operation, []).extend(records)
    first: list[Record] = []
    second: list[Record] = []
    for number, (operation, records) in enumerate(operations.items()):
        # Each operation's execution-topic records before its deliveries (stable), then cut: a
        # delivery in the first phase has every execution record of its operation before it.
        # The fold assumes it (whatever makes a delivery legal is appended before it); a copy
        # of an execution event appended after a delivery could make that delivery legal late.
        ordered = sorted(records, key=lambda r: r.machine != "execution")
        cut = 0 if operation is None else plan.split * (number + 1) % (len(ordered) + 1)
        first += ordered[:cut]
        second += ordered[cut:]
    return first, second


def large_records(rnd: random.Random, ids: FreshIds) -> list[Record]:
    """A few records near the broker's limit (about 1 MiB), each dead for another reason."""
    (op,) = Workload(seed=rnd.randrange(2**32)).operations(1)
    history = [[op[0].model_dump()]]
    ids.remap(history)
    event, ok = build(history[0][0])
    assert ok
    key, encoded = event.operation_id.encode(), CODEC.encode(event)
    huge_error = DeliveryTransitioned.model_construct(
        **{
            **history[0][0],
            "kind": "delivery",
            "destination": "webhook:crm",
            "state": DeliveryState.DEAD_LETTERED,
            "error": "\U0001f600" * (rnd.randint(DLQ_INLINE_LIMIT, LARGEST_RECORD - 200) // 4),
        }
    )
    over_inline = rnd.randbytes(rnd.randint(DLQ_INLINE_LIMIT + 1, LARGEST_RECORD))
    under_inline = rnd.randbytes(rnd.randint(DLQ_INLINE_LIMIT - 4096, DLQ_INLINE_LIMIT - 64))
    huge_key = rnd.randbytes(rnd.randint(DLQ_INLINE_LIMIT, LARGEST_RECORD - 1000))
    return [
        Record("execution", b"op_large", over_inline, Expect.DEAD, "large noise"),
        Record("delivery", key, under_inline, Expect.DEAD, "large noise under the inline limit"),
        Record("delivery", key, CODEC.encode(huge_error), Expect.DEAD, "large error text"),
        Record("execution", huge_key, encoded, Expect.DEAD, "large key"),
    ]


# --- the harness -----------------------------------------------------------------------------

Coordinate = tuple[str, int, int]


@dataclass
class Harness:
    """One producer and one in-process projector over one isolated topic set and database."""

    settings: Settings
    ids: FreshIds = field(default_factory=FreshIds)
    records: int = 0
    rounds: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    ends: dict[tuple[str, int], int] = field(default_factory=dict)
    crashed: AssertionError | None = None
    #: what each appended record was meant to be, to name the ones a crash was projecting
    appended: dict[Coordinate, Record] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.topics = {
            "execution": self.settings.execution_topic,
            "delivery": self.settings.delivery_topic,
        }
        self.producer = Producer(
            {
                **connection_config(self.settings),
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "partitioner": "murmur2_random",  # key -> partition as the SDK and Java clients
                "message.max.bytes": 1_048_576,
                "compression.type": "none",
            }
        )
        self.sink = PostgresProjection.connect(self.settings.dsn)
        self.projector = BatchProjector(
            self.settings, self.sink, CODEC, Metrics.create(CollectorRegistry())
        )
        self.projector._consumer = self.projector._open()  # driven step by step
        self.db = psycopg.connect(self.settings.dsn, autocommit=True)

    def close(self) -> None:
        self.projector.close()
        self.sink.close()
        self.db.close()

    def round(self, *phases: list[Record]) -> None:
        """Append each phase and let the projector catch up; then check where each record
        ended."""
        if self.crashed is not None:
            # The same error from the same place: the projector stays stuck on that batch,
            # and hypothesis must see one failure, not a new one per later round.
            raise self.crashed
        records: list[Record] = []
        coordinates: list[Coordinate] = []
        for phase in phases:
            appended = self._append(phase)
            self.appended.update(zip(appended, phase, strict=True))
            coordinates += appended
            records += phase
            try:
                self._catch_up()
            except Exception as exc:
                self.crashed = self._crash(exc)
                raise self.crashed from exc
        self.rounds += 1
        self.records += len(records)
        self.kinds.update(r.kind for r in records)
        self._check(records, coordinates)

    def _crash(self, exc: Exception) -> AssertionError:
        """The projector raised out of its loop: name what it was projecting."""
        pending = self.projector._pending or []
        projecting = Counter(
            f"{record.kind} ({record.detail})" if record else "?"
            for record in (
                self.appended.get(
                    (r.coordinates.topic, r.coordinates.partition, r.coordinates.offset)
                )
                for r in pending
            )
        )
        return AssertionError(
            f"the projector raised {exc!r} out of its loop, projecting a batch of "
            f"{len(pending)} records: {dict(projecting.most_common(12))}"
        )

    def _append(self, records: list[Record]) -> list[Coordinate]:
        coordinates: list[Coordinate | None] = [None] * len(records)
        errors: list[str] = []

        def reporter(index: int) -> Callable[[KafkaError | None, Message], None]:
            def report(err: KafkaError | None, msg: Message) -> None:
                if err is not None:
                    errors.append(f"{records[index].kind}: {err}")
                    return
                topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
                assert topic is not None and partition is not None and offset is not None
                coordinates[index] = (topic, partition, offset)

            return report

        # Executions are acknowledged before any delivery is appended: whatever causes a
        # delivery is appended before it, the order the projector relies on.
        for machine in ("execution", "delivery"):
            for index, record in enumerate(records):
                if record.machine != machine:
                    continue
                while True:
                    try:
                        self.producer.produce(
                            self.topics[machine],
                            key=record.key,
                            value=record.value,
                            on_delivery=reporter(index),
                        )
                        break
                    except BufferError:
                        self.producer.poll(0.05)
            assert self.producer.flush(60) == 0, "broker did not acknowledge every record"
        assert not errors, errors[:5]
        done = [c for c in coordinates if c is not None]
        assert len(done) == len(records)
        for topic, partition, offset in done:
            self.ends[(topic, partition)] = max(self.ends.get((topic, partition), 0), offset + 1)
        return done

    def _behind(self) -> int:
        rows = self.db.execute(
            "SELECT topic, partition, next_offset FROM projector_offsets WHERE consumer = %s",
            (self.settings.projector_group,),
        ).fetchall()
        stored = {(t, p): n for t, p, n in rows}
        return sum(max(0, end - stored.get(k, 0)) for k, end in self.ends.items())

    def _catch_up(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while behind := self._behind():
            if time.monotonic() > deadline:
                health = self.projector.health.snapshot()
                raise AssertionError(
                    f"projector {behind} records behind after {timeout_s}s: {health}"
                )
            for _ in range(4):
                self.projector.run_once()

    def _places(
        self, coordinates: Sequence[Coordinate]
    ) -> dict[Coordinate, tuple[bool, str | None]]:
        """Per record: whether it is in operation_history, and its dead-letter reason if any."""
        rows = self.db.execute(
            "SELECT x.t, x.p, x.o, "
            " EXISTS (SELECT 1 FROM operation_history h "
            '         WHERE h.topic = x.t AND h.partition = x.p AND h."offset" = x.o), '
            " (SELECT d.reason FROM dead_letters d "
            '   WHERE d.topic = x.t AND d.partition = x.p AND d."offset" = x.o) '
            "FROM unnest(%s::text[], %s::int[], %s::bigint[]) AS x(t, p, o)",
            (
                [c[0] for c in coordinates],
                [c[1] for c in coordinates],
                [c[2] for c in coordinates],
            ),
        ).fetchall()
        return {(t, p, o): (stored, reason) for t, p, o, stored, reason in rows}

    def _check(self, records: list[Record], coordinates: list[Coordinate]) -> None:
        places = self._places(coordinates)
        problems: list[str] = []
        for record, coordinate in zip(records, coordinates, strict=True):
            stored, reason = places[coordinate]
            where = f"{record.kind} ({record.detail}) at {coordinate}"
            if stored == (reason is not None):
                problems.append(f"{where}: in the history {stored}, dead letter {reason!r}")
                continue
            accepted = accepted_event(self.settings, coordinate[0], record.key, record.value)
            if accepted is not None and reason is not None:
                problems.append(f"{where}: the contract accepts it, yet dead-lettered: {reason}")
            elif record.expect is Expect.STORED and not stored:
                problems.append(f"{where}: meant to be stored, dead-lettered: {reason}")
            elif record.expect is Expect.DEAD and stored:
                problems.append(f"{where}: meant to be dead-lettered, stored in the history")
        assert not problems, f"{len(problems)} records misplaced:\n" + "\n".join(problems[:20])

    def large_round_if_due(self, rnd: random.Random) -> None:
        """A round of large records at the start and then every LARGE_EVERY records."""
        if self.kinds["large key"] <= self.records // LARGE_EVERY:
            self.round(large_records(rnd, self.ids))


def explain(
    settings: Settings,
    expected: Expected,
    every: dict[Coordinate, tuple[bytes | None, bytes | None]],
    appended: dict[Coordinate, Record],
) -> str:
    """Where the history differs from the fold: the records, and the whole history of the
    first operation concerned, as the fold and the projector saw it."""
    with psycopg.connect(settings.dsn) as conn:
        actual: dict[Coordinate, str] = {
            (t, p, o): outcome
            for t, p, o, outcome in conn.execute(
                'SELECT topic, partition, "offset", outcome FROM operation_history'
            ).fetchall()
        }
    differing = sorted(
        c
        for c in expected.outcomes.keys() | actual.keys()
        if expected.outcomes.get(c) != actual.get(c)
    )

    def line(c: Coordinate) -> str:
        record = appended.get(c)
        event = accepted_event(settings, c[0], *every[c])
        what = f"{record.kind} ({record.detail})" if record else "?"
        return (
            f"  {c}: fold {expected.outcomes.get(c)}, projector {actual.get(c)}; {what}; "
            f"{event!r:.400}"
        )

    lines = [f"{len(differing)} history outcomes differ:", *map(line, differing[:10])]
    first = accepted_event(settings, differing[0][0], *every[differing[0]]) if differing else None
    if first is not None:
        lines.append(f"every record of {first.operation_id}:")
        for c in sorted(every):
            event = accepted_event(settings, c[0], *every[c])
            if event is not None and event.operation_id == first.operation_id:
                lines.append(line(c))
    return "\n".join(lines)


# --- the test --------------------------------------------------------------------------------


@pytest.fixture
def edge_settings(isolated: Settings) -> Settings:
    with psycopg.connect(isolated.dsn, autocommit=True) as conn:
        database = conn.info.dbname
        conn.execute(f"ALTER DATABASE \"{database}\" SET timezone TO '{DATABASE_TIME_ZONE}'")
    return isolated


_HYPOTHESIS = settings(
    max_examples=MAX_ROUNDS_PER_RUN,
    deadline=None,
    database=None,  # reproduced from the printed seed, not from a local example database
    derandomize=False,
    print_blob=True,
    # No shrinking: a failure already names each misplaced record (what it was meant to be,
    # which field, where it is, the projector's reason), and shrinking would replay rounds
    # against the cumulative state for minutes.
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    # Each example appends to Kafka and waits for PostgreSQL; extreme texts are large draws.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_whatever_reaches_the_topics_is_stored_or_dead_lettered_and_the_fold_holds(
    edge_settings: Settings, request: pytest.FixtureRequest
) -> None:
    target = max(MIN_RECORDS, int(request.config.getoption("--edge-records")))
    forced = request.config.getoption("hypothesis_seed", None)
    base_seed = int(forced) if forced is not None else random.randrange(2**32)
    print(f"edge: base seed {base_seed} (rerun with --hypothesis-seed={base_seed}), {target=}")
    rnd = random.Random(base_seed)
    harness = Harness(edge_settings)
    started = time.monotonic()
    try:
        for chunk in itertools.count():
            harness.large_round_if_due(rnd)
            if harness.records >= target:
                break

            per_round = harness.records / harness.rounds if harness.rounds else 150
            rounds = math.ceil((target - harness.records) / per_round)

            @seed(base_seed + chunk)
            @settings(_HYPOTHESIS, max_examples=max(5, min(MAX_ROUNDS_PER_RUN, rounds)))
            @given(plan=plans)
            def one_round(plan: Plan) -> None:
                first, second = materialize(plan, harness.ids)
                note(f"{len(first)} + {len(second)} records: {Counter(r.kind for r in second)}")
                harness.round(first, second)

            one_round()
        appended_s = time.monotonic() - started
        assert harness.projector.health.progressing, harness.projector.health.snapshot()
    finally:
        harness.close()

    # The whole property, over every record read back from the topics.
    every: dict[Coordinate, tuple[bytes | None, bytes | None]] = {}
    for topic in (edge_settings.execution_topic, edge_settings.delivery_topic):
        for partition, offset, key, value in read_all(edge_settings, topic):
            every[(topic, partition, offset)] = (key, value)
    with psycopg.connect(edge_settings.dsn) as conn:
        history: set[Coordinate] = set(
            conn.execute('SELECT topic, partition, "offset" FROM operation_history').fetchall()
        )
        dead: dict[Coordinate, str] = {
            (t, p, o): reason
            for t, p, o, reason in conn.execute(
                'SELECT topic, partition, "offset", reason FROM dead_letters'
            ).fetchall()
        }
    assert len(every) == harness.records >= target, (len(every), harness.records, target)
    assert not history & dead.keys(), "records both in the history and dead-lettered"
    assert history | dead.keys() == every.keys(), "records neither stored nor dead-lettered"
    refused = {c for c in dead if accepted_event(edge_settings, c[0], *every[c]) is not None}
    assert not refused, "records the contract accepts were dead-lettered:\n" + "\n".join(
        f"{c}: {dead[c]}" for c in sorted(refused)[:20]
    )
    expected = independent_fold(edge_settings, refused)
    try:
        summary = assert_projection_matches(edge_settings, expected)
    except AssertionError as exc:
        explanation = explain(edge_settings, expected, every, harness.appended)
        raise AssertionError(f"{exc}\n{explanation}") from exc
    print(
        f"edge: {len(every)} records in {harness.rounds} rounds, appended and projected in "
        f"{appended_s:.1f}s, {time.monotonic() - started:.1f}s with the final check; {summary}; "
        f"{dict(harness.kinds.most_common())}"
    )
    # What the rounds must have exercised, whatever hypothesis drew.
    assert summary["history"] > 0 and summary["dead"] > 0
    assert summary["duplicates"] > 0 and summary["anomalies"] > 0
    assert harness.kinds["large key"] >= 1
