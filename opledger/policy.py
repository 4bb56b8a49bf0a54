"""``opledger policy grant|revoke|show``: a tenant's policy, written as records on the compacted
policy topic and read back from the projection the workers evaluate.

A write is one PolicyChanged record, acknowledged by the broker (acks=all); the command then
waits, bounded, until the projector has folded it (its subject's version is the record's event
id), since only then do workers see it. Nothing is written unless every input is valid.

Registration imports nothing heavy of its own: Kafka, psycopg and rich are imported by the
handlers (``opledger.cli`` itself loads psycopg and confluent-kafka for every subcommand,
through the stack and database commands).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ledger.entropy import entropy
from ledger.settings import Settings

if TYPE_CHECKING:
    from ledger.domain.events import PolicyChanged
    from ledger.policy_keys import TrustedKeys
    from ledger.policy_store import CurrentPolicy

#: The change was written and the projector has folded it (or ``--no-wait``), or ``show`` ran.
EXIT_OK = 0
#: Kafka or PostgreSQL could not be reached, or did not confirm the write.
EXIT_FAILED = 1
#: Bad input: nothing was written.
EXIT_USAGE = 2
#: Written, but not in effect yet: no projector folded it in time (or a later change won).
EXIT_NOT_IN_EFFECT = 3

#: How long to wait, by default, for the projector to fold a change.
DEFAULT_WAIT_S = 30.0
#: After this long without the change folded, an unanswered /healthz means no projector runs.
NO_PROJECTOR_GRACE_S = 3.0

_EXIT_CODES = """exit codes: 0 done (a change is in effect, or --no-wait) · 1 Kafka or PostgreSQL
unreachable, write not confirmed · 2 bad input, nothing written · 3 written but not in effect
yet (no projector folded it in time, or a later change to the same grant won)"""

# What each field accepts, in words, for errors that would otherwise quote a regex.
_SHAPES = {
    "tenant_id": "letters, digits and . _ : @ / - (starting with a letter or digit)",
    "actor_id": "letters, digits and . _ : @ / - (starting with a letter or digit)",
    "principal": "an actor id (letters, digits and . _ : @ / -) or '*'",
    "tool_name": "a tool name (a letter, then letters, digits, . _ -) or '*'",
    "destinations": "letters, digits and . _ : / @ - (starting with a letter or digit)",
    "credential_id": "letters, digits and . _ : @ / - (starting with a letter or digit)",
    "credential_scopes": "letters, digits and . _ : / @ + = - (starting with a letter or digit)",
}
_OPTIONS = {
    "tenant_id": "--tenant",
    "actor_id": "--by",
    "principal": "--actor",
    "tool_name": "--tool",
    "destinations": "--destination",
    "repeat_safe": "--repeat-safe",
    "expires_at": "--expires",
    "credential_id": "--credential",
    "credential_scopes": "--scope",
    "credential_expires_at": "--credential-expires",
    "reason": "--reason",
}


class InputError(ValueError):
    """An input the command refuses; the message names the option and what it accepts."""


def register(commands: Any) -> None:
    """``opledger policy grant``, ``revoke`` and ``show``."""
    parser = commands.add_parser(
        "policy",
        help="grant and revoke tools per tenant (the policy topic), show the current policy",
        description="A tenant's policy: grants of tools to actors, their revocations and "
        "revoked credentials, written to the compacted policy topic and read from the "
        "projection the workers evaluate.",
        epilog=_EXIT_CODES,
    )
    # Only the operator's principal may write the policy topic (decision 029).
    parser.set_defaults(kafka_role="operator")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    grant = actions.add_parser(
        "grant",
        help="grant a tool to an actor (or every actor: '*'); replaces that grant entirely",
        epilog=_EXIT_CODES,
    )
    grant.add_argument("--tenant", required=True, help="tenant id")
    grant.add_argument(
        "--actor",
        required=True,
        metavar="ACTOR|*",
        help="the actor the grant is for, or '*' for every actor of the tenant",
    )
    grant.add_argument(
        "--tool", required=True, metavar="TOOL|*", help="the tool, or '*' for every tool"
    )
    grant.add_argument(
        "--destination",
        action="append",
        default=[],
        metavar="D",
        help="where the tool's results may be delivered (repeat for several)",
    )
    grant.add_argument(
        "--repeat-safe",
        action="store_true",
        help="a call whose outcome was lost may be made again (reconciliation may retry it)",
    )
    grant.add_argument(
        "--expires",
        metavar="ISO|DURATION",
        help="when the grant ends: an instant with a time zone (2027-01-31T12:00:00Z) or a "
        "duration from now (90s, 5m, 2h, 1d, 1w)",
    )
    grant.add_argument(
        "--credential", metavar="ID", help="the credential the tool uses (its name, not a secret)"
    )
    grant.add_argument(
        "--scope",
        action="append",
        default=[],
        metavar="S",
        help="a scope that credential carries (repeat for several; needs --credential)",
    )
    grant.add_argument(
        "--credential-expires",
        metavar="ISO|DURATION",
        help="when that credential expires (needs --credential)",
    )
    grant.add_argument("--reason", help="why (kept forever: never a secret)")
    _writing_options(grant)
    grant.set_defaults(handler="opledger.policy:grant_command")

    revoke = actions.add_parser(
        "revoke",
        help="revoke the grant of a tool to an actor (--actor and --tool), or a credential "
        "(--credential)",
        description="Revoke a grant (--actor and --tool; a revoked grant for an actor is not "
        "overridden by a broader '*' grant) or a credential (--credential: every grant "
        "naming it refuses).",
        epilog=_EXIT_CODES,
    )
    revoke.add_argument("--tenant", required=True, help="tenant id")
    revoke.add_argument("--actor", metavar="ACTOR|*", help="the actor of the grant, or '*'")
    revoke.add_argument("--tool", metavar="TOOL|*", help="the tool of the grant, or '*'")
    revoke.add_argument("--credential", metavar="ID", help="revoke this credential instead")
    revoke.add_argument("--reason", help="why (kept forever: never a secret)")
    _writing_options(revoke)
    revoke.set_defaults(handler="opledger.policy:revoke_command")

    show = actions.add_parser(
        "show",
        help="a tenant's current grants and revoked credentials, from the projection",
        epilog=_EXIT_CODES,
    )
    show.add_argument("--tenant", required=True, help="tenant id (reads are per tenant)")
    show.add_argument("--actor", help="only grants that apply to this actor (its own and '*')")
    show.add_argument("--tool", help="only grants that apply to this tool (its own and '*')")
    show.set_defaults(handler="opledger.policy:show_command")

    key = actions.add_parser(
        "key",
        help="the operator's signing key: create one, or show the keys changes must be signed by",
        description="Only policy changes signed by a trusted operator key count (decision 032). "
        "`create` writes a new private key (mode 0600) and prints its public line, to be added "
        "to the trusted keys file of every process (OPLEDGER_POLICY_TRUSTED_KEYS_FILE).",
    )
    key_actions = key.add_subparsers(dest="key_action", required=True, metavar="KEY_ACTION")
    create = key_actions.add_parser("create", help="write a new private key; print its public line")
    create.add_argument("--out", required=True, metavar="PATH", help="where (never overwritten)")
    create.set_defaults(handler="opledger.policy:key_create_command")
    trusted = key_actions.add_parser("trusted", help="list the trusted keys and the signing key")
    trusted.set_defaults(handler="opledger.policy:key_trusted_command")


def _writing_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--by",
        metavar="NAME",
        help="who makes the change, recorded as its actor (default: cli:<login name>)",
    )
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="return once the broker acknowledged the change; do not wait for the projector",
    )
    parser.add_argument(
        "--wait",
        default=str(DEFAULT_WAIT_S),
        metavar="SECONDS",
        help=f"longest wait for the projector to fold the change (default {DEFAULT_WAIT_S:.0f})",
    )


# -- handlers -------------------------------------------------------------------------------------


def grant_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger policy grant``."""
    try:
        change = grant_change(args, datetime.now(UTC), _entropy())
        wait_s = _wait_seconds(args)
    except InputError as exc:
        return _usage(str(exc))
    return _write_and_wait(settings, change, wait_s)


