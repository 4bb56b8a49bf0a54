"""A stack of a test's own: a private home on free ports, started by ``opledger stack up`` as a
user starts it, reusing the shared stack's broker jars. For tests that stop, kill or
reconfigure the broker or PostgreSQL, which the shared stack's other tests need running."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

from ledger.settings import Settings
from opledger import stack
from tests.process_support import ROOT
from tests.support import free_port


def home_with_jars(stack_settings: Settings, home: Path) -> None:
    """A new home that reuses the shared stack's broker jars rather than run Maven."""
    version = f"kafka-{stack_settings.kafka_version}"
    shared = stack_settings.home / version
    (home / version).mkdir(parents=True)
    (home / version / "libs").symlink_to(shared / "libs")
    shutil.copy2(shared / "jars.complete", home / version / "jars.complete")


def user_env(home: Path) -> dict[str, str]:
    """The environment a user types commands in: a home of its own on free ports."""
    import os  # noqa: PLC0415

    env = {k: v for k, v in os.environ.items() if not k.startswith("OPLEDGER_")}
    env.update(
        OPLEDGER_HOME=str(home),
        OPLEDGER_KAFKA_PORT=str(free_port()),
        OPLEDGER_KAFKA_CONTROLLER_PORT=str(free_port()),
        OPLEDGER_PG_PORT=str(free_port()),
        OPLEDGER_PROJECTOR_WEB_PORT=str(free_port()),
        OPLEDGER_RECOVERY_WEB_PORT=str(free_port()),
        OPLEDGER_DELIVERY_WEB_PORT=str(free_port()),
        OPLEDGER_CONSUMER_WEB_PORT=str(free_port()),
        OPLEDGER_FAKE_PROVIDER_URL=f"http://127.0.0.1:{free_port()}",
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
    )
    return env


@contextlib.contextmanager
def own_stack_env(stack_settings: Settings, tag: str) -> Iterator[dict[str, str]]:
    """:func:`user_env` for a new home, whose stack is stopped and removed afterwards."""
    home = stack_settings.home / "private" / f"{tag}{uuid4().hex[:10]}"
    home_with_jars(stack_settings, home)
    env = user_env(home)
    try:
        yield env
    finally:
        stack.down(Settings.from_env(env), echo=lambda _line: None)
        shutil.rmtree(home, ignore_errors=True)
