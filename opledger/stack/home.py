"""The layout of ``settings.home`` (outside the git tree): the broker's jars, its data,
PostgreSQL's cluster, pid files, logs and secrets; and the lock that lets one stack command at
a time work in it."""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from ledger.domain.display import displayable
from ledger.settings import Settings
from opledger import supervisor
from opledger.stack.errors import StackError
from opledger.stack.processes import Echo, is_root


def libs_dir(settings: Settings) -> Path:
    """The broker's jars, one directory per Kafka version."""
    return settings.home / f"kafka-{settings.kafka_version}" / "libs"


def jars_marker(settings: Settings) -> Path:
    """Present once Maven has put every jar of the version into :func:`libs_dir`."""
    # Written only after Maven succeeded, so an interrupted download is retried, not trusted.
    return settings.home / f"kafka-{settings.kafka_version}" / "jars.complete"


def kafka_data(settings: Settings) -> Path:
    """The broker's log dirs (its KRaft metadata and the topics' data)."""
    return settings.home / "kafka-data"


def kafka_conf(settings: Settings) -> Path:
    """Where the broker's ``server.properties`` is written on every start."""
    return settings.home / "kafka-conf"


def pg_data(settings: Settings) -> Path:
    """PostgreSQL's cluster (its data directory)."""
    return settings.home / "postgres"


def pg_socket_dir(settings: Settings) -> Path:
    """The directory of PostgreSQL's Unix socket."""
    return settings.home / "pg-socket"


def _run_dir(settings: Settings) -> Path:
    return supervisor.run_dir(settings)


def kafka_pid_file(settings: Settings) -> Path:
    """The broker's pid, a hint only: ``kafka.kafka_pid`` checks the process."""
    return _run_dir(settings) / "kafka.pid"


def log_files(settings: Settings) -> dict[str, Path]:
    """The logs worth reading when something fails, by component."""
    logs = settings.home / "logs"
    return {
        "kafka": logs / "kafka.log",
        "kafka-stdout": logs / "kafka.out",
        "postgres": logs / "postgres.log",
        "supervisor": supervisor.supervisor_log(settings),
        **{spec.name: supervisor.worker_log(settings, spec.name) for spec in supervisor.WORKERS},
    }


def _lock_path(settings: Settings) -> Path:
    return settings.home / ".stack.lock"


@contextlib.contextmanager
def locked(settings: Settings, what: str, echo: Echo = print) -> Iterator[None]:
    """One stack command at a time per home: several pytest sessions and make targets call
    `up` at once, and `down` or `restart` during an `up` would stop what it is starting. The
    others wait, told which process they wait for."""
    prepare_home(settings)
    try:
        fd = os.open(_lock_path(settings), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise StackError(_home_error(settings, exc)) from None
    with os.fdopen(fd, "r+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            echo(
                f"waiting for `opledger stack` ({_lock_holder(lock.fileno())}) to finish with "
                f"{settings.home} before `stack {what}`"
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _lock_holder(fd: int) -> str:
    """``pid N: its command line`` of the process holding the flock on ``fd``, from the
    kernel's own table (a file the holder writes would be read before it is written)."""
    found = os.fstat(fd)
    wanted = f"{os.major(found.st_dev):02x}:{os.minor(found.st_dev):02x}:{found.st_ino}"
    try:
        table = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return "another process"
    for line in table:
        # "1: FLOCK  ADVISORY  WRITE 1234 fd:00:5678 0 EOF"; a waiter's line has "->" second.
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == wanted:
            argv = supervisor.argv_of(int(fields[4])) or []
            command = b" ".join(argv).decode(errors="replace")[:200]
            return displayable(f"pid {fields[4]}: {command}" if command else f"pid {fields[4]}")
    return "another process"


def prepare_home(settings: Settings) -> None:
    """Create home, its logs and its run directory; a :class:`StackError` saying how to fix it
    when that fails."""
    try:
        for directory in (settings.home, settings.home / "logs", _run_dir(settings)):
            directory.mkdir(parents=True, exist_ok=True)
        if is_root():
            # The unprivileged PostgreSQL user must traverse home to reach its own directories.
            settings.home.chmod(0o755)
    except OSError as exc:
        raise StackError(_home_error(settings, exc)) from None


def _home_error(settings: Settings, exc: OSError) -> str:
    return describe_os_error(exc, settings.home)


#: Errors that say the disk holding OPLEDGER_HOME cannot take what the stack writes.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def describe_os_error(exc: OSError, home: Path) -> str:
    """One sentence for a file operation under OPLEDGER_HOME that failed: what, and the fix."""
    where = exc.filename or home
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free space on the disk holding {home} or point OPLEDGER_HOME at another disk"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = (
            f"make {home} writable by uid {os.geteuid()} or point OPLEDGER_HOME at a "
            "directory that is"
        )
    elif exc.errno in (errno.ENOTDIR, errno.EEXIST, errno.ELOOP):
        fix = f"OPLEDGER_HOME ({home}) must be a directory path with no file or symlink in the way"
    else:
        fix = f"check {home} and point OPLEDGER_HOME elsewhere if it cannot be used"
    return f"cannot write {where} ({reason}): {fix}"


def consumer_secret_file(settings: Settings) -> Path:
    """Where the local stack keeps the reference consumer's webhook signing secret."""
    return settings.home / supervisor.LOCAL_CONSUMER_SECRET


def ensure_consumer_secret(settings: Settings) -> Path:
    """Write a new ``whsec_`` secret for the local reference consumer, once; returns its path.

    Created with mode 0600 in a 0700 directory, never rewritten (destinations added with it
    keep working), and tightened back to 0600 if someone widened it.
    """
    path = consumer_secret_file(settings)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        path.chmod(0o600)
        return path
    # Standard Webhooks: "whsec_" + base64 of the key (32 random bytes here).
    secret = "whsec_" + base64.b64encode(os.urandom(32)).decode("ascii")
    with os.fdopen(fd, "w") as out:
        out.write(secret + "\n")
    return path