def revoke_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger policy revoke``."""
    try:
        change = revoke_change(args, datetime.now(UTC), _entropy())
        wait_s = _wait_seconds(args)
    except InputError as exc:
        return _usage(str(exc))
    return _write_and_wait(settings, change, wait_s)


def show_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger policy show``."""
    import psycopg  # noqa: PLC0415  # handlers only

    from ledger import pg  # noqa: PLC0415
    from ledger.domain.redact import redact  # noqa: PLC0415
    from ledger.policy_store import read_current  # noqa: PLC0415

    try:
        _check("tenant_id", args.tenant)
        if args.actor is not None:
            _check("principal", args.actor, option="--actor")
        if args.tool is not None:
            _check("tool_name", args.tool)
    except InputError as exc:
        return _usage(str(exc))
    try:
        # Read-only: a lookup must never hold locks the projector waits on.
        with pg.connect(settings.dsn, name="opledger-policy", read_only=True) as conn:
            policy = read_current(conn, args.tenant, actor_id=args.actor, tool_name=args.tool)
    except psycopg.OperationalError as exc:
        return _failed(
            f"cannot reach PostgreSQL at {redact(settings.dsn)}: {_first_line(exc)}\n"
            "is the stack up? start it with `opledger stack up`"
        )
    if policy is None:
        return _failed(
            "the policy tables do not exist yet: run `opledger db migrate` or start the "
            "projector (`opledger stack up`)"
        )
    from ledger.policy_keys import PolicyKeyError, trusted_keys  # noqa: PLC0415

    try:
        keys = trusted_keys(settings)
    except PolicyKeyError as exc:
        return _failed(str(exc))
    _print_policy(args, policy, keys)
    return EXIT_OK


