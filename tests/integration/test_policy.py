"""Policy against the real broker and database: changes written to the compacted policy topic,
folded by the projector into the tables the workers read, evaluated by PolicyStore, and the
``opledger policy`` command as users run it (a real subprocess, with and without a projector)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from ledger.codec import default_codec
from ledger.domain.events import PolicyChanged
from ledger.domain.policy import PolicyChange, PolicyRequest, Purpose, grant_key
from ledger.kafka import connection_config
from ledger.log import end_offsets
from ledger.pg import open_pool
from ledger.policy_store import NO_PROJECTION, PolicyStore, read_matching
from ledger.settings import Settings
from opledger.workload import Workload
from tests.process_support import run_cli
from tests.support import (
    assert_projection_matches,
    env_for,
    free_port,
    independent_fold,
    policy_change,
    produce,
    project_in_process,
    signed,
)

TENANT = "acme"
OTHER = "globex"
ACTOR = "agent-7"
TOOL = "send_email"


def _write(settings: Settings, *changes: PolicyChanged, key: bytes | None = None) -> None:
    """``changes`` signed by the stack's operator key, as `opledger policy` writes them."""
    producer = Producer({**connection_config(settings), "acks": "all"})
    for unsigned in changes:
        change = signed(settings, unsigned)
        producer.produce(
            settings.policy_topic,
            key=change.subject_key() if key is None else key,
            value=default_codec().encode(change),
        )
    assert producer.flush(30) == 0


def _write_raw(settings: Settings, topic: str, key: bytes | None, value: bytes | None) -> None:
    producer = Producer({**connection_config(settings)})
    producer.produce(topic, key=key, value=value)
    assert producer.flush(30) == 0


def _ask(
    store: PolicyStore,
    purpose: Purpose = Purpose.DISPATCH,
    tenant: str = TENANT,
    actor: str = ACTOR,
    **fields: Any,
) -> Any:
    return store.evaluate(
        PolicyRequest(
            tenant_id=tenant,
            actor_id=actor,
            tool_name=TOOL,
            purpose=purpose,
            now=datetime.now(UTC),
            **fields,
        )
    )


