"""`opledger replay` after a run in which the broker, PostgreSQL and the projector were each
SIGKILLed while the demo's services worked (and the demo kills its own services and the
delivery worker): the demo still holds every invariant, every projection rebuilt from the log
equals the live one, and every result the log names is in the store. On a stack of the test's
own, since the shared broker and database serve every other test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger.settings import Settings
from opledger import stack
from tests.own_stack_support import own_stack_env
from tests.process_support import run_cli, start_cli

pytestmark = pytest.mark.integration

OPERATIONS = 40


@pytest.fixture
def own_env(stack_settings: Settings) -> Iterator[dict[str, str]]:
    with own_stack_env(stack_settings, "crash") as env:
        yield env


def _kill_postgres(settings: Settings) -> None:
    """SIGKILL the postmaster and every backend: PostgreSQL's crash, recovered from its WAL on
    the next start (a postmaster killed alone would leave backends holding its memory)."""
    pid = stack.postgres_pid(settings)
    assert pid is not None
    children = subprocess.run(
        ["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    victims = [pid, *map(int, children)]
    for victim in victims:
        os.kill(victim, signal.SIGKILL)
    # Gone, not only killed: a postmaster whose exit is not reaped yet still holds its pid,
    # and a new one refuses the data directory while it does.
    deadline = time.monotonic() + 60
    while any(_alive(v) for v in victims):
        assert time.monotonic() < deadline, "killed PostgreSQL processes still there after 60s"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is still taken (a zombie's too)."""
    return Path(f"/proc/{pid}").exists()


def test_replay_equals_the_live_projections_after_the_broker_postgres_and_projector_die(
    own_env: dict[str, str], tmp_path: Path
) -> None:
    env = own_env
    up = run_cli(env, "stack", "up", timeout=400)
    assert up.returncode == 0, up.stdout + up.stderr
    user = Settings.from_env(env)
    demo_log = tmp_path / "demo.log"
    demo = start_cli(["demo", "--operations", str(OPERATIONS)], env, demo_log)
    try:
        time.sleep(6)
        assert demo.poll() is None, "the demo ended before the broker was killed"
        killed = run_cli(env, "stack", "restart", "kafka", "--kill", timeout=240)
        assert killed.returncode == 0, killed.stdout + killed.stderr
        time.sleep(3)
        _kill_postgres(user)
        again = run_cli(env, "stack", "up", timeout=400)
        assert again.returncode == 0, again.stdout + again.stderr
        assert demo.poll() is None, "the demo ended before PostgreSQL was killed"
        projector = run_cli(env, "stack", "restart", "projector", "--kill", timeout=120)
        assert projector.returncode == 0, projector.stdout + projector.stderr
        demo.wait(timeout=480)
    finally:
        if demo.poll() is None:
            demo.kill()
    ran = demo_log.read_text(errors="replace")
    # The demo's services and workers rode out the broker and the database going: nothing
    # happened twice at the provider or a consumer, and nothing was lost.
    assert demo.returncode == 0, ran[-4000:]
    for line in (
        "max side effects per operation: 1",
        "provider calls beyond what reconciliation allowed: 0",
        "max applied changes per operation at a consumer: 1",
        f"operations lost or unfinished: 0 of {OPERATIONS}",
        "every invariant held",
    ):
        assert line in ran, ran[-4000:]
    replayed = run_cli(env, "replay", "--json", timeout=300)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr + ran[-3000:]
    report = json.loads(replayed.stdout)
    assert report["equal"] is True
    rows = {t["table"]: t["replay_rows"] for t in report["tables"]}
    assert rows["agent_operations"] == OPERATIONS, rows
    assert rows["operation_history"] > 0 and rows["deliveries"] > 0, rows
    assert report["results_checked"] > 0 and report["results_wrong"] == []
