"""The PostgreSQL edge shared by the SDK, the workers and the commands: the one place sessions
are opened (:func:`connect` for one, :func:`open_pool` and :func:`open_async_pool` for pools),
and a way to run idempotent work that rides out a server restart.

Every session is autocommit and gets the same options (:func:`session_options`): UTC, a bound on
lock waits unless the caller says it must queue (migrations), a statement timeout where the
caller asks for one, and an ``application_name`` that says who it is in ``pg_stat_activity``.
Nothing else in the project calls ``psycopg.connect`` or builds a pool
(``tests/unit/test_pg_sessions.py``).

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
from psycopg.conninfo import conninfo_to_dict
from psycopg.errors import LockNotAvailable
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolClosed, PoolTimeout

from ledger.domain.redact import redact
from ledger.errors import RecordError

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Every session reads timestamps in UTC: in another zone, instants near the ends of Python's
#: datetime range (which the contract allows) would come back out of that range, and an
#: operator's listing would depend on the server's ``initdb``.
SESSION_TIME_ZONE = "UTC"

#: How long one call keeps trying to reach PostgreSQL (a restart takes a second or two).
DEFAULT_RECONNECT_WINDOW_S = 10.0

#: How long a statement waits for a lock another session holds (OPLEDGER_PG_LOCK_TIMEOUT_MS).
LOCK_TIMEOUT_MS = 30_000

#: How long opening a session may take before the caller hears PostgreSQL is unreachable.
CONNECT_TIMEOUT_S = 5


class DatabaseUnavailableError(RecordError):
    """PostgreSQL did not answer within the reconnect window; nothing was done."""


class DatabaseError(RecordError):
    """PostgreSQL refused the work (a constraint, a bad value); retrying would not help."""


def session_options(
    *,
    lock_timeout_ms: int | None = LOCK_TIMEOUT_MS,
    statement_timeout_ms: int | None = None,
    read_only: bool = False,
    dsn_options: str = "",
) -> str:
    """The libpq ``options`` every session starts with: UTC always; a lock wait bounded by
    ``lock_timeout_ms`` (None: wait as long as it takes, for migrations, which queue on their
    lock); statements bounded by ``statement_timeout_ms`` (None: unbounded); read-only
    transactions when asked. ``dsn_options`` (what the DSN itself says) come first, so a
    user's ``search_path`` survives and these settings win over the same names there.

    Start-up options, not ``SET`` statements: they cost no round trip, hold on every
    connection a pool opens or reopens after a restart, and override the database's and the
    role's defaults (``ALTER DATABASE ... SET timezone``). A client's ``PGTZ`` overrides them
    in turn; the factories put such a session back in UTC (:func:`_in_session_time_zone`)."""
    parts = [dsn_options.strip()] if dsn_options.strip() else []
    parts.append(f"-c TimeZone={SESSION_TIME_ZONE}")
    if lock_timeout_ms is not None:
        parts.append(f"-c lock_timeout={int(lock_timeout_ms)}")
    if statement_timeout_ms is not None:
        parts.append(f"-c statement_timeout={int(statement_timeout_ms)}")
    if read_only:
        # psycopg's ``read_only`` attribute does nothing in autocommit mode (it only changes
        # the BEGIN it sends); the server's default holds for every statement.
        parts.append("-c default_transaction_read_only=on")
    return " ".join(parts)


def _session_kwargs(
    dsn: str,
    *,
    name: str,
    connect_timeout: int,
    lock_timeout_ms: int | None,
    statement_timeout_ms: int | None,
    read_only: bool,
) -> dict[str, Any]:
    try:
        dsn_options = str(conninfo_to_dict(dsn).get("options") or "")
    except psycopg.ProgrammingError:
        dsn_options = ""  # a malformed DSN: the connection attempt says what is wrong with it
    return {
        "autocommit": True,
        "connect_timeout": int(connect_timeout),
        "application_name": name,
        "options": session_options(
            lock_timeout_ms=lock_timeout_ms,
            statement_timeout_ms=statement_timeout_ms,
            read_only=read_only,
            dsn_options=dsn_options,
        ),
    }


_SET_TIME_ZONE = f"SET TimeZone TO '{SESSION_TIME_ZONE}'"


def _in_session_time_zone(conn: psycopg.Connection[Any]) -> None:
    """Put ``conn`` in UTC if its start-up options did not: libpq sends a client's ``PGTZ``
    as a start-up parameter the server applies *after* the options. The server reports its
    zone when the session starts, so this costs a round trip only when that happened."""
    if conn.info.parameter_status("TimeZone") != SESSION_TIME_ZONE:
        conn.execute(_SET_TIME_ZONE)


async def _in_session_time_zone_async(conn: psycopg.AsyncConnection[Any]) -> None:
    """:func:`_in_session_time_zone` for an asyncio connection."""
    if conn.info.parameter_status("TimeZone") != SESSION_TIME_ZONE:
        await conn.execute(_SET_TIME_ZONE)


def connect(
    dsn: str,
    *,
    name: str,
    read_only: bool = False,
    connect_timeout: int = CONNECT_TIMEOUT_S,
    lock_timeout_ms: int | None = LOCK_TIMEOUT_MS,
    statement_timeout_ms: int | None = None,
) -> psycopg.Connection[Any]:
    """One autocommit session to ``dsn`` with the options of :func:`session_options`, named
    ``name`` in ``pg_stat_activity``. Autocommit: a lookup holds no lock past its statement,
    and work that needs a transaction says so (``with conn.transaction():``). Raises
    ``psycopg.OperationalError`` when PostgreSQL cannot be reached."""
    conn = psycopg.connect(
        dsn,
        **_session_kwargs(
            dsn,
            name=name,
            connect_timeout=connect_timeout,
            lock_timeout_ms=lock_timeout_ms,
            statement_timeout_ms=statement_timeout_ms,
            read_only=read_only,
        ),
    )
    try:
        _in_session_time_zone(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def open_pool(
    dsn: str,
    *,
    name: str,
    max_size: int = 16,
    lock_timeout_ms: int = LOCK_TIMEOUT_MS,
    statement_timeout_ms: int | None = None,
) -> ConnectionPool[Any]:
    """A pool of autocommit connections to ``dsn``, opened lazily: it does not fail while
    PostgreSQL is down (the first use says so instead). A statement waits at most
    ``lock_timeout_ms`` for a lock another session holds, then fails (and :func:`retrying`
    says so), instead of making its caller wait for ever."""
    return ConnectionPool(
        dsn,
        min_size=1,
        max_size=max_size,
        kwargs=_session_kwargs(
            dsn,
            name=name,
            connect_timeout=CONNECT_TIMEOUT_S,
            lock_timeout_ms=lock_timeout_ms,
            statement_timeout_ms=statement_timeout_ms,
            read_only=False,
        ),
        configure=_in_session_time_zone,
        open=True,
        name=name,
    )


def open_async_pool(
    dsn: str, *, name: str, max_size: int = 4, lock_timeout_ms: int = LOCK_TIMEOUT_MS
) -> AsyncConnectionPool[Any]:
    """An asyncio pool of autocommit connections with the same options, not yet open
    (``await pool.open()`` on the event loop that will use it). A statement waits at most
    ``lock_timeout_ms`` for a lock another session holds: a sender hears 503 and tries again,
    rather than every request waiting on the lock."""
    return AsyncConnectionPool(
        dsn,
        min_size=1,
        max_size=max_size,
        kwargs=_session_kwargs(
            dsn,
            name=name,
            connect_timeout=CONNECT_TIMEOUT_S,
            lock_timeout_ms=lock_timeout_ms,
            statement_timeout_ms=None,
            read_only=False,
        ),
        configure=_in_session_time_zone_async,
        open=False,
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