def _rows(settings: Settings, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(settings.dsn) as conn:
        return [tuple(r) for r in conn.execute(sql).fetchall()]


def test_grant_then_revoke_each_decision_cites_its_version(
    isolated: Settings, store: PolicyStore
) -> None:
    project_in_process(isolated)  # creates the tables; nothing granted yet
    refused = _ask(store)
    assert not refused.allowed and refused.version is None  # default deny, not an error

    grant = policy_change(destinations=["webhook:crm"], repeat_safe=True)
    _write(isolated, grant)
    project_in_process(isolated)
    allowed = _ask(store)
    assert allowed.allowed and allowed.version == grant.event_id
    assert _ask(store, Purpose.NEW_ATTEMPT).allowed
    assert _ask(store, Purpose.DELIVER, destination="webhook:crm").allowed
    assert not _ask(store, Purpose.DELIVER, destination="webhook:other").allowed

    revoke = policy_change(PolicyChange.REVOKE, reason="left the team")
    _write(isolated, revoke)
    project_in_process(isolated)
    decision = _ask(store)
    assert not decision.allowed and decision.version == revoke.event_id
    assert "revoked" in decision.reason
    assert not _ask(store, Purpose.NEW_ATTEMPT).allowed

    # A broader grant does not override the revocation, but serves other actors.
    everyone = policy_change(principal="*")
    _write(isolated, everyone)
    project_in_process(isolated)
    assert _ask(store).version == revoke.event_id and not _ask(store).allowed
    other_actor = _ask(store, actor="agent-8")
    assert other_actor.allowed and other_actor.version == everyone.event_id

    history = _rows(
        isolated,
        'SELECT topic, partition, "offset", event_id, change FROM policy_history ORDER BY "offset"',
    )
    assert history == [
        (isolated.policy_topic, 0, 0, grant.event_id, "GRANT"),
        (isolated.policy_topic, 0, 1, revoke.event_id, "REVOKE"),
        (isolated.policy_topic, 0, 2, everyone.event_id, "GRANT"),
    ]
    grants = _rows(
        isolated,
        "SELECT principal, revoked, version, destinations, repeat_safe, reason "
        "FROM policy_grants ORDER BY principal",
    )
    # The revocation replaced the grant whole: it carries nothing of it (compaction-safe).
    assert grants == [
        ("*", False, everyone.event_id, [], False, None),
        (ACTOR, True, revoke.event_id, [], False, "left the team"),
    ]
    offsets = _rows(
        isolated,
        "SELECT next_offset FROM projector_offsets "
        f"WHERE topic = '{isolated.policy_topic}' AND partition = 0",
    )
    assert offsets == [(3,)], "the position is stored with the rows"


def test_a_credential_revocation_refuses_every_grant_naming_it(
    isolated: Settings, store: PolicyStore
) -> None:
    expires = datetime.now(UTC) + timedelta(days=1)
    grant = policy_change(
        credential_id="vault:mail", credential_scopes=["mail.send"], credential_expires_at=expires
    )
    theirs = policy_change(
        tenant_id=OTHER, credential_id="vault:mail", credential_scopes=["mail.send"]
    )
    _write(isolated, grant, theirs)
    project_in_process(isolated)
    assert _ask(store, required_scope="mail.send").allowed
    missing_scope = _ask(store, required_scope="mail.admin")
    assert not missing_scope.allowed and "mail.admin" in missing_scope.reason

    revocation = policy_change(
        PolicyChange.REVOKE_CREDENTIAL, principal="*", tool_name="*", credential_id="vault:mail"
    )
    _write(isolated, revocation)
    project_in_process(isolated)
    decision = _ask(store, required_scope="mail.send")
    assert not decision.allowed and decision.version == revocation.event_id
    assert "vault:mail" in decision.reason
    # The other tenant's credential of the same name is theirs, and not revoked.
    assert _ask(store, tenant=OTHER, required_scope="mail.send").allowed
    assert _rows(isolated, "SELECT tenant_id, credential_id, version FROM revoked_credentials") == [
        (TENANT, "vault:mail", revocation.event_id)
    ]


def test_a_grant_for_one_tenant_never_lets_another_in(
    isolated: Settings, store: PolicyStore
) -> None:
    everything = policy_change(
        principal="*", tool_name="*", repeat_safe=True, destinations=["webhook:crm"]
    )
    _write(isolated, everything)
    project_in_process(isolated)
    assert _ask(store).allowed
    for purpose in Purpose:
        decision = _ask(store, purpose, tenant=OTHER, destination="webhook:crm")
        assert not decision.allowed and decision.version is None
    theirs, ours = store.current(OTHER), store.current(TENANT)
    assert theirs is not None and theirs.grants == [] and theirs.revoked_credentials == []
    assert ours is not None and [r.grant.version for r in ours.grants] == [everything.event_id]


def test_undecodable_policy_records_are_dead_lettered_and_the_projector_goes_on(
    isolated: Settings, store: PolicyStore
) -> None:
    codec = default_codec()
    stray = next(iter(Workload(seed=3).operations(1)))[0]
    before = policy_change(tool_name="before")
    _write(isolated, before)
    _write_raw(isolated, isolated.policy_topic, grant_key(TENANT, ACTOR, TOOL), b"not avro")
    _write_raw(isolated, isolated.policy_topic, grant_key(TENANT, ACTOR, TOOL), None)
    _write(isolated, policy_change(), key=grant_key(TENANT, "*", TOOL))  # keyed by another subject
    _write_raw(
        isolated, isolated.policy_topic, stray.operation_id.encode(), codec.encode(stray)
    )  # an operation event on the policy topic
    misplaced = policy_change(tool_name="misplaced")
    _write_raw(  # a policy change on the execution topic
        isolated, isolated.execution_topic, misplaced.subject_key(), codec.encode(misplaced)
    )
    after = policy_change(tool_name="after")
    _write(isolated, after)
    operations = [e for op in Workload(seed=4).operations(30) for e in op]
    produce(isolated, operations)
    project_in_process(isolated)

    dead = _rows(isolated, 'SELECT topic, "offset", reason FROM dead_letters ORDER BY 1, 2')
    policy_dead = [(o, r) for t, o, r in dead if t == isolated.policy_topic]
    assert [o for o, _ in policy_dead] == [1, 2, 3, 4]
    reasons = [r for _, r in policy_dead]
    assert "C3 01" in reasons[0]
    assert reasons[1] == "empty record value"
    assert "subject" in reasons[2]
    assert reasons[3] == "execution event on the policy topic"
    assert [r for t, _, r in dead if t == isolated.execution_topic] == [
        "policy event on the execution topic"
    ]
    # Both good changes around the poison are in effect, and the operations were projected.
    assert {r[0] for r in _rows(isolated, "SELECT version FROM policy_grants")} == {
        before.event_id,
        after.event_id,
    }
    expected = independent_fold(isolated)  # of the operation topics only
    expected.dead |= {(isolated.policy_topic, 0, offset) for offset in (1, 2, 3, 4)}
    assert_projection_matches(isolated, expected)
    # Each dead letter went to the dead-letter topic with its source coordinates.
    sources = set()
    consumer = Consumer({**connection_config(isolated), "group.id": "dlq"})
    ends = end_offsets(isolated, [isolated.dead_letter_topic])
    consumer.assign([TopicPartition(t, p, 0) for (t, p) in ends])
    deadline = time.monotonic() + 30
    while len(sources) < sum(ends.values()) and time.monotonic() < deadline:
        for m in consumer.consume(100, 1.0):
            if m.error() is None:
                h = dict(m.headers() or [])
                sources.add((h["opledger-source-topic"].decode(), int(h["opledger-source-offset"])))
    consumer.close()
    assert {(isolated.policy_topic, o) for o in (1, 2, 3, 4)} <= sources
    assert len(sources) == len(dead)


def test_the_policy_topic_is_compacted_with_one_partition(isolated: Settings) -> None:
    admin = AdminClient({**connection_config(isolated)})
    metadata = admin.list_topics(timeout=10)
    assert len(metadata.topics[isolated.policy_topic].partitions) == 1
    resource = ConfigResource(ResourceType.TOPIC, isolated.policy_topic)
    config = admin.describe_configs([resource])[resource].result(10)
    assert config["cleanup.policy"].value == "compact"
    # The operation topics stay append-only logs.
    resource = ConfigResource(ResourceType.TOPIC, isolated.execution_topic)
    assert admin.describe_configs([resource])[resource].result(10)["cleanup.policy"].value == (
        "delete"
    )


def _read_compacted(settings: Settings) -> list[tuple[int, bytes | None]]:
    """(offset, key) of every record left on the policy topic (offsets have gaps there)."""
    ((_, end),) = end_offsets(settings, [settings.policy_topic]).items()
    consumer = Consumer({**connection_config(settings), "group.id": "reader"})
    consumer.assign([TopicPartition(settings.policy_topic, 0, 0)])
    records: list[tuple[int, bytes | None]] = []
    deadline = time.monotonic() + 30
    try:
        # The log's last record is never compacted away (it sits in the active segment).
        while not records or records[-1][0] < end - 1:
            assert time.monotonic() < deadline, "could not read the policy topic to its end"
            for m in consumer.consume(1000, 0.5):
                if m.error() is None:
                    records.append((m.offset(), m.key()))
    finally:
        consumer.close()
    return records


def test_a_replay_of_the_compacted_topic_rebuilds_the_same_policy(isolated: Settings) -> None:
    """Kafka really compacts the topic (segments rolled fast for the test); the projection
    rebuilt from what is left equals the one folded from every record, and policy_history
    still holds every change."""
    admin = AdminClient({**connection_config(isolated)})
    fast = {"segment.ms": "100", "min.cleanable.dirty.ratio": "0.01", "min.compaction.lag.ms": "0"}
    resource = ConfigResource(
        ResourceType.TOPIC,
        isolated.policy_topic,
        incremental_configs=[
            ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)
            for name, value in fast.items()
        ],
    )
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(10)
    subjects = [("a1", "t1"), ("a2", "t1"), ("*", "t2")]
    changes: list[PolicyChanged] = []
    for round_ in range(4):
        for principal, tool in subjects:
            if round_ % 2:
                changes.append(
                    policy_change(PolicyChange.REVOKE, principal=principal, tool_name=tool)
                )
            else:
                changes.append(
                    policy_change(
                        principal=principal,
                        tool_name=tool,
                        destinations=[f"d{round_}"],
                        repeat_safe=bool(round_),
                    )
                )
        changes.append(
            policy_change(
                PolicyChange.REVOKE_CREDENTIAL,
                principal="*",
                tool_name="*",
                credential_id="k",
                reason=f"round {round_}",
            )
        )
        _write(isolated, *changes[-len(subjects) - 1 :])
        # Folded while its segment is still the active one (never compacted): the cleaner may
        # run at any moment once the next append rolls it, and "folded from every record"
        # must hold before compaction is waited for.
        project_in_process(isolated)
        time.sleep(0.3)  # the next append rolls the segment: only closed ones are compacted
    table = (
        "SELECT tenant_id, principal, tool_name, revoked, destinations, repeat_safe, version "
        "FROM policy_grants ORDER BY 1, 2, 3"
    )
    credentials = "SELECT tenant_id, credential_id, version, reason FROM revoked_credentials"
    folded, folded_credentials = _rows(isolated, table), _rows(isolated, credentials)

    produced = len(changes)
    deadline = time.monotonic() + 120
    while len(_read_compacted(isolated)) == produced:
        assert time.monotonic() < deadline, "the broker did not compact the policy topic"
        _write(isolated, policy_change(tool_name="roller"))  # keeps rolling segments
        produced += 1
        time.sleep(2)
    left = _read_compacted(isolated)
    assert len(left) < produced
    # Compaction dropped superseded records only: every subject still has its last one.
    assert {key for _, key in left} >= {c.subject_key() for c in changes}

    with psycopg.connect(isolated.dsn, autocommit=True) as conn:
        history = conn.execute("SELECT count(*) FROM policy_history").fetchone()
        conn.execute("TRUNCATE policy_grants, revoked_credentials, policy_history")
        conn.execute("DELETE FROM projector_offsets WHERE topic = %s", (isolated.policy_topic,))
    assert history is not None and history[0] >= 4 * (len(subjects) + 1)
    project_in_process(isolated)
    rebuilt = _rows(isolated, table)
    rebuilt_without_roller = [r for r in rebuilt if r[2] != "roller"]
    assert rebuilt_without_roller == [r for r in folded if r[2] != "roller"]
    assert _rows(isolated, credentials) == folded_credentials


