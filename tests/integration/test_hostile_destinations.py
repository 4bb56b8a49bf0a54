"""What one tenant (globex) could do to the shared delivery worker, and through it to another
tenant (acme), with nothing but its own destinations and its own webhook's answers (found in a
review of 2026-12-02, each reproduced against the code before its fix): a destination name no
event can carry, a Retry-After header int() refuses or timedelta cannot hold, a reason phrase
shaped to make the secret scrub slow, a queue topic another tenant consumes, a secret given with
a final newline. Each test drives the real worker (in-process or as ``opledger deliver run``)
against the isolated stack, with a projector stepped alongside it."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from consumers.queue import QueueConsumer, drain
from consumers.runtime import ConsumerRuntime
from ledger.destinations import DestinationError, DestinationStore, Kind
from ledger.domain.states import DeliveryState
from ledger.kafka import connection_config
from ledger.pg import open_pool
from ledger.settings import Settings
from producers import TransitionRecorder
from tests.delivery_support import (
    RawListener,
    ScriptedReceiver,
    SteppedDeliveryRig,
    step_for,
    step_until,
)
from tests.support import free_port, grant, project_in_process, read_all

pytestmark = pytest.mark.integration

D = DeliveryState
ACTOR = "agent-7"
TOOL = "send_email"
VICTIM, ATTACKER = "acme", "globex"
SECRET = "whsec_" + base64.b64encode(b"review-secret-0123456789").decode()


#: The rig every test here drives (``tests/delivery_support.py``).
Rig = SteppedDeliveryRig


@pytest.fixture
def rig(isolated: Settings) -> Iterator[Rig]:
    grant(isolated, VICTIM, actor=ACTOR, tool=TOOL, destinations=("hooks", "billing"))
    grant(isolated, ATTACKER, actor=ACTOR, tool=TOOL, destinations=("mine", "billing"))
    project_in_process(isolated)
    made = Rig(isolated, tool=TOOL, actor=ACTOR, secret=SECRET)
    yield made
    made.close()


def _victim_acked_while_attacker_answers(
    rig: Rig, answer: bytes, budget_s: float
) -> tuple[list[float], DeliveryState | None]:
    """globex's webhook answers ``answer``; acme's answers 202. Passes until acme's delivery
    is ACKED or ``budget_s`` passes; the time of each pass and acme's last state."""
    victim_hook = ScriptedReceiver(SECRET)
    evil = RawListener(answer)
    try:
        rig.webhook(VICTIM, "hooks", victim_hook.url)
        rig.webhook(ATTACKER, "mine", evil.url)
        rig.succeeded(ATTACKER)
        # globex's send goes out first; acme's result succeeds while its answer is in flight.
        deadline = time.monotonic() + 20
        while evil.requests == 0 and time.monotonic() < deadline:
            rig.step()
        assert evil.requests >= 1, "the attacker's webhook was never called"
        victim = rig.succeeded(VICTIM)
        passes: list[float] = []
        started = time.monotonic()
        state = None
        while time.monotonic() - started < budget_s:
            passes.append(rig.step())
            state = rig.state(VICTIM, victim, "hooks")
            if state is D.ACKED:
                break
        return passes, state
    finally:
        evil.close()
        victim_hook.close()


def test_a_tenants_retry_after_header_does_not_crash_the_delivery_worker(
    rig: Rig,
) -> None:
    """globex's own webhook answers with ``Retry-After: ²`` (latin-1 superscript two:
    ``str.isdigit`` is true, ``int`` refuses it). The worker must judge that answer like any
    other; acme's delivery must go on."""
    answer = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: \xb2\r\nContent-Length: 0\r\n\r\n"
    passes, state = _victim_acked_while_attacker_answers(rig, answer, budget_s=20)
    assert state is D.ACKED, f"acme's delivery is {state} after {len(passes)} passes"


def test_a_huge_integer_retry_after_does_not_crash_the_delivery_worker(
    rig: Rig,
) -> None:
    answer = (
        b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 99999999999999999999\r\n"
        b"Content-Length: 0\r\n\r\n"
    )
    passes, state = _victim_acked_while_attacker_answers(rig, answer, budget_s=20)
    assert state is D.ACKED, f"acme's delivery is {state} after {len(passes)} passes"


