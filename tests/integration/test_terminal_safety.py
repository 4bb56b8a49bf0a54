"""What the CLI prints of text from outside cannot act on the operator's terminal.

A provider's failure reason is recorded as it was said (the log is evidence); `opledger ops
show` and `ops list` print it, as `destinations list` prints a destination's 410 reason. Escape
sequences in it (clear the screen, write the clipboard with OSC 52) and a carriage return that
overwrites the line are shown as visible escapes.
"""

from __future__ import annotations

import subprocess
import sys

import psycopg

from ledger.destinations import DestinationStore, Kind, new_secret
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
        store = DestinationStore(pool, isolated)
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


#: An outside probe's values, each stored by `destinations add` before names were checked
#: (`--tool` with OSC 52 and a screen clear, `--tenant` with a quote or an escape, `--url` with
#: CR/LF, a space or a tab) while the SDK refused the same tenants.
PROBES = [
    ["--tenant", "acme", "--tool", "x\x1b]52;c;SGVsbG8=\x07\x1b[2J", "--url", "https://h.example/e"],
    ["--tenant", "acme", "--tool", "a\r\nforged line", "--url", "https://h.example/e"],
    ["--tenant", "x'--", "--tool", "*", "--url", "https://h.example/e"],
    ["--tenant", "t\x1b[2J", "--tool", "*", "--url", "https://h.example/e"],
    ["--tenant", "acme", "--tool", "*", "--url", "https://h.example/a\r\nb"],
    ["--tenant", "acme", "--tool", "*", "--url", "https://h.example/a b"],
    ["--tenant", "acme", "--tool", "*", "--url", "https://h.example/\tevents"],
]  # fmt: skip


def test_the_probes_destinations_are_refused_and_nothing_is_stored(isolated: Settings) -> None:
    for probe in PROBES:
        done = subprocess.run(
            [sys.executable, "-m", "opledger.cli", "destinations", "add", "--name", "crm", *probe],
            env=env_for(isolated),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 2, (probe, done.stdout, done.stderr)
        assert "\x1b" not in done.stderr and "\r" not in done.stderr, done.stderr
        assert "whsec_" not in done.stdout + done.stderr  # no secret made for a refused one
    with open_pool(isolated.dsn, name="test-terminal", max_size=1) as pool:
        for tenant in ("acme", "x'--", "t\x1b[2J"):
            assert DestinationStore(pool, isolated).list(tenant) == []


def test_a_row_stored_before_the_checks_is_listed_escaped(isolated: Settings) -> None:
    """Rows written by an earlier version (or by hand) hold whatever they hold: what `destinations
    list` prints of them cannot act on the terminal either."""
    with psycopg.connect(isolated.dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO delivery_destinations (tenant_id, name, kind, target, secret, tools, "
            "timeout_ms, changed_by) VALUES (%s, %s, 'webhook', %s, %s, %s, 1000, %s)",
            (
                "acme",
                "crm",
                "https://h.example/a\r\nInjected: 1",
                new_secret(),
                ["x\x1b]52;c;SGVsbG8=\x07\x1b[2J"],
                "ops\r\nforged line \u202e",
            ),
        )
    printed = _cli(isolated, "destinations", "list", "--tenant", "acme")
    assert "\x1b" not in printed and "\r" not in printed and "\u202e" not in printed
    assert printed.count("\n") == 1, printed  # one destination, one line
    assert "tools=x\\x1b]52" in printed
