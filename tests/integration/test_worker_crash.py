"""``processors/host.py``: a worker whose loop fails crashes (and its supervisor restarts it)
rather than idling alive with a dead loop, the failure a heartbeat cannot see. The host is the
workers' own, as ``opledger projector run`` starts it, around a loop that fails after a second;
the process must exit non-zero by itself."""

from __future__ import annotations

from pathlib import Path

from ledger.settings import Settings
from tests.process_support import run_worker_host
from tests.support import env_for, free_port

LOOP = """
class Loop:
    health = Health()

    def run(self):
        time.sleep(1.0)
        raise RuntimeError("the loop failed on purpose")

    def stop(self):
        pass
"""


def test_a_worker_whose_loop_fails_exits_by_itself(isolated: Settings, tmp_path: Path) -> None:
    code, text = run_worker_host(LOOP, "crashtest", env_for(isolated), tmp_path, free_port())
    assert code is not None, f"alive 60 s after its loop failed:\n{text[-3000:]}"
    assert code != 0, f"exited 0 after its loop failed:\n{text[-3000:]}"
    assert "crashtest loop failed; crashing the worker" in text, text[-3000:]
    assert "the worker returned normally" not in text
