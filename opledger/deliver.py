"""Delivery from the command line:

- ``opledger deliver run``: the delivery worker (any number: one consumer group, scaled on the
  execution topic's partitions);
- ``opledger destinations add|list|enable|disable|rotate-secret``: where a tenant's results go;
- ``opledger deliveries redrive``: send dead-lettered deliveries again, an audited event each
  (who, why), idempotent: two redrives of one dead letter send it once.
"""

from __future__ import annotations

import argparse
import getpass
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ledger import faults
from ledger.settings import Settings
from opledger import arguments
from opledger.arguments import overlap_hours

if TYPE_CHECKING:
    from ledger.destinations import Rekeyed
    from processors.delivery.worker import DeliveryWorker
    from processors.host import Hosted

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def build(settings: Settings) -> tuple[Hosted, DeliveryWorker, list[Any]]:
    """The hosted worker (with its results page), the worker, and what to close afterwards;
    wired, not started."""
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from ledger.destinations import DestinationStore  # noqa: PLC0415
    from ledger.history import HistoryReader  # noqa: PLC0415
    from ledger.log import KafkaTransport  # noqa: PLC0415
    from ledger.metrics import Metrics  # noqa: PLC0415
    from ledger.pg import open_pool  # noqa: PLC0415
    from ledger.policy_store import PolicyStore  # noqa: PLC0415
    from ledger.results import ResultStore  # noqa: PLC0415
    from processors.delivery.results_server import ResultsServer  # noqa: PLC0415
    from processors.delivery.senders import WebhookSender  # noqa: PLC0415
    from processors.delivery.worker import DeliveryWorker  # noqa: PLC0415
    from processors.host import Hosted  # noqa: PLC0415

    registry = CollectorRegistry()
    metrics = Metrics.create(registry)
    pool = open_pool(
        settings.dsn,
        name="opledger-delivery",
        max_size=8,
        lock_timeout_ms=settings.pg_lock_timeout_ms,
    )
    transport = KafkaTransport(settings)
    history = HistoryReader(settings, pool, client_id="opledger-delivery-history")
    webhooks = WebhookSender(concurrency=settings.delivery_concurrency, metrics=metrics)
    worker = DeliveryWorker(
        settings,
        pool=pool,
        transport=transport,
        history=history,
        results=ResultStore(pool),
        destinations=DestinationStore(pool, settings),
        # Policy as it is now, at every send: no cache.
        policy=PolicyStore(pool, settings).evaluate_many,
        webhooks=webhooks,
        metrics=metrics,
    )
    results_server = ResultsServer(pool, settings, metrics)
    hosted = Hosted(
        worker,
        registry,
        name="delivery",
        web_port=settings.delivery_web_port,
        pages=results_server.pages,
    )
    return hosted, worker, [webhooks, history, transport, pool]


