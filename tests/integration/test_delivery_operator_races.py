"""What operators (and time) do to deliveries in flight (a review of 2026-12-02, decision 021):
a destination disabled and enabled again, its secret rotated, its target changed, a grant
revoked, and redrives racing each other and the worker. Each test drives the real worker
in-process against the isolated stack with a projector stepped alongside it, and counts what
the receiver saw (requests per Idempotency-Key); each was checked to fail without its fix."""

from __future__ import annotations

import argparse
import base64
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from ledger.domain.states import DeliveryState
from ledger.log import KafkaTransport
from ledger.settings import Settings
from opledger import deliver
from tests.delivery_support import (
    Answer,
    RawListener,
    ScriptedReceiver,
    SteppedDeliveryRig,
    keys_seen,
    step_for,
    step_until,
)
from tests.support import env_for, grant, project_in_process

pytestmark = pytest.mark.integration

D = DeliveryState
TENANT, OTHER = "acme", "globex"
ACTOR = "agent-7"
TOOL = "send_email"
SECRET = "whsec_" + base64.b64encode(b"operator-races-012345678").decode()
SENT_HOOK = "deliver.after_sent_before_send"

Rig = SteppedDeliveryRig


@pytest.fixture
def rig(isolated: Settings) -> Iterator[Rig]:
    grant(isolated, TENANT, actor=ACTOR, tool=TOOL, destinations=("hooks",))
    project_in_process(isolated)
    made = Rig(isolated, tool=TOOL, actor=ACTOR, secret=SECRET)
    yield made
    made.close()


@pytest.fixture
def receiver() -> Iterator[ScriptedReceiver]:
    server = ScriptedReceiver(SECRET)
    yield server
    server.close()


def _state(rig: Rig, op_id: str) -> DeliveryState | None:
    return rig.state(TENANT, op_id, "hooks")


def _error(rig: Rig, op_id: str) -> str:
    record = rig.delivery(TENANT, op_id, "hooks")
    return "" if record is None else record.error or ""


def _arrived(receiver: ScriptedReceiver, count: int, timeout: float = 10.0) -> None:
    """Wait until the receiver has taken ``count`` requests (it counts before it answers)."""
    deadline = time.monotonic() + timeout
    while len(receiver.received) < count:
        assert time.monotonic() < deadline, "the send never arrived"
        time.sleep(0.01)


def _sending(rig: Rig, receiver: ScriptedReceiver) -> str:
    """A delivery to ``receiver`` (registered as "hooks") whose send has arrived there and is
    still waiting for its answer: its operation id."""
    rig.webhook(TENANT, "hooks", receiver.url)
    op_id = rig.succeeded(TENANT)
    step_until(rig, lambda: len(receiver.received) == 1 or _state(rig, op_id) is D.SENT)
    _arrived(receiver, 1)
    return op_id


def _at_hook(monkeypatch: pytest.MonkeyPatch, action: Callable[[], object]) -> None:
    """Run ``action`` once, at the moment the worker's SENTs are acknowledged and before its
    sends leave: an operator's change committed exactly then."""
    done: list[bool] = []

    def hook(name: str) -> None:
        if name == SENT_HOOK and not done:
            done.append(True)
            action()

    monkeypatch.setattr("processors.delivery.sending.fault_point", hook)


def _applied_errors(settings: Settings, op_id: str) -> list[str]:
    project_in_process(settings)
    with psycopg.connect(settings.dsn) as conn:
        rows = conn.execute(
            "SELECT error FROM operation_history WHERE operation_id = %s AND destination = "
            "'hooks' AND outcome = 'applied' ORDER BY partition, \"offset\"",
            (op_id,),
        ).fetchall()
    return [r[0] or "" for r in rows]


# -- 1. disabled, then enabled again --------------------------------------------------------------


def test_a_destination_disabled_while_deliveries_wait_holds_them_and_resumes_once_enabled(
    rig: Rig,
) -> None:
    receiver = ScriptedReceiver(SECRET, [Answer(503)])
    try:
        rig.webhook(TENANT, "hooks", receiver.url)
        waiting = rig.succeeded(TENANT)
        step_until(rig, lambda: len(receiver.received) == 1 and _state(rig, waiting) is D.PENDING)
        assert rig.destinations.set_enabled(
            TENANT, "hooks", enabled=False, changed_by="ops:ann", reason="receiver upgrade"
        )
        opened = rig.succeeded(TENANT)  # its PENDING is opened while the destination is held
        step_until(rig, lambda: _state(rig, opened) is D.PENDING)
        # Past the retry (300 ms) and the grace after which the projection offers a PENDING (2 s).
        step_for(rig, 2.5)
        assert len(receiver.received) == 1, "sent while disabled"
        assert _state(rig, waiting) is D.PENDING and _state(rig, opened) is D.PENDING
        # Not read again at every pass either: held ones would fill its batch and starve others.
        assert rig.worker.sender.due(datetime.now(UTC), 10) == []
        assert rig.destinations.set_enabled(
            TENANT, "hooks", enabled=True, changed_by="ops:ann", reason=None
        )
        step_until(rig, lambda: _state(rig, waiting) is D.ACKED and _state(rig, opened) is D.ACKED)
        step_for(rig, 0.5)
        assert keys_seen(receiver.received) == {waiting: 2, opened: 1}
    finally:
        receiver.close()


