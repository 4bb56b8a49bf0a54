"""Who may do what on the local broker (decision 029), tried with the principals themselves.

Every forbidden act is attempted for real, over SASL/SCRAM, against the running broker, and the
broker's answer is checked; where a write was refused, what the topic holds afterwards is read
back as the admin, so a refusal that the client reported but the broker did not enforce (or
the reverse) fails the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._acl import AclBinding, AclOperation, AclPermissionType
from confluent_kafka.admin._resource import ResourcePatternType, ResourceType
from confluent_kafka.admin._scram import (
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)
from confluent_kafka.cimpl import NewTopic

from ledger.codec import default_codec
from ledger.kafka import connection_config
from ledger.kafka_access import OPERATOR, SERVICE_ROLES, drop_access, ensure_access
from ledger.log import end_offsets
from ledger.settings import Settings
from tests.support import policy_change

pytestmark = pytest.mark.integration

AUTHORIZATION_FAILED = {
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.GROUP_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
}


def _as(settings: Settings, principal: str) -> Settings:
    return settings.with_(kafka_principal=principal, kafka_password_file="")


def _produce(settings: Settings, topic: str, value: bytes = b"x") -> KafkaError | None:
    """One record written as ``settings``' principal: the error its delivery report carries."""
    reports: list[KafkaError | None] = []
    producer = Producer(
        {
            **connection_config(settings),
            "acks": "all",
            "message.timeout.ms": 15_000,
            "log_level": 0,
        }
    )
    producer.produce(topic, key=b"k", value=value, on_delivery=lambda e, _m: reports.append(e))
    producer.flush(20)
    assert len(reports) == 1, "no delivery report within 20 s"
    return reports[0]


def _records(settings: Settings, topic: str) -> int:
    """How many records ``topic`` holds, asked by the admin (``settings`` is the tests')."""
    return sum(end_offsets(settings, [topic]).values())


def _code(exc: BaseException) -> int:
    assert isinstance(exc, KafkaException), repr(exc)
    error = exc.args[0]
    assert isinstance(error, KafkaError), repr(exc)
    return int(error.code())


@pytest.fixture
def groups(isolated: Settings) -> Settings:
    """``isolated`` with worker groups of its own prefix, and their ACLs."""
    prefix = isolated.topic_prefix
    settings = isolated.with_(
        projector_group=f"{prefix}-projector",
        recovery_group=f"{prefix}-recovery",
        delivery_group=f"{prefix}-delivery",
    )
    assert ensure_access(settings)
    yield settings
    drop_access(settings, prefix)


def test_a_client_without_credentials_learns_nothing(isolated: Settings) -> None:
    anonymous = AdminClient(
        {**connection_config(isolated.with_(kafka_security="plaintext")), "log_level": 0}
    )
    with pytest.raises(KafkaException):
        anonymous.list_topics(timeout=5)


@pytest.mark.parametrize("who", ["a wrong password", "a user nobody created"])
def test_a_wrong_credential_is_refused(isolated: Settings, tmp_path: Path, who: str) -> None:
    password = tmp_path / "password"
    password.write_text("not-the-password\n")
    principal = "sdk" if who == "a wrong password" else "mallory"
    settings = isolated.with_(kafka_principal=principal, kafka_password_file=str(password))
    client = AdminClient({**connection_config(settings), "log_level": 0})
    with pytest.raises(KafkaException) as refused:
        client.list_topics(timeout=5)
    assert _code(refused.value) in {
        KafkaError._AUTHENTICATION,
        KafkaError.SASL_AUTHENTICATION_FAILED,
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
        KafkaError._ALL_BROKERS_DOWN,
    }
    # ... and it wrote nothing: the credential of the real sdk principal still works.
    assert _produce(_as(isolated, "sdk"), isolated.execution_topic) is None


def test_only_the_operator_writes_the_policy_topic(isolated: Settings) -> None:
    # The probe's record: a `*`/`*` repeat-safe grant of wire_money, in the project's codec.
    forged = default_codec().encode(
        policy_change(
            principal="*", tool_name="*", repeat_safe=True, actor_id="cli:security-officer"
        )
    )
    for role in SERVICE_ROLES:
        error = _produce(_as(isolated, role), isolated.policy_topic, forged)
        assert error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, role
    assert _records(isolated, isolated.policy_topic) == 0, "a refused write reached the topic"
    assert _produce(_as(isolated, OPERATOR), isolated.policy_topic, forged) is None
    assert _records(isolated, isolated.policy_topic) == 1


