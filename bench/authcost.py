"""What authentication and ACLs cost a call (decision 029): ``bench_sdk_calls.py --auth``.

The same recorder and lease paths, in the same run, taking turns, on two private single-node
brokers started here alike (same jars, heap, disk, both fresh): one plaintext without an
authorizer (what the stack was before), one configured as the stack's broker is (SASL/SCRAM,
StandardAuthorizer, the ACLs of ``ledger.kafka_access``). On the second, as its super user
(authentication, no ACL evaluation: Kafka skips ACLs for super users) and as the ``sdk``
principal (authentication and ACLs, as a service runs).
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from callbench import Summary, run_threads
from ledger.kafka_access import ADMIN, PRINCIPALS, ensure_users, make_passwords, password_file
from ledger.log import new_admin
from ledger.settings import Settings
from ledger.topics import ensure_topics
from opledger.stack.kafka import (
    BrokerSecrets,
    ensure_kafka_jars,
    find_java,
    format_kafka_storage,
    kafka_command,
    kraft_properties,
    random_cluster_id,
    write_properties,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def private_broker(settings: Settings, *, sasl: bool) -> Iterator[Settings]:
    """A private single-node KRaft broker from the stack's jars, killed and removed on the way
    out: plaintext and open, or as the stack's (``sasl``: its users made, admin signed in);
    ``settings`` for it, as the admin."""
    java, libs = find_java(), ensure_kafka_jars(settings, echo=lambda _line: None)
    port, controller = _free_port(), _free_port()
    with tempfile.TemporaryDirectory(prefix="opledger-bench-broker-") as tmp:
        work = Path(tmp)
        client = settings.with_(
            kafka_bootstrap=f"127.0.0.1:{port}",
            kafka_security="sasl_plaintext" if sasl else "plaintext",
            kafka_principal=ADMIN,
            kafka_password_file="",
            kafka_password_dir=str(work / "keys"),
        )
        secrets = None
        if sasl:
            make_passwords(client, (*PRINCIPALS, "controller"))
            secrets = BrokerSecrets(
                admin_password=_first_line(password_file(client, ADMIN)),
                controller_password=_first_line(password_file(client, "controller")),
            )
        config = write_properties(
            work / "server.properties",
            kraft_properties(
                node_id=1,
                port=port,
                controller_port=controller,
                voters=f"1@127.0.0.1:{controller}",
                log_dir=work / "data",
                secrets=secrets,
            ),
        )
        format_kafka_storage(java, libs, config, random_cluster_id())
        with (work / "stdout.log").open("ab") as out:
            process = subprocess.Popen(
                kafka_command(java, libs, config, work / "kafka.log"),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            # The static PLAIN admin signs in before any SCRAM user exists, as `stack up` does.
            bootstrap_admin = client.with_(kafka_sasl_mechanism="PLAIN") if sasl else client
            deadline = time.monotonic() + 120
            while True:
                try:
                    new_admin(
                        bootstrap_admin, client_id="bench", overrides={"log_level": 0}
                    ).list_topics(timeout=2)
                    break
                except Exception:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the bench broker did not start ({work})") from None
                    time.sleep(0.5)
            if sasl:
                ensure_users(bootstrap_admin)
            ensure_topics(client)
            yield client
        finally:
            process.kill()
            process.wait()


def _first_line(path: Path) -> str:
    return path.read_text().splitlines()[0].strip()


def measure(
    stack_settings: Settings,
    args: argparse.Namespace,
    make_path: Callable[[str, Settings], tuple[object, Callable[[], None]]],
    close: Callable[[object], None],
) -> dict[tuple[str, str], dict[str, list[Summary]]]:
    """(access, path) -> mode -> its rounds, each on fresh recorders."""
    results: dict[tuple[str, str], dict[str, list[Summary]]] = {}
    with (
        private_broker(stack_settings, sasl=False) as plain,
        private_broker(stack_settings, sasl=True) as guarded,
    ):
        # The database side as well (decision 034): the owner, which row-level security does
        # not hold, against the SDK's own role, which it does (a policy on every read).
        accesses = {
            "plaintext, no authorizer": plain.with_(pg_role="owner"),
            "SASL/SCRAM, super user": guarded.with_(pg_role="owner"),
            "SASL/SCRAM + ACLs, sdk": guarded.with_(kafka_principal="sdk", pg_role="owner"),
            "+ PG role opledger_sdk": guarded.with_(kafka_principal="sdk", pg_role="sdk"),
        }
        paths = [p for p in args.paths if p != "execute"]

        def timed(path: str, settings: Settings, mode: str, calls: int, callers: int) -> Summary:
            recorder, call = make_path(path, settings)
            try:
                return run_threads(
                    mode,
                    call,
                    calls=calls,
                    callers=callers,
                    warmup=args.warmup,
                    timeout_s=args.timeout,
                )
            finally:
                close(recorder)

        # Both modes take turns, access after access, --rounds times, each round starting
        # with another: the load of a shared machine drifts, and a fixed order would credit
        # the later ones (a warmer JVM, a quieter minute).
        threads = f"{args.callers} threads"
        for number in range(args.rounds):
            print(f"auth cost, round {number + 1} of {args.rounds}...", flush=True)
            order = list(accesses.items())
            shift = number % len(order)  # who goes first changes from round to round
            for access, settings in order[shift:] + order[:shift]:
                for path in paths:
                    runs = results.setdefault((access, path), {"sequential": [], threads: []})
                    runs["sequential"].append(
                        timed(path, settings, "sequential", args.sequential, 1)
                    )
                    runs[threads].append(
                        timed(path, settings, threads, args.concurrent, args.callers)
                    )
    return results
