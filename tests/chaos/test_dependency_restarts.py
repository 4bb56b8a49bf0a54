"""PostgreSQL restarted five times and the broker three times (once with SIGKILL) under load, with
ONE long-lived recorder shared by four threads and ONE projector process: nobody restarts either
by hand. Afterwards nothing the recorder was told is recorded is missing, nothing is applied
twice, the projections equal the independent fold, and the projector said it was not
progressing (503 on /healthz) while its database was away.

The servers restarted are the test's own (the ``private_stack`` fixture), not the shared ones.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest

from ledger.settings import Settings
from opledger import stack
from producers import DeliveryError, ResultStoreError, TrackedOperation, TransitionRecorder
from tests.support import (
    assert_projection_matches,
    env_for,
    free_port,
    independent_fold,
    wait_caught_up,
)

T = TypeVar("T")
THREADS = 4
PG_RESTARTS = 5
KAFKA_RESTARTS = 3
STEP_DEADLINE_S = 180.0


class Load:
    """Threads that run intent → dispatched → succeeded(payload) → delivery_pending through one
    recorder, riding out failures the way a careful service does: an append whose outcome is
    unknown is resent (the identical event), a result store that is away is tried again."""

    def __init__(self, recorder: TransitionRecorder) -> None:
        self.recorder = recorder
        self.stop = threading.Event()
        self.completed: list[str] = []
        self.resends = 0
        self.store_retries = 0
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

    def _step(self, call: Callable[[], T]) -> T:
        deadline = time.monotonic() + STEP_DEADLINE_S
        while True:
            try:
                return call()
            except ResultStoreError:
                # Nothing was sent: the same call again is the same step.
                with self._lock:
                    self.store_retries += 1
            except DeliveryError as exc:
                return self._resend_until_done(exc, deadline)  # type: ignore[return-value]
            if time.monotonic() > deadline:
                raise TimeoutError("a step did not complete in time")
            time.sleep(0.2)

    def _resend_until_done(self, exc: DeliveryError, deadline: float) -> TrackedOperation:
        handle = exc.handle
        while True:
            time.sleep(0.2)
            with self._lock:
                self.resends += 1
            try:
                self.recorder.resend(handle)
                return handle
            except DeliveryError:
                if time.monotonic() > deadline:
                    raise

    def _operation(self, worker: int, n: int) -> None:
        recorder = self.recorder
        op = self._step(lambda: recorder.intent("acme", f"agent-{worker}", "send", {"n": n}))
        self._step(lambda: recorder.dispatched(op, provider_ref=op.operation_id))
        self._step(lambda: recorder.succeeded(op, f"result {worker}/{n}".encode()))
        self._step(lambda: recorder.delivery_pending(op, "webhook:crm"))
        with self._lock:
            self.completed.append(op.operation_id)

    def run(self, worker: int) -> None:
        try:
            n = 0
            while not self.stop.is_set():
                n += 1
                self._operation(worker, n)
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)


def _health(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return 0, {}


@contextlib.contextmanager
def _projector(settings: Settings, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "opledger.cli", "projector", "run"],
            # A loop that stops turning says where it is early, and never exits: this test
            # forbids a new process.
            env={
                **env_for(settings),
                "OPLEDGER_WORKER_STUCK_AFTER_S": "20",
                "OPLEDGER_WORKER_STUCK_EXIT_S": "0",
            },
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield process
    finally:
        process.kill()
        process.wait(timeout=30)


def _wait_serving(port: int, process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _health(port)[0] != 200:
        assert process.poll() is None, "the projector exited while starting"
        assert time.monotonic() < deadline, "the projector did not start serving"
        time.sleep(0.3)


@pytest.mark.chaos
def test_restarts_of_postgres_and_kafka_lose_and_double_nothing(
    private_stack: Settings, tmp_path: Path
) -> None:
    settings = private_stack.with_(projector_web_port=free_port())
    port = settings.projector_web_port
    statuses: list[int] = []
    with (
        _projector(settings, tmp_path / "projector.log") as projector,
        TransitionRecorder.connect(settings, delivery_timeout_s=5) as recorder,
    ):
        _wait_serving(port, projector)
        load = Load(recorder)
        threads = [threading.Thread(target=load.run, args=(i,)) for i in range(THREADS)]
        for thread in threads:
            thread.start()
        watching = threading.Event()

        def watch() -> None:
            while not watching.is_set():
                statuses.append(_health(port)[0])
                time.sleep(0.1)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            for _ in range(PG_RESTARTS):
                time.sleep(2)
                stack.restart(settings, "postgres", echo=lambda _l: None)
            for i in range(KAFKA_RESTARTS):
                time.sleep(3)
                stack.restart(settings, "kafka", echo=lambda _l: None, kill=i == 1)
            time.sleep(3)
        finally:
            load.stop.set()
            for thread in threads:
                thread.join(timeout=STEP_DEADLINE_S + 30)
            watching.set()
            watcher.join()
        assert not load.errors, load.errors
        assert projector.poll() is None, (
            "the projector exited; nobody may restart it by hand:\n"
            + ((tmp_path / "projector.log").read_text(errors="replace")[-3000:])
        )
        try:
            wait_caught_up(settings, timeout=120)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}; /healthz says {_health(port)}; the projector's log ends:\n"
                + (tmp_path / "projector.log").read_text(errors="replace")[-8000:]
            ) from None
        assert projector.poll() is None
        assert _health(port)[0] == 200

    assert 503 in statuses, "the projector reported that it was not progressing"
    assert load.completed, "the load made progress"
    summary = assert_projection_matches(settings, independent_fold(settings))
    with psycopg.connect(settings.dsn) as conn:
        rows = dict(
            conn.execute("SELECT operation_id, execution_state FROM agent_operations").fetchall()
        )
        delivered = {
            r[0]
            for r in conn.execute(
                "SELECT operation_id FROM deliveries WHERE state = 'PENDING'"
            ).fetchall()
        }
        applied_twice = conn.execute(
            "SELECT operation_id, machine, destination, state, attempt, count(*) "
            "FROM operation_history WHERE outcome = 'applied' "
            "GROUP BY 1, 2, 3, 4, 5 HAVING count(*) > 1"
        ).fetchall()
    # Lost: an operation the recorder confirmed, missing from the projections or short of a step.
    lost = [op for op in load.completed if rows.get(op) != "SUCCEEDED" or op not in delivered]
    assert lost == [], f"{len(lost)} confirmed operations are not fully projected"
    assert applied_twice == [], "a transition was applied twice"
    assert summary["anomalies"] == 0
    print(
        f"\ncompleted {len(load.completed)} operations through {PG_RESTARTS} PostgreSQL and "
        f"{KAFKA_RESTARTS} Kafka restarts; {load.resends} resends, {load.store_retries} "
        f"result-store retries, {summary['duplicates']} duplicates recognised, "
        f"{statuses.count(503)} of {len(statuses)} health probes said 503"
    )
