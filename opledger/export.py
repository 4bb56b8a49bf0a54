"""``opledger audit export`` and ``opledger audit verify``: a tenant's records, written out so
that anyone who can read the topics can prove the export complete and unaltered.

An export is a directory of two files. ``events.jsonl`` holds one line per record of the
tenant (its ``opledger-tenant`` header), in the order of the log, with the record's own bytes
(key, headers, value, base64) beside the event decoded for people. ``manifest.json`` names, per
partition of the execution, delivery and policy topics, the offset range read (``start`` up
to ``end``: the first offsets at ``--since`` and ``--until`` by the records' times, or the
partition's start and end), how many of the tenant's records it holds and the sha256 of their
bytes, in order.

The range is what is exported, not the clock: a record written late with an early timestamp
lies inside the range its offset falls in, and is exported with it. ``verify`` reads every
range again from the topics and compares record by record, so a removed, added or changed line
is named by its offset; it recomputes each range's digest from the file, so a manifest that
does not belong to its file fails too. Compaction may remove a policy record later than the
export; that is told apart (a later record of the same subject is on the topic) and does not
fail verification. Exit 0: verified; 1: not; 2: could not run.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ledger.private_files import write_private
from ledger.settings import Settings

EXIT_VERIFIED = 0
EXIT_NOT_VERIFIED = 1
EXIT_USAGE = 2

FORMAT = "opledger-audit-export/1"
EVENTS_FILE = "events.jsonl"
MANIFEST_FILE = "manifest.json"

#: How long reading the ranges may take, by default.
READ_TIMEOUT_S = 600.0


@dataclass(slots=True)
class Range:
    topic: str
    partition: int
    start: int
    end: int
    records: int = 0
    sha256: str = ""


@dataclass(slots=True)
class Manifest:
    tenant_id: str
    since: str | None
    until: str | None
    created_at: str
    ranges: list[Range]
    records: int = 0
    file_sha256: str = ""
    format: str = FORMAT


@dataclass(slots=True)
class Verification:
    records: int = 0
    problems: list[str] = field(default_factory=list)
    compacted: list[str] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        return not self.problems


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode("ascii")


def raw_fields(message: Any) -> dict[str, Any]:
    """A record's coordinates, time and bytes: what its digest covers."""
    _kind, timestamp = message.timestamp()
    return {
        "topic": message.topic(),
        "partition": int(message.partition() or 0),
        "offset": int(message.offset() or 0),
        "timestamp_ms": int(timestamp),
        "key": _b64(message.key()),
        "headers": [[name, _b64(value)] for name, value in (message.headers() or [])],
        "value": _b64(message.value()),
    }


def canonical(fields: dict[str, Any]) -> bytes:
    """The bytes a record adds to its range's digest: its raw fields as canonical JSON."""
    raw = {name: fields[name] for name in RAW_NAMES}
    return json.dumps(raw, sort_keys=True, separators=(",", ":")).encode("utf-8") + b"\n"


RAW_NAMES = ("topic", "partition", "offset", "timestamp_ms", "key", "headers", "value")


def decoded(codec: Any, value_b64: str | None) -> tuple[Any, str | None]:
    """The event a record's value holds, as JSON, or None and why it does not decode."""
    from ledger.codec import DecodeError  # noqa: PLC0415

    if value_b64 is None:
        return None, "no value (a tombstone)"
    try:
        event = codec.decode(base64.b64decode(value_b64))
    except DecodeError as exc:
        return None, str(exc)
    return event.model_dump(mode="json"), None


def line_of(fields: dict[str, Any], codec: Any) -> dict[str, Any]:
    event, error = decoded(codec, fields["value"])
    return {**fields, "event": event, "decode_error": error}


def _tenant_of(message: Any) -> str | None:
    from ledger.log import TENANT_HEADER  # noqa: PLC0415

    for name, value in message.headers() or []:
        if name == TENANT_HEADER and value is not None:
            return bytes(value).decode("utf-8", "replace")
    return None


def _timestamp_ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _topics(settings: Settings) -> tuple[str, ...]:
    return (settings.execution_topic, settings.delivery_topic, settings.policy_topic)


