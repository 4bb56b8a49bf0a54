"""``processors/app.py``: a worker whose loop fails crashes (and its supervisor restarts it)
rather than idling alive with a dead loop, the failure a heartbeat cannot see. The host is the
real faust worker, as ``opledger projector run`` starts it, around a loop that fails after a
second; the process must exit non-zero by itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from ledger.settings import Settings
from tests.support import env_for, free_port

ROOT = Path(__file__).resolve().parents[2]

HOST = textwrap.dedent(
    """
    import sys, time
    import faust
    from prometheus_client import CollectorRegistry
    from ledger.settings import Settings
    from processors.app import create_app

    class Health:
        def snapshot(self):
            return {"status": "ok", "progressing": True}

    class FailingLoop:
        health = Health()

        def run(self):
            time.sleep(1.0)
            raise RuntimeError("the loop failed on purpose")

        def stop(self):
            pass

    settings = Settings.from_env()
    app = create_app(
        settings, FailingLoop(), CollectorRegistry(), name="crashtest", web_port=int(sys.argv[1])
    )
    faust.Worker(app, loglevel="info", quiet=True).execute_from_commandline()
    print("the worker returned normally", flush=True)
    """
)


def test_a_worker_whose_loop_fails_exits_by_itself(isolated: Settings, tmp_path: Path) -> None:
    script = tmp_path / "host.py"
    script.write_text(HOST)
    log = tmp_path / "host.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, str(script), str(free_port())],
            env=env_for(isolated, PYTHONPATH=str(ROOT)),
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise AssertionError(f"alive 60 s after its loop failed:\n{log.read_text()}") from None
    text = log.read_text()
    assert code != 0, f"exited 0 after its loop failed:\n{text[-3000:]}"
    assert "crashtest loop failed; crashing the worker" in text, text[-3000:]
    assert "the worker returned normally" not in text
