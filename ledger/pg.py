"""The PostgreSQL edge shared by the SDK and the workers: one pool per process, and a way to run
idempotent work that rides out a server restart.

A restart (or failover) kills every pooled connection at once. Work given to :func:`retrying` is
run on a pooled connection; on a connection error the pool tests all its idle connections
(replacing the dead ones) and the work is tried again until a window ends, after which the error
says the database is unreachable. Only idempotent work may be given: a commit whose
acknowledgement was lost is then simply done again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg.errors import LockNotAvailable
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from ledger.domain.redact import redact
from ledger.errors import RecordError

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Every session reads timestamps in UTC: in another zone, instants near the ends of Python's
#: datetime range (which the contract allows) would come back out of that range.
SESSION_OPTIONS = "-c TimeZone=UTC"

#: How long one call keeps trying to reach PostgreSQL (a restart takes a second or two).
DEFAULT_RECONNECT_WINDOW_S = 10.0


class DatabaseUnavailableError(RecordError):
    """PostgreSQL did not answer within the reconnect window; nothing was done."""


class DatabaseError(RecordError):
    """PostgreSQL refused the work (a constraint, a bad value); retrying would not help."""


#: How long a statement waits for a lock another session holds (OPLEDGER_PG_LOCK_TIMEOUT_MS).
LOCK_TIMEOUT_MS = 30_000


def open_pool(
    dsn: str, *, name: str, max_size: int = 16, lock_timeout_ms: int = LOCK_TIMEOUT_MS
) -> ConnectionPool[Any]:
    """A pool of autocommit connections to ``dsn``, opened lazily: it does not fail while
    PostgreSQL is down (the first use says so instead). A statement waits at most
    ``lock_timeout_ms`` for a lock another session holds, then fails (and :func:`retrying`
    says so), instead of making its caller wait for ever."""
    return ConnectionPool(
        dsn,
        min_size=1,
        max_size=max_size,
        kwargs={
            "autocommit": True,
            "connect_timeout": 5,
            "application_name": name,
            "options": f"{SESSION_OPTIONS} -c lock_timeout={int(lock_timeout_ms)}",
        },
        open=True,
        name=name,
    )


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def pool_closed(exc: PoolClosed) -> str:
    """Why work on a closed pool failed, for an error that says what to do."""
    return (
        f"its connection pool is closed ({first_line(exc)}): the client that owned it was "
        "closed; nothing was done. Use an open client"
    )


def retrying(
    pool: ConnectionPool[Any],
    what: str,
    work: Callable[[psycopg.Connection[Any]], T],
    *,
    window_s: float = DEFAULT_RECONNECT_WINDOW_S,
) -> T:
    """Run idempotent ``work`` on a pooled connection, riding out a lost connection for up to
    ``window_s``. Raises :class:`DatabaseUnavailableError` or :class:`DatabaseError`."""
    deadline = time.monotonic() + window_s
    delay = 0.02
    while True:
        try:
            with pool.connection(timeout=max(0.1, deadline - time.monotonic())) as conn:
                return work(conn)
        except PoolClosed as exc:
            # An OperationalError to psycopg, but no reconnect can open a pool its owner closed:
            # retried, a call racing close() would wait out the whole window for nothing.
            raise DatabaseError(f"could not {what}: {pool_closed(exc)}") from exc
        except (psycopg.OperationalError, PoolTimeout) as exc:
            if time.monotonic() + delay >= deadline and isinstance(exc, LockNotAvailable):
                raise DatabaseUnavailableError(
                    f"could not {what}: another session held a lock it needs for "
                    f"{window_s:.0f}s ({first_line(exc)}); nothing was done. Find the holder "
                    "in pg_locks / pg_stat_activity"
                ) from exc
            if time.monotonic() + delay >= deadline:
                where = redact(str(pool.conninfo))
                raise DatabaseUnavailableError(
                    f"could not {what}: PostgreSQL at {where} did not answer for "
                    f"{window_s:.0f}s ({first_line(exc)})"
                ) from exc
            log.warning("%s: %s; retrying on a fresh connection", what, first_line(exc))
            # After a restart every idle connection in the pool is dead: test them all now
            # (dead ones are replaced) rather than meeting them one failed call at a time.
            with contextlib.suppress(Exception):
                pool.check()
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        except psycopg.Error as exc:
            raise DatabaseError(f"could not {what}: {first_line(exc)}") from exc