# -- the command ----------------------------------------------------------------------------------


def _cli(settings: Settings, *argv: str) -> subprocess.CompletedProcess[str]:
    return run_cli(env_for(settings), "policy", *argv)


def _policy_records(settings: Settings) -> int:
    return sum(end_offsets(settings, [settings.policy_topic]).values())


def test_the_cli_refuses_bad_input_and_writes_nothing(isolated: Settings) -> None:
    bad = [
        ["grant", "--tenant", "a b", "--actor", ACTOR, "--tool", TOOL],
        ["grant", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL, "--expires", "soon"],
        ["grant", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL, "--scope", "s"],
        ["grant", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL, "--reason",
         "password=hunter2hunter2"],
        ["grant", "--tenant", TENANT, "--actor", ACTOR],  # argparse: --tool is required
        ["revoke", "--tenant", TENANT, "--actor", ACTOR],
        ["revoke", "--tenant", TENANT, "--credential", "k", "--tool", TOOL],
        ["show", "--tenant", "*"],
        ["grant", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL, "--wait", "0"],
    ]  # fmt: skip
    for argv in bad:
        result = _cli(isolated, *argv)
        assert result.returncode == 2, (argv, result.stderr)
        assert result.stderr.strip(), argv
        assert "Traceback" not in result.stderr, argv
    assert _policy_records(isolated) == 0


