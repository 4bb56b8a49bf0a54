"""The outside probe's forged grant (issue 19), against the real broker and database: a policy
change written by anyone but the operator is refused and reported, never obeyed, whether it
comes through the policy topic or straight into the projected tables (decision 032)."""

from __future__ import annotations

import stat
import subprocess
from contextlib import closing
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from ledger.codec import default_codec
from ledger.dead_letters import REASON_HEADER, SOURCE_OFFSET_HEADER, SOURCE_TOPIC_HEADER
from ledger.domain.events import PolicyChanged
from ledger.domain.policy import PolicyChange, Purpose
from ledger.domain.states import ExecutionState
from ledger.kafka import connection_config
from ledger.log import end_offsets
from ledger.pg import open_pool
from ledger.policy_keys import OperatorKey, ensure_local_keys
from ledger.policy_store import PolicyStore
from ledger.settings import Settings
from ledger.tools import ProviderTerms
from opledger.fakes.memory import MemoryProvider
from opledger.fakes.model import Mode
from producers import TransitionRecorder
from tests.process_support import run_cli
from tests.support import env_for, grant, policy_change, project_in_process

pytestmark = pytest.mark.integration

TENANT, ACTOR, TOOL = "acme", "agent-7", "wire_money"
TERMS = ProviderTerms(
    call_timeout=timedelta(seconds=2), key_retention=timedelta(hours=1), repeat_safe=False
)


def _write_as_anyone(settings: Settings, *changes: PolicyChanged) -> None:
    """What the probe did: a plain producer, no credentials, the project's own codec."""
    producer = Producer({**connection_config(settings), "acks": "all"})
    for change in changes:
        producer.produce(
            settings.policy_topic, key=change.subject_key(), value=default_codec().encode(change)
        )
    assert producer.flush(30) == 0


def _dead_letter_reasons(settings: Settings) -> dict[int, str]:
    with psycopg.connect(settings.dsn) as conn:
        rows = conn.execute(
            'SELECT "offset", reason FROM dead_letters WHERE topic = %s', (settings.policy_topic,)
        ).fetchall()
    return {offset: reason for offset, reason in rows}


def _dead_letter_topic_sources(settings: Settings) -> dict[int, str]:
    """Policy offsets the dead-letter topic names, with the reason header it carries."""
    consumer = Consumer({**connection_config(settings), "group.id": "forgery"})
    ends = end_offsets(settings, [settings.dead_letter_topic])
    consumer.assign([TopicPartition(t, p, 0) for (t, p) in ends])
    found: dict[int, str] = {}
    seen = 0
    try:
        for _ in range(60):
            for message in consumer.consume(100, 0.5):
                if message.error() is not None:
                    continue
                seen += 1
                headers = {k: (v or b"").decode() for k, v in message.headers() or []}
                if headers.get(SOURCE_TOPIC_HEADER) == settings.policy_topic:
                    offset = int(headers[SOURCE_OFFSET_HEADER])
                    found[offset] = headers.get(REASON_HEADER, "")
            if seen >= sum(ends.values()):
                break
    finally:
        consumer.close()
    return found


def test_the_probes_forged_wire_money_grant_is_dead_lettered_and_never_obeyed(
    isolated: Settings,
) -> None:
    provider = MemoryProvider(TOOL, TERMS, mode=Mode.NON_IDEMPOTENT)
    operator = ensure_local_keys(isolated)
    stranger = OperatorKey.generate()
    everything = {"principal": "*", "tool_name": "*", "repeat_safe": True}
    unsigned = policy_change(actor_id="cli:security-officer", **everything)
    # Signed, by a key nobody trusts, and by that key while claiming the operator's key id.
    by_a_stranger = stranger.sign(policy_change(actor_id="cli:security-officer", **everything))
    posing = by_a_stranger.model_copy(update={"signed_by": operator.id})
    # The operator's own signature over a narrow grant, widened after signing.
    widened = operator.sign(policy_change(tool_name="send_email")).model_copy(
        update={"tool_name": "*", "principal": "*", "repeat_safe": True}
    )
    with TransitionRecorder.connect(isolated, providers=[provider]) as recorder:
        before = recorder.execute(TENANT, ACTOR, TOOL, {"amount": 1})
        assert before.refused, before

        _write_as_anyone(isolated, unsigned, by_a_stranger, posing, widened)
        project_in_process(isolated)
        reasons = _dead_letter_reasons(isolated)
        assert sorted(reasons) == [0, 1, 2, 3]
        assert all(r.startswith("policy change refused: ") for r in reasons.values()), reasons
        assert "not signed" in reasons[0]
        assert f"signed by {stranger.id}, not a trusted operator key" in reasons[1]
        assert "does not verify" in reasons[2] and "does not verify" in reasons[3]
        # Reported where operators look: the dead-letter topic, with the reason.
        on_topic = _dead_letter_topic_sources(isolated)
        assert sorted(on_topic) == [0, 1, 2, 3]
        assert all("policy change refused" in r for r in on_topic.values()), on_topic
        with psycopg.connect(isolated.dsn) as conn:
            assert conn.execute("SELECT count(*) FROM policy_grants").fetchone() == (0,)

        forged = recorder.execute(TENANT, ACTOR, TOOL, {"amount": 2})
        assert forged.refused and forged.state is ExecutionState.FAILED, forged
        assert provider.state.tool_stats(TOOL).calls == 0  # what the provider saw

        # The same grant from the operator is obeyed: the refusals above were about the writer.
        grant(isolated, TENANT, actor=ACTOR, tool=TOOL)
        project_in_process(isolated)
        allowed = recorder.execute(TENANT, ACTOR, TOOL, {"amount": 3})
        assert allowed.state is ExecutionState.SUCCEEDED, allowed
    assert provider.state.tool_stats(TOOL).calls == 1


