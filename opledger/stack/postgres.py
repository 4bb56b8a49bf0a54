"""The local stack's PostgreSQL server on 127.0.0.1: the server binaries (installed when
absent), the cluster ``initdb`` creates and the ``opledger.conf`` it includes, the server's
start and stop, and the databases opledger needs on it."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ledger import pg
from ledger.private_files import create_private_once
from ledger.settings import PG_SERVICE_ROLES, Settings, pg_role_name
from opledger import supervisor
from opledger.stack.errors import StackError
from opledger.stack.home import (
    log_files,
    pg_data,
    pg_socket_dir,
)
from opledger.stack.processes import Echo, is_root, port_open, run, tail

PG_USER = "opledger"


PG_DATABASE = "opledger"


PG_START_TIMEOUT = 60


def _as_pg_user(argv: Sequence[str]) -> list[str]:
    # PostgreSQL refuses to run as root, so as root every server command runs as PG_USER.
    return ["runuser", "-u", PG_USER, "--", *argv] if is_root() else list(argv)


def find_pg_bindir(path: str | None = None) -> Path | None:
    """Directory of the newest PostgreSQL server binaries installed, if any."""

    def version(bindir: Path) -> int:
        return int(bindir.parent.name) if bindir.parent.name.isdigit() else 0

    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    pg_config = shutil.which("pg_config", path=path)
    if pg_config:
        result = subprocess.run(
            [pg_config, "--bindir"], capture_output=True, text=True, check=False
        )
        if result.returncode == 0:
            candidates.append(Path(result.stdout.strip()))
    for bindir in candidates:
        if all((bindir / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres")):
            return bindir
    return None


def _ensure_pg_bindir(echo: Echo) -> Path:
    bindir = find_pg_bindir()
    if bindir is not None:
        return bindir
    if not is_root():
        raise StackError(
            "PostgreSQL server not found: install it (sudo apt-get install postgresql) "
            "or put its bin directory (with initdb and pg_ctl) on PATH"
        )
    echo("postgres: server not installed, running apt-get install postgresql")
    # `env` sets the variable for apt without this module touching os.environ. The package may
    # start Debian's own cluster on 5432; it is harmless to us, we run our own on pg_port.
    run(["apt-get", "update"], "apt-get update")
    run(
        ["env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "postgresql"],
        "apt-get install postgresql",
    )
    bindir = find_pg_bindir()
    if bindir is None:
        raise StackError("apt-get installed postgresql but no initdb/pg_ctl was found")
    return bindir


def _ensure_pg_user() -> None:
    try:
        pwd.getpwnam(PG_USER)
    except KeyError:
        run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_USER],
            f"useradd {PG_USER}",
        )


def _own(path: Path) -> None:
    if is_root():
        entry = pwd.getpwnam(PG_USER)
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _prepare_pg_paths(settings: Settings) -> None:
    if is_root():
        _ensure_pg_user()
    for directory, mode in ((pg_data(settings), 0o700), (pg_socket_dir(settings), 0o755)):
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(mode)
        _own(directory)
    log = log_files(settings)["postgres"]
    log.touch()
    _own(log)


def _pg_config_text(settings: Settings) -> str:
    # Durability settings stay at their safe values on purpose: the ledger claims durability,
    # and tests that pass on fsync=off would prove nothing about it.
    lines = {
        "listen_addresses": "'127.0.0.1'",
        "port": str(settings.pg_port),
        "unix_socket_directories": f"'{pg_socket_dir(settings)}'",
        "max_connections": "100",
        "shared_buffers": "'256MB'",
        "fsync": "on",
        "synchronous_commit": "on",
        "full_page_writes": "on",
        "wal_level": "replica",
    }
    header = "# written by `opledger stack up` on every start; edit Settings, not this file\n"
    return header + "".join(f"{key} = {value}\n" for key, value in lines.items())


def _init_pg(settings: Settings, bindir: Path) -> None:
    data = pg_data(settings)
    if not (data / "PG_VERSION").is_file():
        # Born with a password: no moment in which the server trusts whoever connects.
        password_file = settings.home / f".initdb-password.{os.getpid()}"
        fd = os.open(password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(_ensure_passfile(settings) + "\n")
        _own(password_file)
        try:
            run(
                _as_pg_user(
                    [
                        str(bindir / "initdb"),
                        "-D",
                        str(data),
                        "-U",
                        PG_USER,
                        "--auth=scram-sha-256",
                        f"--pwfile={password_file}",
                        "-E",
                        "UTF8",
                        "--locale=C",
                    ]
                ),
                "initdb",
                cwd=settings.home,
            )
        finally:
            password_file.unlink(missing_ok=True)
        conf = os.open(data / "postgresql.conf", os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
        with os.fdopen(conf, "a") as out:
            out.write("\ninclude_if_exists = 'opledger.conf'\n")
    _write_pg_owned(data / "opledger.conf", _pg_config_text(settings))


def _write_pg_owned(path: Path, text: str) -> None:
    """Replace ``path`` in the data directory with ``text``, owned by PG_USER.

    The data directory belongs to PG_USER, so as root anything in it may have been replaced by
    a symlink (say, to /etc/passwd): writing or chowning through it would hand that file to
    PG_USER; :func:`supervisor.write_atomically` renames a new file over the name instead.
    """
    owner = None
    if is_root():
        entry = pwd.getpwnam(PG_USER)
        owner = (entry.pw_uid, entry.pw_gid)
    supervisor.write_atomically(path, text, owner)


def _postmaster_file(settings: Settings) -> Path:
    return pg_data(settings) / "postmaster.pid"


def _is_postmaster(pid: int, data: Path) -> bool | None:
    """Whether ``pid`` is a PostgreSQL server of ``data``: it moves into its data directory
    before it writes postmaster.pid. None when this user may not inspect the process."""
    argv = supervisor.argv_of(pid)
    if argv is None:
        return False
    inside = supervisor.runs_in(pid, data)
    if inside is None:
        return None
    return inside and Path(argv[0].decode(errors="replace")).name == "postgres"


def postgres_pid(settings: Settings) -> int | None:
    """Pid of the postmaster serving our data directory, if it is alive (postmaster.pid can
    outlive its server, and after a crash or a reboot name some other process)."""
    pid = supervisor.read_pid(_postmaster_file(settings))
    if pid is None or _is_postmaster(pid, pg_data(settings)) is False:
        return None
    return pid


def _clear_stale_postmaster_pid(settings: Settings, echo: Echo) -> None:
    """Remove a postmaster.pid naming a live process that is not our server, which PostgreSQL
    would take for another postmaster and refuse to start beside (it handles a dead pid)."""
    path = _postmaster_file(settings)
    pid = supervisor.read_pid(path)
    if pid is None or not supervisor.alive(pid):
        return
    if _is_postmaster(pid, pg_data(settings)) is None:
        raise StackError(
            f"{path} names pid {pid}, which this user may not inspect: stop that process if it "
            f"is PostgreSQL serving {pg_data(settings)}, else remove {path}"
        )
    if port_open(settings.pg_port):
        return  # the port check that follows names the problem
    path.unlink(missing_ok=True)
    echo(f"postgres: removed a stale {path.name} naming pid {pid}, now another process")


#: How the launcher's own sessions are named in pg_stat_activity.
_PG_SESSION = "opledger-stack"


def _admin_dsn(settings: Settings) -> str:
    return make_conninfo(
        user=PG_USER,
        host="127.0.0.1",
        port=str(settings.pg_port),
        dbname="postgres",
        passfile=str(settings.pg_passfile_path),
    )


#: Every connection, over the socket or TCP, shows its role's password (SCRAM-SHA-256): a user
#: of the machine is not a user of the database.
_HBA = """# written by `opledger stack up` on every start; nobody on the machine is trusted
local all all scram-sha-256
host  all all 127.0.0.1/32 scram-sha-256
host  all all ::1/128 scram-sha-256
"""


def _ensure_passfile(settings: Settings) -> str:
    """The superuser's password, from the stack's passfile (made once, 0600)."""
    path = settings.pg_passfile_path
    create_private_once(path, lambda: f"*:*:*:{PG_USER}:{secrets.token_urlsafe(24)}\n")
    return path.read_text().strip().rsplit(":", 1)[1]


def require_passwords(settings: Settings) -> None:
    """Give the superuser the passfile's password, then make the server ask every connection
    for one. A cluster made before this (``trust`` for every local user) is converted on the
    first `stack up` that meets it, while its old rule still lets the launcher in."""
    password = _ensure_passfile(settings)
    hba = pg_data(settings) / "pg_hba.conf"
    if hba.is_file() and hba.read_text() == _HBA:
        return
    with pg.connect(_admin_dsn(settings), name=_PG_SESSION) as conn:
        _set_password(conn, PG_USER, password)
        _write_pg_owned(hba, _HBA)
        conn.execute("SELECT pg_reload_conf()")


#: Serialises `stack up`s giving the service roles their passwords (test workers start at once).
_LOGINS_LOCK = 0x6F706C6567726F6C  # "oplegrol"


def ensure_service_logins(settings: Settings) -> None:
    """Let each service role of decision 034 sign in with a password of its own, kept in its
    own 0600 passfile. The migrations made the roles and their rights; a role whose passfile
    already opens it is left alone."""
    if settings.pg_dsn:
        return  # a server of the user's: its roles are its administrator's
    for role in PG_SERVICE_ROLES:
        user = pg_role_name(role)
        path = settings.pg_passfile_path_of(user)
        create_private_once(path, partial(_passfile_line, user))
        if _can_sign_in(settings, user):
            continue
        password = path.read_text().strip().rsplit(":", 1)[1]
        with pg.connect(_admin_dsn(settings), name=_PG_SESSION) as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOGINS_LOCK,))
            _set_password(conn, user, password, login=True)


def _passfile_line(user: str) -> str:
    return f"*:*:*:{user}:{secrets.token_urlsafe(24)}\n"


def _can_sign_in(settings: Settings, user: str) -> bool:
    dsn = make_conninfo(
        user=user,
        host="127.0.0.1",
        port=str(settings.pg_port),
        dbname="postgres",
        passfile=str(settings.pg_passfile_path_of(user)),
    )
    try:
        with pg.connect(dsn, name=_PG_SESSION, connect_timeout=5):
            return True
    except psycopg.OperationalError:
        return False


def _set_password(
    conn: psycopg.Connection[object], user: str, password: str, *, login: bool = False
) -> None:
    # Hashed by libpq before it is sent: no statement the server may log holds it.
    verifier = conn.pgconn.encrypt_password(password.encode(), user.encode(), b"scram-sha-256")
    conn.execute(
        sql.SQL("ALTER ROLE {} {} PASSWORD {}").format(
            sql.Identifier(user),
            sql.SQL("LOGIN" if login else ""),
            sql.Literal(verifier.decode()),
        )
    )


def postgres_version(settings: Settings) -> str | None:
    """Server version when our PostgreSQL accepts connections, else None."""
    try:
        with pg.connect(_admin_dsn(settings), name=_PG_SESSION, connect_timeout=3) as conn:
            row = conn.execute("SHOW server_version").fetchone()
    except psycopg.Error:
        return None
    # "15.18 (Debian 15.18-0+deb12u1)": the number is what status needs.
    return str(row[0]).split()[0] if row else None


def start_postgres(settings: Settings, echo: Echo) -> None:
    """Install, initialise and start the server as needed, then ensure opledger's databases."""
    bindir = _ensure_pg_bindir(echo)
    _prepare_pg_paths(settings)
    _init_pg(settings, bindir)
    if postgres_pid(settings) is None:
        _clear_stale_postmaster_pid(settings, echo)
        if port_open(settings.pg_port):
            raise StackError(
                f"127.0.0.1:{settings.pg_port} is in use by a process opledger did not start: "
                "stop it or choose another port with OPLEDGER_PG_PORT"
            )
        echo(f"postgres: starting on 127.0.0.1:{settings.pg_port}")
        try:
            run(
                _as_pg_user(
                    [
                        str(bindir / "pg_ctl"),
                        "-D",
                        str(pg_data(settings)),
                        "-l",
                        str(log_files(settings)["postgres"]),
                        "-w",
                        "-t",
                        str(PG_START_TIMEOUT),
                        "start",
                    ]
                ),
                "pg_ctl start",
                cwd=settings.home,
            )
        except StackError as exc:
            raise StackError(
                f"{exc}\nlast log lines:\n{tail(log_files(settings)['postgres'])}"
            ) from None
    ensure_database(settings)