def test_a_tenants_reason_phrase_does_not_stall_every_tenants_deliveries(
    rig: Rig,
) -> None:
    """globex's webhook answers 500 with a 10 KB reason phrase shaped for detect-secrets'
    KeywordDetector ("aPwd" repeated): the worker scrubs the whole phrase before cutting it to
    1000 characters, and that scrub is super-linear. acme's delivery must not wait on it."""
    answer = b"HTTP/1.1 500 " + b"aPwd" * 2500 + b"\r\nContent-Length: 0\r\n\r\n"
    passes, state = _victim_acked_while_attacker_answers(rig, answer, budget_s=90)
    slowest = max(passes)
    assert slowest < 5.0, f"one delivery pass took {slowest:.1f}s (acme's delivery: {state})"
    assert state is D.ACKED


def test_a_queue_consumer_refuses_another_tenants_records_on_its_topic(
    rig: Rig, isolated: Settings
) -> None:
    """acme's results go to its queue topic. globex registers a queue destination naming the
    same topic, and the delivery worker (which writes every tenant's queue records with its own
    broker rights) appends globex's result there. The registry allows one topic for several
    tenants on purpose (one receiving service may take many tenants' results, as the demo's
    billing queue does), so acme's consumer is the boundary: run with ``--tenant acme`` it
    dead-letters globex's record unapplied and applies acme's."""
    topic = f"{isolated.topic_prefix}.acme-billing"
    admin = AdminClient({**connection_config(isolated)})
    for future in admin.create_topics([NewTopic(topic, 3, 1)]).values():
        future.result(timeout=30)
    for tenant in (VICTIM, ATTACKER):
        rig.destinations.add(
            tenant_id=tenant,
            name="billing",
            kind=Kind.QUEUE,
            target=topic,
            tools=[TOOL],
            changed_by="test",
        )
    ops = {tenant: rig.succeeded(tenant) for tenant in (ATTACKER, VICTIM)}
    deadline = time.monotonic() + 30
    while any(rig.state(t, op, "billing") is not D.ACKED for t, op in ops.items()):
        assert time.monotonic() < deadline, "both queue records appended"
        rig.step()
    on_topic = [json.loads(v or b"{}").get("tenant_id") for *_, v in read_all(isolated, topic)]
    assert sorted(on_topic) == sorted([ATTACKER, VICTIM]), "the attack lands on the topic"

    settings = isolated.with_(consumer_pg_dsn=isolated.dsn)
    runtime = ConsumerRuntime(settings, name="acme-billing")
    consumer = QueueConsumer(runtime, topic, tenants=[VICTIM])
    try:
        consumer.open()
        drain(consumer)
        consumer.close()
        dead = {
            dict(sample.labels)["kind"]: sample.value
            for metric in runtime.metrics.dead_letters.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        }
    finally:
        runtime.close()
    with psycopg.connect(isolated.dsn) as conn:
        applied = conn.execute(
            "SELECT operation_id, tenant_id FROM consumer_applied_changes"
        ).fetchall()
    assert applied == [(ops[VICTIM], VICTIM)], "only acme's record applied"
    assert dead == {"foreign-tenant": 1}


def test_the_delivery_process_survives_a_tenants_retry_after_header(
    isolated: Settings, tmp_path: Any
) -> None:
    """The same answer against a real ``opledger deliver run``: it must keep running."""
    from tests.process_support import ROOT, kill, start_cli, wait_http  # noqa: PLC0415
    from tests.support import env_for  # noqa: PLC0415

    grant(isolated, ATTACKER, actor=ACTOR, tool=TOOL, destinations=("mine",))
    evil = RawListener(b"HTTP/1.1 202 Accepted\r\nRetry-After: \xb2\r\nContent-Length: 0\r\n\r\n")
    port = free_port()
    env = env_for(
        isolated,
        PYTHONPATH=str(ROOT),
        OPLEDGER_DELIVERY_WEB_PORT=str(port),
        OPLEDGER_DELIVERY_GROUP=f"{isolated.topic_prefix}-delivery",
    )
    log = tmp_path / "delivery.log"
    process = start_cli(["deliver", "run"], env, log)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        with open_pool(isolated.dsn, name="review", max_size=1) as pool:
            DestinationStore(pool, isolated).add(
                tenant_id=ATTACKER,
                name="mine",
                kind=Kind.WEBHOOK,
                target=evil.url,
                tools=[TOOL],
                changed_by="test",
                secret=SECRET,
            )
        with TransitionRecorder.connect(isolated, owner="service") as service:
            op = service.intent(ATTACKER, ACTOR, TOOL, {"to": "x@example.com"})
            service.dispatched(op, provider_ref=op.operation_id)
            service.succeeded(op, b"{}", content_type="application/json")
        project_in_process(isolated)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.5)
        tail = log.read_text(errors="replace")[-1500:]
        assert evil.requests >= 1
        assert process.poll() is None, f"deliver run exited {process.returncode}:\n{tail}"
    finally:
        if process.poll() is None:
            kill(process)
        evil.close()