def test_a_grant_row_altered_in_the_database_allows_nothing(isolated: Settings) -> None:
    """A writer with the database but not the key: a signed revocation turned back into a grant,
    and a grant row inserted by hand, are refused by the SDK's own check of each row."""
    grant(isolated, TENANT, actor=ACTOR, tool="send_email")
    grant(isolated, TENANT, actor=ACTOR, tool=TOOL)
    grant(isolated, TENANT, actor=ACTOR, tool=TOOL, revoke=True)
    project_in_process(isolated)
    pool = open_pool(isolated.dsn, name="forgery-test", max_size=2)
    with closing(pool):
        store = PolicyStore(pool, isolated)

        def ask(tool: str) -> str | None:
            from datetime import UTC, datetime  # noqa: PLC0415

            from ledger.domain.policy import PolicyRequest  # noqa: PLC0415

            decision = store.evaluate(
                PolicyRequest(
                    tenant_id=TENANT,
                    actor_id=ACTOR,
                    tool_name=tool,
                    purpose=Purpose.DISPATCH,
                    now=datetime.now(UTC),
                )
            )
            return None if decision.allowed else decision.reason

        assert ask("send_email") is None
        assert ask(TOOL) is not None  # revoked
        with psycopg.connect(isolated.dsn, autocommit=True) as conn:
            updated = conn.execute(
                "UPDATE policy_grants SET revoked = false WHERE tool_name = %s", (TOOL,)
            ).rowcount
            assert updated == 1
        refusal = ask(TOOL)
        assert refusal is not None and "not the operator's" in refusal, refusal
        assert "does not verify" in refusal

        # A row copied from a signed grant, with another tool: its signature covers the old one.
        with psycopg.connect(isolated.dsn, autocommit=True) as conn:
            columns = [
                r[0]
                for r in conn.execute(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_schema = current_schema() AND table_name = 'policy_grants' "
                    "AND column_name <> 'tool_name' ORDER BY ordinal_position"
                ).fetchall()
            ]
            listed = ", ".join(f'"{c}"' for c in columns)
            conn.execute(
                f"INSERT INTO policy_grants (tool_name, {listed}) "
                f"SELECT 'delete_account', {listed} FROM policy_grants "
                "WHERE tool_name = 'send_email'"
            )
        copied = ask("delete_account")
        assert copied is not None and "not the operator's" in copied, copied
        # Refusing closed: the untouched grant beside a bad row still stands on its own.
        assert ask("send_email") is None


def test_a_revocation_by_a_stranger_does_not_revoke_either(isolated: Settings) -> None:
    """The signature guards both ways: an unsigned REVOKE must not be obeyed as a revocation,
    or anyone could stop a tenant's work (it is dead-lettered and the grant stands)."""
    grant(isolated, TENANT, actor=ACTOR, tool=TOOL)
    _write_as_anyone(isolated, policy_change(PolicyChange.REVOKE, principal=ACTOR, tool_name=TOOL))
    project_in_process(isolated)
    assert list(_dead_letter_reasons(isolated)) == [1]
    with psycopg.connect(isolated.dsn) as conn:
        assert conn.execute(
            "SELECT revoked FROM policy_grants WHERE tool_name = %s", (TOOL,)
        ).fetchall() == [(False,)]


def _cli(settings: Settings, *argv: str) -> subprocess.CompletedProcess[str]:
    return run_cli(env_for(settings), "policy", *argv)


