"""Running and watching processes, shared by the servers and the supervisor: tools run to
completion, loopback ports probed, log tails made safe to print."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from ledger.domain.display import displayable
from ledger.secrets import scrub
from opledger.stack.errors import StackError

Echo = Callable[[str], None]


def is_root() -> bool:
    """Whether this process runs as root (PostgreSQL then runs as its own user)."""
    return os.geteuid() == 0


def run(argv: Sequence[str], what: str, cwd: Path | None = None) -> str:
    """Run ``argv`` to completion and return its stdout; a :class:`StackError` naming ``what``
    and the end of its output when it fails."""
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False, cwd=cwd)
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()[-3000:]
        raise StackError(f"{what} failed (exit {result.returncode}): {output}")
    return result.stdout


def port_open(port: int) -> bool:
    """Whether something listens on 127.0.0.1:``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        if sock.connect_ex(("127.0.0.1", port)) != 0:
            return False
        # A port inside the ephemeral range can "answer" by TCP simultaneous open: the
        # kernel hands this very socket the port it dials and it connects to itself.
        return bool(sock.getsockname() != sock.getpeername())


#: A log line longer than this is shown cut: scrubbing costs more than linearly in its length.
TAIL_LINE_MAX = 2000


def tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log, safe to print: a log file can hold anything (a
    process's stray output, a line written by hand), so secrets are scrubbed and characters a
    terminal would act on (escape sequences, carriage returns) are shown escaped."""
    try:
        with path.open("rb") as log:
            # Only the end is read: a server's log grows to gigabytes.
            size = log.seek(0, os.SEEK_END)
            log.seek(max(0, size - (lines + 1) * 4 * TAIL_LINE_MAX))
            text = log.read().decode(errors="replace")
    except OSError:
        return f"({path} not readable)"
    # Split on newlines only: a carriage return must not start a line of its own (a forged
    # line); it is shown escaped instead.
    shown = text.split("\n")
    if shown and shown[-1] == "":
        shown.pop()
    if lines <= 0:
        return ""
    return "\n".join(displayable(scrub(_cut(line))) for line in shown[-lines:])


def _cut(line: str) -> str:
    return line if len(line) <= TAIL_LINE_MAX else line[:TAIL_LINE_MAX] + " [cut]"
