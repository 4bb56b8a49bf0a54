"""The inbox: the consumer's check and change, atomic in PostgreSQL.

:meth:`Inbox.record_many` inserts the keys of a batch of events into ``consumer_inbox`` and
applies the change to exactly the events whose insert took their key, in one transaction. The
primary key decides: a concurrent transaction inserting the same key blocks on the uncommitted
row and then finds it taken, so the change runs once however many copies arrive, in one process
or many. A crash before the commit leaves neither rows nor changes (the senders' retries are
first receipts); after it, both.

A change takes one of two forms:

- :class:`StatementChange`: one SQL statement over the events just taken (the relation
  ``fresh``). The inbox runs it in the *same statement* as the inbox insert (data-modifying
  CTEs), so check and change are one statement, one round trip, one implicit transaction. The
  reference consumer's change is one (:data:`REFERENCE_CHANGE`).
- :data:`Change`: any coroutine on the connection, run inside the transaction after the insert;
  it may refuse events. Costs three statements more per batch.

Why batches and one statement: CPU, not waiting, is what runs out first on the 2-core box. A
first version ran one four-statement transaction per request from a thread pool and could not
keep up with 400 requests/s (``bench/bench_consumer_receiver.py``: p50 over 250 ms); in
profiles the statements' round trips in psycopg and the hops to its threads dominated. The
receiver now commits whatever arrived while the previous statement ran (``receiver.py``), the
queue consumer a consumed batch; each event's row and change still commit together.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import enum
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout

from consumers.contract import Event
from ledger import migrate
from ledger.pg import (
    DatabaseError,
    DatabaseUnavailableError,
    first_line,
    pool_closed,
)

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
COMPONENT = "consumers"


class Verdict(enum.StrEnum):
    ACCEPTED = "accepted"  # first receipt: committed with its change now
    DUPLICATE = "duplicate"  # the key was accepted before with the same body
    CONFLICT = "conflict"  # the key was accepted before with another body


@dataclass(frozen=True, slots=True)
class Recorded:
    """What :meth:`Inbox.record_many` found or did for one event."""

    verdict: Verdict
    received_at: datetime | None = None  # of the first receipt
    outcome: str | None = None  # what the change did, when this call applied it


@dataclass(frozen=True, slots=True)
class StatementChange:
    """A change as one data-modifying SQL statement (``INSERT``/``UPDATE``/``DELETE``) reading
    the relation ``fresh``: the events whose keys this statement took, with columns
    ``operation_id, fingerprint, tenant_id, tool_name, destination, result_ref, content_type,
    result (bytea), received_at``. ``%(consumer)s`` is the consumer's name. Every event it sees
    is ``applied``."""

    sql: str


#: Any change: run inside the inbox transaction on ``conn`` after the insert, for the events
#: whose keys were taken; returns one outcome per event, ``"applied"`` or ``"refused"`` (an
#: event the consumer declines: still receipt, and a resend is not applied either).
Change = Callable[[psycopg.AsyncConnection[Any], str, Sequence[Event]], Awaitable[Sequence[str]]]

#: The reference consumer's change: one appended row per event. Not idempotent by itself (no
#: unique key on the operation), so only the inbox keeps it once.
REFERENCE_CHANGE = StatementChange(
    """INSERT INTO consumer_applied_changes
           (consumer, operation_id, tenant_id, tool_name, destination, result_ref,
            content_type, result_bytes)
       SELECT %(consumer)s, operation_id, tenant_id, tool_name, destination, result_ref,
              content_type, octet_length(result)
         FROM fresh"""
)


def apply_migrations(conn: psycopg.Connection[Any]) -> list[int]:
    """Create or upgrade the inbox and the reference change's table; returns versions applied."""
    return migrate.apply(conn, COMPONENT, MIGRATIONS)


# The batch arrives as one JSON parameter (one statement whatever its size): psycopg dumps a
# str in C, where array parameters are dumped element by element in Python (a tenth of the
# receiver's CPU in a profile). Keys are inserted in sorted order, so two processes inserting
# overlapping batches take the row locks in the same order and cannot deadlock.
_INCOMING = """
incoming AS (
    SELECT operation_id, decode(fingerprint, 'hex') AS fingerprint, tenant_id, tool_name,
           destination, result_ref, content_type, decode(result, 'base64') AS result
      FROM jsonb_to_recordset(%(batch)s::jsonb)
        AS e(operation_id text, fingerprint text, tenant_id text, tool_name text,
             destination text, result_ref text, content_type text, result text)
), taken AS (
    INSERT INTO consumer_inbox (consumer, operation_id, fingerprint, via, outcome)
    SELECT %(consumer)s, operation_id, fingerprint, %(via)s, 'applied'
      FROM incoming ORDER BY operation_id
    ON CONFLICT (consumer, operation_id) DO NOTHING
    RETURNING operation_id, received_at
)"""

_INSERT_ONLY = f"WITH {_INCOMING} SELECT operation_id, received_at FROM taken"


