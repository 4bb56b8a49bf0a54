"""A private supervisor of the stack's workers, as `make demo` runs them, for tests that need
the whole path: a home, ports and groups of their own on the shared broker and PostgreSQL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from ledger.settings import Settings
from opledger import stack
from tests.support import env_for, free_port

ROOT = Path(__file__).resolve().parents[1]


def private_demo_settings(isolated: Settings, tmp_path: Path) -> Settings:
    """``isolated`` with a home, ports and groups of its own: a stack's workers for it alone,
    the reference consumer's tables in its database."""
    return isolated.with_(
        home=tmp_path / "home",
        projector_web_port=free_port(),
        recovery_web_port=free_port(),
        recovery_group=f"{isolated.topic_prefix}-recovery",
        delivery_web_port=free_port(),
        delivery_group=f"{isolated.topic_prefix}-delivery",
        consumer_web_port=free_port(),
        consumer_pg_dsn=isolated.dsn,
        fake_provider_url=f"http://127.0.0.1:{free_port()}",
        # As `make demo` runs: loopback is allowed by the stack's supervisor, not by the
        # tests' settings.
        delivery_allow_networks="",
    )


@contextlib.contextmanager
def supervised(settings: Settings, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The stack's supervisor for ``settings``' home, as `stack up` starts it; its environment."""
    stack.ensure_consumer_secret(settings)
    env = env_for(settings, PYTHONPATH=str(ROOT))
    with (tmp_path / "supervisor.out").open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "opledger.supervisor"],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield env
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
