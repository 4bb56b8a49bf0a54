"""What goes wrong in a stack command: :class:`StackError` says how to fix it; a SIGTERM
stops the command as :class:`StackInterruptedError`."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class StackError(RuntimeError):
    """The stack cannot be brought up or down; the message says how to fix it."""


class StackInterruptedError(StackError):
    """A stack command was stopped by SIGTERM; what it had started keeps running."""


@contextlib.contextmanager
def sigterm_interrupts(what: str) -> Iterator[None]:
    """SIGTERM raises :class:`StackInterruptedError` inside: the command stops where it is, the
    child it waits for (mvn, initdb, pg_ctl) is killed with it by ``subprocess.run``, and the
    caller says what was left. What it started is tracked (pid files, or found in /proc by
    its working directory), so the next ``up`` finishes the job and ``down`` stops it.

    A C extension running when the signal lands may turn the handler's exception into its own
    (confluent-kafka's AdminClient reports it as ``TypeError: expected configuration property
    name``), so whatever escapes after a SIGTERM is reported as the interruption it was."""
    message = (
        f"stack {what} stopped by SIGTERM; what it started keeps running: "
        "`opledger stack up` finishes the start, `opledger stack down` stops it"
    )
    received = threading.Event()

    def interrupt(signum: int, frame: object) -> None:
        received.set()
        raise StackInterruptedError(message)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    except StackInterruptedError:
        raise
    except BaseException as exc:
        if received.is_set():
            raise StackInterruptedError(message) from exc
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
