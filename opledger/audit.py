"""``opledger audit OP --tenant T``: one operation's timeline read from the topics themselves,
each attempt labelled, ending with the seed's question answered for every retry: execution or
delivery?

Finding the records does not scan the topics. The projection's history names the coordinates
of every event it folded, and each of those records is read from the broker by its offset. The
records after the live projector's position on the operation's two partitions (its key decides
them: ``ledger.kafka.partition_for``) are read to the end, so events not projected yet are
shown too. Each record read at a coordinate the projection names must decode to the event the
projection says it holds; any disagreement is reported (exit 1). Events the projection lost
from the middle of the log are ``opledger replay``'s to find, not this command's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ledger.settings import Settings

EXIT_OK = 0
EXIT_DISAGREES = 1
EXIT_USAGE = 2

#: How long reading the operation's records may take.
READ_TIMEOUT_S = 30.0
#: Offsets this close on one partition are read in one pass rather than sought one by one: a
#: seek costs a fetch round trip, a few hundred small records cost less.
MERGE_GAP = 1000


@dataclass(slots=True)
class Line:
    topic: str
    partition: int
    offset: int
    occurred_at: str
    writer: str
    kind: str
    text: str
    projected: bool


@dataclass(slots=True)
class Audit:
    operation_id: str
    tenant_id: str
    lines: list[Line] = field(default_factory=list)
    retries: list[str] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)
    unprojected: int = 0
    read_seconds: float = 0.0


def _read_at(
    settings: Settings, wanted: dict[tuple[str, int], list[int]], tails: dict[tuple[str, int], int]
) -> dict[tuple[str, int, int], Any]:
    """The records at ``wanted``'s offsets, and every record from ``tails``' offsets to the
    partitions' ends, by coordinates."""
    from confluent_kafka import TopicPartition  # noqa: PLC0415

    from ledger.log import new_consumer, read_range, watermarks  # noqa: PLC0415

    consumer = new_consumer(
        settings,
        group_id=settings.readers_group("audit"),
        client_id="opledger-audit",
        overrides={"fetch.wait.max.ms": 10},
    )
    found: dict[tuple[str, int, int], Any] = {}
    deadline = time.monotonic() + READ_TIMEOUT_S
    try:
        # One read per run of offsets: a seek only where the next wanted offset is not next.
        ranges: list[tuple[str, int, int, int]] = []
        for (topic, partition), offsets in sorted(wanted.items()):
            run_start = previous = None
            for offset in sorted(offsets):
                if previous is not None and offset - previous <= MERGE_GAP:
                    previous = offset
                    continue
                if run_start is not None and previous is not None:
                    ranges.append((topic, partition, run_start, previous + 1))
                run_start = previous = offset
            if run_start is not None and previous is not None:
                ranges.append((topic, partition, run_start, previous + 1))
        for (topic, partition), start in sorted(tails.items()):
            _low, end = watermarks(consumer, TopicPartition(topic, partition), deadline)
            if end > start:
                ranges.append((topic, partition, start, end))
        for topic, partition, start, end in ranges:
            for message in read_range(consumer, (topic, partition), start, end, deadline):
                found[(topic, partition, int(message.offset() or 0))] = message
    finally:
        consumer.close()
    return found


