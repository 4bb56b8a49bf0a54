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
