"""The suite collects the same test ids in every process.

`make test` runs pytest-xdist, whose processes each collect the suite and must agree on every id,
or the whole run stops before a test runs. An id built from the clock, a random secret or a
hash-ordered set differs between processes; this test collects twice, with different hash seeds
and more than a second apart, as two xdist processes may, and compares.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _collect(hash_seed: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _ids(process: subprocess.Popen[str]) -> list[str]:
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0, out
    return [line for line in out.splitlines() if "::" in line]


def test_every_process_collects_the_same_test_ids() -> None:
    first = _collect("1")
    time.sleep(1.1)  # a clock-derived id then lands on another second
    second = _collect("2")
    first_ids, second_ids = _ids(first), _ids(second)
    assert len(first_ids) > 1000, "the whole suite was collected"
    differing = sorted(set(first_ids) ^ set(second_ids))
    assert not differing, f"ids that differ between two collections: {differing[:10]}"
