"""What a dead letter looks like on its topic, for every component that writes one.

A dead letter is the record itself (key, value, its own headers) plus headers saying why and
where from: ``opledger-dlq-reason`` and the source's topic, partition, offset and timestamp. The
coordinates identify a repeat (dead letters are published at least once). A record too large to
republish is replaced by a reference to it: its coordinates, size, sha256 and a prefix.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections.abc import Sequence

from ledger.log import RawRecord, RawWriter
from ledger.records import Coordinates, DeadLetter

log = logging.getLogger("opledger.dead_letters")

#: Largest record (key + value) republished whole to the dead-letter topic. The broker accepts
#: records up to about 1 MiB (its message.max.bytes); a dead letter adds headers, so anything
#: near that size is sent as a reference instead of being refused by the producer.
DLQ_INLINE_LIMIT = 900_000
#: Bytes of an oversized record kept in its reference, to help whoever investigates it.
DLQ_PREFIX_BYTES = 1024

REASON_HEADER = "opledger-dlq-reason"
BY_REFERENCE_HEADER = "opledger-dlq-by-reference"
SOURCE_TOPIC_HEADER = "opledger-source-topic"
SOURCE_PARTITION_HEADER = "opledger-source-partition"
SOURCE_OFFSET_HEADER = "opledger-source-offset"
SOURCE_TIMESTAMP_HEADER = "opledger-source-timestamp-ms"
#: Headers a dead letter adds to its record's own: a redrive takes them off again.
ADDED_HEADER_PREFIXES = ("opledger-dlq-", "opledger-source-")
#: Bytes of a reason kept in its header.
REASON_HEADER_BYTES = 4000


def needs_reference(item: DeadLetter) -> bool:
    """Whether ``item`` is too large to republish whole."""
    headers = sum(len(k) + len(v or b"") for k, v in item.headers)
    return len(item.key or b"") + len(item.value or b"") + headers > DLQ_INLINE_LIMIT


def by_reference(item: DeadLetter) -> DeadLetter:
    """A dead letter that points at its record instead of carrying it."""
    value = item.value or b""
    c = item.coordinates
    reference = {
        "by_reference": True,
        "source": {"topic": c.topic, "partition": c.partition, "offset": c.offset},
        "size_bytes": len(value),
        "key_size_bytes": len(item.key or b""),
        "sha256": hashlib.sha256(value).hexdigest(),
        "prefix_base64": base64.b64encode(value[:DLQ_PREFIX_BYTES]).decode(),
        "reason": item.reason,
    }
    key = item.key if item.key is None or len(item.key) <= 1024 else item.key[:1024]
    return DeadLetter(
        c,
        item.reason,
        key,
        json.dumps(reference, sort_keys=True).encode(),
        item.timestamp_ms,
        by_reference=True,
        size_bytes=len(value),
    )


def dead_letter_headers(
    item: DeadLetter, extra: Sequence[tuple[str, bytes]] = ()
) -> list[tuple[str, str | bytes | None]]:
    """The headers ``item`` is published with: its record's own (unless it is a reference),
    then why and where from, then ``extra``."""
    c = item.coordinates
    headers: list[tuple[str, str | bytes | None]] = [] if item.by_reference else [*item.headers]
    headers += [
        (REASON_HEADER, item.reason.encode("utf-8", "backslashreplace")[:REASON_HEADER_BYTES]),
        (SOURCE_TOPIC_HEADER, c.topic.encode()),
        (SOURCE_PARTITION_HEADER, str(c.partition).encode()),
        (SOURCE_OFFSET_HEADER, str(c.offset).encode()),
        (SOURCE_TIMESTAMP_HEADER, str(item.timestamp_ms).encode()),
    ]
    if item.by_reference:
        headers.append((BY_REFERENCE_HEADER, b"1"))
    headers += extra
    return headers


def source_of(headers: Sequence[tuple[str, bytes | None]]) -> Coordinates | None:
    """The source coordinates a dead letter's headers name, if they name them."""
    found = {k: v or b"" for k, v in headers if k.startswith("opledger-source-")}
    try:
        return Coordinates(
            found[SOURCE_TOPIC_HEADER].decode(),
            int(found[SOURCE_PARTITION_HEADER]),
            int(found[SOURCE_OFFSET_HEADER]),
        )
    except (KeyError, ValueError, UnicodeDecodeError):
        return None


def own_headers(headers: Sequence[tuple[str, bytes | None]]) -> list[tuple[str, bytes | None]]:
    """A dead letter's headers less those the dead letter added: its record's own."""
    return [(k, v) for k, v in headers if not k.startswith(ADDED_HEADER_PREFIXES)]


class DeadLetterUnavailableError(RuntimeError):
    """The dead-letter topic did not acknowledge every letter: nothing may be committed past
    them yet."""


def send_dead_letters(
    writer: RawWriter,
    topic: str,
    letters: Sequence[DeadLetter],
    *,
    extra: Sequence[Sequence[tuple[str, bytes]]] = (),
    timeout_s: float | None = None,
) -> list[DeadLetter]:
    """Publish ``letters`` to ``topic`` and wait for the broker's acknowledgement of each;
    answers them as published. A letter too large to republish whole (by this module's limit,
    the client's, or the broker's or topic's, which may be lower than assumed) goes as a
    reference to its record. ``extra[i]`` are headers of the writer's own for letter ``i``.

    Raises :class:`DeadLetterUnavailableError` unless every letter was acknowledged."""
    published = [by_reference(item) if needs_reference(item) else item for item in letters]

    def record(index: int) -> RawRecord:
        item = published[index]
        headers = dead_letter_headers(item, extra[index] if extra else ())
        return RawRecord(topic, item.key, item.value, headers)

    sent = writer.send([record(i) for i in range(len(published))], timeout_s)
    refused = list(sent.failed)
    again = []
    for index in sent.too_large:
        if published[index].by_reference:
            refused.append((index, "too large even as a reference"))
        else:
            published[index] = by_reference(published[index])
            again.append(index)
    unacknowledged = sent.unacknowledged
    if again:
        log.warning("%d dead letter(s) refused as too large; sending references", len(again))
        resent = writer.send([record(i) for i in again], timeout_s)
        refused += [(again[i], reason) for i, reason in resent.failed]
        refused += [(again[i], "too large even as a reference") for i in resent.too_large]
        unacknowledged += resent.unacknowledged
    if refused or unacknowledged:
        reasons = sorted({reason for _, reason in refused})
        if unacknowledged:
            reasons.append(f"{unacknowledged} unacknowledged")
        raise DeadLetterUnavailableError(f"dead letters not published: {'; '.join(reasons)}")
    return published