def test_destinations_add_never_prints_the_secret_it_was_given(isolated: Settings) -> None:
    """A secret read with ``--secret-env`` from a variable that ends with a newline (a mounted
    secret file often does): Python's ``$`` accepts it, PostgreSQL's CHECK does not, and the
    refusal must not quote the row (with the secret) on the terminal."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from tests.process_support import ROOT  # noqa: PLC0415
    from tests.support import env_for  # noqa: PLC0415

    secret = "whsec_" + base64.b64encode(b"never-print-me-0123456789").decode()
    # A mounted secret file's final newline is not part of the secret: stored, exit 0. A
    # newline inside it is refused by the registry's own check, before the database sees it.
    for name, value, code in (("crm", secret + "\n", 0), ("crm2", secret + "\nX", 2)):
        env = env_for(isolated, PYTHONPATH=str(ROOT), WEBHOOK_SECRET=value)
        done = subprocess.run(
            [sys.executable, "-m", "opledger.cli", "destinations", "add", "--tenant", ATTACKER,
             "--name", name, "--url", "http://127.0.0.1:9/events", "--tool", "*",
             "--secret-env", "WEBHOOK_SECRET"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        output = done.stdout + done.stderr
        assert secret not in output, f"exit {done.returncode}; the secret was printed:\n{output}"
        assert done.returncode == code, output
        assert "Traceback" not in output


def _written_before_the_registry_checked_names() -> Any:
    """The registry now refuses a name no delivery event can carry; a row written before that
    check (or by hand) can still hold one, and the worker must survive it."""
    return patch("ledger.destinations.recordable_destination", lambda _name: True)


def test_the_registry_refuses_a_destination_name_no_event_can_carry(
    rig: Rig,
) -> None:
    name = "sk_live_abcdefghijklmnopqrstuvwx"
    with pytest.raises(DestinationError, match="looks like a credential") as refused:
        rig.webhook(ATTACKER, name, "http://127.0.0.1:9/events")
    assert name not in str(refused.value), "the refusal does not echo the credential"


def test_a_destination_name_the_events_refuse_does_not_stop_every_tenants_outbox(
    rig: Rig,
) -> None:
    """globex names a destination so that it looks like a Stripe key: the registry takes the
    name (its pattern only), the event contract refuses it in every DeliveryTransitioned. The
    outbox must not fail on globex's SUCCEEDED (and so never read past it); acme's delivery
    must go on."""
    victim_hook = ScriptedReceiver(SECRET)
    try:
        rig.webhook(VICTIM, "hooks", victim_hook.url)
        with _written_before_the_registry_checked_names():
            rig.webhook(ATTACKER, "sk_live_abcdefghijklmnopqrstuvwx", victim_hook.url)
        rig.succeeded(ATTACKER)
        victim = rig.succeeded(VICTIM)
        state = None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and state is not D.ACKED:
            rig.step()
            state = rig.state(VICTIM, victim, "hooks")
        assert state is D.ACKED
    finally:
        victim_hook.close()


def test_the_delivery_process_survives_a_destination_name_the_events_refuse(
    isolated: Settings, tmp_path: Any
) -> None:
    """The same against real ``opledger deliver run`` processes, restarted as the supervisor
    would: each must keep running (on the current code each one exits on the same record)."""
    from tests.process_support import ROOT, kill, start_cli  # noqa: PLC0415
    from tests.support import env_for  # noqa: PLC0415

    hook = ScriptedReceiver(SECRET)
    with (
        open_pool(isolated.dsn, name="review", max_size=1) as pool,
        _written_before_the_registry_checked_names(),
    ):
        for tenant, name in ((VICTIM, "hooks"), (ATTACKER, "sk_live_abcdefghijklmnopqrstuvwx")):
            DestinationStore(pool, isolated).add(
                tenant_id=tenant,
                name=name,
                kind=Kind.WEBHOOK,
                target=hook.url,
                tools=[TOOL],
                changed_by="test",
                secret=SECRET,
            )
    grant(isolated, VICTIM, actor=ACTOR, tool=TOOL, destinations=("hooks",))
    with TransitionRecorder.connect(isolated, owner="service") as service:
        for tenant in (ATTACKER, VICTIM):
            op = service.intent(tenant, ACTOR, TOOL, {"to": "x@example.com"})
            service.dispatched(op, provider_ref=op.operation_id)
            service.succeeded(op, b"{}", content_type="application/json")
    project_in_process(isolated)
    env = env_for(
        isolated,
        PYTHONPATH=str(ROOT),
        OPLEDGER_DELIVERY_WEB_PORT=str(free_port()),
        OPLEDGER_DELIVERY_GROUP=f"{isolated.topic_prefix}-delivery",
    )
    exits = []
    try:
        for run in range(2):
            process = start_cli(["deliver", "run"], env, tmp_path / f"delivery-{run}.log")
            try:
                process.wait(timeout=45)
            except Exception:  # still running after 45 s: what it should do
                kill(process)
                exits.append(None)
            else:
                exits.append(process.returncode)
        assert exits == [None, None], (
            f"deliver run exit codes {exits}; webhook got {len(hook.received)}"
        )
    finally:
        hook.close()


def test_a_webhook_aimed_at_the_fake_providers_control_routes_changes_nothing(
    rig: Rig, isolated: Settings, tmp_path: Any
) -> None:
    """The probe registered a webhook at the fake provider's ``/_control/reset`` (the stack's
    worker may reach 127.0.0.0/8): every delivery reset the provider's counts, the evidence a
    kill test reads. The control routes now answer only the control token."""
    import http.client  # noqa: PLC0415
    from datetime import timedelta  # noqa: PLC0415

    from ledger.tools import ProviderTerms  # noqa: PLC0415
    from opledger.fakes.http_provider import FakeProviderControl, HttpToolProvider  # noqa: PLC0415
    from tests.process_support import ROOT, kill, start_cli  # noqa: PLC0415
    from tests.support import env_for  # noqa: PLC0415

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    provider = start_cli(
        ["fake-provider", "run", "--port", str(port)],
        env_for(isolated, PYTHONPATH=str(ROOT)),
        tmp_path / "provider.log",
    )
    try:
        control = FakeProviderControl.of(isolated, url)
        control.wait_ready(30)
        terms = ProviderTerms(timedelta(seconds=5), timedelta(days=1), repeat_safe=True)
        assert HttpToolProvider(url, TOOL, terms).call({"to": "a"}, "op_probe_1").succeeded

        def plain(method: str, path: str, token: str | None = None) -> tuple[int, bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            headers = {"Content-Type": "application/json"}
            if token is not None:
                headers["Authorization"] = f"Bearer {token}"
            try:
                conn.request(
                    method, path, body=b"{}" if method == "POST" else None, headers=headers
                )
                response = conn.getresponse()
                return response.status, response.read()
            finally:
                conn.close()

        routes = [("GET", "stats")] + [
            ("POST", name) for name in ("reset", "configure", "forget", "release", "script")
        ]
        for method, name in routes:
            path = f"/_control/{name}"
            for token in (None, "", "x" * 43):
                status, body = plain(method, path, token)
                assert status == 401, (method, path, token, status)
                assert b"op_probe_1" not in body
        assert plain("GET", "/_control/health")[0] == 200

        rig.webhook(ATTACKER, "mine", f"{url}/_control/reset")
        op = rig.succeeded(ATTACKER)

        def tried() -> bool:
            record = rig.delivery(ATTACKER, op, "mine")
            return record is not None and record.attempts >= 1

        step_until(rig, tried, timeout=30)
        step_for(rig, 1.0)  # a retry or two at the 300 ms schedule
        assert rig.state(ATTACKER, op, "mine") is not DeliveryState.ACKED
        stats = control.stats()
        assert stats.tools[TOOL].calls == 1, "the counts survived every delivery"
    finally:
        kill(provider)