def key_create_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger policy key create``."""
    from pathlib import Path  # noqa: PLC0415

    from ledger.policy_keys import OperatorKey  # noqa: PLC0415

    key = OperatorKey.generate()
    try:
        key.save(Path(args.out))
    except FileExistsError:
        return _usage(f"{args.out} exists: a key is never overwritten; choose another path")
    except OSError as exc:
        return _failed(f"cannot write {args.out}: {exc.strerror}")
    print(f"private key {key.id} written to {args.out} (mode 0600)")
    print("add this line to the trusted keys file of every opledger process:")
    print(key.public_line)
    return EXIT_OK


def key_trusted_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger policy key trusted``."""
    from ledger.policy_keys import PolicyKeyError, operator_key, trusted_keys  # noqa: PLC0415

    try:
        keys = trusted_keys(settings)
    except PolicyKeyError as exc:
        return _failed(str(exc))
    print(f"trusted keys ({keys.source}): {', '.join(keys.ids) or 'none: every grant is refused'}")
    try:
        signing = operator_key(settings).id
    except PolicyKeyError as exc:
        signing = f"none ({exc})"
    print(f"signing key ({settings.policy_signing_key_path}): {signing}")
    return EXIT_OK


# -- building the change --------------------------------------------------------------------------


def grant_change(args: argparse.Namespace, now: datetime, entropy: bytes) -> PolicyChanged:
    """The GRANT record ``args`` describe; raises :class:`InputError`."""
    from ledger.domain.policy import PolicyChange  # noqa: PLC0415

    # Every problem is reported at once, so a second try is not a second surprise.
    problems: list[str] = []
    instants: dict[str, datetime | None] = {}
    for option, text in (
        ("--expires", args.expires),
        ("--credential-expires", args.credential_expires),
    ):
        try:
            instants[option] = _instant(option, text, now)
        except InputError as exc:
            problems.append(str(exc))
            instants[option] = None
    if args.credential is None and (args.scope or args.credential_expires is not None):
        problems.append(
            "--scope and --credential-expires describe a credential: give --credential ID too"
        )
    try:
        change = _build(
            {
                "change": PolicyChange.GRANT,
                "principal": args.actor,
                "tool_name": args.tool,
                "destinations": list(args.destination),
                "repeat_safe": args.repeat_safe,
                "expires_at": instants["--expires"],
                # Already reported above when missing; not again by the model.
                "credential_id": args.credential,
                "credential_scopes": list(args.scope) if args.credential else [],
                "credential_expires_at": instants["--credential-expires"]
                if args.credential
                else None,
            },
            args,
            now,
            entropy,
        )
    except InputError as exc:
        problems.append(str(exc))
    if problems:
        raise InputError("\n".join(problems))
    return change


def revoke_change(args: argparse.Namespace, now: datetime, entropy: bytes) -> PolicyChanged:
    """The REVOKE or REVOKE_CREDENTIAL record ``args`` describe; raises :class:`InputError`."""
    from ledger.domain.policy import WILDCARD, PolicyChange  # noqa: PLC0415

    if args.credential is not None:
        if args.actor is not None or args.tool is not None:
            raise InputError(
                "give either --credential ID (revoke a credential) or --actor and --tool "
                "(revoke a grant), not both"
            )
        fields: dict[str, Any] = {
            "change": PolicyChange.REVOKE_CREDENTIAL,
            "principal": WILDCARD,
            "tool_name": WILDCARD,
            "credential_id": args.credential,
        }
    elif args.actor is None or args.tool is None:
        raise InputError(
            "say what to revoke: --actor ACTOR --tool TOOL (a grant) or --credential ID"
        )
    else:
        fields = {"change": PolicyChange.REVOKE, "principal": args.actor, "tool_name": args.tool}
    return _build(fields, args, now, entropy)


