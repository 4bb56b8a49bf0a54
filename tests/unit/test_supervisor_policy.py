"""The supervisor's pure decisions, and its worker list kept consistent with the CLI and with
docker-compose.yml (the same workers, restarted the same way, with or without Docker)."""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import yaml

from opledger import supervisor
from opledger.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
RESTART_POLICIES = {"always", "unless-stopped", "on-failure"}


def test_backoff_doubles_from_one_second_up_to_thirty() -> None:
    delays, previous = [], None
    for _ in range(8):
        previous = supervisor.next_backoff(previous, uptime_s=0.5)
        delays.append(previous)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_backoff_resets_after_a_worker_stayed_up_a_minute() -> None:
    assert supervisor.next_backoff(30.0, uptime_s=59.9) == 30.0
    assert supervisor.next_backoff(30.0, uptime_s=60.0) == 1.0


def test_exit_reasons_name_the_code_or_the_signal() -> None:
    assert supervisor.describe_exit(2) == "exit code 2"
    assert supervisor.describe_exit(0) == "exit code 0"
    assert supervisor.describe_exit(-int(signal.SIGKILL)) == "killed by SIGKILL"


def test_every_worker_is_a_real_cli_command_with_a_unique_name() -> None:
    names = [spec.name for spec in supervisor.WORKERS]
    assert len(set(names)) == len(names)
    parser = build_parser()
    for spec in supervisor.WORKERS:
        args = parser.parse_args(list(spec.args))
        assert isinstance(args.handler, str) and ":" in args.handler, spec


def test_every_compose_worker_service_restarts() -> None:
    services: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    # A job other services wait to complete (kafka-setup) runs once per start: not a worker.
    jobs = {
        dependency
        for service in services.values()
        for dependency, condition in service.get("depends_on", {}).items()
        if condition.get("condition") == "service_completed_successfully"
    }
    for job in jobs:
        assert services[job].get("restart") == "no", job
    workers = {
        name: service
        for name, service in services.items()
        if service.get("command", [None])[0] == "opledger" and name not in jobs
    }
    assert workers, "docker-compose.yml runs no opledger worker"
    for name, service in workers.items():
        assert service.get("restart") in RESTART_POLICIES, name


def test_every_compose_worker_runs_a_real_command_with_real_settings() -> None:
    services: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    known = set(re.findall(r'"(OPLEDGER_[A-Z_]+)"', (ROOT / "ledger/settings.py").read_text()))
    parser = build_parser()
    for name, service in services.items():
        command = service.get("command", [None])
        if command[0] != "opledger":
            continue
        args = parser.parse_args(command[1:])
        assert isinstance(args.handler, str), name
        unknown = set(service.get("environment", {})) - known
        assert not unknown, f"{name} sets variables Settings never reads: {unknown}"


def test_every_supervised_worker_but_the_fake_provider_has_a_compose_service() -> None:
    services: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    parser = build_parser()
    in_compose = {
        parser.parse_args(s["command"][1:]).handler
        for s in services.values()
        if s.get("command", [None])[0] == "opledger"
    }
    for spec in supervisor.WORKERS:
        if spec.name == "fake-provider":  # the demo's outside world: local only
            continue
        assert parser.parse_args(list(spec.args)).handler in in_compose, spec.name