def test_services_append_executions_and_deliveries_the_operator_does_not(
    isolated: Settings,
) -> None:
    for role in SERVICE_ROLES:
        for topic in (isolated.execution_topic, isolated.delivery_topic):
            assert _produce(_as(isolated, role), topic) is None, (role, topic)
    for topic in (isolated.execution_topic, isolated.delivery_topic):
        error = _produce(_as(isolated, OPERATOR), topic)
        assert error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert _records(isolated, isolated.execution_topic) == len(SERVICE_ROLES)
    assert _records(isolated, isolated.delivery_topic) == len(SERVICE_ROLES)


def _committed(settings: Settings, group: str, topic: str) -> int:
    """The offset ``group`` has committed on ``topic``[0], asked as ``settings``' principal."""
    admin = AdminClient({**connection_config(settings), "log_level": 0})
    request = [ConsumerGroupTopicPartitions(group, [TopicPartition(topic, 0)])]
    answer = admin.list_consumer_group_offsets(request, request_timeout=15)[group].result()
    return int(answer.topic_partitions[0].offset)


def _commit(settings: Settings, group: str, topic: str, offset: int) -> None:
    consumer = Consumer({**connection_config(settings), "group.id": group, "log_level": 0})
    try:
        consumer.commit(offsets=[TopicPartition(topic, 0, offset)], asynchronous=False)
    finally:
        consumer.close()


def _overwrite(settings: Settings, group: str, topic: str, offset: int) -> None:
    """Set ``group``'s committed offset, as ``settings``' principal (a consumer's commit to a
    group it may not use waits for a coordinator it is never given; the admin API says why)."""
    admin = AdminClient({**connection_config(settings), "log_level": 0})
    request = [ConsumerGroupTopicPartitions(group, [TopicPartition(topic, 0, offset)])]
    admin.alter_consumer_group_offsets(request, request_timeout=15)[group].result()


def test_a_role_reads_and_commits_its_own_consumer_groups_and_no_other(groups: Settings) -> None:
    own = {
        "projector": groups.projector_group,
        "recovery": groups.recovery_group,
        "delivery": groups.delivery_group,
    }
    topic = groups.execution_topic
    for _ in range(3):
        assert _produce(_as(groups, "sdk"), topic) is None
    for role, group in own.items():
        _commit(_as(groups, role), group, topic, 2)
        assert _committed(_as(groups, role), group, topic) == 2
    for intruder, group in ((r, g) for r in own for g in own.values() if g != own[r]):
        with pytest.raises(KafkaException) as refused:
            _committed(_as(groups, intruder), group, topic)
        assert _code(refused.value) == KafkaError.GROUP_AUTHORIZATION_FAILED, (intruder, group)
        with pytest.raises(KafkaException) as refused:
            _overwrite(_as(groups, intruder), group, topic, 0)
        assert _code(refused.value) == KafkaError.GROUP_AUTHORIZATION_FAILED, (intruder, group)
    # What the broker keeps, asked by the admin: every group's own commit, untouched.
    for group in own.values():
        assert _committed(groups, group, topic) == 2, group


@pytest.mark.parametrize("role", [*SERVICE_ROLES, OPERATOR])
def test_no_role_deletes_creates_or_grants(isolated: Settings, role: str) -> None:
    assert _produce(_as(isolated, "sdk"), isolated.execution_topic) is None
    admin = AdminClient({**connection_config(_as(isolated, role)), "log_level": 0})
    attempts = {
        "delete records": lambda: admin.delete_records(
            [TopicPartition(isolated.execution_topic, 0, -1)], request_timeout=15
        ),
        "delete a topic": lambda: admin.delete_topics(
            [isolated.execution_topic], request_timeout=15
        ),
        "create a topic": lambda: admin.create_topics(
            [NewTopic(f"{isolated.topic_prefix}.sneaky.v1", 1, 1)], request_timeout=15
        ),
        "grant itself the policy topic": lambda: admin.create_acls(
            [
                AclBinding(
                    ResourceType.TOPIC,
                    isolated.policy_topic,
                    ResourcePatternType.LITERAL,
                    f"User:{role}",
                    "*",
                    AclOperation.WRITE,
                    AclPermissionType.ALLOW,
                )
            ],
            request_timeout=15,
        ),
        "create a user": lambda: admin.alter_user_scram_credentials(
            [
                UserScramCredentialUpsertion(
                    "mallory", ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192), b"pw"
                )
            ],
            request_timeout=15,
        ),
    }
    for what, attempt in attempts.items():
        futures = attempt()
        for future in futures.values():
            with pytest.raises(KafkaException) as refused:
                future.result()
            assert _code(refused.value) in AUTHORIZATION_FAILED, (role, what)
    # What the broker holds, asked by the admin: nothing of it happened.
    assert _records(isolated, isolated.execution_topic) == 1
    topics = AdminClient(connection_config(isolated)).list_topics(timeout=10).topics
    assert isolated.execution_topic in topics
    assert f"{isolated.topic_prefix}.sneaky.v1" not in topics
