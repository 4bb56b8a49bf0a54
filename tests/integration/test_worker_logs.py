"""A faust-hosted worker's log lines are scrubbed and shown, not run, as the commands' own are.

``opledger recover run``, ``deliver run`` and ``projector run`` put a scrubbing filter on their
log handlers, but faust's ``mode`` replaces the root handlers as the worker starts; until
``processors/app.py`` put the filter back, a provider's words reached those workers' logs as
they were said. The host is the real faust worker around a loop that logs such words once."""

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
    import logging, sys
    import faust
    from prometheus_client import CollectorRegistry
    from ledger.settings import Settings
    from processors.app import create_app

    class Health:
        def snapshot(self):
            return {"status": "ok", "progressing": True}

    class Loop:
        health = Health()

        def run(self):
            logging.getLogger("opledger.recovery").warning(
                "lookup raised: %s", "api_key=abcd1234efgh5678ijkl then \\x1b[2J\\nFORGED LINE"
            )
            raise RuntimeError("done logging")

        def stop(self):
            pass

    settings = Settings.from_env()
    app = create_app(
        settings, Loop(), CollectorRegistry(), name="logtest", web_port=int(sys.argv[1])
    )
    faust.Worker(app, loglevel="info", quiet=True).execute_from_commandline()
    """
)


def test_a_faust_workers_log_is_scrubbed_and_shown_not_run(
    isolated: Settings, tmp_path: Path
) -> None:
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
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    text = log.read_text()
    assert "lookup raised:" in text, text[-3000:]
    assert "abcd1234efgh5678ijkl" not in text, "a secret reached the log"
    assert "\x1b" not in text, "an escape sequence reached the log"
    assert "\nFORGED LINE" not in text and "\\x0aFORGED LINE" in text, text[-3000:]