def test_key_rotation_with_the_cli_and_show_says_who_signed(
    isolated: Settings, tmp_path: Path
) -> None:
    """An operator's rotation as README tells it: create a key, sign with it before every
    reader trusts it (refused), trust it (obeyed), and `policy show` names the key of each row."""
    old = ensure_local_keys(isolated)
    new_path = tmp_path / "operator-2.key"
    created = _cli(isolated, "key", "create", "--out", str(new_path))
    assert created.returncode == 0, created.stderr
    assert stat.S_IMODE(new_path.stat().st_mode) == 0o600
    new = OperatorKey.load(new_path)
    assert new.public_line in created.stdout.splitlines()
    again = _cli(isolated, "key", "create", "--out", str(new_path))
    assert again.returncode == 2 and "never overwritten" in again.stderr
    assert OperatorKey.load(new_path).id == new.id

    trusted = tmp_path / "trusted.pub"
    trusted.write_text(f"# the stack's key\n{old.public_line}\n")
    rotated = isolated.with_(
        policy_signing_key_file=str(new_path), policy_trusted_keys_file=str(trusted)
    )
    listed = _cli(rotated, "key", "trusted")
    assert listed.returncode == 0, listed.stderr
    assert old.id in listed.stdout and f"signing key ({new_path}): {new.id}" in listed.stdout

    early = _cli(rotated, "grant", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL,
                 "--no-wait")  # fmt: skip
    assert early.returncode == 0, early.stderr
    assert f"signed by {new.id}" in early.stdout
    project_in_process(rotated)
    assert "not a trusted operator key" in _dead_letter_reasons(rotated)[0]

    trusted.write_text(f"{old.public_line}\n{new.public_line}\n")
    assert _cli(rotated, "grant", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL,
                "--no-wait").returncode == 0  # fmt: skip
    grant(isolated, TENANT, actor=ACTOR, tool="send_email")  # by the old key, still trusted
    project_in_process(rotated)
    shown = _cli(rotated, "show", "--tenant", TENANT)
    assert shown.returncode == 0, shown.stderr
    lines = {line.split("│")[2].strip(): line for line in shown.stdout.splitlines() if "│" in line}
    assert new.id[:20] in lines[TOOL] and "active" in lines[TOOL]
    assert old.id[:20] in lines["send_email"] and "active" in lines["send_email"]

    # The old key removed from the trusted file: what it signed stops counting, and says so.
    trusted.write_text(f"{new.public_line}\n")
    shown = _cli(rotated, "show", "--tenant", TENANT)
    lines = {line.split("│")[2].strip(): line for line in shown.stdout.splitlines() if "│" in line}
    assert "not the operator's: refused" in lines["send_email"]
    assert "active" in lines[TOOL]


@pytest.mark.parametrize("one_batch", [False, True], ids=["batches", "one-batch"])
def test_a_replayed_signed_grant_does_not_undo_the_revocation_after_it(
    isolated: Settings, one_batch: bool
) -> None:
    """A signature says who wrote a change, not when: the operator's own grant, written again
    by anyone after its revocation, must not bring the grant back. The projector keeps it in the
    history with the reason, counts it, and the revocation still decides."""
    operator = ensure_local_keys(isolated)
    granted = operator.sign(policy_change(principal=ACTOR, tool_name=TOOL))
    revoked = operator.sign(policy_change(PolicyChange.REVOKE, principal=ACTOR, tool_name=TOOL))
    _write_as_anyone(isolated, granted)
    if not one_batch:
        project_in_process(isolated)
    _write_as_anyone(isolated, revoked)
    if not one_batch:
        project_in_process(isolated)
    _write_as_anyone(isolated, granted)  # the same signed bytes, replayed
    projector = project_in_process(isolated)
    with psycopg.connect(isolated.dsn) as conn:
        rows = conn.execute(
            "SELECT version, revoked FROM policy_grants WHERE tool_name = %s", (TOOL,)
        ).fetchall()
        history = conn.execute(
            'SELECT "offset", event_id, refused_reason FROM policy_history ORDER BY 1'
        ).fetchall()
    assert rows == [(revoked.event_id, True)]
    assert [(o, e) for o, e, _ in history] == [
        (0, granted.event_id),
        (1, revoked.event_id),
        (2, granted.event_id),
    ]
    assert history[0][2] is None and history[1][2] is None
    assert history[2][2] is not None and "was folded already from" in history[2][2]
    assert f"{isolated.policy_topic}[0]@0" in history[2][2]
    assert _dead_letter_reasons(isolated) == {}  # signed and well-formed: history, not DLQ
    # What an operator's dashboard would see.
    counted = projector._metrics.anomalies.labels("policy", "replayed_policy_change")._value.get()
    assert counted == 1.0