def ensure_database(settings: Settings) -> None:
    """Wait until the server accepts connections, then create opledger's and the reference
    consumer's databases if missing."""
    deadline = time.monotonic() + PG_START_TIMEOUT
    while postgres_version(settings) is None:
        if time.monotonic() > deadline:
            raise StackError(
                f"postgres not accepting connections after {PG_START_TIMEOUT}s; last log "
                f"lines:\n{tail(log_files(settings)['postgres'])}"
            )
        time.sleep(0.3)
    require_passwords(settings)
    with pg.connect(_admin_dsn(settings), name=_PG_SESSION) as conn:
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (PG_DATABASE,)
        ).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{PG_DATABASE}" OWNER "{PG_USER}"')
    with pg.connect(settings.dsn, name=_PG_SESSION):
        pass
    _ensure_consumer_database(settings)


def _ensure_consumer_database(settings: Settings) -> None:
    """The reference consumer's own database on the local server (it creates its tables, not
    its database). Left alone when OPLEDGER_CONSUMER_PG_DSN points elsewhere."""
    if settings.consumer_pg_dsn:
        return
    name = conninfo_to_dict(settings.consumer_dsn).get("dbname")
    if not name:
        return
    with pg.connect(_admin_dsn(settings), name=_PG_SESSION) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(
                sql.SQL("CREATE DATABASE {} OWNER {}").format(
                    sql.Identifier(str(name)), sql.Identifier(PG_USER)
                )
            )


def stop_postgres(settings: Settings, echo: Echo) -> None:
    """Stop the server with ``pg_ctl stop -m fast`` (sessions cut, data flushed)."""
    pid = postgres_pid(settings)
    bindir = find_pg_bindir()
    if pid is None or bindir is None:
        echo("postgres: not running")
        return
    run(
        _as_pg_user(
            [str(bindir / "pg_ctl"), "-D", str(pg_data(settings)), "-m", "fast", "-w", "stop"]
        ),
        "pg_ctl stop",
        cwd=settings.home,
    )
    echo(f"postgres: stopped (pid {pid})")