def _build(
    fields: dict[str, Any], args: argparse.Namespace, now: datetime, entropy: bytes
) -> PolicyChanged:
    from pydantic import ValidationError  # noqa: PLC0415

    from ledger.domain import ids  # noqa: PLC0415
    from ledger.domain.events import PolicyChanged  # noqa: PLC0415

    by = args.by if args.by is not None else _default_by()
    try:
        return PolicyChanged.model_validate(
            {
                "event_id": ids.event_id(int(now.timestamp() * 1000), entropy),
                "tenant_id": args.tenant,
                "actor_id": by,
                "occurred_at": now,
                "reason": args.reason,
                **fields,
            }
        )
    except ValidationError as exc:
        raise InputError(_explain(exc, args)) from None


def _explain(exc: Any, args: argparse.Namespace) -> str:
    """A ValidationError as one line per problem, naming the option, not the field."""
    lines = []
    for error in exc.errors():
        loc = error["loc"]
        name = str(loc[0]) if loc else ""
        option = _OPTIONS.get(name, "")
        if name == "actor_id" and args.by is None:
            option = "--by (the default, from your login name)"
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "string_pattern_mismatch" and name in _SHAPES:
            message = f"{error['input']!r} is not valid: use {_SHAPES[name]}"
        elif error["type"] == "too_long" and name in ("destinations", "credential_scopes"):
            message = f"at most {error['ctx']['max_length']} values"
        lines.append(f"{option}: {message}" if option else message)
    return "\n".join(lines)


def _check(field: str, value: str, option: str | None = None) -> None:
    """Refuse ``value`` unless it is a name of the kind the policy record's ``field`` takes
    (checked as every entry point checks names: :mod:`ledger.domain.names`). Not an argparse
    type: this command reports every problem of its input at once."""
    from ledger.domain.names import NameKind, is_name, quoted  # noqa: PLC0415
    from ledger.domain.policy import WILDCARD  # noqa: PLC0415

    kind, wildcard = {
        "tenant_id": (NameKind.TENANT, False),
        "principal": (NameKind.ACTOR, True),
        "tool_name": (NameKind.TOOL, True),
    }[field]
    if not (wildcard and value == WILDCARD) and not is_name(kind, value):
        raise InputError(
            f"{option or _OPTIONS[field]}: {quoted(value)} is not valid: use {_SHAPES[field]}"
        )


def _instant(option: str, text: str | None, now: datetime) -> datetime | None:
    """An instant from ``ISO`` (with a time zone) or a ``DURATION`` from now; must be later."""
    from opledger.ops import DurationTooLongError, parse_duration  # noqa: PLC0415

    if text is None:
        return None
    moment: datetime | None = None
    try:
        moment = now + parse_duration(text)
    except DurationTooLongError as exc:
        raise InputError(f"{option}: {exc}") from None
    except argparse.ArgumentTypeError:
        pass  # not a duration: an instant, then
    if moment is None:
        try:
            moment = datetime.fromisoformat(text.strip())
        except ValueError:
            raise InputError(
                f"{option}: {text!r} is neither an instant (2027-01-31T12:00:00Z) nor a "
                "duration (90s, 5m, 2h, 1d, 1w)"
            ) from None
        if moment.tzinfo is None or moment.utcoffset() is None:
            raise InputError(
                f"{option}: {text!r} has no time zone; add one (2027-01-31T12:00:00Z or +02:00)"
            )
    if moment <= now:
        raise InputError(f"{option}: {moment.isoformat()} is not in the future")
    return moment


def _wait_seconds(args: argparse.Namespace) -> float | None:
    """Seconds to wait for the projector, or None with ``--no-wait``."""
    # Checked even with --no-wait: a command line that says two things is refused, not guessed.
    try:
        seconds = float(args.wait)
    except ValueError:
        raise InputError(f"--wait: {args.wait!r} is not a number of seconds") from None
    if not 0 < seconds <= 3600:
        raise InputError(f"--wait: {args.wait} must be more than 0 and at most 3600 seconds")
    return None if args.no_wait else seconds


def _default_by() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a bare container)
        user = f"uid{os.getuid()}"
    return f"cli:{user}"


