"""``processors/host.py``: a worker whose loop blocks in a call that never returns (no exception,
no log line: what a client whose own timeout fails looks like) is found by the host's watchdog.
Past OPLEDGER_WORKER_STUCK_AFTER_S, /healthz answers 503 "stuck" and the log shows where the
loop is; past OPLEDGER_WORKER_STUCK_EXIT_S the process exits by itself, for its supervisor to
start a fresh one. The host is the workers' own (processors/host.py), as ``opledger projector
run`` starts it."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from ledger.settings import Settings
from tests.process_support import run_worker_host
from tests.support import env_for, free_port

LOOP = """
class Loop:
    health = Health("stucktest")

    def run(self):
        for _ in range(10):
            self.health.ok()
            time.sleep(0.1)
        blocked_in_a_call_that_never_returns()

    def stop(self):
        pass


def blocked_in_a_call_that_never_returns():
    threading.Event().wait()
"""


def test_a_loop_blocked_forever_is_reported_where_it_is_and_the_worker_exits(
    isolated: Settings, tmp_path: Path
) -> None:
    port = free_port()
    answers: list[tuple[int, dict[str, object]]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                    answers.append((r.status, json.loads(r.read())))
            except urllib.error.HTTPError as exc:
                answers.append((exc.code, json.loads(exc.read())))
            except OSError:
                pass
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    env = {
        **env_for(isolated),
        "OPLEDGER_WORKER_STUCK_AFTER_S": "3",
        "OPLEDGER_WORKER_STUCK_EXIT_S": "8",
    }
    started = time.monotonic()
    try:
        code, text = run_worker_host(LOOP, "stucktest", env, tmp_path, port)
    finally:
        done.set()
        watcher.join()
    took = time.monotonic() - started
    assert code is not None, f"alive 60 s after its loop stopped turning:\n{text[-3000:]}"
    assert code != 0, f"exited 0 with a stuck loop:\n{text[-3000:]}"
    assert "stucktest loop has not turned for 3s" in text, text[-3000:]
    assert "in blocked_in_a_call_that_never_returns" in text, text[-3000:]
    assert "exiting so that a fresh process takes over" in text, text[-3000:]
    assert took < 45, f"took {took:.0f}s to give up on an 8 s bound"
    statuses = [body.get("status") for _code, body in answers]
    assert "ok" in statuses, answers[:5]
    assert (503, "stuck") in [(c, b.get("status")) for c, b in answers], answers[-5:]