def audit(settings: Settings, operation_id: str, tenant_id: str) -> Audit | None:
    """The operation's audit, or None when ``tenant_id`` has no such operation (another
    tenant's operation reads as none: no answer tells one from the other)."""
    from ledger import pg  # noqa: PLC0415
    from ledger.codec import DecodeError, default_codec  # noqa: PLC0415
    from ledger.kafka import partition_for  # noqa: PLC0415
    from ledger.log.records import WRITER_HEADER  # noqa: PLC0415
    from projections import progress  # noqa: PLC0415

    # No row yet is no answer: an operation the projector has not reached is in the tail.
    with pg.connect(settings.dsn, name="opledger-audit", read_only=True) as conn:
        history = conn.execute(
            'SELECT topic, partition, "offset", state, attempt, destination '
            "FROM operation_history WHERE operation_id = %s AND tenant_id = %s",
            (operation_id, tenant_id),
        ).fetchall()
    key = operation_id.encode("ascii")
    execution = (settings.execution_topic, partition_for(key, settings.partitions))
    delivery = (settings.delivery_topic, partition_for(key, settings.partitions))
    wanted: dict[tuple[str, int], list[int]] = {}
    claimed: dict[tuple[str, int, int], tuple[str, int, str | None]] = {}
    for topic, partition, offset, state, attempt, destination in history:
        wanted.setdefault((topic, partition), []).append(offset)
        claimed[(topic, partition, offset)] = (state, attempt, destination)
    stored = progress.stored_offsets(settings.dsn, settings.projector_group)
    tails = {where: stored.get(where, 0) for where in (execution, delivery)}
    started = time.monotonic()
    records = _read_at(settings, wanted, tails)
    result = Audit(operation_id, tenant_id, read_seconds=time.monotonic() - started)
    codec = default_codec()
    events: list[tuple[tuple[str, int, int], Any, str]] = []
    for coordinates, message in sorted(records.items()):
        if message.key() != key:
            if coordinates in claimed:
                result.disagreements.append(
                    f"{_at(coordinates)}: the projection says it holds this operation's "
                    f"{claimed[coordinates][0]}, the record there is keyed by another"
                )
            continue
        try:
            event = codec.decode_operation(message.value() or b"")
        except DecodeError as exc:
            result.disagreements.append(f"{_at(coordinates)}: does not decode: {exc}")
            continue
        if event.tenant_id != tenant_id or event.operation_id != operation_id:
            continue  # another tenant's event under this id: never part of this operation
        writer = dict(message.headers() or []).get(WRITER_HEADER, b"?")
        events.append((coordinates, event, bytes(writer).decode("ascii", "replace")))
        if coordinates in claimed:
            state, attempt, _destination = claimed[coordinates]
            says = (
                getattr(getattr(event, "state", None), "value", event.kind.upper()),
                event.attempt,
            )
            if (state, attempt) != says and getattr(event, "state", None) is not None:
                result.disagreements.append(
                    f"{_at(coordinates)}: the projection says {state} attempt {attempt}, the "
                    f"log says {says[0]} attempt {says[1]}"
                )
    seen = {coordinates for coordinates, _e, _w in events}
    for coordinates in sorted(set(claimed) - seen):
        if coordinates not in records or records[coordinates].key() == key:
            result.disagreements.append(
                f"{_at(coordinates)}: the projection holds {claimed[coordinates][0]} from here, "
                "the log has no event of this operation there"
            )
    if not events and not claimed:
        return None
    _describe(result, events, claimed)
    return result


def _at(coordinates: tuple[str, int, int]) -> str:
    topic, partition, offset = coordinates
    return f"{topic}[{partition}]@{offset}"


