"""Recovery and delivery workers scale out by partition, and a SIGKILLed one hands its
partitions over.

README and ``opledger/recover.py`` say: any number of recovery workers form one consumer group on
the execution topic, each looks after the operations of its partitions, and killing one hands
its partitions to the others. Here two ``opledger recover run`` processes share the execution
topic's six partitions; one is SIGKILLed; services are then killed between intent and dispatch
(seed row 1) on every partition, and the survivor must resume each operation, with exactly one
provider call per operation, the dead worker's partitions included.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from ledger.kafka import partition_for
from ledger.settings import Settings
from opledger.fakes.http_provider import FakeProviderControl
from tests.chaos.test_delivery_kills import ACTOR, SECRET, TENANT, _rig, _succeeded
from tests.chaos.test_recovery_kills import Rig, _first_op
from tests.delivery_support import ScriptedReceiver
from tests.process_support import kill, start_cli, wait_http
from tests.support import env_for, free_port, grant, project_in_process

ROOT = Path(__file__).resolve().parents[2]
#: Services killed after the intent: enough that the dead worker's half of the partitions holds
#: some of them (each lands on one of 6 partitions; all 16 missing 3 given ones: 1 in 65,536).
SERVICES = 16


def _partitions(port: int) -> set[int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
        return set(json.loads(answer.read())["partitions"])


def _shared(ports: tuple[int, int], partitions: int) -> set[int]:
    """Wait until the two workers on ``ports`` split every partition between them, none held
    by both; returns the first worker's."""
    deadline = time.monotonic() + 60
    while True:
        first, second = (_partitions(port) for port in ports)
        if first and second and first | second == set(range(partitions)):
            break
        assert time.monotonic() < deadline, f"never shared: {first} / {second}"
        time.sleep(0.2)
    assert not first & second, "a partition looked after by both workers"
    return first


@pytest.mark.chaos
def test_a_killed_recovery_worker_hands_its_partitions_to_the_other(
    isolated: Settings, tmp_path: Path
) -> None:
    grant(isolated, "acme", repeat_safe=True)
    project_in_process(isolated)
    provider_port, projector_port = free_port(), free_port()
    worker_ports = free_port(), free_port()
    env = env_for(
        isolated,
        PYTHONPATH=str(ROOT),
        OPLEDGER_FAKE_PROVIDER_URL=f"http://127.0.0.1:{provider_port}",
        OPLEDGER_PROVIDERS="opledger.fakes.providers:from_settings",
        OPLEDGER_PROJECTOR_WEB_PORT=str(projector_port),
        OPLEDGER_RECOVERY_GROUP=f"{isolated.topic_prefix}-recovery",
        OPLEDGER_RECOVERY_INTERVAL_MS="200",
    )
    started = [
        start_cli(["fake-provider", "run"], env, tmp_path / "provider.log"),
        start_cli(["projector", "run"], env, tmp_path / "projector.log"),
    ]
    workers = [
        start_cli(
            ["recover", "run"],
            dict(env, OPLEDGER_RECOVERY_WEB_PORT=str(port)),
            tmp_path / f"recovery-{n}.log",
        )
        for n, port in enumerate(worker_ports)
    ]
    started += workers
    try:
        control = FakeProviderControl.of(isolated, f"http://127.0.0.1:{provider_port}")
        control.wait_ready(30)
        wait_http(f"http://127.0.0.1:{projector_port}/healthz")
        for port in worker_ports:
            wait_http(f"http://127.0.0.1:{port}/healthz")
        first = _shared(worker_ports, isolated.partitions)

        os.killpg(workers[0].pid, signal.SIGKILL)
        assert workers[0].wait(timeout=30) == -signal.SIGKILL
        killed_at = time.time()
        rig = Rig(isolated, env, control, tmp_path)
        fault = "execute.after_intent_before_dispatch:kill"
        services = [
            rig.service("execute", "--tool", "send_email", fault=fault) for _ in range(SERVICES)
        ]
        ops = [_first_op(service) for service in services]
        for op, service in zip(ops, services, strict=True):
            assert service.wait(timeout=60) == -signal.SIGKILL, f"{op} was not killed"
        orphaned = [op for op in ops if partition_for(op.encode(), isolated.partitions) in first]
        assert orphaned, "no operation landed on the dead worker's partitions"

        moved: dict[str, float] = {}
        for op in ops:
            row = rig.wait_state(op, {"SUCCEEDED", "FAILED"}, timeout=90)
            assert row[0] == "SUCCEEDED", (op, row)
            moved[op] = row[4].timestamp() - killed_at
        assert _partitions(worker_ports[1]) == set(range(isolated.partitions))
        stats = control.stats()
    finally:
        for process in started:
            kill(process)
    calls = stats.tools["send_email"].keys
    assert {op: calls[op].calls for op in ops} == dict.fromkeys(ops, 1), "one call each"
    slowest = max(moved[op] for op in orphaned)
    print(f"\n{len(orphaned)} of {len(ops)} on the dead worker's partitions {sorted(first)}; "
          f"the last moved {slowest:.1f} s after the kill")  # fmt: skip


@pytest.mark.chaos
def test_a_killed_delivery_worker_hands_its_partitions_to_the_other(
    isolated: Settings, tmp_path: Path
) -> None:
    """The same for ``opledger deliver run``: two workers share the partitions, one is
    SIGKILLed, and results that succeed afterwards on every partition are each delivered once
    by the survivor."""
    grant(isolated, TENANT, actor=ACTOR, tool="send_email", destinations=("crm",))
    receiver = ScriptedReceiver(SECRET)
    worker_ports = free_port(), free_port()
    try:
        with _rig(isolated, tmp_path) as rig:
            rig.destination("crm", receiver.url, ["send_email"])
            workers = [
                start_cli(
                    ["deliver", "run"],
                    dict(rig.env, OPLEDGER_DELIVERY_WEB_PORT=str(port)),
                    tmp_path / f"delivery-{n}.log",
                )
                for n, port in enumerate(worker_ports)
            ]
            rig.processes += workers
            for port in worker_ports:
                wait_http(f"http://127.0.0.1:{port}/healthz")
            first = _shared(worker_ports, isolated.partitions)

            os.killpg(workers[0].pid, signal.SIGKILL)
            assert workers[0].wait(timeout=30) == -signal.SIGKILL
            ops = _succeeded(isolated, SERVICES)
            orphaned = [
                op for op in ops if partition_for(op.encode(), isolated.partitions) in first
            ]
            assert orphaned, "no operation landed on the dead worker's partitions"
            wanted = {(op, "crm") for op in ops}
            rig.wait(
                lambda: {k for k, v in rig.deliveries().items() if v[0] == "ACKED"} >= wanted,
                "every delivery acknowledged",
            )
            assert _partitions(worker_ports[1]) == set(range(isolated.partitions))
            time.sleep(2)  # anything more it would send, it sends now
        got = sorted(r.headers["Idempotency-Key"] for r in receiver.received)
        assert got == sorted(ops), "each result delivered once"
        assert all(r.signature_ok for r in receiver.received)
    finally:
        receiver.close()
