"""The seed's failure-injection row 1, and row 2's boundary before the call, for an asyncio
service: ``await recorder.execute`` on an ``AsyncTransitionRecorder`` (asyncio providers),
SIGKILLed at a named fault point; the recovery worker (its own process) carries the operation on,
and the fake provider (its own process) counts what the outside world saw. The rig is
``test_recovery_kills.py``'s.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger.settings import Settings
from tests.chaos.test_recovery_kills import (
    MOVED_WITHIN_S,
    Rig,
    _first_op,
    _processes,
    rig_decision,
)
from tests.support import grant, project_in_process


@pytest.fixture
def rig(isolated: Settings, tmp_path: Path) -> Iterator[Rig]:
    """The fake provider, the projector and the recovery worker as processes, for a tenant whose
    grant allows repeats."""
    grant(isolated, "acme", repeat_safe=True)
    project_in_process(isolated)
    with _processes(isolated, tmp_path, recovery=True) as running:
        yield running


@pytest.mark.chaos
def test_an_asyncio_service_killed_mid_execute_is_recovered_by_the_worker(rig: Rig) -> None:
    # Killed after the dispatch was recorded, before the provider was called.
    before_call = rig.service(
        "execute", "--asyncio", "--tool", "send_email",
        fault="execute.after_dispatch_before_call:kill",
    )  # fmt: skip
    # Killed after the intent, before the dispatch.
    before_dispatch = rig.service(
        "execute", "--asyncio", "--tool", "create_invoice",
        fault="execute.after_intent_before_dispatch:kill",
    )  # fmt: skip
    killed: dict[str, float] = {}
    ops = {}
    for name, process in (("before_call", before_call), ("before_dispatch", before_dispatch)):
        op = _first_op(process)
        code = process.wait(timeout=30)
        rest = process.stdout.read() if process.stdout else ""
        assert code == -signal.SIGKILL, f"{op} was not killed (exit {code}): {rest}"
        killed[op] = time.time()
        ops[name] = op
    rows = {name: rig.wait_state(op, {"SUCCEEDED", "FAILED"}) for name, op in ops.items()}
    stats = rig.control.stats()

    assert {name: row[0] for name, row in rows.items()} == {
        "before_call": "SUCCEEDED",
        "before_dispatch": "SUCCEEDED",
    }
    keys = {tool: t.keys for tool, t in stats.tools.items()}
    # The dead service never called: the lookup found nothing, and policy (a repeat-safe grant,
    # within the key's retention) allowed one new attempt under the same key.
    assert keys["send_email"][ops["before_call"]].calls == 1
    assert rig_decision(rig.settings, ops["before_call"]) == ("NEW_ATTEMPT", "NOT_FOUND")
    assert rows["before_call"][1] == 2, "attempt 2: the dead service's dispatch was attempt 1"
    # No call had happened and nothing was dispatched: the worker dispatched it once.
    assert keys["create_invoice"][ops["before_dispatch"]].calls == 1
    assert rig_decision(rig.settings, ops["before_dispatch"]) == ("RESUME", "NOT_LOOKED_UP")
    assert stats.max_side_effects_per_key <= 1
    moved = {op: rows[name][4].timestamp() - killed[op] for name, op in ops.items()}
    print(f"\nseconds from the kill to the operation moving on: {moved}")
    assert all(seconds <= MOVED_WITHIN_S for seconds in moved.values()), moved