def _entropy() -> bytes:
    return entropy(10)


# -- writing and waiting --------------------------------------------------------------------------


def _subject(change: PolicyChanged) -> str:
    if change.credential_id is not None and change.change.value == "REVOKE_CREDENTIAL":
        return f"credential {change.credential_id} of tenant {change.tenant_id}"
    return f"actor {change.principal}, tool {change.tool_name} of tenant {change.tenant_id}"


def _write_and_wait(settings: Settings, change: PolicyChanged, wait_s: float | None) -> int:
    from ledger.errors import DeliveryError, DeliveryTimeoutError  # noqa: PLC0415
    from ledger.log import LogWriter  # noqa: PLC0415  # handlers only
    from ledger.policy_keys import PolicyKeyError, operator_key  # noqa: PLC0415

    try:
        change = operator_key(settings).sign(change)
    except PolicyKeyError as exc:
        return _failed(f"nothing was written: {exc}")
    writer = LogWriter.connect(settings, "policy")
    try:
        positions = writer.append([change])
    except DeliveryTimeoutError as exc:
        return _failed(
            f"the broker did not confirm the change: {exc}\nit may have been written or not; "
            "running the same command again is safe (it sets the same state)"
        )
    except DeliveryError as exc:
        return _failed(f"the change was not written: {exc}")
    finally:
        writer.close()
    where = ", ".join(f"{t} partition {p} offset {o}" for t, p, o in positions)
    verb = {"GRANT": "granted", "REVOKE": "revoked", "REVOKE_CREDENTIAL": "revoked"}
    print(f"{verb[change.change.value]}: {_subject(change)}")
    print(f"policy version {change.event_id} ({where}), signed by {change.signed_by}")
    if wait_s is None:
        print("not waiting for the projector (--no-wait): it counts once a projector folds it")
        return EXIT_OK
    return _wait_folded(settings, change, wait_s)


@dataclass(frozen=True, slots=True)
class _Health:
    url: str
    #: the /healthz body, or None when nothing answered
    body: dict[str, Any] | None


def _wait_folded(settings: Settings, change: PolicyChanged, wait_s: float) -> int:
    """Poll the projection until ``change`` is folded, bounded by ``wait_s``."""
    import psycopg  # noqa: PLC0415

    from ledger import pg  # noqa: PLC0415
    from ledger.domain.redact import redact  # noqa: PLC0415
    from ledger.policy_store import FoldState, read_fold_state  # noqa: PLC0415

    started = time.monotonic()
    deadline = started + wait_s
    health: _Health | None = None
    problem = ""
    conn: psycopg.Connection[Any] | None = None
    try:
        while True:
            state: FoldState | None = None
            try:
                if conn is None:
                    conn = pg.connect(settings.dsn, name="opledger-policy", read_only=True)
                state = read_fold_state(conn, change)
            except psycopg.OperationalError as exc:
                problem = f"cannot read PostgreSQL at {redact(settings.dsn)}: {_first_line(exc)}"
                if conn is not None:
                    conn.close()
                    conn = None
            if state is not None and state.folded:
                waited = time.monotonic() - started
                if state.current_version == change.event_id:
                    print(f"in effect: the projector folded it after {waited:.1f}s")
                    return EXIT_OK
                print(
                    f"not in effect: the projector folded it, but a later change "
                    f"({state.current_version}) now decides for {_subject(change)}",
                    file=sys.stderr,
                )
                return EXIT_NOT_IN_EFFECT
            now = time.monotonic()
            if health is None and (now - started >= NO_PROJECTOR_GRACE_S or now >= deadline):
                # A running projector folds a change in well under a second (append-to-visible
                # p99 66 ms, README): after the grace, silence on /healthz means none runs.
                health = _projector_health(settings)
                if health.body is None:
                    print(
                        "not in effect yet: no projector is running (nothing answers "
                        f"{health.url}). The change is on the policy topic and takes effect "
                        "when a projector folds it: start one with `opledger stack up` or "
                        "`opledger projector run`",
                        file=sys.stderr,
                    )
                    return EXIT_NOT_IN_EFFECT
            if now >= deadline:
                assert health is not None and health.body is not None
                status = health.body.get("status")
                reason = health.body.get("reason")
                detail = problem or (
                    f"a projector answers {health.url} ({status}"
                    + (f": {reason}" if reason else "")
                    + f") but has not folded it; is it the one reading {settings.policy_topic} "
                    f"into {redact(settings.dsn)}?"
                )
                print(
                    f"not in effect yet after {wait_s:g}s: {detail}. The change is on the "
                    "policy topic and takes effect when a projector folds it",
                    file=sys.stderr,
                )
                return EXIT_NOT_IN_EFFECT
            time.sleep(0.1)
    finally:
        if conn is not None:
            conn.close()


