"""Every worker rides out its database going away: the recovery worker, the delivery worker and
the reference receiver run as real processes whose PostgreSQL connections all pass through a
TCP proxy the test cuts for longer than a lease, a poll interval and a reconnect window. Work
arrives meanwhile (services on the database directly: a crashed call to recover, successful
calls to deliver). Nobody restarts a worker: afterwards each is the same process, the crashed
call is recovered, every delivery is acknowledged and applied once, and the provider saw one
call per operation. The receiver answers 503 to a POST it cannot record meanwhile (the sender
tries again) and 202 once its database is back.

Found by this test: the delivery worker's outbox pass read SUCCEEDED records, failed to open
their deliveries while PostgreSQL was away, and went on past them; they opened only when a
later reader started from the committed offset. It now seeks back and reads them again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ledger.destinations import DestinationStore, Kind
from ledger.pg import open_pool
from ledger.settings import Settings
from opledger.fakes.http_provider import FakeProviderControl
from tests.consumer_support import SECRET, event_body, new_op_id, signed_headers
from tests.process_support import ROOT, kill, start_cli, wait_http
from tests.support import env_for, free_port, grant, project_in_process
from tests.tcp_proxy import TcpProxy

pytestmark = pytest.mark.chaos

SERVICE = ROOT / "tests" / "chaos" / "service.py"
TENANT = "acme"
#: Longer than the 10 s lease of a crashed call, librdkafka's 10 s session and every
#: reconnect window of the workers.
OUTAGE_S = 20.0


def _health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _post(port: int, op: str) -> int:
    """A signed POST /events of ``op``'s event (not one of the ledger's), straight to the
    receiver; its status."""
    body = event_body(op, destination="crm")
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/events",
        data=body,
        headers=signed_headers(op, body, destination="crm"),
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _wait(condition: Callable[[], bool], what: Callable[[], str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what()
        time.sleep(0.3)


def test_workers_ride_out_their_database_going_away(isolated: Settings, tmp_path: Path) -> None:
    target = conninfo_to_dict(isolated.dsn)
    proxy = TcpProxy((str(target.get("host", "127.0.0.1")), int(target.get("port", 5432))))
    through_proxy = make_conninfo(isolated.dsn, host="127.0.0.1", port=str(proxy.port))
    ports = {name: free_port() for name in ("provider", "projector", "recovery", "delivery")}
    ports["consumer"] = free_port()
    env = env_for(
        isolated,
        PYTHONPATH=str(ROOT),
        OPLEDGER_FAKE_PROVIDER_URL=f"http://127.0.0.1:{ports['provider']}",
        OPLEDGER_PROVIDERS="opledger.fakes.providers:from_settings",
        OPLEDGER_PROJECTOR_WEB_PORT=str(ports["projector"]),
        OPLEDGER_RECOVERY_WEB_PORT=str(ports["recovery"]),
        OPLEDGER_RECOVERY_GROUP=f"{isolated.topic_prefix}-recovery",
        OPLEDGER_RECOVERY_INTERVAL_MS="200",
        OPLEDGER_DELIVERY_WEB_PORT=str(ports["delivery"]),
        OPLEDGER_DELIVERY_GROUP=f"{isolated.topic_prefix}-delivery",
        OPLEDGER_DELIVERY_SCHEDULE="500ms",
        OPLEDGER_CONSUMER_PG_DSN=isolated.dsn,
        OPLEDGER_CONSUMER_SECRETS=SECRET,
        OPLEDGER_CONSUMER_WEB_PORT=str(ports["consumer"]),
    )
    # The fake provider, the projector and the services reach PostgreSQL directly; the three
    # workers under test only through the proxy.
    cut_off = dict(env, OPLEDGER_PG_DSN=through_proxy, OPLEDGER_CONSUMER_PG_DSN=through_proxy)
    grant(isolated, TENANT, repeat_safe=True, destinations=("crm",))
    project_in_process(isolated)
    with open_pool(isolated.dsn, name="outage-destinations", max_size=1) as pool:
        DestinationStore(pool).add(
            tenant_id=TENANT,
            name="crm",
            kind=Kind.WEBHOOK,
            target=f"http://127.0.0.1:{ports['consumer']}/events",
            tools=["*"],
            changed_by="test",
            secret=SECRET,
        )

    def service(*args: str, fault: str = "") -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, str(SERVICE), *args],
            env=dict(env, OPLEDGER_FAULT_POINTS=fault),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=(tmp_path / f"service-{time.monotonic_ns()}.err").open("w"),
            text=True,
            start_new_session=True,
        )

    def announced(process: subprocess.Popen[str]) -> list[str]:
        out, _err = process.communicate(timeout=120)
        return [line.split()[1] for line in out.splitlines() if line.startswith("op ")]

    def states() -> dict[str, tuple[str, str | None]]:
        with psycopg.connect(isolated.dsn) as conn:
            rows = conn.execute(
                "SELECT o.operation_id, o.execution_state, d.state FROM agent_operations o "
                "LEFT JOIN deliveries d USING (operation_id)"
            ).fetchall()
        return {op: (execution, delivery) for op, execution, delivery in rows}

    def applied() -> Counter[str]:
        with psycopg.connect(isolated.dsn) as conn:
            rows = conn.execute("SELECT operation_id FROM consumer_applied_changes").fetchall()
        return Counter(op for (op,) in rows)

    started: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, argv, where in (
            ("provider", ["fake-provider", "run"], env),
            ("projector", ["projector", "run"], env),
            ("recovery", ["recover", "run"], cut_off),
            ("delivery", ["deliver", "run"], cut_off),
            ("consumer", ["consumer", "run"], cut_off),
        ):
            started[name] = start_cli(argv, where, tmp_path / f"{name}.log")
        FakeProviderControl(f"http://127.0.0.1:{ports['provider']}").wait_ready(30)
        for name in ("projector", "recovery", "delivery", "consumer"):
            wait_http(f"http://127.0.0.1:{ports[name]}/healthz")

        before = announced(service("execute", "--count", "3"))
        _wait(
            lambda: all(states().get(op) == ("SUCCEEDED", "ACKED") for op in before),
            lambda: f"the first calls were not delivered: {states()}",
        )

        proxy.cut()
        cut_at = time.monotonic()
        crashed = announced(
            service("execute", "--tool", "create_invoice",
                    fault="execute.after_intent_before_dispatch:kill")
        )  # fmt: skip
        during = announced(service("execute", "--count", "3"))
        direct = new_op_id()
        posted_during = _post(ports["consumer"], direct)
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - cut_at)))
        seen_during = {name: _health(ports[name]) for name in ("recovery", "delivery", "consumer")}
        alive_during = {name: p.poll() for name, p in started.items()}
        proxy.restore()

        ops = before + crashed + during
        assert len(crashed) == 1 and len(during) == 3, (crashed, during)
        _wait(
            lambda: all(states().get(op) == ("SUCCEEDED", "ACKED") for op in ops),
            lambda: f"not every call recovered and delivered after the outage: {states()}",
        )
        _wait(lambda: set(applied()) >= set(ops), lambda: f"not every one applied: {applied()}")
        posted_after = [_post(ports["consumer"], direct) for _ in range(2)]
        stats = FakeProviderControl(f"http://127.0.0.1:{ports['provider']}").stats()
        exits = {name: p.poll() for name, p in started.items()}
    finally:
        for process in started.values():
            kill(process)
        proxy.close()
    print(f"\n/healthz while the database was away: {json.dumps(seen_during)}")
    assert alive_during == dict.fromkeys(started), f"a worker exited: {alive_during}"
    assert exits == dict.fromkeys(started), f"a worker exited: {exits}"
    # The receiver refused what it could not record (the sender tries again), took it after.
    assert posted_during == 503 and posted_after == [202, 202]
    assert applied() == Counter(dict.fromkeys([*ops, direct], 1))
    calls = {op: k.calls for t in stats.tools.values() for op, k in t.keys.items()}
    assert {op: calls.get(op, 0) for op in ops} == dict.fromkeys(ops, 1)
