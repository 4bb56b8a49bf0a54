"""A hosted worker's log lines are scrubbed and shown, not run, as the commands' own are.

``opledger recover run``, ``deliver run`` and ``projector run`` put a scrubbing filter on their
log handlers, and the workers' host (``processors/host.py``) puts it on any handler added since
(faust's ``mode``, the previous host, replaced the root handlers as it started, and a provider's
words reached those workers' logs as they were said). The host runs a loop that logs such words
once."""

from __future__ import annotations

from pathlib import Path

from ledger.settings import Settings
from tests.process_support import run_worker_host
from tests.support import env_for, free_port

LOOP = """
class Loop:
    health = Health()

    def run(self):
        logging.getLogger("opledger.recovery").warning(
            "lookup raised: %s", "api_key=abcd1234efgh5678ijkl then \\x1b[2J\\nFORGED LINE"
        )
        raise RuntimeError("done logging")

    def stop(self):
        pass
"""


def test_a_hosted_workers_log_is_scrubbed_and_shown_not_run(
    isolated: Settings, tmp_path: Path
) -> None:
    _code, text = run_worker_host(LOOP, "logtest", env_for(isolated), tmp_path, free_port())
    assert "lookup raised:" in text, text[-3000:]
    assert "abcd1234efgh5678ijkl" not in text, "a secret reached the log"
    assert "\x1b" not in text, "an escape sequence reached the log"
    assert "\nFORGED LINE" not in text and "\\x0aFORGED LINE" in text, text[-3000:]
