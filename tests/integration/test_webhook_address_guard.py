"""Webhooks are not sent to addresses a webhook product refuses by default (decision 019): a
tenant's destination at the cloud metadata address, at an internal 10.x service, at loopback
written as an IPv4-mapped IPv6 address or behind a host name. Each drives the real delivery
worker in-process against the isolated stack, with a real listener on 127.0.0.1 that counts
every connection it is offered, so "never called" is counted, not assumed.

The worker here runs without the tests' loopback allowance (``tests/conftest.py``): only
127.0.0.2/32, where the other tenant's good receiver listens."""

from __future__ import annotations

import base64
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ledger.destinations import DestinationStore
from ledger.domain.fold import DeliveryRecord
from ledger.domain.states import DeliveryState
from ledger.pg import open_pool
from ledger.settings import Settings
from opledger.cli import build_parser
from opledger.deliver import destinations_add
from tests.delivery_support import RawListener, SteppedDeliveryRig
from tests.process_support import ROOT as ROOT_DIR
from tests.support import env_for, grant, project_in_process

pytestmark = pytest.mark.integration

D = DeliveryState
ACTOR = "agent-7"
TOOL = "send_email"
VICTIM, ATTACKER = "acme", "globex"
SECRET = "whsec_" + base64.b64encode(b"address-guard-0123456789").decode()
#: Where the good receiver listens, and all the worker is allowed besides public addresses.
GOOD_HOST = "127.0.0.2"


def _rig(settings: Settings) -> SteppedDeliveryRig:
    return SteppedDeliveryRig(
        settings, tool=TOOL, actor=ACTOR, secret=SECRET, webhook_timeout_ms=2000
    )


def _final(record: DeliveryRecord | None) -> bool:
    return record is not None and record.state in (D.ACKED, D.DEAD_LETTERED)


@pytest.fixture
def guarded(isolated: Settings) -> Settings:
    """The isolated settings without the tests' loopback allowance: only GOOD_HOST."""
    grant(isolated, VICTIM, actor=ACTOR, tool=TOOL, destinations=("hooks",))
    grant(isolated, ATTACKER, actor=ACTOR, tool=TOOL, destinations=("mine",))
    project_in_process(isolated)
    return isolated.with_(delivery_allow_networks=f"{GOOD_HOST}/32")


@pytest.fixture
def trap() -> Iterator[RawListener]:
    """A listener on 127.0.0.1: where a refused loopback destination would land."""
    listener = RawListener()
    yield listener
    listener.close()


def _refused_urls(trap: RawListener) -> dict[str, tuple[str, str]]:
    """id -> (URL, the words its refusal must hold)."""
    return {
        "metadata": ("http://169.254.169.254:1/latest/meta-data/", "169.254.169.254"),
        "internal": ("http://10.0.0.1:1/events", "10.0.0.1"),
        "mapped-loopback": (f"http://[::ffff:127.0.0.1]:{trap.port}/events", "::ffff:127.0.0.1"),
        "name-to-loopback": (f"http://localhost:{trap.port}/events", "localhost"),
    }


RULES = {
    "metadata": "(link-local)",
    "internal": "(private, RFC 1918)",
    "mapped-loopback": "(loopback, as IPv4-mapped 127.0.0.1)",
    "name-to-loopback": "resolves to 127.0.0.1, which is in a refused network (loopback)",
}


@pytest.mark.parametrize("case", sorted(RULES))
def test_a_refused_address_is_dead_lettered_unconnected_and_the_others_go_on(
    guarded: Settings, trap: RawListener, case: str
) -> None:
    url, shown = _refused_urls(trap)[case]
    good = RawListener(host=GOOD_HOST)
    rig = _rig(guarded)
    try:
        rig.webhook(ATTACKER, "mine", url)
        rig.webhook(VICTIM, "hooks", f"http://{GOOD_HOST}:{good.port}/events")
        # Both SUCCEEDED before the worker's first pass: their sends share one batch.
        evil_op = rig.succeeded(ATTACKER)
        good_op = rig.succeeded(VICTIM)
        deadline = time.monotonic() + 30
        while not (
            _final(rig.delivery(ATTACKER, evil_op, "mine"))
            and _final(rig.delivery(VICTIM, good_op, "hooks"))
        ):
            assert time.monotonic() < deadline, (
                f"not final: {rig.delivery(ATTACKER, evil_op, 'mine')}, "
                f"{rig.delivery(VICTIM, good_op, 'hooks')}"
            )
            rig.step()
        refused = rig.delivery(ATTACKER, evil_op, "mine")
        assert refused is not None and refused.state is D.DEAD_LETTERED, refused
        error = refused.error or ""
        assert shown in error and RULES[case] in error, error
        assert "OPLEDGER_DELIVERY_ALLOW_NETWORKS" in error, error
        assert refused.attempts == 1, "dead-lettered at its first send, not retried"
        assert trap.connections == 0, "a refused destination was connected to"
        assert rig.delivery(VICTIM, good_op, "hooks").state is D.ACKED  # type: ignore[union-attr]
        assert good.requests == 1
        # Counted where every lasting failure of a send is.
        assert rig.sample("mine", "dead_lettered") == 1
        assert rig.sample("hooks", "acked") == 1
    finally:
        rig.close()
        good.close()


