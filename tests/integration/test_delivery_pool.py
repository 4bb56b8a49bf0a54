"""The delivery worker's own connections are not the destination's retry budget (issue 18,
point 9; decision 026).

An outside attack's soak ended with ~18,000 deliveries waiting and a short retry schedule: 1,929
deliveries to destinations that were answering were dead-lettered with "gave up after 8
attempts; last: no answer: not sent: no connection came free within N s". Here the same shape,
small: a backlog many times the sender's connections (``OPLEDGER_DELIVERY_CONCURRENCY``) to a
destination that answers 202, slowly but well within its timeout, with a short schedule and few
attempts. Every delivery must be acknowledged on its first send: waiting for a connection is not
an attempt. The real broker and database, a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import base64
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest

from ledger.domain.schedule import RetryPolicy
from ledger.domain.states import DeliveryState
from ledger.settings import Settings
from tests.delivery_support import Answer, ScriptedReceiver, SteppedDeliveryRig, keys_seen
from tests.support import grant, project_in_process

pytestmark = pytest.mark.integration

D = DeliveryState
TENANT = "acme"
ACTOR = "agent-7"
TOOL = "send_email"
SECRET = "whsec_" + base64.b64encode(b"pool-secret-0123456789ab").decode()

#: The sender's connections: far fewer than the deliveries waiting.
CONNECTIONS = 4
#: Deliveries waiting at once: the old sender fitted 4 connections x 2 s / 0.25 s = 32 of them
#: into one pass's timeout and failed the rest "not sent", an attempt each; three passes of
#: that leave 24 dead-lettered.
BACKLOG = 120
#: The destination answers 202 after this long, well within its timeout.
ANSWER_DELAY_S = 0.25
TIMEOUT_MS = 2000
#: A short schedule and few attempts, as in the soak (1s,2s,3s,5s,... and 8 attempts there).
RETRY = RetryPolicy(
    schedule=(timedelta(milliseconds=200), timedelta(milliseconds=400)), max_attempts=3, jitter=0.0
)

SIZE = "opledger_delivery_pool_connections_max"
IN_USE = "opledger_delivery_pool_connections_in_use"
WAIT = "opledger_delivery_pool_wait_seconds"
WAITING = "opledger_delivery_pool_waiting_deliveries"


@pytest.fixture
def slow() -> Iterator[ScriptedReceiver]:
    receiver = ScriptedReceiver(SECRET, then=Answer(202, delay=ANSWER_DELAY_S))
    yield receiver
    receiver.close()


@pytest.fixture
def rig(isolated: Settings) -> Iterator[SteppedDeliveryRig]:
    settings = isolated.with_(delivery_concurrency=CONNECTIONS)
    grant(settings, TENANT, actor=ACTOR, tool=TOOL, destinations=("slow",))
    project_in_process(settings)
    made = SteppedDeliveryRig(
        settings, tool=TOOL, actor=ACTOR, secret=SECRET, webhook_timeout_ms=TIMEOUT_MS, retry=RETRY
    )
    yield made
    made.close()


def _counts(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT state, count(*) FROM deliveries GROUP BY state").fetchall()
    return {state: count for state, count in rows}


def test_a_backlog_larger_than_the_connections_to_a_slow_destination_dead_letters_nothing(
    rig: SteppedDeliveryRig, slow: ScriptedReceiver
) -> None:
    rig.webhook(TENANT, "slow", slow.url)
    ops = [rig.succeeded(TENANT) for _ in range(BACKLOG)]
    sample = rig.registry.get_sample_value
    in_use_seen: list[float] = []
    waiting_seen: list[float] = []
    deadline = time.monotonic() + 120
    while True:
        rig.step()
        # Sampled between passes, while the pass's sends are out.
        in_use_seen.append(sample(IN_USE) or 0.0)
        waiting_seen.append(sample(WAITING) or 0.0)
        counts = _counts(rig.settings.dsn)
        if counts.get("ACKED", 0) + counts.get("DEAD_LETTERED", 0) >= BACKLOG:
            break
        assert time.monotonic() < deadline, f"not finished in time: {counts}"

    records = rig.history.load([(op, TENANT) for op in ops])
    deliveries = {op: records[op].deliveries["slow"] for op in ops}
    dead = {op: r.error for op, r in deliveries.items() if r.state is not D.ACKED}
    assert not dead, f"{len(dead)} of {BACKLOG} not acknowledged: {Counter(dead.values())}"
    # Acknowledged on the first send: no attempt was spent waiting for a connection.
    spent = sorted({r.attempts for r in deliveries.values()})
    assert spent == [1], f"attempts per delivery: {spent}"
    # And each went out once: a send that waited never had its timeout cut short either.
    assert sorted(keys_seen(slow.received).values()) == [1] * BACKLOG

    # The pool is visible: its size, the connections in use (never more than it has), the
    # deliveries waiting for one, and how long each send waited for its connection.
    assert sample(SIZE) == CONNECTIONS
    assert 0 < max(in_use_seen) <= CONNECTIONS
    assert sample(IN_USE) == 0  # every answer is in
    assert max(waiting_seen) > CONNECTIONS
    assert sample(WAITING) == 0
    assert sample(f"{WAIT}_count") == BACKLOG  # one wait per send
    # 4 sends per pass of at least 0.25 s each: most of the backlog waited over a second.
    waited_a_second_at_most = sample(f"{WAIT}_bucket", {"le": "1.0"})
    assert waited_a_second_at_most is not None and waited_a_second_at_most < BACKLOG / 2