def _projector_health(settings: Settings) -> _Health:
    """The projector's /healthz answer (its body even when it says 503), or no body."""
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    host = settings.projector_web_bind
    if host in ("", "0.0.0.0", "::"):  # a wildcard bind answers on loopback
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    url = f"http://{host}:{settings.projector_web_port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return _Health(url, _json_object(response.read()))
    except urllib.error.HTTPError as exc:  # 503: alive but stalled, the body says why
        return _Health(url, _json_object(exc.read()) or {"status": f"HTTP {exc.code}"})
    except (OSError, ValueError):
        return _Health(url, None)


def _json_object(data: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(data)
    except ValueError:
        return {"status": "answered, not JSON"}
    return value if isinstance(value, dict) else {"status": str(value)}


# -- output ---------------------------------------------------------------------------------------


def _usage(message: str) -> int:
    print(f"opledger: {message}\nnothing was written", file=sys.stderr)
    return EXIT_USAGE


def _failed(message: str) -> int:
    print(f"opledger: {message}", file=sys.stderr)
    return EXIT_FAILED


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _when(moment: datetime | None) -> str:
    return "-" if moment is None else moment.isoformat(sep=" ", timespec="seconds")


def _short_key(key_id: str | None) -> str:
    """A key id as `policy key trusted` lists it, cut to what tells keys apart in a table."""
    return "no key" if key_id is None else key_id[: len("ed25519:") + 12]


def _print_policy(args: argparse.Namespace, policy: CurrentPolicy, keys: TrustedKeys) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    from opledger.terminal import shown  # noqa: PLC0415

    console = Console()
    if not console.is_terminal:
        console = Console(width=300)  # piped: never truncate ids
    now = datetime.now(UTC)
    filters = [f"tenant {args.tenant}"]
    if args.actor:
        filters.append(f"applying to actor {args.actor}")
    if args.tool:
        filters.append(f"applying to tool {args.tool}")
    table = Table(title=f"{len(policy.grants)} grants ({', '.join(filters)})", title_justify="left")
    for column in (
        "actor",
        "tool",
        "state",
        "destinations",
        "repeat-safe",
        "expires",
        "credential",
        "scopes",
        "credential expires",
        "version",
        "changed",
        "signed by",
        "reason",
    ):
        table.add_column(column, no_wrap=column not in ("reason", "destinations", "scopes"))
    for row in policy.grants:
        g = row.grant
        refusal = keys.refusal(row.signed.signed_bytes, row.signed.signed_by, row.signed.signature)
        if refusal is not None:
            state = "[red]not the operator's: refused[/]"
        elif g.revoked:
            state = "[red]revoked[/]"
        elif g.expires_at is not None and g.expires_at <= now:
            state = "[yellow]expired[/]"
        elif row.credential_revoked_by is not None:
            state = "[red]credential revoked[/]"
        elif g.credential_expires_at is not None and g.credential_expires_at <= now:
            state = "[yellow]credential expired[/]"
        else:
            state = "[green]active[/]"
        table.add_row(
            shown(g.principal),
            shown(g.tool_name),
            state,
            shown(", ".join(sorted(g.destinations)) or "-"),
            "yes" if g.repeat_safe else "no",
            _when(g.expires_at),
            shown(g.credential_id or "-"),
            shown(", ".join(sorted(g.credential_scopes)) or "-"),
            _when(g.credential_expires_at),
            g.version,
            f"{_when(row.updated_at)} by {shown(row.changed_by)}",
            _short_key(row.signed.signed_by),
            shown(row.reason or ""),
        )
    console.print(table)
    if not policy.revoked_credentials:
        console.print(f"revoked credentials: none (tenant {args.tenant})")
        return
    revoked = Table(
        title=f"{len(policy.revoked_credentials)} revoked credentials (tenant {args.tenant})",
        title_justify="left",
    )
    for column in ("credential", "revoked at", "by", "version", "reason"):
        revoked.add_column(column, no_wrap=column != "reason")
    for r in policy.revoked_credentials:
        revoked.add_row(
            shown(r.revocation.credential_id),
            _when(r.revoked_at),
            shown(r.revoked_by),
            r.revocation.version,
            shown(r.reason or ""),
        )
    console.print(revoked)
