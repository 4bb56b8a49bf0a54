"""Work given to a closed connection pool fails at once with an error that says so.

psycopg_pool's ``PoolClosed`` is an ``OperationalError``, the class a lost connection raises,
and both retry loops (``ledger.pg.retrying``, the consumer inbox's ``record_many``) retried it
for their whole reconnect window: a call racing its client's ``close()`` waited that long to
be told "PostgreSQL did not answer", which was not what happened.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from psycopg_pool import AsyncConnectionPool

from consumers.contract import parse_event
from consumers.inbox import Inbox
from ledger.pg import DatabaseError, DatabaseUnavailableError, open_pool, retrying
from ledger.settings import Settings
from tests.consumer_support import event_body, new_op_id

WINDOW_S = 10.0
#: Far under the window: a retried PoolClosed takes the whole window.
PROMPTLY_S = 2.0


def test_retrying_on_a_closed_pool_says_it_is_closed_at_once(isolated: Settings) -> None:
    pool = open_pool(isolated.dsn, name="test-closed-pool")
    assert retrying(pool, "read one", lambda conn: conn.execute("SELECT 1").fetchone()) == (1,)
    pool.close()
    started = time.monotonic()
    with pytest.raises(DatabaseError, match="pool is closed") as refused:
        retrying(pool, "read one", lambda conn: conn.execute("SELECT 1"), window_s=WINDOW_S)
    assert time.monotonic() - started < PROMPTLY_S
    assert not isinstance(refused.value, DatabaseUnavailableError)  # a retry would not help


def test_a_closing_inbox_answers_not_now_at_once(isolated: Settings) -> None:
    op_id = new_op_id()
    event = parse_event(event_body(op_id), op_id, None)

    async def scenario() -> float:
        pool: AsyncConnectionPool = AsyncConnectionPool(isolated.consumer_dsn, open=False)
        await pool.open()
        inbox = Inbox("test-closed", pool, reconnect_window_s=WINDOW_S)
        await inbox.close()
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailableError, match="pool is closed"):
            await inbox.record_many([event], "http")
        return time.monotonic() - started

    assert asyncio.run(scenario()) < PROMPTLY_S
