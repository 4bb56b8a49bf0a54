"""Real worker processes for the chaos tier: start ``opledger ...`` in its own session (so a
SIGKILL of its group takes every child with it), wait for its HTTP endpoint, kill it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_cli(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``python -m opledger.cli ARGV`` with ``env``, its output appended to ``log``."""
    return subprocess.Popen(
        [sys.executable, "-m", "opledger.cli", *argv],
        env=env,
        cwd=ROOT,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_http(url: str, timeout: float = 60) -> None:
    """Until ``url`` answers 200."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as response:
            if response.status == 200:
                return
        assert time.monotonic() < deadline, f"{url} did not answer"
        time.sleep(0.3)


def kill(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process and its session; wait for it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