def test_a_host_name_refused_then_allowed_is_delivered_after_a_redrive(
    guarded: Settings, trap: RawListener, tmp_path: Any
) -> None:
    """``localhost`` with no allowance: dead-lettered, nothing connected. The operator allows
    loopback and redrives (``opledger deliveries redrive``): it is delivered, once."""
    url = f"http://localhost:{trap.port}/events"
    rig = _rig(guarded)
    try:
        rig.webhook(ATTACKER, "mine", url)
        op = rig.succeeded(ATTACKER)
        deadline = time.monotonic() + 30
        while not _final(rig.delivery(ATTACKER, op, "mine")):
            assert time.monotonic() < deadline
            rig.step()
        assert rig.delivery(ATTACKER, op, "mine").state is D.DEAD_LETTERED  # type: ignore[union-attr]
        assert trap.connections == 0
    finally:
        rig.close()

    allowed = guarded.with_(delivery_allow_networks="127.0.0.0/8,::1/128")
    done = subprocess.run(
        [sys.executable, "-m", "opledger.cli", "deliveries", "redrive", op,
         "--tenant", ATTACKER, "--destination", "mine", "--reason", "loopback allowed"],
        env=env_for(allowed, PYTHONPATH=str(ROOT_DIR)), cwd=ROOT_DIR,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and "1 redriven" in done.stdout, done.stdout + done.stderr
    rig = _rig(allowed)
    try:
        deadline = time.monotonic() + 60
        while rig.delivery(ATTACKER, op, "mine").state is not D.ACKED:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, rig.delivery(ATTACKER, op, "mine")
            rig.step()
        assert trap.requests == 1
        record = rig.delivery(ATTACKER, op, "mine")
        assert record is not None and record.redrives == 1
    finally:
        rig.close()


def _add(settings: Settings, name: str, url: str) -> int:
    args = build_parser().parse_args(
        ["destinations", "add", "--tenant", ATTACKER, "--name", name, "--url", url, "--tool", "*"]
    )
    return destinations_add(args, settings)


def test_registration_refuses_a_literal_address_in_a_refused_network(
    isolated: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = isolated.with_(delivery_allow_networks="")
    for url, words in (
        ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is in a refused network "
         "(link-local)"),
        ("https://10.1.2.3/hooks", "10.1.2.3 is in a refused network (private, RFC 1918)"),
        ("http://[::ffff:127.0.0.1]:15432/", "(loopback, as IPv4-mapped 127.0.0.1)"),
        ("http://[fd00::5]/", "(private, unique local)"),
    ):  # fmt: skip
        assert _add(bare, "refused", url) == 2, url
        err = capsys.readouterr().err
        assert words in err and "OPLEDGER_DELIVERY_ALLOW_NETWORKS" in err, err
    with open_pool(isolated.dsn, name="guard", max_size=1) as pool:
        assert DestinationStore(pool, isolated).list(ATTACKER) == [], "nothing refused was stored"
    # A host name is checked at send time only; a public address and an allowed one pass.
    assert _add(bare, "named", "http://localhost:9/events") == 0
    assert _add(bare, "public", "https://203.0.113.7/hooks") == 0
    assert _add(bare.with_(delivery_allow_networks="10.0.0.0/8"), "inside", "http://10.1.2.3/") == 0
    capsys.readouterr()
    with open_pool(isolated.dsn, name="guard", max_size=1) as pool:
        names = {d.name for d in DestinationStore(pool, isolated).list(ATTACKER)}
    assert names == {"named", "public", "inside"}


def test_the_command_line_exits_2_for_a_refused_address(isolated: Settings) -> None:
    env = env_for(isolated.with_(delivery_allow_networks=""), PYTHONPATH=str(ROOT_DIR))
    done = subprocess.run(
        [sys.executable, "-m", "opledger.cli", "destinations", "add", "--tenant", ATTACKER,
         "--name", "meta", "--url", "http://169.254.169.254/latest/meta-data/", "--tool", "*"],
        env=env, cwd=ROOT_DIR, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "refused network (link-local)" in done.stderr
    assert "Traceback" not in done.stderr
    bad = {**env, "OPLEDGER_DELIVERY_ALLOW_NETWORKS": "10.0.0.1/8"}
    done = subprocess.run(
        [sys.executable, "-m", "opledger.cli", "destinations", "list", "--tenant", ATTACKER],
        env=bad, cwd=ROOT_DIR, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "OPLEDGER_DELIVERY_ALLOW_NETWORKS" in done.stderr, done.stderr