def _consumer(settings: Settings, reader: str) -> Any:
    from ledger.log import new_consumer  # noqa: PLC0415

    return new_consumer(
        settings,
        group_id=settings.readers_group(reader),
        client_id=f"opledger-{reader}",
        overrides={"fetch.wait.max.ms": 10},
    )


def _ranges(
    settings: Settings, since: datetime | None, until: datetime | None, timeout_s: float
) -> list[Range]:
    from confluent_kafka import TopicPartition  # noqa: PLC0415

    from ledger.log import end_offsets, offsets_at, watermarks  # noqa: PLC0415

    ends = end_offsets(settings, _topics(settings), timeout_s=min(timeout_s, 60.0))
    keys = sorted(ends)
    consumer = _consumer(settings, "audit-export")
    deadline = time.monotonic() + min(timeout_s, 60.0)
    try:
        if since is None:
            starts = {key: watermarks(consumer, TopicPartition(*key), deadline)[0] for key in keys}
        else:
            starts = offsets_at(consumer, keys, _timestamp_ms(since), ends, deadline)
        stops = (
            ends
            if until is None
            else offsets_at(consumer, keys, _timestamp_ms(until), ends, deadline)
        )
    finally:
        consumer.close()
    return [Range(t, p, starts[(t, p)], max(starts[(t, p)], stops[(t, p)])) for t, p in keys]


def _tenant_records(
    consumer: Any, ranges: Iterable[Range], tenant_id: str, deadline: float
) -> Iterator[tuple[Range, Any]]:
    from ledger.log import read_range  # noqa: PLC0415

    for where in ranges:
        for message in read_range(
            consumer, (where.topic, where.partition), where.start, where.end, deadline
        ):
            if _tenant_of(message) == tenant_id:
                yield where, message


def export(
    settings: Settings,
    tenant_id: str,
    out: Path,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    timeout_s: float = READ_TIMEOUT_S,
) -> Manifest:
    """Write ``tenant_id``'s records between ``since`` and ``until`` to ``out``."""
    from ledger.codec import default_codec  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    events_path, manifest_path = out / EVENTS_FILE, out / MANIFEST_FILE
    for path in (events_path, manifest_path):
        if path.exists():
            raise FileExistsError(f"{path} exists: export into an empty directory")
    ranges = _ranges(settings, since, until, timeout_s)
    manifest = Manifest(
        tenant_id,
        since.isoformat() if since else None,
        until.isoformat() if until else None,
        datetime.now(UTC).isoformat(),
        ranges,
    )
    codec = default_codec()
    digests = {(r.topic, r.partition): hashlib.sha256() for r in ranges}
    whole = hashlib.sha256()
    consumer = _consumer(settings, "audit-export")
    deadline = time.monotonic() + timeout_s
    try:
        # The tenant's records are its data: readable by the exporter only, as a backup is.
        descriptor = os.open(events_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as lines:
            for where, message in _tenant_records(consumer, ranges, tenant_id, deadline):
                fields = raw_fields(message)
                digests[(where.topic, where.partition)].update(canonical(fields))
                where.records += 1
                line = json.dumps(line_of(fields, codec), sort_keys=True) + "\n"
                whole.update(line.encode("utf-8"))
                lines.write(line)
    finally:
        consumer.close()
    for where in ranges:
        where.sha256 = digests[(where.topic, where.partition)].hexdigest()
    manifest.records = sum(r.records for r in ranges)
    manifest.file_sha256 = whole.hexdigest()
    write_private(manifest_path, json.dumps(asdict(manifest), indent=2) + "\n")
    return manifest


def read_manifest(directory: Path) -> Manifest:
    raw = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"{directory / MANIFEST_FILE} is not an {FORMAT} manifest")
    ranges = [Range(**r) for r in raw.pop("ranges")]
    return Manifest(ranges=ranges, **raw)


def _at(topic: str, partition: int, offset: int) -> str:
    return f"{topic}[{partition}]@{offset}"


