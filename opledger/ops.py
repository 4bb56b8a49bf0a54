"""``opledger ops list|show``: the analyst queries (``projections.queries``) as tables.

Registration imports nothing heavy of its own: rich and the queries are imported by the
handlers. (psycopg and confluent-kafka are loaded by ``opledger.cli`` itself, through the stack
and database commands, for every subcommand.)
"""

from __future__ import annotations

import argparse
import re
import sys
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ledger.settings import Settings
from opledger import arguments

if TYPE_CHECKING:
    import psycopg
    from rich.console import Console

    from projections.queries import (
        DeliveryRow,
        HistoryRow,
        OperationDetail,
        OperationRow,
        ReconciliationRow,
    )

#: Exit code for errors whose message says how to fix them (same as ``opledger.cli``).
EXIT_USAGE = 2

_DURATION = re.compile(r"^(\d+)([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
#: The longest duration accepted: far past any age or expiry that means something, and short
#: enough that "now" plus or minus it is an instant Python and PostgreSQL both hold.
MAX_DURATION = timedelta(days=1000 * 365)


class DurationTooLongError(argparse.ArgumentTypeError):
    """A duration longer than :data:`MAX_DURATION`."""


def parse_duration(text: str) -> timedelta:
    """``90s``, ``5m``, ``2h``, ``1d``, ``1w`` -> timedelta (argparse type; bad input exits 2)."""
    match = _DURATION.match(text.strip())
    if match is None or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(
            f"not a duration: {text!r} (a positive whole number and a unit: 90s, 5m, 2h, 1d, 1w)"
        )
    amount = int(match.group(1))
    unit = timedelta(**{_UNITS[match.group(2)]: 1})
    # Compared before a timedelta is built: 99999999999w is more than timedelta can hold.
    if amount > MAX_DURATION // unit:
        raise DurationTooLongError(
            f"too long a duration: {text!r} (at most {MAX_DURATION.days} days)"
        )
    return amount * unit


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def register(commands: Any) -> None:
    """``opledger ops list`` and ``opledger ops show``."""
    parser = commands.add_parser("ops", help="look up operations in the projections (per tenant)")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    list_parser = actions.add_parser(
        "list", help="a tenant's operations, oldest state change first"
    )
    list_parser.add_argument(
        "--tenant",
        required=True,
        type=arguments.tenant,
        help="tenant id (reads are per tenant)",
    )
    list_parser.add_argument(
        "--state",
        type=str.upper,
        help="execution state: INTENT_RECORDED, DISPATCHED, SUCCEEDED, FAILED or UNKNOWN",
    )
    list_parser.add_argument("--tool", type=arguments.tool, help="only this tool name")
    list_parser.add_argument(
        "--older-than",
        type=parse_duration,
        metavar="DURATION",
        help="current state entered longer ago than this (90s, 5m, 2h, 1d, 1w)",
    )
    list_parser.add_argument(
        "--limit", type=_limit, default=50, help="most rows to show (default 50)"
    )
    list_parser.set_defaults(handler="opledger.ops:list_command")
    show_parser = actions.add_parser(
        "show",
        help="one operation: execution, deliveries, reconciliations, full history and anomalies",
    )
    show_parser.add_argument("operation_id", type=arguments.operation_id, metavar="OP_ID")
    show_parser.add_argument(
        "--tenant",
        required=True,
        type=arguments.tenant,
        help="tenant id the operation belongs to",
    )
    show_parser.set_defaults(handler="opledger.ops:show_command")
    cancel_parser = actions.add_parser(
        "cancel",
        help="cancel an operation: final before dispatch; after dispatch it is reconciled, "
        "never attempted again",
    )
    cancel_parser.add_argument("operation_id", type=arguments.operation_id, metavar="OP_ID")
    cancel_parser.add_argument(
        "--tenant",
        required=True,
        type=arguments.tenant,
        help="tenant id the operation belongs to",
    )
    cancel_parser.add_argument(
        "--actor", required=True, type=arguments.actor, help="who cancels (recorded)"
    )
    cancel_parser.add_argument("--reason", required=True, help="why (recorded; no secrets)")
    cancel_parser.set_defaults(handler="opledger.ops:cancel_command")


def _fail(message: str) -> int:
    print(f"opledger: {message}", file=sys.stderr)
    return EXIT_USAGE


def _connect(settings: Settings) -> psycopg.Connection[Any]:
    from ledger import pg  # noqa: PLC0415  # handlers only

    # Read-only and autocommit: an analyst's lookup must never hold locks the projector waits on.
    return pg.connect(settings.dsn, name="opledger-ops", read_only=True)


def _run(settings: Settings, query: Any) -> tuple[int, Any]:
    """Run ``query(conn)``, turning expected failures into a message and exit code 2."""
    import psycopg  # noqa: PLC0415

    from ledger.domain.redact import redact  # noqa: PLC0415
    from projections.queries import QueryError  # noqa: PLC0415

    try:
        with _connect(settings) as conn:
            return 0, query(conn)
    except QueryError as exc:
        return _fail(str(exc)), None
    except psycopg.errors.UndefinedTable:
        return _fail(
            "the projection tables do not exist yet: run `opledger projector run` "
            "(or `opledger demo`) first"
        ), None
    except psycopg.OperationalError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return _fail(
            f"cannot reach PostgreSQL at {redact(settings.dsn)}: {first_line}\n"
            "is the stack up? start it with `opledger stack up`"
        ), None


def list_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger ops list``."""
    from projections import queries  # noqa: PLC0415

    code, rows = _run(
        settings,
        lambda conn: queries.list_operations(
            conn,
            args.tenant,
            state=args.state,
            tool=args.tool,
            older_than=args.older_than,
            limit=args.limit,
        ),
    )
    if code:
        return code
    console = _console()
    console.print(_operations_table(rows, args))
    return 0


def show_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger ops show OP_ID``."""
    from projections import queries  # noqa: PLC0415

    code, detail = _run(
        settings, lambda conn: queries.show_operation(conn, args.tenant, args.operation_id)
    )
    if code:
        return code
    if detail is None:
        return _fail(f"no operation {args.operation_id} for tenant {args.tenant}")
    _print_detail(_console(), detail)
    return 0


def cancel_problems(actor: str, reason: str) -> list[str]:
    """Why the log would refuse a cancel by ``actor`` for ``reason``, option by option (empty
    when it would take it). Checked before anything is done: a cancel takes the operation's
    lease by force first, so one refused afterwards would have taken it from a live owner for
    nothing. A refused value is never quoted back (a reason may hold a pasted secret)."""
    from pydantic import TypeAdapter, ValidationError  # noqa: PLC0415

    from ledger.domain import events  # noqa: PLC0415

    problems = []
    try:
        TypeAdapter(events.Identifier).validate_python(actor)
    except ValidationError:
        problems.append(
            "--actor: not valid: use letters, digits and . _ : @ / - (starting with a letter "
            "or digit, at most 128 characters)"
        )
    # The reason is recorded on its own (the decision) and, before dispatch, inside the error.
    said = f"cancelled before dispatch by {actor}: {reason}"
    for text in (reason, said):
        try:
            TypeAdapter(events.ErrorText).validate_python(text)
        except ValidationError as exc:
            message = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
            if exc.errors()[0]["type"] == "string_too_long":
                message = f"too long: at most {events.MAX_ERROR_LENGTH} characters with --actor"
            problems.append(f"--reason: {message}")
            break
    return problems


def cancel_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger ops cancel OP_ID``."""
    from ledger.errors import RecordError  # noqa: PLC0415
    from producers import TransitionRecorder  # noqa: PLC0415

    problems = cancel_problems(args.actor, args.reason)
    if problems:
        return _fail("\n".join([*problems, "nothing was recorded"]))
    try:
        with TransitionRecorder.connect(settings, owner=f"cancel:{args.actor}") as recorder:
            handle = recorder.cancel(args.operation_id, args.tenant, args.actor, args.reason)
    except RecordError as exc:
        return _fail(str(exc))
    execution = handle.require_execution()
    if execution.state.value == "FAILED":
        print(f"{args.operation_id}: cancelled before dispatch (FAILED, no call was made)")
    else:
        print(
            f"{args.operation_id}: cancelled while {execution.state.value}: it will be "
            "reconciled with the provider and never attempted again"
        )
    return 0


# -- rendering ------------------------------------------------------------------------------------


def _console() -> Console:
    from rich.console import Console  # noqa: PLC0415

    console = Console()
    if not console.is_terminal:
        # Piped or captured: never truncate ids to the 80-column default.
        console = Console(width=240)
    return console


def format_age(age: timedelta) -> str:
    """``3d 4h``, ``2h 5m``, ``4m 10s``, ``7s``: two units are enough to judge staleness."""
    seconds = int(age.total_seconds())
    if seconds < 0:
        return "in the future"
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {seconds}s"
    return f"{seconds}s"


def _age(moment: datetime | None) -> str:
    return "-" if moment is None else format_age(datetime.now(moment.tzinfo) - moment)


def _when(moment: datetime | None) -> str:
    return "-" if moment is None else moment.isoformat(sep=" ", timespec="milliseconds")


_STATE_STYLE = {
    "SUCCEEDED": "green",
    "ACKED": "green",
    "FAILED": "red",
    "DEAD_LETTERED": "red",
    "UNKNOWN": "bold yellow",
    "DISPATCHED": "cyan",
    "SENT": "cyan",
}


def _state(value: str) -> str:
    style = _STATE_STYLE.get(value)
    return f"[{style}]{value}[/]" if style else value


def _operations_table(rows: list[OperationRow], args: argparse.Namespace) -> Any:
    from rich.table import Table  # noqa: PLC0415

    from opledger.terminal import shown  # noqa: PLC0415

    filters = [f"tenant {args.tenant}"]
    if args.state:
        filters.append(f"state {args.state}")
    if args.tool:
        filters.append(f"tool {args.tool}")
    if args.older_than:
        filters.append(f"older than {args.older_than}")
    table = Table(title=f"{len(rows)} operations ({', '.join(filters)})", title_justify="left")
    for column in ("operation_id", "tool", "state", "attempt", "in state for", "actor", "error"):
        table.add_column(column, no_wrap=column != "error")
    for r in rows:
        table.add_row(
            r.operation_id,
            r.tool_name,
            _state(r.execution_state.value),
            str(r.attempt),
            _age(r.state_entered_at),
            shown(r.actor_id),
            shown(r.error or ""),
        )
    return table


def _print_detail(console: Console, detail: OperationDetail) -> None:
    from rich.table import Table  # noqa: PLC0415

    from opledger.terminal import shown  # noqa: PLC0415

    op = detail.operation
    if op is None:
        console.print("[yellow]no execution recorded for this operation (deliveries only)[/]")
    else:
        table = Table(title=f"operation {op.operation_id}", title_justify="left", show_header=False)
        table.add_column("field", style="bold")
        table.add_column("value")
        for name, value in (
            ("tenant", op.tenant_id),
            ("actor", op.actor_id),
            ("tool", op.tool_name),
            ("execution state", _state(op.execution_state.value)),
            ("attempt", str(op.attempt)),
            ("in state for", _age(op.state_entered_at)),
            ("provider_ref", shown(op.provider_ref or "-")),
            ("result_ref", op.result_ref or "-"),
            ("error", shown(op.error or "-")),
            ("created", _when(op.created_at)),
            ("updated", _when(op.updated_at)),
        ):
            table.add_row(name, value)
        console.print(table)
    if detail.deliveries:
        console.print(_deliveries_table(detail.deliveries))
    else:
        console.print("deliveries: none (only a SUCCEEDED execution is delivered)")
    if detail.reconciliations:
        console.print(_reconciliations_table(detail.reconciliations))
    else:
        console.print("reconciliations: none")
    console.print(_history_table(detail.history))
    if detail.anomalies:
        table = Table(title="anomalies (never applied)", title_justify="left")
        for column in ("topic/partition/offset", "machine", "kind", "reason"):
            table.add_column(column)
        for a in detail.anomalies:
            table.add_row(f"{a.topic}/{a.partition}/{a.offset}", a.machine, a.kind, shown(a.reason))
        console.print(table)
    else:
        console.print("anomalies: none")


def _deliveries_table(rows: list[DeliveryRow]) -> Any:
    from rich.table import Table  # noqa: PLC0415

    from opledger.terminal import shown  # noqa: PLC0415

    table = Table(title=f"deliveries ({len(rows)})", title_justify="left")
    for column in ("destination", "state", "attempts", "next attempt at", "error"):
        table.add_column(column, no_wrap=column != "error")
    for d in rows:
        table.add_row(
            d.destination,
            _state(d.state.value),
            str(d.attempts),
            _when(d.next_attempt_at),
            shown(d.error or ""),
        )
    return table


_DECISION_STYLE = {
    "MARK_SUCCEEDED": "green",
    "MARK_FAILED": "red",
    "REFUSE": "red",
    "CANCEL": "red",
    "PARK": "bold yellow",
    "RETRY_LOOKUP": "yellow",
    "NEW_ATTEMPT": "cyan",
    "RESUME": "cyan",
}


def _policy_cited(r: ReconciliationRow) -> str:
    """The policy record a decision cites, one line each: its version; what it did and who did
    it (a revocation names who revoked); the reason they gave."""
    from opledger.terminal import shown  # noqa: PLC0415

    if r.policy_version is None:
        return "no grant matched"
    lines = [shown(r.policy_version)]
    if r.policy_change is not None:
        lines.append(shown(f"{r.policy_change} by {r.policy_changed_by}"))
    if r.policy_reason:
        lines.append(shown(r.policy_reason))
    return "\n".join(lines)


def _reconciliations_table(rows: list[ReconciliationRow]) -> Any:
    from rich.table import Table  # noqa: PLC0415

    from opledger.terminal import shown  # noqa: PLC0415

    table = Table(title=f"reconciliations ({len(rows)})", title_justify="left")
    for column in (
        "decided at",
        "by",
        "attempt",
        "lookup",
        "policy",
        "policy version",
        "decision",
        "provider_ref",
        "reason",
    ):
        table.add_column(column, no_wrap=column not in ("policy version", "reason"))
    for r in rows:
        style = _DECISION_STYLE.get(r.decision)
        decision = shown(r.decision)
        table.add_row(
            _when(r.occurred_at),
            shown(r.actor_id),
            str(r.attempt),
            shown(r.lookup),
            "[green]allowed[/]" if r.policy_allowed else "[red]refused[/]",
            _policy_cited(r),
            f"[{style}]{decision}[/]" if style else decision,
            shown(r.provider_ref or "-"),
            shown(r.reason),
        )
    return table


def _history_table(rows: list[HistoryRow]) -> Any:
    from rich.table import Table  # noqa: PLC0415

    from opledger.terminal import shown  # noqa: PLC0415

    table = Table(title=f"history ({len(rows)} events)", title_justify="left")
    for column in (
        "occurred at",
        "topic/partition/offset",
        "machine",
        "state",
        "attempt",
        "outcome",
        "error",
    ):
        table.add_column(column, no_wrap=column != "error")
    for h in rows:
        machine = h.machine if h.destination is None else f"delivery {h.destination}"
        outcome = h.outcome if h.outcome == "applied" else f"[yellow]{h.outcome}[/]"
        table.add_row(
            _when(h.occurred_at),
            f"{h.topic}/{h.partition}/{h.offset}",
            machine,
            _state(h.state),
            str(h.attempt),
            outcome,
            shown(h.error or ""),
        )
    return table
