"""The stack launcher's pure parts under hostile input: a status file of the wrong shape, a log
holding escape sequences and secrets, a file under OPLEDGER_HOME replaced by a symlink, and the
one-sentence messages for a home that cannot be written. No process is started."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from ledger.settings import Settings
from opledger import stack, supervisor
from opledger.stack import postgres, processes, workers


def _settings(home: Path) -> Settings:
    return Settings.from_env().with_(home=home)


@pytest.mark.parametrize(
    "text",
    [
        '{"supervisor": "x", "workers": [1, 2]}',
        '{"supervisor": 5, "workers": {"projector": "running"}}',
        '{"workers": {"projector": {"pid": "12", "state": 3}}',
        "[1, 2, 3]",
        '{"supervisor": {"pid": 1}, "work',
        "\udcff garbage",
    ],
)
def test_a_status_file_of_any_shape_is_read_without_crashing(tmp_path: Path, text: str) -> None:
    settings = _settings(tmp_path)
    supervisor.run_dir(settings).mkdir(parents=True)
    supervisor.status_file(settings).write_text(text, errors="surrogateescape")
    status = supervisor.read_status(settings)
    assert isinstance(status.get("supervisor", {}), dict)
    assert all(isinstance(worker, dict) for worker in status.get("workers", {}).values())
    # What `status`, `up` and `restart` do with it.
    assert supervisor.status_lines(settings)[0].startswith("supervisor stopped")
    assert workers.workers_changed(settings) == ""
    assert supervisor.worker_pid(settings, "projector", parent=1) is None


def test_logs_show_escapes_and_no_secrets(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    log = supervisor.worker_log(settings, "projector")
    log.parent.mkdir(parents=True)
    log.write_bytes(
        b"old line\n"
        b"\x1b]52;c;ZWNobyBwd25lZA==\x07\x1b[2Jcleared\rFORGED supervisor line\n"
        b"Authorization: Bearer sk_live_51Habcdefghijklmnopqrstuv api_key=abcd1234efgh5678ijkl\n"
        b"\xff\xfe not utf-8\n"
    )
    shown: list[str] = []
    stack.logs(settings, lines=3, echo=shown.append)
    text = "\n".join(shown)
    assert "\x1b" not in text and "\x07" not in text and "\r" not in text
    assert "\\x1b]52;c;" in text and "cleared\\x0dFORGED supervisor line" in text
    assert "sk_live_51Habcdefghijklmnopqrstuv" not in text and "abcd1234efgh5678ijkl" not in text
    assert "old line" not in text, "three lines asked, three shown"


def test_a_long_log_is_read_from_its_end_only(tmp_path: Path) -> None:
    log = tmp_path / "big.log"
    with log.open("w") as out:
        for number in range(200_000):
            out.write(f"line {number}\n")
    assert processes.tail(log, 2) == "line 199998\nline 199999"
    assert processes.tail(log, 0) == ""
    long_line = tmp_path / "long.log"
    long_line.write_text("x" * 50_000 + "\n")
    assert processes.tail(long_line, 1).endswith(" [cut]")


def test_the_postgres_config_replaces_a_symlink_instead_of_writing_through_it(
    tmp_path: Path,
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("not yours\n")
    victim.chmod(0o600)
    before = victim.stat()
    conf = tmp_path / "opledger.conf"
    conf.symlink_to(victim)
    postgres._write_pg_owned(conf, "port = 1\n")
    assert victim.read_text() == "not yours\n"
    assert (victim.stat().st_uid, victim.stat().st_mode) == (before.st_uid, before.st_mode)
    assert not conf.is_symlink() and conf.read_text() == "port = 1\n"
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


@pytest.mark.parametrize(
    ("code", "fix"),
    [
        (errno.ENOSPC, "free space on the disk holding"),
        (errno.EROFS, "writable by uid"),
        (errno.EACCES, "writable by uid"),
        (errno.ENOTDIR, "must be a directory path"),
    ],
)
def test_a_home_that_cannot_be_written_is_one_sentence(code: int, fix: str) -> None:
    home = Path("/srv/opledger")
    message = stack.describe_os_error(OSError(code, "reason", str(home / "run")), home)
    assert message.startswith(f"cannot write {home / 'run'} (reason): ")
    assert fix in message and "\n" not in message


def test_every_worker_port_is_checked_with_the_variable_that_moves_it() -> None:
    settings = Settings.from_env().with_(fake_provider_url="http://127.0.0.1:2345")
    ports = dict(stack.worker_ports(settings))
    assert ports[2345] == "OPLEDGER_FAKE_PROVIDER_URL"
    assert ports[settings.projector_web_port] == "OPLEDGER_PROJECTOR_WEB_PORT"
    assert len(ports) == len(supervisor.WORKERS), "one port per worker"


class _SignalsWhileRead:
    """A configuration value that delivers SIGTERM to this process while librdkafka's Python
    binding reads it: the signal lands inside C code, which replaces the handler's exception
    with its own TypeError (what failed CI once, in ``kafka_healthy`` during ``stack up``)."""

    def __str__(self) -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        return "opledger-test"


def test_a_sigterm_landing_inside_a_c_extension_is_still_an_interruption() -> None:
    before = signal.getsignal(signal.SIGTERM)
    interrupted = pytest.raises(stack.StackInterruptedError, match="stopped by SIGTERM")
    with interrupted as raised, stack.sigterm_interrupts("up"):
        AdminClient({"bootstrap.servers": "127.0.0.1:9", "client.id": _SignalsWhileRead()})  # type: ignore[dict-item]
    assert isinstance(raised.value.__cause__, TypeError)
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_error_without_a_sigterm_is_left_as_it_is() -> None:
    refused = pytest.raises(KafkaException, match="No such configuration property")
    with refused, stack.sigterm_interrupts("up"):
        AdminClient({"bootstrap.servers": "127.0.0.1:9", "no.such.property": "x"})
