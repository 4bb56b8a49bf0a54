"""Where a queue consumer puts the records it cannot take (decision 017).

A record that is not a valid event, a result by reference whose bytes are not the result, a key
already taken with another body, and a result that could not be fetched for longer than the
hold limit: each goes, whole (key, value, its own headers), to the consumers' dead-letter topic
with the reason and its coordinates, before the consumer commits its offset past it. Nothing is
lost, the partition goes on, and ``opledger consumer redrive`` puts records back on their topic:
the inbox refuses a key it already took, so a redrive applies a change at most once. A record
too large to republish is dead-lettered as a reference (coordinates, size, sha256, a prefix);
the redrive reads it back from its topic and checks it against the reference first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    TopicPartition,
)

from ledger.dead_letters import (
    BY_REFERENCE_HEADER,
    DeadLetterUnavailableError,
    own_headers,
    send_dead_letters,
    source_of,
)
from ledger.kafka import MESSAGE_MAX_BYTES
from ledger.log import RawRecord, RawWriter, new_consumer, watermarks
from ledger.records import Coordinates, DeadLetter
from ledger.settings import Settings

log = logging.getLogger("opledger.consumer.dead_letters")

#: Header naming what kind of refusal a dead letter is (invalid, foreign-tenant, refused,
#: conflict, unfetchable).
KIND_HEADER = "opledger-dlq-kind"
#: Header naming the consumer that refused the record.
CONSUMER_HEADER = "opledger-dlq-consumer"
#: Seconds the broker has to acknowledge a pass's dead letters.
PUBLISH_TIMEOUT_S = 30.0
#: Room for a record's framing and headers above its key and value in the producer's limit.
_RECORD_OVERHEAD_BYTES = 64 * 1024


class QueueDeadLetters:
    """A writer of one consumer's dead letters; :meth:`publish` returns once the broker
    acknowledged all of them."""

    def __init__(
        self, settings: Settings, consumer: str, *, timeout_s: float = PUBLISH_TIMEOUT_S
    ) -> None:
        self.topic = settings.consumer_dead_letter_topic
        self._consumer = consumer.encode()
        self._timeout_s = timeout_s
        self._writer = RawWriter(
            settings, client_id=f"opledger-consumer-dlq-{consumer}", delivery_timeout_s=timeout_s
        )

    def publish(self, letters: Sequence[tuple[DeadLetter, str]]) -> None:
        """Publish each ``(letter, kind)``; a letter too large to republish goes as a reference.
        Raises :class:`DeadLetterUnavailableError` if the broker did not acknowledge them all."""
        extra = [
            [(KIND_HEADER, kind.encode()), (CONSUMER_HEADER, self._consumer)] for _, kind in letters
        ]
        send_dead_letters(
            self._writer,
            self.topic,
            [letter for letter, _ in letters],
            extra=extra,
            timeout_s=self._timeout_s,
        )

    def close(self) -> None:
        self._writer.close(self._timeout_s)


@dataclass(frozen=True, slots=True)
class RedriveReport:
    """What :func:`redrive` put back, and what it could not."""

    redriven: tuple[Coordinates, ...]
    #: of those, records whose letter held only a reference (too large to republish): read
    #: back from their own topic at their coordinates, their size and sha256 checked
    read_back: tuple[Coordinates, ...]
    #: letters holding only a reference whose record cannot be read back, and why
    unrecoverable: tuple[tuple[Coordinates, str], ...]


def redrive(
    settings: Settings,
    source_topic: str,
    *,
    kinds: Collection[str] = (),
    at: Collection[tuple[int, int]] = (),
    timeout_s: float = 30.0,
) -> RedriveReport:
    """Put the dead letters of ``source_topic`` back on it, each once, on its own partition,
    with its own key, value and headers: the consumers read them again.

    ``kinds`` and ``at`` (partition, offset of the source record) narrow the choice. Letters
    are read from the start of the dead-letter topic to its end as of now; a record
    dead-lettered twice (dead letters are published at least once) is redriven once, and a
    redrive repeated, or of a key the consumer took since, is a duplicate to the consumer's
    inbox: the change is applied at most once. A letter that holds only a reference to its
    record (too large to republish) has the record read back from ``source_topic`` at its
    coordinates, and put back only if its size and sha256 are the reference's: a record
    deleted by retention since, or not the one dead-lettered, is reported, not guessed at."""
    deadline = time.monotonic() + timeout_s
    letters = _letters_of(settings, source_topic, set(kinds), set(at), timeout_s)
    references = _references(letters)
    read_back, unrecoverable = _read_back(settings, {c: letters[c] for c in references}, deadline)
    wanted: list[tuple[Coordinates, Any, list[tuple[str, str | bytes | None]]]] = [
        (c, m, [*own_headers(_raw_headers(m))]) for c, m in letters.items() if c not in references
    ]
    wanted += [(c, m, [*_raw_headers(m)]) for c, m in read_back.items()]
    largest = max((len(m.key() or b"") + len(m.value() or b"") for _c, m, _h in wanted), default=0)
    writer = RawWriter(
        settings,
        client_id="opledger-consumer-redrive",
        # A record read back was taken by its topic, which may accept more than the
        # producer's default: the broker, not this client, decides.
        overrides={"message.max.bytes": max(MESSAGE_MAX_BYTES, largest + _RECORD_OVERHEAD_BYTES)},
    )
    sent = writer.send(
        [
            RawRecord(source_topic, message.key(), message.value(), headers, source.partition)
            for source, message, headers in wanted
        ],
        max(1.0, deadline - time.monotonic()),
    )
    if not sent.complete:
        reasons = sorted({reason for _, reason in sent.failed})
        if sent.too_large:
            reasons.append(f"{len(sent.too_large)} too large for the topic")
        if sent.unacknowledged:
            reasons.append(f"{sent.unacknowledged} unacknowledged")
        raise DeadLetterUnavailableError(f"redrive not acknowledged: {'; '.join(reasons)}")
    return RedriveReport(
        tuple(sorted(c for c, _m, _h in wanted)),
        tuple(sorted(read_back)),
        tuple(sorted(unrecoverable.items())),
    )


def _read_back(
    settings: Settings, letters: Mapping[Coordinates, Any], deadline: float
) -> tuple[dict[Coordinates, Any], dict[Coordinates, str]]:
    """The records that reference ``letters`` name, read from their topic at their
    coordinates and checked against the reference's size and sha256; or why not."""
    found: dict[Coordinates, Any] = {}
    missing: dict[Coordinates, str] = {}
    if not letters:
        return found, missing
    reader = new_consumer(
        settings, group_id=f"{settings.topic_prefix}-consumer-redrive", client_id="opledger-redrive"
    )
    try:
        for source, letter in sorted(letters.items()):
            try:
                reference = json.loads(letter.value() or b"")
                size, digest = int(reference["size_bytes"]), str(reference["sha256"])
            except (ValueError, TypeError, KeyError):
                missing[source] = "its dead letter's reference does not parse"
                continue
            partition = TopicPartition(source.topic, source.partition)
            low, high = watermarks(reader, partition, deadline)
            if not low <= source.offset < high:
                missing[source] = (
                    f"no longer on {source.topic} (partition {source.partition} holds offsets "
                    f"{low} to {high - 1}): deleted by its retention"
                )
                continue
            message = _record_at(reader, source, deadline)
            if message.offset() != source.offset:
                missing[source] = f"no longer on {source.topic}: compacted away"
                continue
            value = message.value() or b""
            if len(value) != size or hashlib.sha256(value).hexdigest() != digest:
                missing[source] = (
                    "the record at its coordinates is not the one dead-lettered (its size or "
                    "sha256 differs from the reference's)"
                )
                continue
            found[source] = message
        return found, missing
    finally:
        reader.close()


