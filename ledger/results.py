"""Durable, content-addressed result payloads in PostgreSQL.

Events carry only ``result_ref``; the payload lives here. ``put`` commits before it returns, so a
worker that records ``SUCCEEDED`` (and then acknowledges its job) never points at a result that a
crash could still lose - the seed's "Are result records durable before a worker acknowledges the
job?".

Connections come from a pool, and a connection that PostgreSQL dropped (a restart, a failover) is
replaced instead of poisoning every later call (``ledger.pg.retrying``). Concurrent ``put`` calls
on one store share commits (:class:`_GroupCommit`): each caller still returns only once its own
row is committed, and a payload PostgreSQL refuses fails only its own caller.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar

import psycopg
from psycopg_pool import ConnectionPool

from ledger import migrate
from ledger.domain.call import storable_content_type
from ledger.domain.ids import SHA256_REF_RE, content_ref
from ledger.domain.names import InvalidNameError, NameKind, is_name
from ledger.errors import ResultStoreError
from ledger.pg import (
    DEFAULT_RECONNECT_WINDOW_S,
    DatabaseError,
    DatabaseUnavailableError,
    open_pool,
    retrying,
)

T = TypeVar("T")

#: Largest payload accepted. Results are read whole by the delivery worker and sent in one
#: request; anything bigger belongs in an object store with only its address stored here.
MAX_RESULT_BYTES = 16 * 1024 * 1024

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
COMPONENT = "ledger"


#: Payload bytes one shared commit takes at most (a single larger payload still goes alone).
GROUP_COMMIT_BYTES = 4 * 1024 * 1024


class _Waiter:
    """One ``put`` in a :class:`_GroupCommit`: released when its row is committed (or refused),
    or when it is handed the lead of the next commit."""

    __slots__ = ("abandoned", "error", "latch", "leads", "result")

    def __init__(self, result: PreparedResult) -> None:
        self.result = result
        self.error: ResultStoreError | None = None
        #: holds the lead and has not yet taken its group
        self.leads = False
        #: its caller stopped waiting (an interrupt): it must not be handed the lead
        self.abandoned = False
        self.latch = threading.Lock()
        self.latch.acquire()


class _GroupCommit:
    """Concurrent puts share one commit: the first caller leads and commits every put queued
    by then in one statement; callers arriving meanwhile queue, and when the commit is done the
    oldest of them leads the next one. With 16 callers, one commit (and one WAL flush) instead
    of up to 16; a lone caller commits at once, as before.

    A failed shared commit is tried again row by row, so that a row PostgreSQL refuses fails
    only its own caller; a database that is away fails the whole group (each row would only
    wait out the same reconnect window again), and so do the puts that queued behind it, so no
    caller waits much longer than one window, as before. A caller interrupted while it waits (a
    KeyboardInterrupt in the main thread) gives up its place in the line of leaders, so the
    puts behind it never wait for a leader who is gone."""

    def __init__(
        self,
        commit_many: Callable[[Sequence[PreparedResult]], None],
        byte_limit: int = GROUP_COMMIT_BYTES,
    ) -> None:
        self._commit_many = commit_many
        self._byte_limit = byte_limit
        self._lock = threading.Lock()
        self._queue: list[_Waiter] = []
        self._leading = False

    def put(self, result: PreparedResult) -> None:
        waiter = _Waiter(result)
        with self._lock:
            self._queue.append(waiter)
            if not self._leading:
                self._leading = waiter.leads = True
        try:
            if not waiter.leads:
                waiter.latch.acquire()  # committed by a leader, or handed the lead
            if waiter.leads:
                self._lead(waiter)
        except BaseException:
            self._abandon(waiter)
            raise
        if waiter.error is not None:
            raise waiter.error

    def _lead(self, leader: _Waiter) -> None:
        with self._lock:
            leader.leads = False
            group = self._take()
        away: ResultStoreError | None = None
        try:
            away = self._commit(group)
        finally:
            for waiter in group:
                if waiter is not leader:
                    waiter.latch.release()
            with self._lock:
                if away is not None:
                    # The puts that queued meanwhile have waited out the same reconnect window:
                    # they fail now rather than each wait another one.
                    for waiter in self._queue:
                        waiter.error = _again(away)
                        waiter.latch.release()
                    self._queue = []
                self._hand_off()

    def _abandon(self, waiter: _Waiter) -> None:
        with self._lock:
            waiter.abandoned = True
            if waiter.leads:  # handed the lead, but gone before taking a group: pass it on
                waiter.leads = False
                self._hand_off()

    def _hand_off(self) -> None:
        """(The lock held.) Hand the lead to the oldest put still waiting, or stand down."""
        queue = self._queue
        while queue and queue[0].abandoned:
            queue.pop(0)  # its caller was told it failed: nothing is owed to it
        if queue:
            queue[0].leads = True
            queue[0].latch.release()
        else:
            self._leading = False

    def _take(self) -> list[_Waiter]:
        """The oldest queued puts, up to the byte limit (at least one: the leader, the oldest)."""
        queue = self._queue
        size, count = 0, 0
        for waiter in queue:
            size += len(waiter.result.payload)
            if count and size > self._byte_limit:
                break
            count += 1
        batch, self._queue = queue[:count], queue[count:]
        return batch

    def _commit(self, batch: list[_Waiter]) -> ResultStoreError | None:
        """Commit ``batch``, setting each waiter's error; returns the error when the database
        did not answer within the reconnect window."""
        try:
            self._commit_many([w.result for w in batch])
            return None
        except ResultStoreError as exc:
            away = isinstance(exc.__cause__, DatabaseUnavailableError)
            if len(batch) == 1 or away:
                for waiter in batch:
                    waiter.error = _again(exc)
                return exc if away else None
        except BaseException:
            for waiter in batch:
                waiter.error = ResultStoreError(
                    "the shared commit was interrupted: nothing is known to be stored; "
                    "retry the call"
                )
            raise
        for waiter in batch:  # one row at a time: find the row PostgreSQL refuses
            try:
                self._commit_many([waiter.result])
            except ResultStoreError as exc:
                waiter.error = _again(exc)
        return None


def _again(exc: ResultStoreError) -> ResultStoreError:
    """A fresh copy of ``exc`` for one caller (an exception raised in several threads would
    share and grow one traceback)."""
    copy = ResultStoreError(*exc.args)
    copy.__cause__ = exc.__cause__
    return copy


def _check_tenant(tenant_id: str) -> None:
    # The events' shape, so a stored result's tenant is one an event can carry.
    if not is_name(NameKind.TENANT, tenant_id):
        raise ResultStoreError(str(InvalidNameError(NameKind.TENANT, tenant_id)))


@dataclass(frozen=True, slots=True)
class StoredResult:
    content_type: str
    payload: bytes


@dataclass(frozen=True, slots=True)
class PreparedResult:
    """A payload checked for storing, with its content-addressed ref (``ResultStore.prepare``)."""

    tenant_id: str
    result_ref: str
    content_type: str
    payload: bytes


class ResultStore:
    """Tenant-scoped result payloads, keyed by ``(tenant_id, sha256 of the bytes)``."""

    def __init__(
        self,
        pool: ConnectionPool[Any],
        *,
        owns_pool: bool = False,
        reconnect_window_s: float = DEFAULT_RECONNECT_WINDOW_S,
    ) -> None:
        self._pool = pool
        self._owns = owns_pool
        self._window_s = reconnect_window_s
        self._group = _GroupCommit(self.put_many)

    @classmethod
    def connect(
        cls,
        dsn: str,
        *,
        max_connections: int = 16,
        reconnect_window_s: float = DEFAULT_RECONNECT_WINDOW_S,
    ) -> Self:
        """A store over its own pool to ``dsn`` (closed by :meth:`close`). It does not fail
        while PostgreSQL is down: the first ``put`` says so instead."""
        pool = open_pool(dsn, name="opledger-sdk", max_size=max_connections)
        return cls(pool, owns_pool=True, reconnect_window_s=reconnect_window_s)

    @property
    def pool(self) -> ConnectionPool[Any]:
        """The connection pool (the SDK's lease store shares it)."""
        return self._pool

    def migrate(self) -> list[int]:
        """Create or upgrade the ``results`` table; returns the migration versions applied now."""
        return self._retrying(
            "apply the results migrations", lambda c: migrate.apply(c, COMPONENT, MIGRATIONS)
        )

    def put(
        self, tenant_id: str, payload: bytes, content_type: str = "application/octet-stream"
    ) -> str:
        """Store ``payload`` for ``tenant_id``; returns its ``result_ref``, committed and durable.

        Storing the same bytes again is a no-op returning the same ref, which is also why a put
        interrupted by a dropped connection is simply tried again on a fresh one. Puts made at
        the same time from several threads share a commit (see :class:`_GroupCommit`).
        """
        result = self.prepare(tenant_id, payload, content_type)
        self._group.put(result)
        return result.result_ref

    @staticmethod
    def prepare(
        tenant_id: str, payload: bytes, content_type: str = "application/octet-stream"
    ) -> PreparedResult:
        """``payload`` checked as :meth:`put` checks it, with its ``result_ref``: what
        :meth:`put_many` stores. Raises ResultStoreError; nothing is stored here."""
        _check_tenant(tenant_id)
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise ResultStoreError(f"payload must be bytes, got {type(payload).__name__}")
        payload = bytes(payload)
        if len(payload) > MAX_RESULT_BYTES:
            raise ResultStoreError(
                f"result is {len(payload)} bytes; the limit is {MAX_RESULT_BYTES} "
                "(store large results elsewhere and record their address)"
            )
        if not storable_content_type(content_type):
            raise ResultStoreError(f"not a valid content type: {content_type!r}")
        return PreparedResult(tenant_id, content_ref(payload), content_type, payload)

    def put_many(self, results: Sequence[PreparedResult]) -> None:
        """Store prepared results in one statement (one commit), durable when it returns; a
        result already stored is a no-op, as with :meth:`put`."""
        if not results:
            return

        def insert(conn: psycopg.Connection[Any]) -> None:
            # Autocommit: the statement is its own transaction, committed (on disk, with
            # synchronous_commit on) when execute returns.
            if len(results) == 1:
                # One row (a lone caller, the usual case): plain parameters cost the client
                # less than four one-element arrays.
                (one,) = results
                conn.execute(
                    """INSERT INTO results
                           (result_ref, tenant_id, content_type, payload, size_bytes)
                       VALUES (%s, %s, %s, %s, %s)
                       ON CONFLICT (tenant_id, result_ref) DO NOTHING""",
                    (
                        one.result_ref,
                        one.tenant_id,
                        one.content_type,
                        one.payload,
                        len(one.payload),
                    ),
                )
                return
            conn.execute(
                """INSERT INTO results (result_ref, tenant_id, content_type, payload, size_bytes)
                   SELECT r, t, c, p, length(p)
                     FROM unnest(%s::text[], %s::text[], %s::text[], %s::bytea[]) AS x(r, t, c, p)
                   ON CONFLICT (tenant_id, result_ref) DO NOTHING""",
                (
                    [x.result_ref for x in results],
                    [x.tenant_id for x in results],
                    [x.content_type for x in results],
                    [x.payload for x in results],
                ),
            )

        what = (
            f"store result {results[0].result_ref}"
            if len(results) == 1
            else f"store {len(results)} results in one commit"
        )
        self._retrying(what, insert)

    def get(self, tenant_id: str, result_ref: str) -> bytes | None:
        """The payload stored under ``result_ref`` *for this tenant*; None if there is none."""
        _check_tenant(tenant_id)
        if not SHA256_REF_RE.match(result_ref):
            raise ResultStoreError(f"not a result ref: {result_ref!r}")

        def select(conn: psycopg.Connection[Any]) -> bytes | None:
            row = conn.execute(
                "SELECT payload FROM results WHERE tenant_id = %s AND result_ref = %s",
                (tenant_id, result_ref),
            ).fetchone()
            return None if row is None else bytes(row[0])

        return self._retrying(f"read result {result_ref}", select)

    def get_many(self, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], StoredResult]:
        """``(tenant_id, result_ref)`` -> the stored result, for those found; one round trip.
        Each result is read only for its own tenant."""
        wanted = sorted(set(keys))
        for tenant_id, result_ref in wanted:
            _check_tenant(tenant_id)
            if not SHA256_REF_RE.match(result_ref):
                raise ResultStoreError(f"not a result ref: {result_ref!r}")
        if not wanted:
            return {}

        def select(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(
                """SELECT r.tenant_id, r.result_ref, r.content_type, r.payload
                     FROM unnest(%s::text[], %s::text[]) AS k(tenant_id, result_ref)
                     JOIN results r USING (tenant_id, result_ref)""",
                ([k[0] for k in wanted], [k[1] for k in wanted]),
            ).fetchall()

        rows = self._retrying(f"read {len(wanted)} results", select)
        return {(t, ref): StoredResult(ctype, bytes(payload)) for t, ref, ctype, payload in rows}

    def close(self) -> None:
        """Close the pool if this store opened it."""
        if self._owns:
            self._pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _retrying(self, what: str, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        try:
            return retrying(self._pool, what, work, window_s=self._window_s)
        except DatabaseUnavailableError as exc:
            raise ResultStoreError(
                f"{exc}. Nothing was recorded; retry the call once the database is back"
            ) from exc
        except DatabaseError as exc:
            raise ResultStoreError(str(exc)) from exc
