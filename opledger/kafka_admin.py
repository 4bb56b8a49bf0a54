"""``opledger kafka passwords|setup``: the broker's principals for a broker opledger did not
start (docker-compose.yml's, or a cluster of your own), as `opledger stack up` makes them for
the local one (decision 029).

``passwords`` makes, once, a password file per principal in a directory, with the broker's
JAAS file and an admin client's properties derived from them; ``setup``, as the broker's
admin, makes each principal's SCRAM user from its file, the topics and every role's ACLs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ledger.settings import Settings

EXIT_USAGE = 2

#: The broker's own logins (JAAS), read by its JVM (KAFKA_OPTS) rather than its settings.
BROKER_JAAS = "kafka-server-jaas.conf"
#: How Kafka's own tools sign in as the admin (the compose broker's health check).
ADMIN_CLIENT_PROPERTIES = "kafka-admin-client.properties"


def _first_line(path: Path) -> str:
    return path.read_text().splitlines()[0].strip()


def write_broker_files(settings: Settings, directory: Path) -> list[Path]:
    """Every principal's password file in ``directory`` (made if missing, never replaced),
    then the broker's JAAS file and the admin client's properties written from them."""
    # Here, not above: the CLI imports every command's module, and these load librdkafka.
    from ledger.kafka_access import ADMIN, PRINCIPALS, make_passwords, password_file  # noqa: PLC0415
    from ledger.private_files import write_private  # noqa: PLC0415
    from opledger.stack.kafka import BrokerSecrets, broker_jaas, plain_client  # noqa: PLC0415

    here = settings.with_(kafka_password_dir=str(directory), kafka_password_file="")
    make_passwords(here, (*PRINCIPALS, "controller"))
    admin = _first_line(password_file(here, ADMIN))
    jaas = broker_jaas(
        BrokerSecrets(
            admin_password=admin,
            controller_password=_first_line(password_file(here, "controller")),
        )
    )
    client = (
        "security.protocol=SASL_PLAINTEXT\n"
        "sasl.mechanism=PLAIN\n"
        f"sasl.jaas.config={plain_client(ADMIN, admin)}\n"
    )
    write_private(directory / BROKER_JAAS, jaas)
    write_private(directory / ADMIN_CLIENT_PROPERTIES, client)
    files = [password_file(here, p) for p in (*PRINCIPALS, "controller")]
    return [*files, directory / BROKER_JAAS, directory / ADMIN_CLIENT_PROPERTIES]


def passwords_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger kafka passwords --dir DIR``."""
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    for path in write_broker_files(settings, directory):
        print(path)
    return 0


def setup(settings: Settings, timeout: float = 60.0) -> tuple[list[str], list[str]]:
    """As the broker's admin: a SCRAM user per principal from its password file, then the
    topics and every role's ACLs. Returns (users written, topics)."""
    import time  # noqa: PLC0415

    from ledger.kafka_access import ensure_users  # noqa: PLC0415
    from ledger.log.reads import ride_out  # noqa: PLC0415
    from ledger.topics import ensure_topics  # noqa: PLC0415

    users = ride_out(
        lambda: ensure_users(settings),
        deadline=time.monotonic() + timeout,
        what="the SCRAM users",
        bootstrap=settings.bootstrap_servers,
    )
    specs = ensure_topics(settings)
    return users, [spec.name for spec in specs]


def setup_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger kafka setup``."""
    from ledger.kafka import KafkaCredentialsError  # noqa: PLC0415
    from ledger.topics import TopicError  # noqa: PLC0415

    try:
        users, topics = setup(settings, timeout=args.timeout)
    except (KafkaCredentialsError, TopicError, OSError) as exc:
        print(f"opledger: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"kafka setup: SCRAM users {', '.join(users)}")
    print(f"kafka setup: topics and ACLs {', '.join(topics)}")
    return 0


def register(commands: Any) -> None:
    """``opledger kafka``."""
    parser = commands.add_parser(
        "kafka",
        help="principals, topics and ACLs of a broker opledger did not start (compose, yours)",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    passwords = actions.add_parser(
        "passwords",
        help="a password file per principal (made once), the broker's JAAS file and an admin "
        "client's properties",
    )
    passwords.add_argument("--dir", required=True, help="where to write them (0600 each)")
    passwords.set_defaults(handler="opledger.kafka_admin:passwords_command")
    run = actions.add_parser(
        "setup",
        help="as the broker's admin: each principal's SCRAM user from its password file, the "
        "topics and every role's ACLs (idempotent)",
    )
    run.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the broker")
    run.set_defaults(handler="opledger.kafka_admin:setup_command", kafka_role="admin")
