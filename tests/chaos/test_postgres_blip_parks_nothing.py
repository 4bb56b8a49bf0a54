"""A PostgreSQL restart of about a second while services call tools leaves no work for a person.

An outside soak parked 7 intents begun while PostgreSQL restarted for one second: the intent
reached the log while its lease and stored request (committed alongside it) waited for the
database, the recovery worker took the lease-less intent over at once and, with no request to
dispatch, parked it. Now the worker leaves such an intent to its writer for a grace
(OPLEDGER_RECOVERY_UNLEASED_GRACE_S): the writer's commit, retried across the restart, lands,
and the operation goes on. Counted from outside: every operation begun ends SUCCEEDED, none is
parked, and the provider saw one side effect per operation.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import psycopg

from ledger.domain.policy import PolicyDecision, PolicyRequest
from ledger.settings import Settings
from ledger.tools import ProviderTerms
from opledger.fakes.memory import MemoryProvider
from opledger.fakes.model import Mode
from opledger.stack import postgres
from producers import RecordError, TransitionRecorder
from tests.process_support import kill, start_cli, wait_http
from tests.support import env_for, free_port, recovery_worker, wait_caught_up

THREADS = 4
RESTARTS = 2
#: Longer than the SDK's reconnect window (10 s), shorter than the default, to keep the test short.
GRACE_S = 15
TERMS = ProviderTerms(
    call_timeout=timedelta(seconds=2), key_retention=timedelta(hours=1), repeat_safe=True
)


def _allow(request: PolicyRequest) -> PolicyDecision:
    return PolicyDecision(True, "allowed by the test", None)


class _Calls:
    """Threads calling execute() until stopped; what each call began, whatever it answered."""

    def __init__(self, recorder: TransitionRecorder) -> None:
        self.recorder = recorder
        self.stop = threading.Event()
        self.begun: set[str] = set()
        self.failed_calls = 0
        self.unexpected: list[BaseException] = []
        self._lock = threading.Lock()

    def run(self, worker: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                done = self.recorder.execute(
                    "acme", f"agent-{worker}", "send_email", {"to": f"{worker}-{n}@example.com"}
                )
                with self._lock:
                    self.begun.add(done.operation_id)
            except RecordError as exc:
                # A call that met the restart: the error names the operation if it began one.
                with self._lock:
                    self.failed_calls += 1
                    if exc.operation_id is not None:
                        self.begun.add(exc.operation_id)
                time.sleep(0.1)
            except BaseException as exc:  # surfaced by the test
                self.unexpected.append(exc)
                return


def _recovering(settings: Settings, provider: MemoryProvider, stop: threading.Event) -> None:
    with recovery_worker(settings, [provider], _allow) as worker:
        while not stop.is_set():
            worker.run_once(range(settings.partitions))
            time.sleep(0.3)


def test_a_one_second_postgres_restart_during_calls_parks_nothing(
    private_stack: Settings, tmp_path: Path
) -> None:
    settings = private_stack.with_(
        projector_web_port=free_port(), recovery_unleased_grace_s=GRACE_S
    )
    projector = start_cli(["projector", "run"], env_for(settings), tmp_path / "projector.log")
    provider = MemoryProvider("send_email", TERMS, mode=Mode.NON_IDEMPOTENT)
    stop_recovery = threading.Event()
    recovery = threading.Thread(target=_recovering, args=(settings, provider, stop_recovery))
    try:
        wait_http(f"http://127.0.0.1:{settings.projector_web_port}/healthz", timeout=90)
        recovery.start()
        with TransitionRecorder.connect(settings, providers=[provider]) as recorder:
            recorder.collaborators.policy = _allow
            calls = _Calls(recorder)
            threads = [threading.Thread(target=calls.run, args=(i,)) for i in range(THREADS)]
            for thread in threads:
                thread.start()
            restarts = []
            try:
                for _ in range(RESTARTS):
                    time.sleep(2)
                    started = time.monotonic()
                    _restart_postgres(settings, down_s=1.0)
                    restarts.append(time.monotonic() - started)
                time.sleep(2)
            finally:
                calls.stop.set()
                for thread in threads:
                    thread.join(timeout=120)
        assert not calls.unexpected, calls.unexpected
        assert calls.begun, "no operation was begun"
        state = _wait_finished(settings, calls.begun, timeout=GRACE_S + 120)
    finally:
        stop_recovery.set()
        if recovery.is_alive():
            recovery.join(timeout=60)
        kill(projector)
    print(
        f"{len(calls.begun)} operations begun, {calls.failed_calls} calls failed during "
        f"{len(restarts)} restarts of {', '.join(f'{s:.1f}' for s in restarts)} s"
    )
    unfinished = {op: s for op, s in state.items() if s != ("SUCCEEDED", None)}
    assert not unfinished, f"parked or unfinished: {unfinished}"
    stats = provider.stats()
    effects = {op: stats.keys[op].side_effects for op in calls.begun if op in stats.keys}
    assert set(effects) == calls.begun, "an operation finished without the provider's effect"
    assert set(effects.values()) == {1}, effects


def _restart_postgres(settings: Settings, down_s: float) -> None:
    """Stop PostgreSQL, leave it down for ``down_s``, start it: a restart as an upgrade makes."""
    quiet = lambda _line: None  # noqa: E731
    postgres.stop_postgres(settings, quiet)
    time.sleep(down_s)
    postgres.start_postgres(settings, quiet)


def _wait_finished(
    settings: Settings, operations: set[str], timeout: float
) -> dict[str, tuple[str, str | None]]:
    """(state, parked) of each operation once all are finished or parked, or at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        wait_caught_up(settings, timeout=60)
        with psycopg.connect(settings.dsn) as conn:
            rows = conn.execute(
                "SELECT operation_id, execution_state, parked FROM agent_operations "
                "WHERE operation_id = ANY(%s)",
                (sorted(operations),),
            ).fetchall()
        state = {op: (str(s), p) for op, s, p in rows}
        open_ = [op for op in operations if state.get(op, ("", None))[0] not in ("SUCCEEDED",)]
        if not open_ or all(state.get(op, ("", None))[1] for op in open_):
            return {op: state.get(op, ("missing", None)) for op in operations}
        if time.monotonic() > deadline:
            return {op: state.get(op, ("missing", None)) for op in operations}
        time.sleep(1)
