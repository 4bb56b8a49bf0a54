"""A private stack for tests that restart or kill the servers themselves: its own broker and
PostgreSQL on free ports under a home of their own, so restarting them disturbs no other test
(or person) using the shared stack."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from uuid import uuid4

import pytest

from ledger.settings import Settings
from opledger import stack
from tests.support import private_stack_settings


@pytest.fixture
def private_stack(stack_settings: Settings) -> Iterator[Settings]:
    """Settings of a freshly started broker and database that only this test uses."""
    home = stack_settings.home / "private" / f"s{uuid4().hex[:10]}"
    settings = private_stack_settings(stack_settings, home)
    # The shared stack already resolved the broker's jars: reuse them rather than run Maven.
    version = f"kafka-{settings.kafka_version}"
    shared_jars = stack_settings.home / version
    (home / version).mkdir(parents=True)
    (home / version / "libs").symlink_to(shared_jars / "libs")
    shutil.copy2(shared_jars / "jars.complete", home / version / "jars.complete")
    try:
        stack.up(settings, echo=lambda _line: None, workers=False)
        yield settings
    finally:
        stack.down(settings, echo=lambda _line: None)
        shutil.rmtree(home, ignore_errors=True)
