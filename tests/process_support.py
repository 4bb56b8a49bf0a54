"""Real worker processes for the chaos tier: start ``opledger ...`` in its own session (so a
SIGKILL of its group takes every child with it), wait for its HTTP endpoint, kill it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(
    env: dict[str, str], *argv: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -m opledger.cli ARGV`` with ``env``, run to its end (``timeout`` seconds at
    most), its output captured: a command as an operator types it."""
    return subprocess.run(
        [sys.executable, "-m", "opledger.cli", *argv],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


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


_WORKER_HOST = """
import logging, sys, threading, time
from prometheus_client import CollectorRegistry
from ledger.secrets import RedactingFilter
from ledger.settings import Settings
from processors.health import Health
from processors.host import Hosted, serve

{loop}

settings = Settings.from_env()
logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s %(message)s")
for handler in logging.getLogger().handlers:
    handler.addFilter(RedactingFilter())
code = serve(settings, Hosted(Loop(), CollectorRegistry(), {name!r}, int(sys.argv[1])))
print("the worker returned " + ("normally" if code == 0 else f"{{code}}"), flush=True)
sys.exit(code)
"""


def run_worker_host(
    loop: str, name: str, env: dict[str, str], workdir: Path, port: int, *, timeout: float = 60
) -> tuple[int | None, str]:
    """Run the workers' host, as ``opledger projector run`` hosts its loop, around ``loop``:
    the source of a class ``Loop`` with ``health = Health()``, ``run()`` and ``stop()``. Returns
    its exit code (None: still alive after ``timeout`` s, then SIGKILLed) and its output."""
    script = workdir / f"{name}-host.py"
    script.write_text(_WORKER_HOST.format(loop=textwrap.dedent(loop).strip(), name=name))
    log = workdir / f"{name}-host.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, str(script), str(port)],
            env={**env, "PYTHONPATH": str(ROOT)},
            cwd=workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        code: int | None
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    return code, log.read_text()
