"""The projector as users run it: ``opledger projector run``, a faust worker in its own process,
serving /metrics and /healthz, stopping cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psycopg
from prometheus_client.parser import text_string_to_metric_families

from ledger.settings import Settings
from opledger.workload import Workload
from tests.support import (
    assert_no_identifying_labels,
    env_for,
    free_port,
    produce,
    produce_raw,
    wait_caught_up,
)


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert assert_no_identifying_labels(text) > 0
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _wait_for(predicate: object, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def test_worker_serves_metrics_that_match_the_projections(
    isolated: Settings, tmp_path: Path
) -> None:
    settings = isolated.with_(projector_web_port=free_port())
    operations = list(Workload(seed=21).operations(400))
    # Two operations stop mid-delivery (one PENDING, one SENT): the workload finishes every
    # delivery, and the delivery-age gauges need some left unfinished.
    delivering = [op for op in operations if any(e.kind == "delivery" for e in op)][:2]
    for op, kept in zip(delivering, (1, 2), strict=True):
        first = next(i for i, e in enumerate(op) if e.kind == "delivery")
        del op[first + kept :]
    events = [e for op in operations for e in op]
    produce(settings, events)
    produce_raw(settings, settings.execution_topic, b"op_bad", b"garbage")
    log = tmp_path / "projector.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "opledger.cli", "projector", "run"],
            env=env_for(settings),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_caught_up(settings, timeout=60)
        port = settings.projector_web_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            assert response.status == 200
        with psycopg.connect(settings.dsn) as conn:
            counts = {
                (machine, outcome): n
                for machine, outcome, n in conn.execute(
                    "SELECT machine, outcome, count(*) FROM operation_history GROUP BY 1, 2"
                ).fetchall()
            }
            unknown = conn.execute(
                "SELECT count(*) FROM agent_operations WHERE execution_state = 'UNKNOWN'"
            ).fetchone()
        assert unknown is not None and unknown[0] > 0, "the workload leaves some UNKNOWN"
        assert counts[("execution", "duplicate")] > 0

        def metrics_settled() -> bool:
            m = _scrape(port)
            lag = sum(v for (name, _), v in m.items() if name == "opledger_projector_lag_records")
            ages = [
                v
                for (name, labels), v in m.items()
                if name == "opledger_execution_oldest_age_seconds"
                and labels == (("state", "UNKNOWN"),)
            ]
            return lag == 0 and bool(ages) and ages[0] > 0

        _wait_for(metrics_settled)
        m = _scrape(port)
        for machine in ("execution", "delivery"):
            for outcome in ("applied", "duplicate", "anomaly"):
                key = (
                    "opledger_projected_events_total",
                    (("machine", machine), ("outcome", outcome)),
                )
                assert m.get(key, 0.0) == counts.get((machine, outcome), 0), key
        dead = ("opledger_dead_letters_total", (("source_topic", settings.execution_topic),))
        assert m[dead] == 1

        # The oldest unfinished delivery per destination and state, as the projection has it
        # (refreshed every 5 s: wait for a refresh after the last record was projected).
        def delivery_ages() -> dict[tuple[str, str], float]:
            return {
                (dict(labels)["destination"], dict(labels)["state"]): v
                for (name, labels), v in _scrape(port).items()
                if name == "opledger_delivery_oldest_age_seconds"
            }

        def open_deliveries() -> dict[tuple[str, str], float]:
            with psycopg.connect(settings.dsn) as conn:
                rows = conn.execute(
                    "SELECT destination, state, extract(epoch FROM now() - min(state_entered_at))"
                    " FROM deliveries WHERE state IN ('PENDING', 'SENT') GROUP BY 1, 2"
                ).fetchall()
            return {(d, s): float(age) for d, s, age in rows}

        want = open_deliveries()
        assert {state for _destination, state in want} == {"PENDING", "SENT"}, want
        _wait_for(lambda: delivery_ages().keys() == want.keys())
        ages, want = delivery_ages(), open_deliveries()  # read after: the database's are older
        for key, age in ages.items():
            assert want[key] - 20 <= age <= want[key], (key, age, want[key])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # never outlive the test, whatever happened
            raise
    assert code == 0, log.read_text()[-2000:]