def _with_change(change: StatementChange) -> str:
    # Every data-modifying CTE runs exactly once, referenced or not, in the statement's one
    # snapshot and transaction: the change sees precisely the rows "taken" returned.
    return f"""WITH {_INCOMING}, fresh AS (
        SELECT incoming.*, taken.received_at FROM incoming JOIN taken USING (operation_id)
    ), change AS ({change.sql})
    SELECT operation_id, received_at FROM taken"""


# Read after the insert, in a new statement: a key another transaction committed while ours
# waited on it is visible to this statement, not to the insert's snapshot.
_EXISTING = """
SELECT operation_id, fingerprint, received_at
  FROM consumer_inbox
 WHERE consumer = %s AND operation_id = ANY(%s)
"""
_REFUSED = """
UPDATE consumer_inbox SET outcome = 'refused' WHERE consumer = %s AND operation_id = ANY(%s)
"""


def _result_b64(event: Event) -> str:
    # Checked against result_ref already: when parsed (inline) or when fetched (by reference).
    if event.body.result_b64 is not None:
        return event.body.result_b64
    if event.result is None:
        raise ValueError(f"{event.operation_id}: a result by reference is recorded once fetched")
    return base64.b64encode(event.result).decode("ascii")


def _params(consumer: str, via: str, events: Sequence[Event]) -> dict[str, Any]:
    rows = [
        {
            "operation_id": e.body.operation_id,
            "fingerprint": e.fingerprint.hex(),
            "tenant_id": e.body.tenant_id,
            "tool_name": e.body.tool_name,
            "destination": e.body.destination,
            "result_ref": e.body.result_ref,
            "content_type": e.body.content_type,
            "result": _result_b64(e),
        }
        for e in events
    ]
    return {"consumer": consumer, "via": via, "batch": json.dumps(rows)}


# A record already held keeps its first failure: the update is a no-op that lets RETURNING
# give the stored time.
_HOLD = """
INSERT INTO consumer_held_records (consumer, topic, kafka_partition, kafka_offset)
SELECT %(consumer)s, topic, kafka_partition, kafka_offset
  FROM unnest(%(topics)s::text[], %(partitions)s::int[], %(offsets)s::bigint[])
    AS r(topic, kafka_partition, kafka_offset)
 ORDER BY 1, 2, 3, 4
ON CONFLICT (consumer, topic, kafka_partition, kafka_offset)
   DO UPDATE SET first_failed_at = consumer_held_records.first_failed_at
RETURNING topic, kafka_partition, kafka_offset,
          EXTRACT(EPOCH FROM clock_timestamp() - first_failed_at)::float8
"""

_RELEASE = """
DELETE FROM consumer_held_records
 WHERE consumer = %(consumer)s
   AND (topic, kafka_partition, kafka_offset) IN (
       SELECT * FROM unnest(%(topics)s::text[], %(partitions)s::int[], %(offsets)s::bigint[]))
"""

_FORGET_OLD_HOLDS = """
DELETE FROM consumer_held_records
 WHERE consumer = %s AND first_failed_at < clock_timestamp() - make_interval(secs => %s)
"""

#: A Kafka record, as (topic, partition, offset).
RecordAt = tuple[str, int, int]


def _records(consumer: str, records: Sequence[RecordAt]) -> dict[str, Any]:
    return {
        "consumer": consumer,
        "topics": [r[0] for r in records],
        "partitions": [r[1] for r in records],
        "offsets": [r[2] for r in records],
    }


def _ordered(events: Sequence[Event]) -> list[Event]:
    ordered = sorted(events, key=lambda e: e.operation_id)
    if len({e.operation_id for e in ordered}) != len(ordered):
        raise ValueError("one batch may hold each operation once")
    return ordered


def _refused(fresh: list[Event], outcomes: list[str]) -> list[str]:
    if len(outcomes) != len(fresh) or set(outcomes) - {"applied", "refused"}:
        raise ValueError("a change returns 'applied' or 'refused' per event")
    return [e.operation_id for e, o in zip(fresh, outcomes, strict=True) if o == "refused"]