def test_a_send_in_flight_when_its_destination_is_disabled_is_recorded_and_its_retry_held(
    rig: Rig,
) -> None:
    receiver = ScriptedReceiver(SECRET, [Answer(503, delay=0.5)])
    try:
        op_id = _sending(rig, receiver)
        rig.destinations.set_enabled(
            TENANT, "hooks", enabled=False, changed_by="ops:ann", reason="maintenance"
        )
        # The answer in flight is recorded (a retry), and the retry waits.
        step_until(rig, lambda: _state(rig, op_id) in (D.PENDING, D.DEAD_LETTERED))
        assert _state(rig, op_id) is D.PENDING
        assert "503" in _error(rig, op_id)
        step_for(rig, 1.0)
        assert len(receiver.received) == 1 and _state(rig, op_id) is D.PENDING
        rig.destinations.set_enabled(TENANT, "hooks", enabled=True, changed_by="ops:ann", reason="")
        step_until(rig, lambda: _state(rig, op_id) is D.ACKED)
        assert keys_seen(receiver.received) == {op_id: 2}
    finally:
        receiver.close()


def test_a_disable_committed_as_the_sent_is_appended_stops_the_send(
    rig: Rig, receiver: ScriptedReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig.webhook(TENANT, "hooks", receiver.url)
    _at_hook(
        monkeypatch,
        lambda: rig.destinations.set_enabled(
            TENANT, "hooks", enabled=False, changed_by="ops:ann", reason="stop"
        ),
    )
    op_id = rig.succeeded(TENANT)
    step_until(rig, lambda: bool(receiver.received) or "disabled" in _error(rig, op_id))
    step_for(rig, 1.0)
    assert receiver.received == [], "sent after the disable was committed"
    assert _state(rig, op_id) is D.PENDING
    assert "disabled before the send left" in _applied_errors(rig.settings, op_id)[-1]
    rig.destinations.set_enabled(TENANT, "hooks", enabled=True, changed_by="ops:ann", reason=None)
    step_until(rig, lambda: _state(rig, op_id) is D.ACKED)
    assert keys_seen(receiver.received) == {op_id: 1}


def test_a_410_still_dead_letters_what_follows_but_a_replacement_keeps_a_disable(
    rig: Rig, receiver: ScriptedReceiver
) -> None:
    rig.webhook(TENANT, "hooks", receiver.url)
    rig.destinations.set_enabled(TENANT, "hooks", enabled=False, changed_by="ops:ann", reason="x")
    # Another operator changes its URL (or timeout) meanwhile: still held, nothing sent.
    rig.webhook(TENANT, "hooks", receiver.url + "?v=2")
    (listed,) = rig.destinations.list(TENANT)
    assert not listed.enabled and not listed.gone
    op_id = rig.succeeded(TENANT)
    # Opened first (a slow group join under load took longer than the passes below, once),
    # then passes that had every chance to send or dead-letter it.
    step_until(rig, lambda: _state(rig, op_id) is D.PENDING)
    step_for(rig, 2.5)
    assert receiver.received == [] and _state(rig, op_id) is D.PENDING
    # The worker's own disable after a 410 Gone: what follows is dead-lettered, as before.
    rig.destinations.set_enabled(
        TENANT, "hooks", enabled=False, changed_by="delivery-worker", reason="410 Gone", gone=True
    )
    step_until(rig, lambda: _state(rig, op_id) is D.DEAD_LETTERED)
    assert receiver.received == []


# -- 2. secret rotation ---------------------------------------------------------------------------


def _verifies(secret: str, request: Any) -> bool:
    try:
        Webhook(secret).verify(request.body, request.headers)
    except WebhookVerificationError:
        return False
    return True


def test_a_resend_after_a_rotation_is_signed_with_both_secrets_during_the_overlap(
    rig: Rig, isolated: Settings
) -> None:
    receiver = ScriptedReceiver(SECRET, [Answer(503)])
    try:
        rig.webhook(TENANT, "hooks", receiver.url)
        op_id = rig.succeeded(TENANT)
        step_until(rig, lambda: len(receiver.received) == 1 and _state(rig, op_id) is D.PENDING)
        rotated = rig.destinations.rotate_secret(
            TENANT, "hooks", changed_by="ops:ann", overlap=timedelta(hours=1)
        )
        assert rotated is not None and rotated.secret not in (None, SECRET)
        assert rotated.secret not in repr(rotated) and SECRET not in repr(rotated)
        step_until(rig, lambda: _state(rig, op_id) is D.ACKED)
        resend = receiver.received[1]
        assert _verifies(SECRET, resend) and _verifies(str(rotated.secret), resend)
        assert len(resend.headers["webhook-signature"].split(" ")) == 2

        # Rotated again with no overlap: only the newest signs from now on.
        done = subprocess.run(
            [
                sys.executable, "-m", "opledger.cli", "destinations", "rotate-secret",
                "--tenant", TENANT, "--name", "hooks", "--overlap-hours", "0", "--by", "ops:bob",
            ],
            env=env_for(isolated), capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        newest = done.stdout.rsplit("signing secret (configure the receiver with it): ", 1)[1]
        newest = newest.strip()
        later = rig.succeeded(TENANT)
        step_until(rig, lambda: _state(rig, later) is D.ACKED)
        last = receiver.received[-1]
        assert _verifies(newest, last)
        assert not _verifies(SECRET, last) and not _verifies(str(rotated.secret), last)
        assert all(s not in done.stderr for s in (SECRET, str(rotated.secret)))
    finally:
        receiver.close()


# -- 3. the target changed ------------------------------------------------------------------------


def test_a_waiting_delivery_goes_to_the_target_as_it_is_at_the_send_and_the_guard_checks_it(
    rig: Rig,
) -> None:
    first = ScriptedReceiver(SECRET, [Answer(503), Answer(503)])
    moved = RawListener()
    try:
        rig.webhook(TENANT, "hooks", first.url)
        op_id = rig.succeeded(TENANT)
        step_until(rig, lambda: len(first.received) == 1 and _state(rig, op_id) is D.PENDING)
        rig.webhook(TENANT, "hooks", moved.url)
        step_until(rig, lambda: _state(rig, op_id) is D.ACKED)
        assert len(first.received) == 1 and moved.requests == 1

        # Moved to an address the guard refuses: refused at the send, never connected to.
        rig.webhook(TENANT, "hooks", first.url)
        second = rig.succeeded(TENANT)
        step_until(rig, lambda: len(first.received) == 2 and _state(rig, second) is D.PENDING)
        rig.webhook(TENANT, "hooks", "http://169.254.169.254/events")
        step_until(rig, lambda: _state(rig, second) is D.DEAD_LETTERED)
        assert "link-local" in _error(rig, second)
        assert len(first.received) == 2 and moved.requests == 1
    finally:
        first.close()
        moved.close()


# -- 4. redrives racing ---------------------------------------------------------------------------


def _redrive(settings: Settings, *argv: str) -> int:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers()
    deliver.register(commands)
    args = parser.parse_args(["deliveries", "redrive", *argv])
    return deliver.redrive(args, settings)


def test_two_redrives_of_one_dead_letter_at_once_write_one_event_and_send_once_more(
    rig: Rig, isolated: Settings
) -> None:
    receiver = ScriptedReceiver(SECRET, [Answer(413)])
    try:
        rig.webhook(TENANT, "hooks", receiver.url)
        op_id = rig.succeeded(TENANT)
        step_until(rig, lambda: _state(rig, op_id) is D.DEAD_LETTERED)
        project_in_process(isolated)
        racing = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "opledger.cli",
                    "deliveries",
                    "redrive",
                    op_id,
                    "--destination",
                    "hooks",
                    "--tenant",
                    TENANT,
                    "--reason",
                    "limit raised",
                    "--by",
                    f"ops:{who}",
                ],
                env=env_for(isolated),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for who in ("ann", "bob")
        ]
        outcomes = [(p.wait(120), p.communicate()[0]) for p in racing]
        assert any(code == 0 for code, _out in outcomes), outcomes
        for code, out in outcomes:  # the later one either wrote the same event or was told
            assert code == 0 or "not dead-lettered" in out, out
        step_until(rig, lambda: _state(rig, op_id) is D.ACKED)
        step_for(rig, 1.0)
        assert keys_seen(receiver.received) == {op_id: 2}
        redriven = [e for e in _applied_errors(isolated, op_id) if e.startswith("redriven by")]
        assert len(redriven) == 1 and "limit raised" in redriven[0]
    finally:
        receiver.close()


