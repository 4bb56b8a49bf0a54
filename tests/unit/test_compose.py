"""docker-compose.yml cannot run here (no Docker engine), so these checks keep it honest: pinned
images matching the local stack, only settings that exist, a command the CLI accepts."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

from ledger.settings import Settings
from opledger.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def _known_variables() -> set[str]:
    return set(re.findall(r'"(OPLEDGER_[A-Z_]+)"', (ROOT / "ledger" / "settings.py").read_text()))


def test_images_are_pinned_and_match_the_local_stack() -> None:
    services = _compose()["services"]
    kafka_image = services["kafka"]["image"]
    assert kafka_image == f"apache/kafka:{Settings(home=Path('/x')).kafka_version}"
    postgres_image = services["postgres"]["image"]
    assert re.fullmatch(r"postgres:\d+\.\d+", postgres_image), postgres_image


def test_topics_are_never_auto_created() -> None:
    env = _compose()["services"]["kafka"]["environment"]
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"


def test_projector_uses_only_real_settings_and_a_real_command() -> None:
    projector = _compose()["services"]["projector"]
    unknown = set(projector["environment"]) - _known_variables()
    assert not unknown, f"compose sets variables Settings never reads: {unknown}"
    command = projector["command"]
    assert command[0] == "opledger"
    args = build_parser().parse_args(command[1:])
    assert args.handler == "opledger.projector:run"
    settings = Settings.from_env({k: str(v) for k, v in projector["environment"].items()})
    assert settings.bootstrap_servers == "kafka:9092"


def test_dockerfile_copies_every_package_it_installs() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in [*packages, "schemas", "kafka"]:
        assert f"COPY {package} {package}" in dockerfile, package


def test_the_delivery_worker_may_send_to_the_compose_network_and_no_further() -> None:
    """Webhooks to private addresses are refused unless allowed (decision 019); the services
    reach each other by name on the project's network, so the delivery worker allows exactly
    that network's pinned subnet."""
    compose = _compose()
    delivery = compose["services"]["delivery"]["environment"]
    unknown = set(delivery) - _known_variables()
    assert not unknown, f"compose sets variables Settings never reads: {unknown}"
    settings = Settings.from_env({k: str(v) for k, v in delivery.items()})
    subnets = [c["subnet"] for c in compose["networks"]["default"]["ipam"]["config"]]
    assert [str(n) for n in settings.delivery_allowed_networks] == subnets


#: The compose services that are Kafka clients, each signing in as its command's role.
KAFKA_CLIENTS = ("kafka-setup", "projector", "recovery", "delivery", "consumer")


def test_the_broker_asks_for_sasl_with_the_local_stacks_settings_and_no_secret_in_its_env() -> None:
    """The same listeners, mechanisms and authorizer as `opledger stack up`'s broker
    (decision 029), its logins in a mounted JAAS file rather than its environment."""
    from opledger.stack.kafka import SASL_BROKER_SETTINGS  # noqa: PLC0415
    from tests.compose_support import image_properties  # noqa: PLC0415

    kafka = _compose()["services"]["kafka"]
    properties = image_properties(kafka["environment"])
    assert {k: properties.get(k) for k in SASL_BROKER_SETTINGS} == SASL_BROKER_SETTINGS
    listeners = properties["listener.security.protocol.map"].split(",")
    assert sorted(listeners) == ["CONTROLLER:SASL_PLAINTEXT", "SASL_PLAINTEXT:SASL_PLAINTEXT"]
    assert properties["advertised.listeners"] == "SASL_PLAINTEXT://kafka:9092"
    assert not any("jaas" in k or "password" in k for k in properties), properties
    jaas = "-Djava.security.auth.login.config=/run/secrets/kafka-server-jaas.conf"
    assert jaas in kafka["environment"]["KAFKA_OPTS"].split()
    mounted = {s["target"] for s in kafka["secrets"]}
    assert mounted == {"kafka-server-jaas.conf", "kafka-admin-client.properties"}
    health = " ".join(kafka["healthcheck"]["test"])
    assert "--command-config /run/secrets/kafka-admin-client.properties" in health


def test_every_kafka_client_signs_in_as_its_role_with_its_own_password_file(
    tmp_path: Path,
) -> None:
    from ledger.kafka_access import PRINCIPALS  # noqa: PLC0415
    from opledger.kafka_admin import write_broker_files  # noqa: PLC0415

    compose = _compose()
    made = {p.name for p in write_broker_files(Settings(home=tmp_path), tmp_path / "k")}
    declared = compose["secrets"]
    for name, secret in declared.items():
        if name.startswith("kafka_"):
            assert secret["file"].startswith("./secrets/kafka/"), secret
            assert secret["file"].removeprefix("./secrets/kafka/") in made, secret
    for name in KAFKA_CLIENTS:
        service = compose["services"][name]
        env = {k: str(v) for k, v in service["environment"].items()}
        assert not set(env) - _known_variables(), name
        settings = Settings.from_env(env)
        assert settings.kafka_security_protocol == "sasl_plaintext", name
        assert settings.kafka_password_directory == Path("/run/secrets"), name
        args = build_parser().parse_args(service["command"][1:])
        principal = settings.as_kafka_role(args.kafka_role).kafka_user
        mounts = {s["target"]: s["source"] for s in service["secrets"] if isinstance(s, dict)}
        assert mounts.get(f"kafka-{principal}.password") == f"kafka_{principal}", name
        assert all(source in declared for source in mounts.values()), name
        if name != "kafka-setup":
            assert service["depends_on"]["kafka-setup"] == {
                "condition": "service_completed_successfully"
            }, name
    setup = compose["services"]["kafka-setup"]
    assert {s["target"] for s in setup["secrets"]} == {f"kafka-{p}.password" for p in PRINCIPALS}