def _record_at(reader: Consumer, source: Coordinates, deadline: float) -> Any:
    """The first record at or after ``source``'s offset on its partition: another offset's
    where compaction removed the record itself (the partition's last record is never removed,
    so below the high watermark there is always one)."""
    reader.assign([TopicPartition(source.topic, source.partition, source.offset)])
    try:
        while time.monotonic() < deadline:
            for message in reader.consume(1, 0.5):
                if message.error() is None:
                    return message
        raise DeadLetterUnavailableError(
            f"{source.topic}[{source.partition}]@{source.offset} was not read back in time"
        )
    finally:
        reader.unassign()


def _raw_headers(message: Any) -> list[tuple[str, bytes | None]]:
    """A record's headers as librdkafka gives them: names, and values as bytes (or None)."""
    return [
        (name, value.encode() if isinstance(value, str) else value)
        for name, value in (message.headers() or [])
    ]


def _references(letters: Mapping[Coordinates, Any]) -> set[Coordinates]:
    return {
        c for c, m in letters.items() if any(k == BY_REFERENCE_HEADER for k, _v in _raw_headers(m))
    }


def _letters_of(
    settings: Settings,
    source_topic: str,
    kinds: set[str],
    at: set[tuple[int, int]],
    timeout_s: float,
) -> dict[Coordinates, Any]:
    """The dead letters of ``source_topic`` (narrowed by ``kinds`` and ``at``), by source
    coordinates, the first copy of each."""
    topic = settings.consumer_dead_letter_topic
    reader = new_consumer(
        settings, group_id=f"{settings.topic_prefix}-consumer-redrive", client_id="opledger-redrive"
    )
    try:
        partitions = reader.list_topics(topic, timeout=timeout_s).topics[topic].partitions
        ends: dict[int, int] = {}
        for p in partitions:
            low, high = watermarks(reader, TopicPartition(topic, p), time.monotonic() + timeout_s)
            if high > low:
                ends[p] = high
        reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        found: dict[Coordinates, Any] = {}
        deadline = time.monotonic() + timeout_s
        while ends:
            if time.monotonic() > deadline:
                raise DeadLetterUnavailableError(
                    f"{topic} was not read to its end within {timeout_s:.0f} s"
                )
            for message in reader.consume(500, 0.5):
                if message.error() is not None:
                    continue
                partition, offset = int(message.partition() or 0), int(message.offset() or 0)
                if offset + 1 >= ends.get(partition, 0):
                    ends.pop(partition, None)
                headers = _raw_headers(message)
                source = source_of(headers)
                kind = (dict(headers).get(KIND_HEADER) or b"").decode(errors="replace")
                if source is None or source.topic != source_topic:
                    continue
                if kinds and kind not in kinds:
                    continue
                if at and (source.partition, source.offset) not in at:
                    continue
                found.setdefault(source, message)
        return found
    finally:
        reader.close()
