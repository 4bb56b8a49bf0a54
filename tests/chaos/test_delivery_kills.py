"""The seed's failure rows 4 and 5 with real processes and SIGKILL: the delivery worker
(``opledger deliver run``) killed at a named boundary, the service killed after its result write,
the reference consumer (``opledger consumer run``) receiving. Afterwards every destination got
its delivery, the consumer applied each change once, and the tool was called once."""

from __future__ import annotations

import base64
import contextlib
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from ledger.destinations import DestinationStore, Kind
from ledger.pg import open_pool
from ledger.settings import Settings
from opledger.fakes.http_provider import FakeProviderControl
from producers import TransitionRecorder
from tests.delivery_support import ScriptedReceiver
from tests.process_support import ROOT, kill, start_cli, wait_http
from tests.support import env_for, free_port, grant

SECRET = "whsec_" + base64.b64encode(b"chaos-delivery-secret-0123").decode()
TENANT = "acme"
ACTOR = "agent-7"


@dataclass
class Rig:
    settings: Settings
    env: dict[str, str]
    logs: Path
    delivery_port: int
    processes: list[subprocess.Popen[bytes]]

    def start(self, name: str, *argv: str, fault: str = "") -> subprocess.Popen[bytes]:
        env = dict(self.env, OPLEDGER_FAULT_POINTS=fault)
        process = start_cli(list(argv), env, self.logs / f"{name}.log")
        self.processes.append(process)
        return process

    def deliver(self, fault: str = "") -> subprocess.Popen[bytes]:
        return self.start("delivery", "deliver", "run", fault=fault)

    def destination(self, name: str, url: str, tools: list[str]) -> None:
        with open_pool(self.settings.dsn, name="chaos-destinations", max_size=1) as pool:
            DestinationStore(pool, self.settings).add(
                tenant_id=TENANT,
                name=name,
                kind=Kind.WEBHOOK,
                target=url,
                tools=tools,
                changed_by="test",
                secret=SECRET,
                timeout_ms=1000,
            )

    def reference_consumer(self, port: int, tools: list[str]) -> None:
        """Start ``opledger consumer run`` on ``port`` (its inbox in the test's database) and
        make it the tenant's destination ``reference`` for ``tools``."""
        self.env.update(
            OPLEDGER_CONSUMER_PG_DSN=self.settings.dsn,
            OPLEDGER_CONSUMER_SECRETS=SECRET,
            OPLEDGER_CONSUMER_WEB_PORT=str(port),
        )
        self.start("consumer", "consumer", "run")
        wait_http(f"http://127.0.0.1:{port}/healthz")
        self.destination("reference", f"http://127.0.0.1:{port}/events", tools)

    def deliveries(self) -> dict[tuple[str, str], tuple[str, int]]:
        with psycopg.connect(self.settings.dsn) as conn:
            rows = conn.execute(
                "SELECT operation_id, destination, state, attempts FROM deliveries"
            ).fetchall()
        return {(r[0], r[1]): (r[2], r[3]) for r in rows}

    def wait(self, done: Callable[[], bool], what: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"timed out waiting for {what}; logs: {self.logs}"
            time.sleep(0.3)


@contextlib.contextmanager
def _rig(settings: Settings, logs: Path, *, provider: bool = False) -> Iterator[Rig]:
    ports = {name: free_port() for name in ("projector", "recovery", "delivery", "provider")}
    env = env_for(
        settings,
        PYTHONPATH=str(ROOT),
        OPLEDGER_PROJECTOR_WEB_PORT=str(ports["projector"]),
        OPLEDGER_RECOVERY_WEB_PORT=str(ports["recovery"]),
        OPLEDGER_RECOVERY_GROUP=f"{settings.topic_prefix}-recovery",
        OPLEDGER_RECOVERY_INTERVAL_MS="200",
        OPLEDGER_DELIVERY_WEB_PORT=str(ports["delivery"]),
        OPLEDGER_DELIVERY_GROUP=f"{settings.topic_prefix}-delivery",
        OPLEDGER_DELIVERY_SCHEDULE="500ms",
        OPLEDGER_FAKE_PROVIDER_URL=f"http://127.0.0.1:{ports['provider']}",
        OPLEDGER_PROVIDERS="opledger.fakes.providers:from_settings",
    )
    rig = Rig(settings, env, logs, ports["delivery"], [])
    try:
        rig.start("projector", "projector", "run")
        wait_http(f"http://127.0.0.1:{ports['projector']}/healthz")
        if provider:
            rig.start("provider", "fake-provider", "run")
            FakeProviderControl.of(settings, env["OPLEDGER_FAKE_PROVIDER_URL"]).wait_ready(30)
            rig.start("recovery", "recover", "run")
            wait_http(f"http://127.0.0.1:{ports['recovery']}/healthz")
        yield rig
    finally:
        for process in rig.processes:
            kill(process)


def _succeeded(settings: Settings, count: int, tool: str = "send_email") -> list[str]:
    with TransitionRecorder.connect(settings, owner="chaos-service") as service:
        ops = []
        for n in range(count):
            op = service.intent(TENANT, ACTOR, tool, {"n": n, "at": time.time_ns()})
            service.dispatched(op, provider_ref=op.operation_id)
            service.succeeded(op, f'{{"n": {n}}}'.encode(), content_type="application/json")
            ops.append(op.operation_id)
    return ops


def _killed(process: subprocess.Popen[bytes], timeout: float = 90) -> None:
    assert process.wait(timeout=timeout) == -signal.SIGKILL, "the fault point never fired"


@pytest.mark.chaos
def test_killed_between_the_outbox_appends_and_its_commit_every_destination_gets_one(
    isolated: Settings, tmp_path: Path
) -> None:
    grant(isolated, TENANT, actor=ACTOR, tool="send_email", destinations=("crm", "billing"))
    receiver = ScriptedReceiver(SECRET)
    try:
        with _rig(isolated, tmp_path) as rig:
            rig.destination("crm", receiver.url, ["send_email"])
            rig.destination("billing", receiver.url, ["*"])
            ops = _succeeded(isolated, 5)
            _killed(rig.deliver(fault="deliver.after_enqueue_before_commit:kill"))
            assert receiver.received == [], "killed before anything was sent"
            rig.deliver()
            wanted = {(op, d) for op in ops for d in ("crm", "billing")}
            rig.wait(
                lambda: {k for k, v in rig.deliveries().items() if v[0] == "ACKED"} >= wanted,
                "every delivery acknowledged",
            )
            time.sleep(2)  # anything more it would send, it sends now
        got = [(r.headers["Idempotency-Key"], r.headers["webhook-id"]) for r in receiver.received]
        assert sorted(got) == sorted((op, f"{op}:{d}") for op, d in wanted)
        assert all(r.signature_ok for r in receiver.received)
        assert set(rig.deliveries()) == wanted
    finally:
        receiver.close()


@pytest.mark.chaos
def test_a_service_killed_after_its_result_write_still_delivers_once_and_calls_once(
    isolated: Settings, tmp_path: Path
) -> None:
    grant(isolated, TENANT, repeat_safe=True, destinations=("crm",))
    receiver = ScriptedReceiver(SECRET)
    try:
        with _rig(isolated, tmp_path, provider=True) as rig:
            rig.destination("crm", receiver.url, ["*"])
            rig.deliver()
            wait_http(f"http://127.0.0.1:{rig.delivery_port}/healthz")
            service = subprocess.Popen(
                [sys.executable, str(ROOT / "tests/chaos/service.py"), "execute"],
                env=dict(
                    rig.env, OPLEDGER_FAULT_POINTS="producer.after_result_write_before_record:kill"
                ),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=(tmp_path / "service.err").open("w"),
                text=True,
                start_new_session=True,
            )
            assert service.stdout is not None
            op_id = service.stdout.readline().split()[1]
            assert service.wait(timeout=60) == -signal.SIGKILL
            rig.wait(
                lambda: rig.deliveries().get((op_id, "crm"), ("",))[0] == "ACKED",
                "the delivery of the recovered operation",
                timeout=120,
            )
            time.sleep(2)
            stats = FakeProviderControl.of(
                rig.settings, rig.env["OPLEDGER_FAKE_PROVIDER_URL"]
            ).stats()
        calls = stats.tools["send_email"].keys[op_id]
        assert calls.calls == 1 and calls.side_effects == 1
        assert [r.headers["Idempotency-Key"] for r in receiver.received] == [op_id]
    finally:
        receiver.close()


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if re.match(rf"^{name}(\{{.*\}})? ", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.chaos
def test_killed_after_the_send_before_the_ack_the_consumer_applies_once_and_counts_a_duplicate(
    isolated: Settings, tmp_path: Path
) -> None:
    settings = isolated.with_(consumer_pg_dsn=isolated.dsn, consumer_secrets=SECRET)
    grant(settings, TENANT, actor=ACTOR, tool="send_email", destinations=("reference",))
    consumer_port = free_port()
    with _rig(settings, tmp_path) as rig:
        rig.reference_consumer(consumer_port, ["send_email"])
        (op_id,) = _succeeded(settings, 1)
        _killed(rig.deliver(fault="deliver.after_send_before_ack:kill"))
        # SENT was appended (acknowledged by the broker) before the send; the projector may
        # still be folding it, so the projection is waited for, never read once.
        rig.wait(
            lambda: rig.deliveries().get((op_id, "reference"), ("",))[0] == "SENT",
            "the SENT recorded before the send, projected",
        )
        duplicates_before = _metric(consumer_port, "opledger_consumer_duplicate_keys_total")
        rig.deliver()
        rig.wait(
            lambda: rig.deliveries().get((op_id, "reference"), ("",))[0] == "ACKED",
            "the delivery re-sent and acknowledged",
        )
        duplicates_after = _metric(consumer_port, "opledger_consumer_duplicate_keys_total")
        with psycopg.connect(settings.dsn) as conn:
            applied = conn.execute(
                "SELECT count(*) FROM consumer_applied_changes WHERE operation_id = %s", (op_id,)
            ).fetchone()
            steps = conn.execute(
                "SELECT state, attempt, error FROM operation_history WHERE operation_id = %s "
                "AND machine = 'delivery' AND outcome = 'applied' ORDER BY \"offset\"",
                (op_id,),
            ).fetchall()
    assert applied == (1,), "the consumer applied the change once"
    assert duplicates_after - duplicates_before == 1, "it saw the re-send as a duplicate"
    assert [(s, a) for s, a, _e in steps] == [
        ("PENDING", 0),
        ("SENT", 1),
        ("PENDING", 1),
        ("SENT", 2),
        ("ACKED", 2),
    ]
    assert "never recorded" in (steps[2][2] or "")


@pytest.mark.chaos
def test_a_worker_killed_while_serving_a_result_by_reference_still_delivers_it_once(
    isolated: Settings, tmp_path: Path
) -> None:
    settings = isolated.with_(consumer_pg_dsn=isolated.dsn, consumer_secrets=SECRET)
    grant(settings, TENANT, actor=ACTOR, tool="render_report", destinations=("reference",))
    consumer_port = free_port()
    result = bytes(range(256)) * 400  # 100 KiB, over the 1 KiB limit set below
    with _rig(settings, tmp_path) as rig:
        rig.env.update(OPLEDGER_DELIVERY_INLINE_MAX_BYTES="1024")
        rig.reference_consumer(consumer_port, ["*"])
        with TransitionRecorder.connect(settings, owner="chaos-service") as service:
            op = service.intent(TENANT, ACTOR, "render_report", {"at": time.time_ns()})
            service.dispatched(op, provider_ref=op.operation_id)
            service.succeeded(op, result, content_type="application/octet-stream")
        # The receiver asks the worker for the result; the worker dies reading it out.
        _killed(rig.deliver(fault="deliver.result_read_before_answer:kill"))

        def applied() -> list[tuple[int]]:
            with psycopg.connect(settings.dsn) as conn:
                return conn.execute(
                    "SELECT result_bytes FROM consumer_applied_changes WHERE operation_id = %s",
                    (op.operation_id,),
                ).fetchall()

        assert applied() == [], "nothing is applied without the result"
        rig.deliver()
        rig.wait(
            lambda: rig.deliveries().get((op.operation_id, "reference"), ("",))[0] == "ACKED",
            "the delivery re-sent, its result fetched from the new worker, acknowledged",
        )
        time.sleep(1)
        duplicates = _metric(consumer_port, "opledger_consumer_duplicate_keys_total")
    assert applied() == [(len(result),)], "applied once, with the whole result"
    assert duplicates == 0, "the first send was never accepted: nothing to count twice"
