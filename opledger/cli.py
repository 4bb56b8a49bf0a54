"""The ``opledger`` command line.

Subcommands are contributed by *registrars*: functions that add parsers to the top-level
subparsers and set a ``handler`` default, either a callable ``(args, settings) -> int`` or a
``"module:function"`` string imported only when that subcommand runs, so ``opledger stack up``
never pays for importing faust.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

from ledger.settings import Settings, SettingsError
from opledger import (
    analysts,
    audit,
    backup,
    consumer,
    db,
    deliver,
    demo,
    export,
    kafka_admin,
    ops,
    policy,
    projector,
    recover,
    replay,
    stack,
    supervisor,
)
from opledger.fakes import commands as fake_provider

if TYPE_CHECKING:
    Commands = argparse._SubParsersAction[argparse.ArgumentParser]
else:
    Commands = argparse._SubParsersAction

Handler = Callable[[argparse.Namespace, Settings], int]
Registrar = Callable[[Commands], None]

#: Exit code of ``stack status`` when something is not healthy (like ``pg_ctl status``).
EXIT_UNHEALTHY = 3
#: Exit code for errors whose message says how to fix them (no traceback).
EXIT_USAGE = 2
#: Exit code when the reader of our output went away: what a shell reports for SIGPIPE.
EXIT_BROKEN_PIPE = 128 + 13


def add_command(
    commands: Commands, name: str, handler: Handler | str, help_text: str
) -> argparse.ArgumentParser:
    """Add one subcommand; ``handler`` may be ``"package.module:function"`` to import lazily."""
    parser = commands.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(handler=handler)
    return parser


#: Exit code of a stack command stopped by SIGTERM: what a shell reports for that signal.
EXIT_TERMINATED = 128 + 15


def _stack_command(run: Handler) -> Handler:
    """A stack command: SIGTERM stops it with a sentence saying what is left, and a file
    under OPLEDGER_HOME that cannot be written (full disk, read-only, not a directory) is one
    sentence saying how to fix it, not a traceback."""

    def handler(args: argparse.Namespace, settings: Settings) -> int:
        try:
            with stack.sigterm_interrupts(args.action):
                return run(args, settings)
        except stack.StackInterruptedError as exc:
            print(f"opledger: {exc}", file=sys.stderr)
            return EXIT_TERMINATED
        except OSError as exc:
            # A flush on a full disk names no file; a broken pipe is not about the home.
            if isinstance(exc, BrokenPipeError) or (
                exc.filename is None and exc.errno not in stack.STORAGE_ERRNOS
            ):
                raise
            raise stack.StackError(stack.describe_os_error(exc, settings.home)) from None

    return handler


@_stack_command
def _stack_up(args: argparse.Namespace, settings: Settings) -> int:
    stack.up(settings, workers=not args.no_workers)
    return 0


@_stack_command
def _stack_down(args: argparse.Namespace, settings: Settings) -> int:
    stack.down(settings)
    return 0


@_stack_command
def _stack_status(args: argparse.Namespace, settings: Settings) -> int:
    return 0 if stack.status(settings) else EXIT_UNHEALTHY


@_stack_command
def _stack_restart(args: argparse.Namespace, settings: Settings) -> int:
    if args.service in _worker_names():
        stack.restart_worker(settings, args.service, kill=args.kill)
    else:
        stack.restart(settings, args.service, kill=args.kill)
    return 0


def _worker_names() -> tuple[str, ...]:
    return tuple(spec.name for spec in supervisor.WORKERS)


@_stack_command
def _stack_logs(args: argparse.Namespace, settings: Settings) -> int:
    stack.logs(settings, lines=args.lines)
    return 0


def register_stack(commands: Commands) -> None:
    """``opledger stack up|down|status|logs``."""
    parser = commands.add_parser("stack", help="the local Kafka + PostgreSQL stack")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = add_command(
        actions,
        "up",
        _stack_up,
        "start Kafka and PostgreSQL (idempotent), create topics, then the supervisor that keeps "
        "the workers (the projector) running",
    )
    up.add_argument(
        "--no-workers",
        action="store_true",
        help="start only Kafka and PostgreSQL, no supervisor and no workers",
    )
    add_command(
        actions, "down", _stack_down, "stop the workers, then Kafka and PostgreSQL; data is kept"
    )
    add_command(
        actions,
        "status",
        _stack_status,
        "what runs where, workers included; exit 3 unless Kafka and PostgreSQL are healthy "
        "(workers are shown but do not change the exit code)",
    )
    restart = add_command(
        actions,
        "restart",
        _stack_restart,
        "stop and start kafka or postgres while the workers keep running, or stop one worker "
        "and wait until the supervisor has started it again",
    )
    restart.add_argument("service", choices=("kafka", "postgres", *_worker_names()))
    restart.add_argument(
        "--kill",
        action="store_true",
        help="kafka or a worker: SIGKILL it instead of stopping it cleanly",
    )
    logs = add_command(actions, "logs", _stack_logs, "print the tail of the stack's logs")
    logs.add_argument("-n", "--lines", type=int, default=40, help="lines per log (default 40)")


#: Every subcommand group. To add one, write ``register(commands)`` in your module (keep its
#: top-level imports light; point handlers at "module:function" strings) and list it here.
REGISTRARS: list[Registrar] = [
    register_stack,
    db.register,
    projector.register,
    recover.register,
    deliver.register,
    ops.register,
    policy.register,
    analysts.register,
    kafka_admin.register,
    replay.register,
    audit.register,
    export.register,
    backup.register,
    demo.register,
    fake_provider.register,
    consumer.register,
]


class _Parser(argparse.ArgumentParser):
    """A refusal of the arguments says that nothing happened, so a caller need not wonder
    whether a half-checked command wrote anything (every subcommand's parser is one of these)."""

    def error(self, message: str) -> NoReturn:
        super().error(f"{message}\nnothing was recorded or changed")


def build_parser(registrars: Sequence[Registrar] = REGISTRARS) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = _Parser(
        prog="opledger",
        description="Event-sourced ledger of AI agent tool calls. "
        "Configured by OPLEDGER_* environment variables (see ledger/settings.py).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in registrars:
        register(commands)
    return parser


def _resolve(handler: Handler | str) -> Handler:
    if callable(handler):
        return handler
    module, _, name = handler.partition(":")
    resolved: Handler = getattr(importlib.import_module(module), name)
    return resolved


#: Words after a command that name a command of their own: ``opledger audit export`` is
#: ``audit-export``, since no operation id ``opledger audit OP`` takes can be "export".
ROUTED = {"audit": export.SUBCOMMANDS}


def _routed(argv: list[str]) -> list[str]:
    if len(argv) >= 2 and argv[1] in ROUTED.get(argv[0], {}):
        return [ROUTED[argv[0]][argv[1]], *argv[2:]]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``opledger`` console script."""
    args = build_parser().parse_args(_routed(list(sys.argv[1:] if argv is None else argv)))
    try:
        settings = Settings.from_env()
        # The Kafka principal of the command's role (ledger.kafka_access), unless
        # OPLEDGER_KAFKA_PRINCIPAL names one: a worker signs in as itself, `policy` as the
        # operator, everything else as "sdk".
        if role := getattr(args, "kafka_role", None):
            settings = settings.as_kafka_role(role)
        # Its database role likewise (decision 034): a worker's own, the owner for the rest.
        if role := getattr(args, "pg_role", None):
            settings = settings.as_pg_role(role)
        return _resolve(args.handler)(args, settings)
    except (stack.StackError, SettingsError) as exc:
        print(f"opledger: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`opledger ops list | head`): say nothing more, and keep the
        # interpreter from reporting the same error again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
