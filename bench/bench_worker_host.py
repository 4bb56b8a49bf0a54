"""The workers' host: a faust app (as the workers were hosted until decision 028)
against the plain aiohttp host (``processors.host``), around the same trivial loop, in one run.

Not a test. Needs the local stack (the faust host joins a consumer group on the broker). Each
round starts one host of each kind, alternating, and measures:

- *ready*: from the process's start to its first ``/healthz`` answering 200;
- *rss*: the process's resident memory once ready (``VmRSS``);
- *stop*: from SIGTERM to the process's exit;
- *again*: a second process of the same worker started right after the first was SIGKILLed,
  from its start to 200 (the faust host's group must let go of the killed member first).

    .venv/bin/python bench/bench_worker_host.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from uuid import uuid4

from ledger.settings import Settings

ROOT = Path(__file__).resolve().parents[1]

_LOOP = """
import threading, time
from prometheus_client import CollectorRegistry
from ledger.settings import Settings
from processors.health import Health

class Loop:
    health = Health("bench")
    def __init__(self):
        self._stop = threading.Event()
    def run(self):
        while not self._stop.wait(0.1):
            self.health.ok()
    def stop(self):
        self._stop.set()

settings = Settings.from_env()
port = int(__import__("sys").argv[1])
"""

#: The faust host as ``processors/app.py`` built it (a faust App with a web page per endpoint,
#: the loop on a thread under a mode.Service, a static member of its own consumer group).
_FAUST = (
    _LOOP
    + """
import asyncio, faust, mode
from prometheus_client import generate_latest
from benchenv import faust_credentials
creds = faust_credentials(settings)
loop_ = Loop()
app_id = f"{settings.topic_prefix}-bench-host"
datadir = settings.home / "faust" / app_id
datadir.mkdir(parents=True, exist_ok=True)
app = faust.App(app_id, broker=f"kafka://{settings.bootstrap_servers}", store="memory://",
    broker_credentials=creds,
    datadir=str(datadir), web_enabled=True, web_bind="127.0.0.1", web_port=port,
    web_in_thread=False, consumer_group_instance_id=f"{settings.topic_prefix}-bench-0",
    broker_session_timeout=10.0)

class Host(mode.Service):
    @mode.Service.task
    async def _run(self):
        # as processors/app.py ran it: a daemon thread, awaited through a future
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        def run():
            loop_.run()
            loop.call_soon_threadsafe(done.set_result, None)
        threading.Thread(target=run, daemon=True).start()
        try:
            await done
        finally:
            loop_.stop()
    async def on_stop(self):
        loop_.stop()

app.service(Host)

@app.page("/metrics")
async def metrics(web, request):
    return web.bytes(generate_latest(CollectorRegistry()), content_type="text/plain")

@app.page("/healthz")
async def healthz(web, request):
    h = loop_.health.snapshot()
    return web.json(h, status=200 if h["progressing"] else 503)

faust.Worker(app, loglevel="warning", quiet=True).execute_from_commandline()
"""
)

_PLAIN = (
    _LOOP
    + """
import sys
from processors.host import Hosted, serve
sys.exit(serve(settings, Hosted(Loop(), CollectorRegistry(), "bench", port)))
"""
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(script: Path, port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(script), str(port)],
        env=env,
        cwd=script.parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _until_ready(process: subprocess.Popen[bytes], port: int, timeout: float = 120) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"host exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                if r.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.02)
    raise RuntimeError("host not ready in time")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _one(script: Path, env: dict[str, str]) -> dict[str, float]:
    port = _free_port()
    began = time.monotonic()
    first = _start(script, port, env)
    ready = _until_ready(first, port)
    rss = _rss_mib(first.pid)
    killed_at = time.monotonic()
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    second = _start(script, port, env)
    again = _until_ready(second, port)
    sigterm = time.monotonic()
    os.killpg(second.pid, signal.SIGTERM)
    try:
        second.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(second.pid, signal.SIGKILL)
        second.wait()
    stop = time.monotonic() - sigterm
    del began, killed_at
    return {"ready": ready, "rss": rss, "again": again, "stop": stop}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    settings = Settings.from_env()
    prefix = f"benchhost{uuid4().hex[:8]}"
    env = {
        **os.environ,
        # The bench's own directory too: the faust host takes its credentials from benchenv.
        "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "bench"))),
        "OPLEDGER_TOPIC_PREFIX": prefix,
        "OPLEDGER_KAFKA_BOOTSTRAP": settings.bootstrap_servers,
        "OPLEDGER_KAFKA_SECURITY": settings.kafka_security_protocol,
        # Both hosts as the admin: the faust one makes its own topics and groups.
        "OPLEDGER_KAFKA_PRINCIPAL": "admin",
        "OPLEDGER_KAFKA_PASSWORD_DIR": str(settings.kafka_password_directory),
    }
    results: dict[str, list[dict[str, float]]] = {"faust": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        scripts = {"faust": Path(tmp) / "faust_host.py", "plain": Path(tmp) / "plain_host.py"}
        scripts["faust"].write_text(_FAUST)
        scripts["plain"].write_text(_PLAIN)
        for round_ in range(args.rounds):
            for kind in ("faust", "plain") if round_ % 2 == 0 else ("plain", "faust"):
                results[kind].append(_one(scripts[kind], env))
    print(f"{args.rounds} rounds, medians (faust host | plain host | plain/faust)")
    for measure, unit in (("ready", "s"), ("again", "s"), ("stop", "s"), ("rss", "MiB")):
        faust_ = statistics.median(r[measure] for r in results["faust"])
        plain = statistics.median(r[measure] for r in results["plain"])
        print(
            f"  {measure:6} {faust_:8.2f} {unit:3} | {plain:8.2f} {unit:3} | {plain / faust_:5.2f}x"
        )


if __name__ == "__main__":
    main()