def _describe(
    result: Audit,
    events: list[tuple[tuple[str, int, int], Any, str]],
    claimed: dict[tuple[str, int, int], tuple[str, int, str | None]],
) -> None:
    """One line per event, in the order the operation lived them, and the retries named."""
    from ledger.domain.events import (  # noqa: PLC0415
        DeliveryTransitioned,
        ExecutionTransitioned,
        OwnershipTaken,
        ReconciliationDecided,
    )

    decisions: dict[str, ReconciliationDecided] = {}
    sends: dict[str, list[int]] = {}
    #: attempt -> the decision that permitted it ("" for the first call)
    permits: dict[int, str] = {}
    # As the operation lived them: by time, an execution before the delivery it caused.
    for coordinates, event, writer in sorted(
        events, key=lambda e: (e[1].occurred_at, e[1].kind == "delivery", e[0])
    ):
        projected = coordinates in claimed
        if not projected:
            result.unprojected += 1
        if isinstance(event, ExecutionTransitioned):
            kind = "execution"
            text = f"{event.state.value} attempt {event.attempt}"
            if event.lease_token is not None:
                text += f", lease {event.lease_token}"
            if event.state.value == "DISPATCHED":
                label = "the call" if event.attempt <= 1 else "an execution retry"
                text += f": {label}"
                why = decisions.get(event.decision_id or "")
                permits[event.attempt] = "" if why is None else _decision(why)
                if permits[event.attempt]:
                    text += f", permitted by {permits[event.attempt]}"
            if event.error:
                text += f" ({event.error})"
        elif isinstance(event, DeliveryTransitioned):
            kind = "delivery"
            text = f"{event.destination} {event.state.value} attempt {event.attempt}"
            if event.state.value == "SENT":
                sends.setdefault(event.destination, []).append(event.attempt)
                if len(sends[event.destination]) > 1:
                    text += ": a delivery retry (the tool was not called again)"
            if event.error:
                text += f" ({event.error})"
        elif isinstance(event, ReconciliationDecided):
            kind = "decision"
            decisions[event.event_id] = event
            text = _decision(event)
        elif isinstance(event, OwnershipTaken):
            kind = "ownership"
            text = f"taken with lease {event.lease_token}: {event.reason}"
        else:
            kind, text = event.kind, type(event).__name__
        topic, partition, offset = coordinates
        result.lines.append(
            Line(
                topic,
                partition,
                offset,
                event.occurred_at.isoformat(),
                writer,
                kind,
                text,
                projected,
            )
        )
    for attempt in sorted(permits)[1:]:
        permit = permits[attempt]
        result.retries.append(
            f"attempt {attempt} was an execution retry: the tool was called again"
            + (f", permitted by {permit}" if permit else "")
        )
    for destination, attempts in sorted(sends.items()):
        if len(attempts) > 1:
            result.retries.append(
                f"{len(attempts) - 1} resend(s) to {destination} were delivery retries: the same "
                "result was sent again, the tool was not called again"
            )
    if not result.retries:
        result.retries.append(
            "no retry: the tool was called at most once, and each destination was sent to once"
        )


def _decision(event: Any) -> str:
    policy = "allowed" if event.policy_allowed else "refused"
    return (
        f"decision {event.decision.value} (lookup {event.lookup.value}, policy "
        f"{event.policy_version or 'none'} {policy}: {event.reason})"
    )


def _print(result: Audit, out: Any) -> None:
    from ledger.domain.display import displayable  # noqa: PLC0415

    out.write(f"audit of {result.operation_id} (tenant {displayable(result.tenant_id)})\n")
    for line in result.lines:
        mark = "" if line.projected else "  [not projected yet]"
        out.write(
            f"{line.topic}[{line.partition}]@{line.offset} {line.occurred_at} "
            f"{line.writer:<8} {line.kind:<9} {displayable(line.text)}{mark}\n"
        )
    for sentence in result.retries:
        out.write(f"retry: {displayable(sentence)}\n")
    if result.disagreements:
        for disagreement in result.disagreements:
            out.write(f"DISAGREES: {displayable(disagreement)}\n")
    else:
        out.write(
            f"the projection's history agrees with the log ({len(result.lines)} events read "
            f"in {result.read_seconds * 1000:.0f} ms)\n"
        )


def audit_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger audit``."""
    import psycopg  # noqa: PLC0415
    from confluent_kafka import KafkaException  # noqa: PLC0415

    try:
        result = audit(settings, args.operation_id, args.tenant)
    except (psycopg.Error, KafkaException, TimeoutError) as exc:
        print(f"opledger: audit could not run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if result is None:
        print(
            f"opledger: tenant {args.tenant} has no operation {args.operation_id}", file=sys.stderr
        )
        return EXIT_DISAGREES
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        _print(result, sys.stdout)
    return EXIT_DISAGREES if result.disagreements else EXIT_OK


def register(commands: Any) -> None:
    """``opledger audit``."""
    from opledger import arguments  # noqa: PLC0415

    parser = commands.add_parser(
        "audit",
        help="one operation's timeline from the topics, each retry named execution or delivery",
        epilog="opledger audit export --tenant T --out DIR [--since] [--until]: a tenant's "
        "records with a manifest; opledger audit verify DIR: prove such an export complete and "
        "unaltered against the topics",
    )
    parser.add_argument("operation_id", type=arguments.operation_id, help="the operation")
    parser.add_argument("--tenant", required=True, type=arguments.tenant, help="its tenant")
    parser.add_argument("--json", action="store_true", help="the audit as JSON")
    parser.set_defaults(handler="opledger.audit:audit_command")
