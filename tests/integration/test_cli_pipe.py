"""The CLI writing into a pipe whose reader went away (`opledger ops list | head`)."""

from __future__ import annotations

import os
import subprocess
import sys

from ledger.settings import Settings
from opledger.cli import EXIT_BROKEN_PIPE
from tests.support import env_for


def test_a_reader_that_goes_away_gets_no_traceback(stack_settings: Settings) -> None:
    reader, writer = os.pipe()
    os.close(reader)  # gone before the command writes its first line
    try:
        done = subprocess.run(
            [sys.executable, "-m", "opledger.cli", "stack", "status"],
            env=env_for(stack_settings),
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(writer)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == EXIT_BROKEN_PIPE, done.stderr
