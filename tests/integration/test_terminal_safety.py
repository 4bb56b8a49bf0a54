"""What the CLI prints of text from outside cannot act on the operator's terminal.

A provider's failure reason is recorded as it was said (the log is evidence); `opledger ops
show` and `ops list` print it, as `destinations list` prints a destination's 410 reason. Escape
sequences in it (clear the screen, write the clipboard with OSC 52) and a carriage return that
overwrites the line are shown as visible escapes.
"""

from __future__ import annotations

import subprocess
import sys

from ledger.destinations import DestinationStore, Kind
from ledger.pg import open_pool
from ledger.settings import Settings
from producers import TransitionRecorder
from tests.support import env_for, project_in_process

SAID = "card declined\x1b[2J\x1b]52;c;ZXZpbA==\x07\rall good\u202e"


def _cli(settings: Settings, *argv: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "opledger.cli", *argv],
        env=env_for(settings, COLUMNS="400"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_providers_words_are_shown_by_ops_show_and_list_not_run(isolated: Settings) -> None:
    with TransitionRecorder.connect(isolated) as recorder:
        op = recorder.intent("acme", "agent-7", "charge_card", {"amount": 5})
        recorder.dispatched(op, provider_ref=op.operation_id)
        recorder.failed(op, SAID)
    project_in_process(isolated)
    for printed in (
        _cli(isolated, "ops", "show", op.operation_id, "--tenant", "acme"),
        _cli(isolated, "ops", "list", "--tenant", "acme"),
    ):
        assert "\x1b" not in printed and "\r" not in printed and "\u202e" not in printed
        assert "card declined\\x1b[2J" in printed.replace("\n", "")


def test_a_destinations_gone_reason_is_shown_by_destinations_list_not_run(
    isolated: Settings,
) -> None:
    """A 410's reason phrase (the destination's own words) disables the destination and is
    printed by ``destinations list``."""
    with open_pool(isolated.dsn, name="test-terminal", max_size=1) as pool:
        store = DestinationStore(pool)
        store.add(
            tenant_id="acme",
            name="hooks",
            kind=Kind.WEBHOOK,
            target="https://hooks.example.com/events",
            tools=["*"],
            changed_by="ops",
        )
        store.set_enabled(
            "acme", "hooks", enabled=False, changed_by="delivery-worker", reason=f"410 {SAID}"
        )
    printed = _cli(isolated, "destinations", "list", "--tenant", "acme")
    assert "\x1b" not in printed and "\r" not in printed and "\u202e" not in printed
    assert "DISABLED (410 card declined\\x1b[2J" in printed
