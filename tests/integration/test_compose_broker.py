"""docker-compose.yml's broker, run from the official jars as the apache/kafka image would run
it (no Docker here): its environment turned into ``server.properties`` by the image's own rule,
its logins from the JAAS file `opledger kafka passwords` writes, then `opledger kafka setup` as
its admin. What the compose services would then meet is tried with their own principals: a
service appends, nobody but the operator writes the policy topic, a client without a password
learns nothing.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, Producer
from confluent_kafka.admin import AdminClient

from ledger.kafka import connection_config
from ledger.settings import Settings
from opledger import stack
from opledger.stack.kafka import format_kafka_storage, kafka_command, random_cluster_id
from tests.compose_support import compose, image_properties
from tests.process_support import run_cli
from tests.support import env_for, free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def compose_broker(stack_settings: Settings, tmp_path: Path) -> Iterator[tuple[Settings, Path]]:
    """The compose broker on free loopback ports; (settings for its clients, secrets dir)."""
    secrets = tmp_path / "secrets"
    made = run_cli(env_for(stack_settings), "kafka", "passwords", "--dir", str(secrets))
    assert made.returncode == 0, made.stdout + made.stderr
    service: dict[str, Any] = compose()["services"]["kafka"]
    port, controller = free_port(), free_port()
    properties = image_properties(service["environment"])
    for key, value in properties.items():
        # The compose network's host name and the container's ports, on loopback here.
        local = value.replace("://:", "://127.0.0.1:").replace("//kafka:", "//127.0.0.1:")
        local = local.replace("@kafka:", "@127.0.0.1:")
        properties[key] = local.replace(":9092", f":{port}").replace(":9093", f":{controller}")
    properties["log.dirs"] = str(tmp_path / "data")
    config = tmp_path / "server.properties"
    config.write_text("".join(f"{k}={v}\n" for k, v in properties.items()))
    # Where the image mounts the secrets, the test's directory; the JVM's options as given.
    options = [
        option.replace("/run/secrets/", f"{secrets}/")
        for option in service["environment"]["KAFKA_OPTS"].split()
    ]
    java = stack.find_java()
    libs = stack.ensure_kafka_jars(stack_settings, echo=lambda _line: None)
    format_kafka_storage(java, libs, config, random_cluster_id())
    argv = kafka_command(java, libs, config, tmp_path / "kafka.log")
    argv[1:1] = options
    with (tmp_path / "stdout.log").open("ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    clients = stack_settings.with_(
        kafka_bootstrap=f"127.0.0.1:{port}",
        kafka_security="sasl_plaintext",
        kafka_password_dir=str(secrets),
        kafka_password_file="",
        topic_prefix="opledger",
    )
    try:
        yield clients, secrets
    finally:
        process.kill()
        process.wait()


def _reaches(settings: Settings, **overrides: str) -> bool:
    config = {**connection_config(settings), **overrides, "log_level": 0}
    try:
        AdminClient(config).list_topics(timeout=5)
    except Exception:
        return False
    return True


def _produce(settings: Settings, topic: str) -> KafkaError | None:
    reports: list[KafkaError | None] = []
    producer = Producer(
        {**connection_config(settings), "message.timeout.ms": 15_000, "log_level": 0}
    )
    producer.produce(topic, key=b"k", value=b"v", on_delivery=lambda e, _m: reports.append(e))
    producer.flush(20)
    assert len(reports) == 1
    return reports[0]


def test_the_compose_broker_asks_every_client_who_it_is_and_its_setup_grants_each_role(
    compose_broker: tuple[Settings, Path],
) -> None:
    clients, secrets = compose_broker
    # The static PLAIN admin of the JAAS file signs in before any SCRAM user exists (the
    # broker's health check, kafka-setup).
    plain_admin = clients.with_(kafka_principal="admin", kafka_sasl_mechanism="PLAIN")
    deadline = time.monotonic() + 90
    while not _reaches(plain_admin):
        assert time.monotonic() < deadline, "the compose broker did not start"
        time.sleep(0.5)

    # What the kafka-setup service runs, with its environment from docker-compose.yml.
    setup_env = compose()["services"]["kafka-setup"]["environment"]
    env = env_for(clients)
    env.update({k: str(v) for k, v in setup_env.items()})
    env.update(
        OPLEDGER_KAFKA_BOOTSTRAP=clients.bootstrap_servers,
        OPLEDGER_KAFKA_PASSWORD_DIR=str(secrets),
        OPLEDGER_HOME=str(clients.home),
        OPLEDGER_TOPIC_PREFIX="opledger",
    )
    done = run_cli(env, "kafka", "setup")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "SCRAM users admin, operator, sdk, projector, recovery, delivery, consumer" in done.stdout
    )
    again = run_cli(env, "kafka", "setup")
    assert again.returncode == 0, again.stdout + again.stderr

    sdk = clients.with_(kafka_principal="sdk")
    assert _reaches(sdk)
    assert _produce(sdk, clients.execution_topic) is None
    refused = _produce(sdk, clients.policy_topic)
    assert refused is not None and refused.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert _produce(clients.with_(kafka_principal="operator"), clients.policy_topic) is None
    # Without a password, or with another's: nothing.
    assert not _reaches(sdk, **{"sasl.password": "not-the-password"})
    assert not _reaches(clients.with_(kafka_security="plaintext"))