def _event_id(output: str) -> str:
    match = re.search(r"policy version (ev_[0-9A-Z]{26})", output)
    assert match is not None, output
    return match.group(1)


def test_the_cli_waits_for_the_projector_and_says_when_none_runs(
    isolated: Settings, store: PolicyStore, tmp_path: Path
) -> None:
    settings = isolated.with_(projector_web_port=free_port())
    early = _cli(settings, "grant", "--tenant", TENANT, "--actor", "*", "--tool", TOOL,
                 "--destination", "webhook:crm", "--by", "ops:alice")  # fmt: skip
    assert early.returncode == 3, early.stderr
    assert "no projector is running" in early.stderr
    assert _policy_records(settings) == 1, "the change itself was written"
    early_version = _event_id(early.stdout)
    nowait = _cli(settings, "grant", "--tenant", OTHER, "--actor", ACTOR, "--tool", TOOL,
                  "--no-wait")  # fmt: skip
    assert nowait.returncode == 0 and "--no-wait" in nowait.stdout

    log = tmp_path / "projector.log"
    with log.open("wb") as out:
        projector = subprocess.Popen(
            [sys.executable, "-m", "opledger.cli", "projector", "run"],
            env=env_for(settings),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        url = f"http://127.0.0.1:{settings.projector_web_port}/healthz"
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if json.load(response)["status"] == "ok":
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        granted = _cli(settings, "grant", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL,
                       "--repeat-safe", "--expires", "1d", "--credential", "vault:mail",
                       "--scope", "mail.send")  # fmt: skip
        assert granted.returncode == 0, granted.stderr
        assert "in effect" in granted.stdout
        version = _event_id(granted.stdout)
        decision = _ask(store, Purpose.NEW_ATTEMPT, required_scope="mail.send")
        assert decision.allowed and decision.version == version
        # The change written while no projector ran is in effect now too.
        assert _ask(store, actor="agent-9").version == early_version

        shown = _cli(settings, "show", "--tenant", TENANT)
        assert shown.returncode == 0, shown.stderr
        assert "2 grants" in shown.stdout and version in shown.stdout
        assert "ops:alice" in shown.stdout and "webhook:crm" in shown.stdout
        other = _cli(settings, "show", "--tenant", OTHER, "--actor", "agent-9")
        assert other.returncode == 0 and "0 grants" in other.stdout
        assert version not in other.stdout and early_version not in other.stdout

        revoked = _cli(settings, "revoke", "--tenant", TENANT, "--credential", "vault:mail",
                       "--reason", "rotated")  # fmt: skip
        assert revoked.returncode == 0, revoked.stderr
        revocation = _event_id(revoked.stdout)
        refused = _ask(store, required_scope="mail.send")
        assert not refused.allowed and refused.version == revocation
        shown = _cli(settings, "show", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL)
        assert "credential revoked" in shown.stdout and "rotated" in shown.stdout
    finally:
        os.killpg(projector.pid, signal.SIGTERM)
        projector.wait(timeout=30)


def test_without_the_tables_evaluate_refuses_and_says_why(isolated: Settings) -> None:
    # A database no projector (nor `opledger db migrate`) has prepared (CASCADE: the analysts' views
    # and policies lean on these tables).
    with psycopg.connect(isolated.dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE policy_grants, revoked_credentials CASCADE")
    pool = open_pool(isolated.dsn, name="policy-test", max_size=1)
    try:
        decision = PolicyStore(pool, isolated).evaluate(
            PolicyRequest(TENANT, ACTOR, TOOL, Purpose.DISPATCH, datetime.now(UTC))
        )
    finally:
        pool.close()
    assert not decision.allowed and decision.reason == NO_PROJECTION


def test_the_dispatch_cache_allows_only_its_documented_staleness(isolated: Settings) -> None:
    grant = policy_change(destinations=["webhook:crm"], repeat_safe=True)
    neighbour = policy_change(principal="agent-8")
    _write(isolated, grant, neighbour)
    project_in_process(isolated)
    pool = open_pool(isolated.dsn, name="policy-cache-test", max_size=2)
    clock = [0.0]
    try:
        cached = PolicyStore(pool, isolated, cache_ttl_s=30.0, clock=lambda: clock[0])
        small = PolicyStore(pool, isolated, cache_ttl_s=30.0, cache_size=1, clock=lambda: clock[0])
        assert _ask(cached).allowed  # read and cached
        assert _ask(small).allowed
        assert _ask(small, actor="agent-8").allowed  # evicts agent-7 from the one-entry cache
        revoke = policy_change(PolicyChange.REVOKE)
        _write(isolated, revoke)
        project_in_process(isolated)
        # Within the TTL a dispatch still sees the cached grant ...
        clock[0] = 29.9
        assert _ask(cached).allowed and _ask(cached).version == grant.event_id
        # ... reconciliation and delivery never do,
        for purpose in (Purpose.NEW_ATTEMPT, Purpose.DELIVER):
            fresh = _ask(cached, purpose, destination="webhook:crm")
            assert not fresh.allowed and fresh.version == revoke.event_id
        # nor does a subject the bounded cache had to drop,
        evicted = _ask(small)
        assert not evicted.allowed and evicted.version == revoke.event_id
        # and once the TTL has passed neither does a dispatch.
        clock[0] = 30.0
        after = _ask(cached)
        assert not after.allowed and after.version == revoke.event_id
    finally:
        pool.close()


class _CountingConnection:
    """A connection that counts the statements sent through it."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.statements = 0

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        self.statements += 1
        return self.conn.execute(*args, **kwargs)


def test_evaluate_reads_grants_and_credential_revocations_in_one_statement(
    isolated: Settings,
) -> None:
    _write(
        isolated,
        policy_change(credential_id="k1"),
        policy_change(principal="*", credential_id="k2"),
        policy_change(tool_name="*"),
        policy_change(principal="agent-8", credential_id="k1"),  # cannot match agent-7
        policy_change(
            PolicyChange.REVOKE_CREDENTIAL, principal="*", tool_name="*", credential_id="k1"
        ),
        policy_change(
            PolicyChange.REVOKE_CREDENTIAL, principal="*", tool_name="*", credential_id="k9"
        ),
    )
    project_in_process(isolated)
    with psycopg.connect(isolated.dsn) as conn:
        counting = _CountingConnection(conn)
        rows = read_matching(counting, TENANT, ACTOR, TOOL)  # type: ignore[arg-type]
    assert counting.statements == 1
    assert rows is not None
    signed, revoked = rows
    grants = [row.grant for row in signed]
    assert sorted((g.principal, g.tool_name, g.credential_id) for g in grants) == [
        ("*", TOOL, "k2"),
        (ACTOR, "*", None),
        (ACTOR, TOOL, "k1"),
    ]
    # Only the revocations the matching grants can meet (k9 names no matching grant).
    assert [(r.credential_id, r.tenant_id) for r in revoked] == [("k1", TENANT)]