def with_allowed(settings: Settings, networks: str | None) -> Settings:
    """``settings`` allowing ``networks`` (comma-separated CIDRs) too, besides those of
    OPLEDGER_DELIVERY_ALLOW_NETWORKS; SettingsError naming the option for a bad one."""
    from ledger.settings import SettingsError, parse_networks  # noqa: PLC0415

    if not networks:
        return settings
    try:
        parse_networks(networks)
    except ValueError as exc:
        raise SettingsError(f"--allow-networks: {exc}") from None
    both = ",".join(filter(None, (settings.delivery_allow_networks, networks)))
    return settings.with_(delivery_allow_networks=both)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger deliver run``: deliver results until SIGTERM/SIGINT."""
    from ledger.secrets import RedactingFilter  # noqa: PLC0415
    from ledger.topics import ensure_topics  # noqa: PLC0415
    from opledger import db  # noqa: PLC0415
    from processors.host import serve  # noqa: PLC0415

    settings = with_allowed(settings, args.allow_networks)
    faults.arm(settings.fault_points)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())
    if settings.delivery_allow_networks:
        logging.getLogger("opledger.delivery").info(
            "webhooks may go to these networks although they are refused by default: %s",
            settings.delivery_allow_networks,
        )
    ensure_topics(settings)
    db.migrate(settings.dsn)
    hosted, _worker, owned = build(settings)
    try:
        return serve(settings, hosted)
    finally:
        for item in owned:
            item.close()


# -- destinations ------------------------------------------------------------------------------


def _by(args: argparse.Namespace) -> str:
    return args.by or f"cli:{getpass.getuser()}"


def _env_secret(variable: str) -> str | None:
    """The secret in ``$variable``, or None (said on stderr) when it is unset or empty."""
    # A secret mounted from a file usually ends with a newline: it is not part of it.
    secret = (os.environ.get(variable) or "").strip()
    if not secret:
        print(f"--secret-env: ${variable} is not set", file=sys.stderr)
        return None
    return secret


def destinations_add(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger destinations add``."""
    from ledger.destinations import (  # noqa: PLC0415
        AddressGuard,
        DestinationError,
        DestinationStore,
        Kind,
        check_webhook_address,
        new_secret,
    )
    from ledger.pg import DatabaseError, open_pool  # noqa: PLC0415
    from opledger import db  # noqa: PLC0415

    kind = Kind.WEBHOOK if args.url else Kind.QUEUE
    if args.fetch_secret and kind is not Kind.QUEUE:
        print("--fetch-secret is for a queue (--topic); a webhook always has one", file=sys.stderr)
        return EXIT_USAGE
    secret = None
    if args.secret_env:
        secret = _env_secret(args.secret_env)
        if secret is None:
            return EXIT_USAGE
    if kind is Kind.WEBHOOK:
        # Told now rather than at the first delivery: a literal address in a refused network
        # (a host name is checked at every connection: what it resolves to may change).
        try:
            check_webhook_address(args.url, AddressGuard(settings.delivery_allowed_networks))
        except DestinationError as exc:
            print(f"destination refused: {exc}", file=sys.stderr)
            return EXIT_USAGE
    made = secret is None and (kind is Kind.WEBHOOK or args.fetch_secret)
    if made and kind is Kind.QUEUE:
        secret = new_secret()
    db.migrate(settings.dsn)
    with open_pool(settings.dsn, name="opledger-destinations", max_size=1) as pool:
        try:
            added = DestinationStore(pool, settings).add(
                tenant_id=args.tenant,
                name=args.name,
                kind=kind,
                target=args.url or args.topic,
                tools=args.tool,
                changed_by=_by(args),
                secret=secret,
                timeout_ms=args.timeout_ms,
            )
        except DestinationError as exc:
            print(f"destination refused: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except DatabaseError as exc:
            # Never the driver's text: a refused row is quoted whole in it, secret included.
            print(
                f"destination not stored: the database refused it ({type(exc).__name__}); "
                "nothing was changed",
                file=sys.stderr,
            )
            return EXIT_USAGE
    print(f"{added.tenant_id}/{added.name}: {added.kind.value} -> {added.target}")
    if not added.enabled:
        # A replacement does not undo a disable: what an operator held stays held.
        print(
            f"still disabled; its deliveries {'are dead-lettered' if added.gone else 'wait'} "
            f"until: opledger destinations enable --tenant {added.tenant_id} --name {added.name}"
        )
    # Shown once, to whoever configures the receiver; never logged, never in an event.
    if made and kind is Kind.WEBHOOK:
        print(f"signing secret (configure the receiver with it): {added.secret}")
    elif made:
        print(f"fetch secret (configure the queue's consumer with it): {added.secret}")
    return EXIT_OK


def destinations_list(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger destinations list --tenant T``."""
    from ledger.destinations import DestinationStore  # noqa: PLC0415
    from ledger.domain.display import displayable  # noqa: PLC0415
    from ledger.pg import open_pool  # noqa: PLC0415

    with open_pool(settings.dsn, name="opledger-destinations", max_size=1) as pool:
        found = DestinationStore(pool, settings).list(args.tenant)
    if not found:
        print(f"tenant {args.tenant} has no destinations")
    for d in found:
        # Every stored field through one escape: a 410's reason phrase is the destination's
        # own words, and a row written before the names were checked may hold anything.
        reason = d.disabled_reason or "by an operator"
        held = "deliveries dead-lettered" if d.gone else "deliveries wait"
        state = "enabled" if d.enabled else f"DISABLED ({reason}) {held}"
        fields = (
            d.name,
            d.kind.value,
            d.target,
            f"tools={','.join(d.tools)}",
            f"timeout={d.timeout_ms}ms",
            state,
            f"changed by {d.changed_by or ''}",
        )
        print("\t".join(displayable(field) for field in fields))
    return EXIT_OK


def destinations_enable(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger destinations enable|disable``."""
    from ledger.destinations import DestinationStore  # noqa: PLC0415
    from ledger.pg import open_pool  # noqa: PLC0415

    enabled = args.action == "enable"
    with open_pool(settings.dsn, name="opledger-destinations", max_size=1) as pool:
        changed = DestinationStore(pool, settings).set_enabled(
            args.tenant, args.name, enabled=enabled, changed_by=_by(args), reason=args.reason
        )
    if not changed:
        print(f"tenant {args.tenant} has no destination {args.name}", file=sys.stderr)
        return EXIT_USAGE
    print(
        f"{args.tenant}/{args.name}: "
        + (
            "enabled; deliveries that waited while it was disabled are sent now (those "
            "dead-lettered after a 410 Gone need: opledger deliveries redrive)"
            if enabled
            else "disabled; its deliveries wait (nothing is sent) until it is enabled again"
        )
    )
    return EXIT_OK


def destinations_rotate(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger destinations rotate-secret``: a new signing secret, the old one kept for an
    overlap (sends are signed with both until then)."""
    from datetime import timedelta  # noqa: PLC0415

    from ledger.destinations import DestinationError, DestinationStore  # noqa: PLC0415
    from ledger.pg import open_pool  # noqa: PLC0415

    secret = None
    if args.secret_env:
        secret = _env_secret(args.secret_env)
        if secret is None:
            return EXIT_USAGE
    with open_pool(settings.dsn, name="opledger-destinations", max_size=1) as pool:
        try:
            rotated = DestinationStore(pool, settings).rotate_secret(
                args.tenant,
                args.name,
                changed_by=_by(args),
                secret=secret,
                overlap=timedelta(hours=args.overlap_hours),
            )
        except DestinationError as exc:
            print(f"not rotated: {exc}", file=sys.stderr)
            return EXIT_USAGE
    if rotated is None:
        print(f"tenant {args.tenant} has no destination {args.name} with a secret", file=sys.stderr)
        return EXIT_USAGE
    until = rotated.previous_secret_until
    print(
        f"{rotated.tenant_id}/{rotated.name}: secret rotated; "
        + (
            f"sends are signed with the old one too until {until.isoformat()}"
            if until is not None
            else "the old one is no longer used"
        )
    )
    if secret is None:  # shown once, to whoever configures the receiver
        print(f"signing secret (configure the receiver with it): {rotated.secret}")
    return EXIT_OK


def _rekey(settings: Settings) -> Rekeyed | str:
    """Every secret sealed under the current key; or why not (nothing changed)."""
    from ledger.destinations import DestinationStore  # noqa: PLC0415
    from ledger.pg import open_pool  # noqa: PLC0415
    from ledger.secret_box import SecretKeyError  # noqa: PLC0415

    try:
        with open_pool(settings.dsn, name="opledger-destinations", max_size=1) as pool:
            return DestinationStore(pool, settings).rekey()
    except SecretKeyError as exc:
        return str(exc)


def destinations_rekey(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger destinations rekey``."""
    done = _rekey(settings)
    if isinstance(done, str):
        print(f"nothing was changed: {done}", file=sys.stderr)
        return EXIT_FAILED
    print(
        f"{done.sealed} secrets sealed under key {done.key_id} "
        f"({done.current} already were; key file {settings.secrets_key_path})"
    )
    return EXIT_OK


def destinations_key_create(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger destinations key create``: a key file for OPLEDGER_SECRETS_KEY_FILE."""
    from pathlib import Path  # noqa: PLC0415

    from ledger.secret_box import SecretBox, new_key_line  # noqa: PLC0415

    path = Path(args.out)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        print(f"{path} exists: a key is never overwritten; choose another path", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"cannot write {path}: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILED
    with os.fdopen(fd, "w") as out:
        out.write(new_key_line() + "\n")
    print(f"secrets key {SecretBox.load(path).current_id} written to {path} (mode 0600)")
    return EXIT_OK


def destinations_rotate_key(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger destinations rotate-key``: add a key, seal everything under it, drop the old.

    The old key stays in the file until every row is sealed under the new one, so a worker
    reading a destination meanwhile opens it with either. A second pass catches a secret that a
    writer which had not yet seen the new key sealed during the first."""
    from ledger.secret_box import (  # noqa: PLC0415
        SecretBox,
        SecretKeyError,
        key_lines,
        new_key_line,
        write_key_file,
    )

    path = settings.secrets_key_path
    try:
        old = key_lines(path)
    except SecretKeyError as exc:
        print(f"nothing was changed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    fresh = new_key_line()
    write_key_file(path, [fresh, *old])
    first = _rekey(settings)
    second = first if isinstance(first, str) else _rekey(settings)
    if isinstance(first, str) or isinstance(second, str):
        print(
            f"the new key is in {path}, but not every secret is sealed under it: "
            f"{first if isinstance(first, str) else second}; the old keys were kept",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if not args.keep_old:
        write_key_file(path, [fresh])
    dropped = "kept" if args.keep_old else "dropped"
    print(
        f"secrets key rotated: new key {SecretBox.load(path).current_id}; {first.sealed} "
        f"secrets sealed again under it; {len(old)} old key(s) {dropped} from {path}"
    )
    return EXIT_OK


# -- redrive -----------------------------------------------------------------------------------

#: Dead letters one ``redrive --since`` reads, loads and appends per round trip: memory and the
#: size of each append stay bounded however many the period holds.
REDRIVE_BATCH = 500

# Keyset pages up to the moment the command started: a delivery redriven, sent and dead-lettered
# again while the command runs is a new dead letter, for a later redrive, not this one's next page.
_DEAD_SINCE_SQL = """
SELECT operation_id, destination, state_entered_at FROM deliveries
 WHERE tenant_id = %(tenant)s AND state = 'DEAD_LETTERED'
   AND state_entered_at >= %(since)s AND state_entered_at <= %(until)s
   AND (%(destination)s::text IS NULL OR destination = %(destination)s)
   AND (state_entered_at, operation_id, destination) > (%(at)s, %(op)s, %(dest)s)
 ORDER BY state_entered_at, operation_id, destination
 LIMIT %(limit)s
"""

_DEAD_SINCE_COUNT_SQL = """
SELECT count(*) FROM deliveries
 WHERE tenant_id = %(tenant)s AND state = 'DEAD_LETTERED'
   AND state_entered_at >= %(since)s AND state_entered_at <= %(until)s
   AND (%(destination)s::text IS NULL OR destination = %(destination)s)
"""


def _dead_since(dsn: str, params: dict[str, Any], batch: int) -> Iterator[list[tuple[str, str]]]:
    """The period's dead letters, ``batch`` at a time, oldest first."""
    from ledger import pg  # noqa: PLC0415

    after: tuple[datetime, str, str] = (datetime.min.replace(tzinfo=UTC), "", "")
    # Autocommit: each batch is read on its own, holding nothing while the batch is redriven.
    with pg.connect(dsn, name="opledger-redrive", read_only=True) as conn:
        while True:
            rows = conn.execute(
                _DEAD_SINCE_SQL,
                {**params, "at": after[0], "op": after[1], "dest": after[2], "limit": batch},
            ).fetchall()
            if not rows:
                return
            yield [(r[0], r[1]) for r in rows]
            last = rows[-1]
            after = (last[2], last[0], last[1])
            if len(rows) < batch:
                return


def redrive(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger deliveries redrive (OP --destination D | --since T)``.

    One operation: exit 1 unless it was redriven (no such delivery for the tenant, or not
    dead-lettered), saying why. A period: every dead letter of the tenant from ``T`` up to the
    moment the command started, in batches, with progress on stderr."""
    from pydantic import ValidationError  # noqa: PLC0415

    from ledger import pg  # noqa: PLC0415
    from ledger.domain.delivery import redrive as redrive_event  # noqa: PLC0415
    from ledger.domain.events import DeliveryTransitioned  # noqa: PLC0415
    from ledger.domain.states import DeliveryState  # noqa: PLC0415
    from ledger.errors import RecordError  # noqa: PLC0415
    from ledger.history import HistoryReader  # noqa: PLC0415
    from ledger.log import LogWriter  # noqa: PLC0415
    from ledger.pg import open_pool  # noqa: PLC0415

    if (args.operation_id is None) == (args.since is None):
        print("name one operation (OP --destination D) or a period (--since T)", file=sys.stderr)
        return EXIT_USAGE
    if args.operation_id is not None and args.destination is None:
        print("--destination: which destination of the operation to send again", file=sys.stderr)
        return EXIT_USAGE
    if not args.reason.strip():
        print("--reason: say why (it is recorded with the redrive)", file=sys.stderr)
        return EXIT_USAGE
    started = datetime.now(UTC)
    batches: Iterable[list[tuple[str, str]]]
    total: int | None = None
    if args.operation_id is not None:
        batches = [[(args.operation_id, args.destination)]]
    else:
        try:
            since = datetime.fromisoformat(args.since)
        except ValueError:
            print(f"--since: not an ISO 8601 time: {args.since!r}", file=sys.stderr)
            return EXIT_USAGE
        if since.tzinfo is None:
            since = since.replace(tzinfo=UTC)
        if since > started:
            print(
                f"--since {since.isoformat()} is in the future (it is {started.isoformat()} "
                "now): nothing can have been dead-lettered since then",
                file=sys.stderr,
            )
            return EXIT_USAGE
        params = {
            "tenant": args.tenant,
            "since": since,
            "until": started,
            "destination": args.destination,
        }
        with pg.connect(settings.dsn, name="opledger-redrive", read_only=True) as conn:
            row = conn.execute(_DEAD_SINCE_COUNT_SQL, params).fetchone()
        total = int(row[0]) if row else 0
        print(
            f"{total} dead letters of tenant {args.tenant} from {since.isoformat()} to "
            f"{started.isoformat()}"
            + (f" for destination {args.destination}" if args.destination else ""),
            file=sys.stderr,
        )
        batches = _dead_since(settings.dsn, params, REDRIVE_BATCH)
    actor = _by(args)
    sent, skipped, seen = 0, 0, 0
    with open_pool(settings.dsn, name="opledger-redrive", max_size=2) as pool:
        history = HistoryReader(settings, pool, client_id="opledger-redrive")
        writer = LogWriter.connect(settings, "redrive")
        try:
            for wanted in batches:
                # Read from the log, not the projection: what the fold holds now, tenant-scoped.
                snapshots = history.load({(op, args.tenant) for op, _d in wanted})
                events: list[DeliveryTransitioned] = []
                now = datetime.now(UTC)
                for op_id, destination in wanted:
                    snapshot = snapshots.get(op_id)
                    record = None if snapshot is None else snapshot.deliveries.get(destination)
                    if record is None:
                        print(f"{op_id} {destination}: no such delivery for tenant {args.tenant}")
                        skipped += 1
                        continue
                    if record.state is not DeliveryState.DEAD_LETTERED:
                        print(
                            f"{op_id} {destination}: {record.state.value}, not dead-lettered "
                            "(redriven already, or never dead-lettered): nothing to do"
                        )
                        skipped += 1
                        continue
                    try:
                        event = redrive_event(record, actor_id=actor, reason=args.reason, now=now)
                    except (ValueError, ValidationError) as exc:
                        print(f"refused: {exc}", file=sys.stderr)
                        return EXIT_USAGE
                    events.append(event)
                    if total is None:
                        print(f"{op_id} {destination}: redriven ({event.event_id})")
                writer.append(events)
                sent += len(events)
                seen += len(wanted)
                if total is not None:
                    print(f"{seen}/{total} read, {sent} redriven", file=sys.stderr, flush=True)
        except RecordError as exc:
            # What was appended before stays appended: a rerun skips it (no longer dead).
            print(f"not redriven: {exc} ({sent} redriven before it)", file=sys.stderr)
            return EXIT_FAILED
        finally:
            history.close()
            writer.close()
    print(f"{sent} redriven, {skipped} skipped")
    if args.operation_id is not None and sent == 0:
        return EXIT_FAILED
    return EXIT_OK


def register(commands: Any) -> None:
    """``opledger deliver run``, ``opledger destinations ...``, ``opledger deliveries ...``."""
    parser = commands.add_parser(
        "deliver", help="the delivery worker: outbox, signed webhooks and queues, retries"
    )
    parser.set_defaults(kafka_role="delivery", pg_role="delivery")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    run_parser = actions.add_parser("run", help="deliver results until stopped (SIGTERM/SIGINT)")
    run_parser.add_argument(
        "--allow-networks",
        metavar="CIDRS",
        help="comma-separated networks webhooks may go to although refused by default, added "
        "to OPLEDGER_DELIVERY_ALLOW_NETWORKS (the local stack passes loopback: its consumer "
        "listens there)",
    )
    run_parser.set_defaults(handler="opledger.deliver:run")

    parser = commands.add_parser(
        "destinations", help="where a tenant's results are delivered (webhooks, queues)"
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = actions.add_parser("add", help="add (or replace) a destination")
    add.add_argument("--tenant", required=True, type=arguments.tenant, help="tenant id")
    add.add_argument(
        "--name",
        required=True,
        type=arguments.destination_name,
        help="its name: what events and metrics show",
    )
    where = add.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a webhook: results are POSTed here, signed")
    where.add_argument("--topic", help="a queue: results are appended to this Kafka topic")
    add.add_argument(
        "--tool",
        action="append",
        required=True,
        type=arguments.tool_or_wildcard,
        metavar="TOOL|*",
        help="whose results go there (repeat for several; '*' for every tool)",
    )
    add.add_argument(
        "--secret-env",
        metavar="VAR",
        help="read the whsec_ signing secret from this environment variable (default: a new "
        "one is made and printed once); for a queue, the secret its consumer signs fetches of "
        "large results with",
    )
    add.add_argument(
        "--fetch-secret",
        action="store_true",
        help="a queue only: make a whsec_ secret (printed once) so that results over "
        "OPLEDGER_DELIVERY_INLINE_MAX_BYTES go by reference and its consumer fetches them "
        "(without one, a result too large for a record is dead-lettered)",
    )
    add.add_argument("--timeout-ms", type=int, default=10_000, help="request timeout")
    add.add_argument(
        "--by",
        metavar="NAME",
        type=arguments.actor,
        help="who makes the change (default: cli:<login>)",
    )
    add.set_defaults(handler="opledger.deliver:destinations_add")
    listing = actions.add_parser("list", help="a tenant's destinations (secrets never shown)")
    listing.add_argument("--tenant", required=True, type=arguments.tenant, help="tenant id")
    listing.set_defaults(handler="opledger.deliver:destinations_list")
    for name in ("enable", "disable"):
        change = actions.add_parser(name, help=f"{name} a destination")
        change.add_argument("--tenant", required=True, type=arguments.tenant, help="tenant id")
        change.add_argument(
            "--name", required=True, type=arguments.destination_name, help="the destination"
        )
        change.add_argument("--reason", default=None, help="why (kept with the destination)")
        change.add_argument(
            "--by", metavar="NAME", type=arguments.actor, help="who (default: cli:<login>)"
        )
        change.set_defaults(handler="opledger.deliver:destinations_enable")
    rotate = actions.add_parser(
        "rotate-secret",
        help="a new signing secret; sends are signed with the old one too for an overlap, so "
        "the receiver can switch when it is ready",
    )
    rotate.add_argument("--tenant", required=True, type=arguments.tenant, help="tenant id")
    rotate.add_argument(
        "--name", required=True, type=arguments.destination_name, help="the destination"
    )
    rotate.add_argument(
        "--secret-env",
        metavar="VAR",
        help="read the new whsec_ secret from this environment variable (default: a new one is "
        "made and printed once)",
    )
    rotate.add_argument(
        "--overlap-hours",
        type=overlap_hours,
        default=24.0,
        help="how long the old secret still signs sends (0: from now on only the new one; at "
        "most 720)",
    )
    rotate.add_argument(
        "--by", metavar="NAME", type=arguments.actor, help="who (default: cli:<login>)"
    )
    rotate.set_defaults(handler="opledger.deliver:destinations_rotate")
    rekey = actions.add_parser(
        "rekey",
        help="seal every stored secret under the secrets key file's first key (after an "
        "upgrade, or after adding a key by hand)",
    )
    rekey.set_defaults(handler="opledger.deliver:destinations_rekey")
    rotate_key = actions.add_parser(
        "rotate-key",
        help="a new secrets key: added to the key file, every secret sealed again under it, "
        "the old key dropped",
    )
    rotate_key.add_argument(
        "--keep-old",
        action="store_true",
        help="keep the old key in the file (drop it later by hand, then run rekey)",
    )
    rotate_key.set_defaults(handler="opledger.deliver:destinations_rotate_key")
    key = actions.add_parser("key", help="the key destinations' secrets are sealed with")
    key_actions = key.add_subparsers(dest="key_action", required=True, metavar="KEY_ACTION")
    create = key_actions.add_parser(
        "create", help="write a new secrets key file (mode 0600; never overwritten)"
    )
    create.add_argument("--out", required=True, metavar="PATH", help="where")
    create.set_defaults(handler="opledger.deliver:destinations_key_create")

    parser = commands.add_parser("deliveries", help="dead-lettered deliveries: send them again")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    again = actions.add_parser(
        "redrive",
        help="send dead-lettered deliveries again (one, or all since a time); recorded with who "
        "and why; a second redrive of the same dead letter changes nothing",
    )
    again.add_argument("operation_id", nargs="?", type=arguments.operation_id, metavar="OP_ID")
    again.add_argument(
        "--tenant",
        required=True,
        type=arguments.tenant,
        help="tenant id the deliveries belong to",
    )
    again.add_argument(
        "--destination",
        type=arguments.destination,
        help="the destination (with OP_ID: required)",
    )
    again.add_argument("--since", metavar="TIME", help="every dead letter since this ISO time")
    again.add_argument("--reason", required=True, help="why (recorded; no secrets)")
    again.add_argument(
        "--by", metavar="NAME", type=arguments.actor, help="who (default: cli:<login>)"
    )
    again.set_defaults(handler="opledger.deliver:redrive")