def _exported(
    directory: Path, manifest: Manifest, result: Verification, codec: Any
) -> dict[tuple[str, int, int], dict[str, Any]]:
    """The export's records by coordinates, each line checked against itself: its event must
    be its value decoded. Each range's digest is recomputed from the file."""
    by_range = {(r.topic, r.partition): r for r in manifest.ranges}
    digests = {key: hashlib.sha256() for key in by_range}
    counts = dict.fromkeys(by_range, 0)
    whole = hashlib.sha256()
    records: dict[tuple[str, int, int], dict[str, Any]] = {}
    with (directory / EVENTS_FILE).open("rb") as lines:
        for number, raw_line in enumerate(lines, start=1):
            whole.update(raw_line)
            try:
                line = json.loads(raw_line)
                fields = {name: line[name] for name in RAW_NAMES}
                where = (str(fields["topic"]), int(fields["partition"]), int(fields["offset"]))
            except (ValueError, KeyError, TypeError) as exc:
                result.problems.append(f"line {number} is not an exported record: {exc}")
                continue
            span = by_range.get(where[:2])
            if span is None or not span.start <= where[2] < span.end:
                result.problems.append(f"{_at(*where)} (line {number}) is outside every range")
                continue
            if where in records:
                result.problems.append(f"{_at(*where)} is in the export twice")
                continue
            records[where] = fields
            digests[where[:2]].update(canonical(fields))
            counts[where[:2]] += 1
            event, error = decoded(codec, fields["value"])
            if (event, error) != (line.get("event"), line.get("decode_error")):
                result.problems.append(
                    f"{_at(*where)} (line {number}): the decoded event is not what the "
                    "record's bytes hold"
                )
    if whole.hexdigest() != manifest.file_sha256:
        result.problems.append(f"{EVENTS_FILE}'s sha256 is not the manifest's")
    for key, span in by_range.items():
        if digests[key].hexdigest() != span.sha256 or counts[key] != span.records:
            result.problems.append(
                f"{span.topic}[{span.partition}] {span.start}..{span.end}: the file holds "
                f"{counts[key]} records with another digest than the manifest's {span.records}"
            )
    return records


def verify(settings: Settings, directory: Path, timeout_s: float = READ_TIMEOUT_S) -> Verification:
    """Read every range of the export at ``directory`` again and compare."""
    from confluent_kafka import TopicPartition  # noqa: PLC0415

    from ledger.codec import default_codec  # noqa: PLC0415
    from ledger.log import watermarks  # noqa: PLC0415

    manifest = read_manifest(directory)
    result = Verification()
    exported = _exported(directory, manifest, result, default_codec())
    result.records = len(exported)
    on_log: dict[tuple[str, int, int], dict[str, Any]] = {}
    consumer = _consumer(settings, "audit-verify")
    deadline = time.monotonic() + timeout_s
    try:
        for span in manifest.ranges:
            low, _high = watermarks(consumer, TopicPartition(span.topic, span.partition), deadline)
            if low > span.start and span.topic != settings.policy_topic:
                result.problems.append(
                    f"{span.topic}[{span.partition}] no longer holds offsets {span.start} to "
                    f"{low - 1} (its retention removed them): they cannot be verified"
                )
        for _where, message in _tenant_records(
            consumer, manifest.ranges, manifest.tenant_id, deadline
        ):
            fields = raw_fields(message)
            on_log[(fields["topic"], fields["partition"], fields["offset"])] = fields
        for where in sorted(set(on_log) | set(exported)):
            in_log, in_file = on_log.get(where), exported.get(where)
            if in_file is None:
                result.problems.append(f"{_at(*where)}: on the topic, missing from the export")
            elif in_log is None:
                later = (
                    _later_of_key(consumer, where, in_file["key"], deadline)
                    if where[0] == settings.policy_topic
                    else None
                )
                if later is not None:
                    result.compacted.append(
                        f"{_at(*where)}: compacted away since the export (the same subject's "
                        f"later record is at @{later})"
                    )
                else:
                    result.problems.append(
                        f"{_at(*where)}: in the export, not the tenant's record on the topic"
                    )
            elif canonical(in_log) != canonical(in_file):
                changed = [n for n in RAW_NAMES if in_log[n] != in_file[n]]
                result.problems.append(
                    f"{_at(*where)}: the export's record differs from the topic's "
                    f"({', '.join(changed)})"
                )
    finally:
        consumer.close()
    return result