class Inbox:
    """One consumer's inbox, on asyncio connections: a request never waits for another thread
    (on two shared cores, hops to a thread pool queued the answers behind the GIL)."""

    def __init__(
        self,
        consumer: str,
        pool: AsyncConnectionPool[Any],
        change: StatementChange | Change = REFERENCE_CHANGE,
        *,
        reconnect_window_s: float = 3.0,
    ) -> None:
        self.consumer = consumer
        self._pool = pool
        self._change = change
        self._statement = _with_change(change) if isinstance(change, StatementChange) else None
        self._window_s = reconnect_window_s

    async def close(self) -> None:
        await self._pool.close()

    async def answers(self, timeout_s: float = 2.0) -> bool:
        """Whether the database answers a trivial query within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s), self._pool.connection() as conn:
                await conn.execute("SELECT 1")
        except (psycopg.Error, PoolTimeout, TimeoutError):
            return False
        return True

    async def record_many(self, events: Sequence[Event], via: str) -> list[Recorded]:
        """Take the keys and apply the change atomically; one answer per event, in order. The
        events must have distinct operation ids.

        Rides out a lost connection for ``reconnect_window_s`` (then raises
        ``ledger.pg.DatabaseUnavailableError``): a retried batch whose first commit did land
        finds its own rows and answers DUPLICATE, which is what the senders must hear.
        """
        if not events:
            return []
        ordered = _ordered(events)
        deadline = time.monotonic() + self._window_s
        delay = 0.02
        while True:
            try:
                async with self._pool.connection(
                    timeout=max(0.1, deadline - time.monotonic())
                ) as conn:
                    found = await self._record(conn, ordered, via)
                return [found[event.operation_id] for event in events]
            except PoolClosed as exc:
                # The consumer is closing: no reconnect can help, and its sender must hear
                # "not now" (a 503, retried) rather than wait out the window.
                raise DatabaseUnavailableError(
                    f"could not record deliveries: {pool_closed(exc)}"
                ) from exc
            except (psycopg.OperationalError, PoolTimeout) as exc:
                # As ledger.pg.retrying: the work is idempotent (a repeat finds its own rows).
                if time.monotonic() + delay >= deadline:
                    raise DatabaseUnavailableError(
                        "could not record deliveries: PostgreSQL did not answer for "
                        f"{self._window_s:.0f}s ({first_line(exc)})"
                    ) from exc
                with contextlib.suppress(Exception):
                    await self._pool.check()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
            except psycopg.Error as exc:
                raise DatabaseError(f"could not record deliveries: {first_line(exc)}") from exc

    async def held_for(self, records: Sequence[RecordAt]) -> dict[RecordAt, float]:
        """Seconds since each record's result first failed to be fetched, by any replica of
        this consumer (0 for one that fails for the first time now). Raises
        ``ledger.pg.DatabaseUnavailableError`` if the database does not answer."""
        if not records:
            return {}
        rows = await self._run(_HOLD, _records(self.consumer, records), "hold records")
        return {(t, int(p), int(o)): float(age) for t, p, o, age in rows}

    async def release(self, records: Sequence[RecordAt]) -> None:
        """Forget the hold clocks of ``records`` (fetched, or dead-lettered)."""
        if records:
            await self._run(_RELEASE, _records(self.consumer, records), "release records")

    async def forget_holds_older_than(self, seconds: float) -> None:
        """Delete hold clocks left behind (their records were fetched by an owner that did not
        know of them: offsets are never reused, so they would never match again)."""
        await self._run(_FORGET_OLD_HOLDS, (self.consumer, seconds), "forget old holds")

    async def _run(self, statement: str, params: Any, what: str) -> list[Any]:
        try:
            async with self._pool.connection(timeout=self._window_s) as conn:
                cursor = await conn.execute(statement, params)
                return list(await cursor.fetchall()) if cursor.description else []
        except PoolClosed as exc:
            raise DatabaseUnavailableError(f"could not {what}: {pool_closed(exc)}") from exc
        except (psycopg.OperationalError, PoolTimeout) as exc:
            raise DatabaseUnavailableError(f"could not {what}: {first_line(exc)}") from exc
        except psycopg.Error as exc:
            raise DatabaseError(f"could not {what}: {first_line(exc)}") from exc

    async def _record(
        self, conn: psycopg.AsyncConnection[Any], ordered: list[Event], via: str
    ) -> dict[str, Recorded]:
        params = _params(self.consumer, via, ordered)
        outcomes: dict[str, str] = {}
        if self._statement is not None:
            # Autocommit: the one statement is its own transaction.
            cursor = await conn.execute(self._statement, params)
            taken: dict[str, datetime] = dict(await cursor.fetchall())
            outcomes = dict.fromkeys(taken, "applied")
        else:
            assert not isinstance(self._change, StatementChange)
            async with conn.transaction():
                cursor = await conn.execute(_INSERT_ONLY, params)
                taken = dict(await cursor.fetchall())
                fresh = [e for e in ordered if e.operation_id in taken]
                if fresh:
                    said = list(await self._change(conn, self.consumer, fresh))
                    refused = _refused(fresh, said)
                    if refused:
                        await conn.execute(_REFUSED, (self.consumer, refused))
                    outcomes = {e.operation_id: o for e, o in zip(fresh, said, strict=True)}
        answers = {
            op: Recorded(Verdict.ACCEPTED, received_at, outcomes[op])
            for op, received_at in taken.items()
        }
        others = [e for e in ordered if e.operation_id not in taken]
        if others:
            cursor = await conn.execute(
                _EXISTING, (self.consumer, [e.operation_id for e in others])
            )
            stored = {op: (bytes(d), at) for op, d, at in await cursor.fetchall()}
            for event in others:
                digest, received_at = stored[event.operation_id]
                same = digest == event.fingerprint
                verdict = Verdict.DUPLICATE if same else Verdict.CONFLICT
                answers[event.operation_id] = Recorded(verdict, received_at)
        return answers
