"""Wiring of the reference consumer: ``opledger consumer run`` (the HTTP receiver) and
``opledger consumer queue --topic T`` (a queue destination's records).

Both need the consumer's own database (``OPLEDGER_CONSUMER_PG_DSN``, by default
``opledger_consumer`` on the local server), created once by whoever runs the consumer; the
consumer creates its tables there itself. The receiver also needs ``OPLEDGER_CONSUMER_SECRETS``
(or ``--secrets-file``: the local stack's supervisor runs it with the secret `stack up` wrote).
The queue consumer takes the same variable or option for its destination's fetch secret, which
it needs only for results delivered by reference (decision 016).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ledger import faults
from ledger.settings import Settings, SettingsError
from opledger import arguments
from opledger.arguments import tcp_port

if TYPE_CHECKING:
    import asyncio

#: Exit code for errors whose message says how to fix them (same as ``opledger.cli``).
EXIT_USAGE = 2
#: ``consumer redrive``: Kafka did not acknowledge; running it again is safe.
EXIT_RETRY = 1
#: ``consumer redrive``: some records could not be put back, and running it again will not
#: change that (each is named with why; its dead letter stays).
EXIT_UNRECOVERABLE = 4


def _setup(settings: Settings) -> None:
    from ledger.secrets import RedactingFilter  # noqa: PLC0415
    from ledger.topics import ensure_topics  # noqa: PLC0415

    faults.arm(settings.fault_points)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())
    ensure_topics(settings)  # the key store among them


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    # uvloop (a declared dependency): libuv does the receiver's socket work with less Python
    # per request; bench/bench_consumer_receiver.py runs its baseline on it too.
    import uvloop  # noqa: PLC0415

    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger consumer run``: serve POST /events until SIGTERM/SIGINT."""
    import asyncio  # noqa: PLC0415

    from consumers.receiver import serve  # noqa: PLC0415
    from consumers.runtime import ConsumerRuntime, ConsumerSetupError  # noqa: PLC0415
    from consumers.signatures import SignatureVerifier  # noqa: PLC0415

    read = _read_secrets_file(args, settings)
    if read is None:
        return EXIT_USAGE
    settings = read
    if not settings.consumer_secret_list:
        print(
            "opledger: OPLEDGER_CONSUMER_SECRETS is empty; the receiver verifies every request's "
            "signature, so give it the destination's whsec_ secret (or --secrets-file)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.name:
        settings = settings.with_(consumer_name=args.name)  # validated like the variable
    _setup(settings)
    port = settings.consumer_web_port if args.port is None else args.port
    verifier = SignatureVerifier(
        settings.consumer_secret_list, tolerance_s=settings.consumer_timestamp_tolerance_s
    )
    runtime = ConsumerRuntime(settings)
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(serve(runtime, verifier, args.host, port))
    except ConsumerSetupError as exc:
        print(f"opledger: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _read_secrets_file(args: argparse.Namespace, settings: Settings) -> Settings | None:
    """``settings`` with ``--secrets-file``'s secrets, if given; None (the reason printed) if
    the file cannot be used."""
    if not args.secrets_file:
        return settings
    try:
        return _with_secrets_file(settings, args.secrets_file)
    except (OSError, SettingsError) as exc:
        print(f"opledger: --secrets-file: {exc}", file=sys.stderr)
        return None


def _with_secrets_file(settings: Settings, name: str) -> Settings:
    """``settings`` with the secret(s) read from ``name`` (relative to OPLEDGER_HOME), checked
    as OPLEDGER_CONSUMER_SECRETS would be. Errors name the file, never its content."""
    path = Path(name)
    if not path.is_absolute():
        path = settings.home / path
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} does not exist (`opledger stack up` writes the local stack's)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OSError(f"cannot read {path}: {type(exc).__name__}") from None
    secrets = " ".join(text.split())
    if not secrets:
        raise SettingsError(f"{path} holds no secret")
    return settings.with_(consumer_secrets=secrets)


def queue(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger consumer queue --topic T``: consume a queue destination until SIGTERM/SIGINT."""
    import signal  # noqa: PLC0415

    from consumers.queue import EVERY_TENANT, QueueConsumer  # noqa: PLC0415
    from consumers.runtime import ConsumerRuntime, ConsumerSetupError  # noqa: PLC0415

    read = _read_secrets_file(args, settings)
    if read is None:
        return EXIT_USAGE
    settings = read
    if args.name:
        settings = settings.with_(consumer_name=args.name)
    _setup(settings)
    runtime = ConsumerRuntime(settings)
    consumer = QueueConsumer(
        runtime,
        args.topic,
        group_id=args.group,
        fetch_secrets=settings.consumer_secret_list,
        tenants=EVERY_TENANT if args.every_tenant else args.tenant,
    )
    if args.metrics_port is not None:
        from prometheus_client import start_http_server  # noqa: PLC0415

        server, _thread = start_http_server(
            args.metrics_port, addr=args.host, registry=runtime.registry
        )
        print(
            f"consumer {settings.consumer_name}: metrics on "
            f"http://{args.host}:{server.server_port}/metrics",
            flush=True,
        )
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _n, _f: consumer.stop())
    try:
        consumer.run()
    except ConsumerSetupError as exc:
        print(f"opledger: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        runtime.close()
    return 0


def redrive(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger consumer redrive --topic T``: put a queue's dead letters back on it."""
    from consumers.dead_letters import redrive as put_back  # noqa: PLC0415
    from ledger.dead_letters import DeadLetterUnavailableError  # noqa: PLC0415

    _setup(settings)
    try:
        report = put_back(settings, args.topic, kinds=args.kind or (), at=args.at or ())
    except DeadLetterUnavailableError as exc:
        print(f"opledger: {exc}; nothing is lost, run the redrive again", file=sys.stderr)
        return EXIT_RETRY
    read_back = set(report.read_back)
    for c in report.redriven:
        how = (
            " (read back from its topic: its dead letter held a reference)"
            if c in read_back
            else ""
        )
        print(f"redriven {c.topic}[{c.partition}]@{c.offset}{how}")
    for c, why in report.unrecoverable:
        print(f"not redriven {c.topic}[{c.partition}]@{c.offset}: {why}")
    print(
        f"{len(report.redriven)} record(s) put back on {args.topic}; the consumers take each "
        "key at most once",
        flush=True,
    )
    # A letter that could not be put back is not lost (it stays on the dead-letter topic with
    # its size, digest and prefix), but a redrive that did not do all it was asked says so.
    return EXIT_UNRECOVERABLE if report.unrecoverable else 0


def _coordinates(raw: str) -> tuple[int, int]:
    partition, sep, offset = raw.partition(":")
    if not sep or not partition.isdigit() or not offset.isdigit():
        raise argparse.ArgumentTypeError(f"not PARTITION:OFFSET: {raw!r}")
    return int(partition), int(offset)


def register(commands: Any) -> None:
    """``opledger consumer run|queue|redrive``."""
    parser = commands.add_parser(
        "consumer", help="the reference consumer: POST /events receiver and queue consumer"
    )
    parser.set_defaults(kafka_role="consumer")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    run_parser = actions.add_parser(
        "run",
        help="serve POST /events (deduplicated on operation_id), /metrics and /healthz until "
        "SIGTERM/SIGINT",
    )
    run_parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    run_parser.add_argument(
        "--port",
        type=tcp_port,
        default=None,
        help="port to bind (default OPLEDGER_CONSUMER_WEB_PORT, 16068; 0 picks a free one)",
    )
    run_parser.set_defaults(handler="opledger.consumer:run")
    queue_parser = actions.add_parser(
        "queue", help="consume a queue destination's topic with the same deduplication"
    )
    queue_parser.add_argument("--topic", required=True, help="the queue destination's topic")
    queue_parser.add_argument(
        "--metrics-port",
        type=tcp_port,
        default=None,
        help="serve /metrics on this port (0 picks a free one; default: no metrics server)",
    )
    queue_parser.add_argument(
        "--host", default="127.0.0.1", help="address /metrics binds to (127.0.0.1)"
    )
    queue_parser.add_argument(
        "--group", default=None, help="consumer group (default <prefix>-consumer-<name>)"
    )
    # No default scope: a consumer that took every tenant unless told otherwise would take
    # what another tenant's destination wrote to its topic.
    scope = queue_parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--tenant",
        action="append",
        type=arguments.tenant,
        metavar="TENANT",
        help="take only this tenant's records (repeatable); others are dead-lettered "
        "unapplied as foreign-tenant, their results never fetched",
    )
    scope.add_argument(
        "--every-tenant",
        action="store_true",
        help="take every tenant's records (a consumer that receives for all the tenants "
        "that may name its topic)",
    )
    for sub in (run_parser, queue_parser):
        sub.add_argument(
            "--name", default=None, help="consumer name (default OPLEDGER_CONSUMER_NAME)"
        )
        sub.add_argument(
            "--secrets-file",
            metavar="PATH",
            default=None,
            help="read the whsec_ secret(s) from this file (whitespace-separated; relative to "
            "OPLEDGER_HOME) instead of OPLEDGER_CONSUMER_SECRETS; a queue consumer needs its "
            "destination's fetch secret only for results delivered by reference",
        )
    queue_parser.set_defaults(handler="opledger.consumer:queue")
    redrive_parser = actions.add_parser(
        "redrive",
        help="put a queue topic's dead letters (records its consumers could not take) back on it",
        description="Put a queue topic's dead letters back on it, each once. A letter that "
        "holds only a reference (its record was too large to republish) has its record read "
        "back from the topic and checked against the reference's size and sha256.",
        epilog="exit codes: 0 done · 1 Kafka did not acknowledge (nothing is lost; run it "
        "again) · 2 usage · 4 some letters' records could not be read back (deleted by "
        "retention, or not the record dead-lettered); each is named, and its letter stays",
    )
    redrive_parser.add_argument("--topic", required=True, help="the queue destination's topic")
    redrive_parser.add_argument(
        "--kind",
        action="append",
        choices=("invalid", "foreign-tenant", "refused", "conflict", "unfetchable"),
        help="only dead letters of this kind (repeatable; default: every kind)",
    )
    redrive_parser.add_argument(
        "--at",
        action="append",
        type=_coordinates,
        metavar="PARTITION:OFFSET",
        help="only the dead letter of the record at these source coordinates (repeatable)",
    )
    redrive_parser.set_defaults(handler="opledger.consumer:redrive")
