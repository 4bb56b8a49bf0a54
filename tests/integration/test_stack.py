"""The local stack launcher against the real broker and database server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from confluent_kafka.admin import (  # type: ignore[attr-defined]  # public, re-exported without "as"
    AdminClient,
    ConfigResource,
    ResourceType,
)

from ledger.kafka import connection_config
from ledger.settings import Settings
from ledger.topics import all_topic_specs, topic_specs
from opledger import cli, stack, supervisor
from opledger.demo.plan import queue_topic
from tests.support import free_port


def test_status_is_healthy_after_up(stack_settings: Settings) -> None:
    lines: list[str] = []
    assert stack.status(stack_settings, echo=lines.append)
    assert any(line.startswith("kafka") and "healthy" in line for line in lines)
    assert any(line.startswith("postgres") and "healthy" in line for line in lines)


def test_cli_status_exit_code_is_zero_when_healthy(stack_settings: Settings) -> None:
    assert cli.main(["stack", "status"]) == 0


def test_cli_status_exits_3_when_nothing_answers(tmp_path: Path) -> None:
    """A stack whose home is empty and whose ports answer nothing: exit 3, not 0 or a crash."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OPLEDGER_")},
        "OPLEDGER_HOME": str(tmp_path),
        "OPLEDGER_KAFKA_PORT": str(free_port()),
        "OPLEDGER_KAFKA_CONTROLLER_PORT": str(free_port()),
        "OPLEDGER_PG_PORT": str(free_port()),
    }
    done = subprocess.run(
        [sys.executable, "-m", "opledger.cli", "stack", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr


def test_second_up_is_fast_and_downloads_nothing(stack_settings: Settings) -> None:
    libs = stack_settings.home / f"kafka-{stack_settings.kafka_version}" / "libs"
    marker = libs.parent / "jars.complete"
    before = (libs.stat().st_mtime_ns, marker.stat().st_mtime_ns)
    supervisor_before = supervisor.supervisor_pid(stack_settings)
    lines: list[str] = []
    started = time.monotonic()
    stack.up(stack_settings, echo=lines.append)
    elapsed = time.monotonic() - started
    assert elapsed < 5, f"second up took {elapsed:.1f}s"
    # "already running" covers the supervisor too: the first up (the fixture) started it.
    assert lines == ["stack already running"]
    assert (libs.stat().st_mtime_ns, marker.stat().st_mtime_ns) == before
    assert supervisor_before is not None
    assert supervisor.supervisor_pid(stack_settings) == supervisor_before


def test_up_starts_the_supervisor_and_status_shows_its_workers(stack_settings: Settings) -> None:
    lines: list[str] = []
    stack.status(stack_settings, echo=lines.append)
    pid = supervisor.supervisor_pid(stack_settings)
    assert pid is not None, "the fixture's `stack.up` starts the supervisor"
    assert any(line.startswith(f"supervisor running  pid {pid} ") for line in lines), lines
    assert any(re.match(r"projector +(running|restarting) +pid ", line) for line in lines), lines


def test_cli_up_accepts_no_workers() -> None:
    assert cli.build_parser().parse_args(["stack", "up", "--no-workers"]).no_workers
    assert not cli.build_parser().parse_args(["stack", "up"]).no_workers


def test_topics_have_configured_partitions_and_retention(stack_settings: Settings) -> None:
    admin = AdminClient({**connection_config(stack_settings)})
    metadata = admin.list_topics(timeout=10)
    specs = topic_specs(stack_settings)
    resources = [ConfigResource(ResourceType.TOPIC, spec.name) for spec in specs]
    configs = {
        res.name: future.result(10) for res, future in admin.describe_configs(resources).items()
    }
    for spec in specs:
        assert len(metadata.topics[spec.name].partitions) == stack_settings.partitions
        assert configs[spec.name]["cleanup.policy"].value == "delete"
        assert configs[spec.name]["retention.ms"].value == "-1"


def test_every_topic_on_the_broker_is_one_of_ours_as_specified(stack_settings: Settings) -> None:
    """Each topic of the stack's prefix is one ``ledger/topics.py`` specifies, with its
    partitions and every config it names (the compacted key store and policy topic, the kept
    dead letters): the workers' host joins no group and declares no topic of its own."""
    admin = AdminClient({**connection_config(stack_settings)})
    specs = {spec.name: spec for spec in all_topic_specs(stack_settings)}
    prefix = stack_settings.topic_prefix
    ours = {
        name
        for name in admin.list_topics(timeout=10).topics
        if name.startswith((f"{prefix}.", f"{prefix}-"))
    }
    assert set(specs) <= ours, "ensure_topics created every topic it specifies"
    # A queue destination's topic is its owner's, not the ledger's: the demo creates one under
    # the stack's prefix for its billing queue, as a user would create theirs.
    destinations = {queue_topic(prefix)}
    others = ours - set(specs) - destinations
    assert others == set()
    metadata = admin.list_topics(timeout=10)
    resources = [ConfigResource(ResourceType.TOPIC, name) for name in specs]
    described = admin.describe_configs(resources)
    for resource, future in described.items():
        spec = specs[resource.name]
        config = future.result(10)
        assert len(metadata.topics[spec.name].partitions) == spec.partitions, spec.name
        for key, want in spec.config.items():
            assert config[key].value == want, (spec.name, key)
    assert specs[stack_settings.consumer_keys_topic].config["cleanup.policy"] == "compact"
    assert specs[stack_settings.consumer_dead_letter_topic].config["retention.ms"] == "-1"


def test_isolated_settings_get_their_own_topics_and_database(isolated: Settings) -> None:
    admin = AdminClient({**connection_config(isolated)})
    topics = admin.list_topics(timeout=10).topics
    assert all(spec.name in topics for spec in topic_specs(isolated))
    with psycopg.connect(isolated.dsn) as conn:
        row = conn.execute("SELECT current_database()").fetchone()
    assert row is not None and row[0].startswith("opledger_t")


def test_postgres_listens_on_loopback_only_and_not_as_root(stack_settings: Settings) -> None:
    with psycopg.connect(stack_settings.dsn) as conn:
        row = conn.execute("SELECT current_setting('listen_addresses')").fetchone()
    assert row == ("127.0.0.1",)
    pid = stack.postgres_pid(stack_settings)
    assert pid is not None
    if os.geteuid() == 0:
        assert Path(f"/proc/{pid}").stat().st_uid != 0


def test_postgres_asks_every_connection_for_a_password(
    stack_settings: Settings, tmp_path: Path
) -> None:
    """The probe found `trust` for every local user: anyone on the machine was the superuser.
    Now every connection, over TCP or the socket, shows the role's password (SCRAM)."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo  # noqa: PLC0415

    from opledger.stack.home import pg_socket_dir  # noqa: PLC0415

    empty = tmp_path / "pgpass"
    empty.write_text("")
    empty.chmod(0o600)
    wrong = tmp_path / "wrong"
    wrong.write_text("*:*:*:opledger:not-the-password\n")
    wrong.chmod(0o600)
    attempts = {
        "no password over TCP": make_conninfo(stack_settings.dsn, passfile=str(empty)),
        "a wrong password": make_conninfo(stack_settings.dsn, passfile=str(wrong)),
        "no password on the socket": make_conninfo(
            stack_settings.dsn, host=str(pg_socket_dir(stack_settings)), passfile=str(empty)
        ),
        "another role, no password": make_conninfo(
            stack_settings.dsn, user="postgres", passfile=str(empty)
        ),
    }
    for what, dsn in attempts.items():
        with pytest.raises(psycopg.OperationalError) as refused:
            psycopg.connect(dsn, connect_timeout=5).close()
        text = str(refused.value)
        assert "password" in text, (what, text)
    assert "password=" not in stack_settings.dsn, "the DSN names the passfile, never holds it"
    assert conninfo_to_dict(stack_settings.dsn)["passfile"] == str(stack_settings.pg_passfile_path)
    assert stack_settings.pg_passfile_path.stat().st_mode & 0o077 == 0
    with psycopg.connect(stack_settings.dsn) as conn:  # the launcher's own file: admitted
        methods = conn.execute(
            "SELECT DISTINCT auth_method FROM pg_hba_file_rules WHERE error IS NULL"
        ).fetchall()
    assert methods == [("scram-sha-256",)]


def test_missing_java_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(stack.StackError) as raised:
        stack.find_java(path=str(tmp_path))
    message = str(raised.value)
    assert message.startswith("java not found:")
    assert "\n" not in message and "apt-get install" in message


def test_missing_mvn_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(stack.StackError, match=r"^mvn not found: install Maven"):
        stack.find_mvn(path=str(tmp_path))