def test_a_redrive_refuses_what_is_not_a_dead_letter_of_the_tenant_and_says_why(
    rig: Rig, isolated: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    receiver = ScriptedReceiver(SECRET, [Answer(202, delay=1.0)])
    try:
        op_id = _sending(rig, receiver)
        why = ["--reason", "retry", "--by", "ops:ann"]
        # While the worker is sending it.
        assert _redrive(isolated, op_id, "--destination", "hooks", "--tenant", TENANT, *why) == 1
        assert "SENT, not dead-lettered" in capsys.readouterr().out
        step_until(rig, lambda: _state(rig, op_id) is D.ACKED)
        # Delivered already.
        assert _redrive(isolated, op_id, "--destination", "hooks", "--tenant", TENANT, *why) == 1
        assert "ACKED, not dead-lettered" in capsys.readouterr().out
        # Named under another tenant.
        assert _redrive(isolated, op_id, "--destination", "hooks", "--tenant", OTHER, *why) == 1
        assert f"no such delivery for tenant {OTHER}" in capsys.readouterr().out
        step_for(rig, 0.5)
        assert keys_seen(receiver.received) == {op_id: 1}
        assert not any(e.startswith("redriven") for e in _applied_errors(isolated, op_id))
    finally:
        receiver.close()


# -- 5. redrive --since over many -----------------------------------------------------------------


def test_redrive_since_goes_in_batches_with_progress_and_refuses_a_future_time(
    rig: Rig,
    isolated: Settings,
    receiver: ScriptedReceiver,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig.webhook(TENANT, "nogrant", receiver.url)  # no grant: dead-lettered without a send
    since = datetime.now(UTC)
    ops = [rig.succeeded(TENANT) for _ in range(25)]
    step_until(rig, lambda: all(rig.state(TENANT, op, "nogrant") is D.DEAD_LETTERED for op in ops))
    project_in_process(isolated)
    monkeypatch.setattr(deliver, "REDRIVE_BATCH", 10)
    appends: list[int] = []
    send = KafkaTransport.send

    def counted(self: KafkaTransport, records: Any) -> Any:
        appends.append(len(records))
        return send(self, records)

    monkeypatch.setattr(KafkaTransport, "send", counted)
    why = ["--tenant", TENANT, "--reason", "policy fixed", "--by", "ops:ann"]
    assert _redrive(isolated, "--since", since.isoformat(), *why) == 0
    out, err = capsys.readouterr()
    assert "25 dead letters of tenant acme" in err
    assert [line.split(" ")[0] for line in err.splitlines()[1:]] == ["10/25", "20/25", "25/25"]
    assert appends == [10, 10, 5], "one append per batch, not per dead letter"
    assert out.strip().endswith("25 redriven, 0 skipped")
    snapshots = rig.history.load([(op, TENANT) for op in ops])
    assert all(snapshots[op].deliveries["nogrant"].redrives == 1 for op in ops)

    later = datetime.now(UTC) + timedelta(hours=1)
    assert _redrive(isolated, "--since", later.isoformat(), *why) == 2
    assert "in the future" in capsys.readouterr().err
    assert receiver.received == []


# -- 6. a revocation racing a send ----------------------------------------------------------------


def test_a_revocation_while_a_send_is_in_flight_dead_letters_the_next_attempt(
    rig: Rig, isolated: Settings
) -> None:
    receiver = ScriptedReceiver(SECRET, [Answer(503, delay=0.5)])
    try:
        op_id = _sending(rig, receiver)
        grant(isolated, TENANT, actor=ACTOR, tool=TOOL, revoke=True)
        project_in_process(isolated)
        step_until(rig, lambda: _state(rig, op_id) is D.DEAD_LETTERED)
        step_for(rig, 1.0)
        assert "refused by policy" in _error(rig, op_id)
        assert keys_seen(receiver.received) == {op_id: 1}
    finally:
        receiver.close()


def test_a_revocation_folded_as_the_sent_is_appended_stops_the_send(
    rig: Rig, isolated: Settings, receiver: ScriptedReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig.webhook(TENANT, "hooks", receiver.url)

    def revoke() -> None:
        grant(isolated, TENANT, actor=ACTOR, tool=TOOL, revoke=True)
        project_in_process(isolated)

    _at_hook(monkeypatch, revoke)
    op_id = rig.succeeded(TENANT)
    step_until(rig, lambda: _state(rig, op_id) in (D.DEAD_LETTERED, D.ACKED))
    step_for(rig, 1.0)
    assert "refused by policy" in _error(rig, op_id)
    assert receiver.received == [], "sent after the revocation was folded"