def _later_of_key(
    consumer: Any, where: tuple[str, int, int], key_b64: str | None, deadline: float
) -> int | None:
    """The offset of a record with the same key after ``where``, if the topic holds one: the
    only reason compaction removes a record."""
    from confluent_kafka import TopicPartition  # noqa: PLC0415

    from ledger.log import read_range, watermarks  # noqa: PLC0415

    topic, partition, offset = where
    _low, high = watermarks(consumer, TopicPartition(topic, partition), deadline)
    for message in read_range(consumer, (topic, partition), offset + 1, high, deadline):
        if _b64(message.key()) == key_b64:
            return int(message.offset() or 0)
    return None


def _moment(raw: str) -> datetime:
    try:
        moment = datetime.fromisoformat(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 time: {raw!r} (2026-12-01 or 2026-12-01T12:00:00+00:00)"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def export_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger audit export``."""
    import psycopg  # noqa: PLC0415
    from confluent_kafka import KafkaException  # noqa: PLC0415

    if args.since and args.until and args.since >= args.until:
        print("opledger: --since must be before --until; nothing was written", file=sys.stderr)
        return EXIT_USAGE
    try:
        manifest = export(
            settings,
            args.tenant,
            args.out,
            since=args.since,
            until=args.until,
            timeout_s=args.timeout,
        )
    except (FileExistsError, KafkaException, TimeoutError, psycopg.Error) as exc:
        print(f"opledger: export could not run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    spans = sum(1 for r in manifest.ranges if r.end > r.start)
    print(
        f"exported {manifest.records} records of tenant {manifest.tenant_id} from {spans} "
        f"partition ranges to {args.out / EVENTS_FILE}; manifest {args.out / MANIFEST_FILE} "
        f"(sha256 of the file {manifest.file_sha256})"
    )
    return EXIT_VERIFIED


def verify_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger audit verify``."""
    from confluent_kafka import KafkaException  # noqa: PLC0415

    from ledger.domain.display import displayable  # noqa: PLC0415

    try:
        result = verify(settings, args.directory, timeout_s=args.timeout)
    except (OSError, ValueError, TypeError, KafkaException, TimeoutError) as exc:
        print(f"opledger: verify could not run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps({**asdict(result), "verified": result.verified}, indent=2))
    else:
        for problem in result.problems:
            print(f"NOT VERIFIED: {displayable(problem)}")
        for note in result.compacted:
            print(f"compacted: {displayable(note)}")
        if result.verified:
            print(
                f"verified: the export's {result.records} records are every record of its "
                "tenant in its ranges, unaltered"
            )
    return EXIT_VERIFIED if result.verified else EXIT_NOT_VERIFIED


#: ``opledger audit export|verify``: words no operation id can be (op_ and a ULID).
SUBCOMMANDS = {"export": "audit-export", "verify": "audit-verify"}


def register(commands: Any) -> None:
    """``opledger audit export`` and ``opledger audit verify`` (the CLI routes the words)."""
    from opledger import arguments  # noqa: PLC0415

    parser = commands.add_parser(
        "audit-export",
        help="(opledger audit export) a tenant's records with a manifest anyone can verify",
        prog="opledger audit export",
    )
    parser.add_argument("--tenant", required=True, type=arguments.tenant, help="the tenant")
    parser.add_argument("--since", type=_moment, help="from the first record at this time")
    parser.add_argument("--until", type=_moment, help="up to the first record at this time")
    parser.add_argument("--out", required=True, type=Path, help="an empty directory")
    parser.add_argument("--timeout", type=float, default=READ_TIMEOUT_S, help="seconds to read")
    parser.set_defaults(handler="opledger.export:export_command")
    check = commands.add_parser(
        "audit-verify",
        help="(opledger audit verify) re-read an export's ranges and prove it complete, unaltered",
        prog="opledger audit verify",
    )
    check.add_argument("directory", type=Path, help="the export's directory")
    check.add_argument("--json", action="store_true", help="the verdict as JSON")
    check.add_argument("--timeout", type=float, default=READ_TIMEOUT_S, help="seconds to read")
    check.set_defaults(handler="opledger.export:verify_command")
