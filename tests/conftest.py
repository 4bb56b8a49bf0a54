"""Fixtures shared by every tier.

Fixtures are lazy: only tests that request ``stack_settings`` or ``isolated`` start the local
stack, so ``tests/unit`` runs without Kafka or PostgreSQL. The tier is in the path, and the
matching marker is added here so ``-m 'not integration'`` works without decorating each test.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING
from uuid import uuid4

import psycopg
import pytest
from hypothesis import settings as hypothesis_settings
from psycopg import sql
from psycopg.conninfo import make_conninfo

from ledger.kafka_access import drop_access
from ledger.log.clients import new_admin
from ledger.pg import open_pool
from ledger.policy_store import PolicyStore
from ledger.settings import Settings
from ledger.topics import ensure_topics
from opledger import db, stack

if TYPE_CHECKING:
    from tests.cluster_support import KafkaCluster

# Two cores are shared with Kafka and PostgreSQL: a slow example is not a failing one.
hypothesis_settings.register_profile("opledger", deadline=None)
hypothesis_settings.load_profile("opledger")

_TIERS = {"integration": "integration", "chaos": "chaos"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--edge-records",
        type=int,
        default=10_000,
        metavar="N",
        help="records tests/integration/test_edge_generative.py pushes through the projector "
        "(at least 10,000; raise it for a soak run)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.path)).parts
        for directory, marker in _TIERS.items():
            if directory in parts:
                item.add_marker(getattr(pytest.mark, marker))


@pytest.fixture(scope="session")
def stack_settings() -> Settings:
    """Settings of the running local stack, started if needed (idempotent, fast when up)."""
    # The broker's admin (its SCRAM user): tests read every group and topic, create and drop
    # their own; what the service principals may not do is tests/integration/test_kafka_access.
    settings = Settings.from_env().as_kafka_role("admin")
    stack.up(settings, echo=lambda _line: None)
    # Kept with a test's private home too: the passwords are the stack's broker's.
    settings = settings.with_(
        kafka_password_dir=str(settings.kafka_password_directory),
        pg_password_dir=str(settings.pg_passfile_path.parent),
    )
    # Test receivers listen on loopback, where webhooks may not go unless allowed (decision
    # 019): every test's settings, isolated or a private stack's, start from these.
    return settings.with_(delivery_allow_networks="127.0.0.0/8,::1/128")


@contextmanager
def _isolated(stack_settings: Settings) -> Iterator[Settings]:
    """Settings with topics and a database of their own, dropped on the way out."""
    tag = f"t{uuid4().hex[:10]}"
    database = f"opledger_{tag}"
    admin_dsn = make_conninfo(stack_settings.dsn, dbname="postgres")
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    settings = stack_settings.with_(
        topic_prefix=tag,
        # The local server's database, not a DSN: the SDK and the workers in it sign in as
        # their own roles (decision 034); the test itself is the owner.
        pg_database=database,
    )
    try:
        ensure_topics(settings)
        db.migrate(settings.dsn)  # as `opledger stack up` does for the shared database
        yield settings
    finally:
        _drop(settings, tag, database, admin_dsn)


def _drop(settings: Settings, tag: str, database: str, admin_dsn: str) -> None:
    # A function of its own, not the finally above: a setup that failed keeps its traceback,
    # and with it that frame's locals, until pytest has reported it; an admin client held there
    # outlived its cluster and wrote librdkafka's reconnect complaints into later tests' stderr.
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
        )
    drop_access(settings, tag)  # the ACLs ensure_topics made for the prefix
    # Infinite retention would otherwise keep every test's records on disk forever.
    # The projector's faust worker adds its own internal topics under the same prefix.
    admin = new_admin(settings, client_id="tests-cleanup")
    ours = [
        t
        for t in admin.list_topics(timeout=10).topics
        if t.startswith(f"{tag}.") or t.startswith(f"{tag}-")
    ]
    if ours:
        for future in admin.delete_topics(ours).values():
            future.exception(timeout=30)


@pytest.fixture
def isolated(stack_settings: Settings) -> Iterator[Settings]:
    """Settings with topics and a database of their own, dropped after the test."""
    with _isolated(stack_settings) as settings:
        yield settings


@pytest.fixture(scope="module")
def module_isolated(stack_settings: Settings) -> Iterator[Settings]:
    """:func:`isolated` shared by a module's tests: only for tests that read what a module
    fixture wrote, never for tests that write."""
    with _isolated(stack_settings) as settings:
        yield settings


@pytest.fixture(scope="module")
def kafka_cluster(
    stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KafkaCluster]:
    """A private three-node KRaft cluster from the shared stack's jars (``KafkaCluster``),
    killed after the module. A test that stops a node restarts it before it ends."""
    # Imported here: the unit tier loads this file too, and needs none of it.
    from tests.cluster_support import KafkaCluster  # noqa: PLC0415

    cluster = KafkaCluster(
        tmp_path_factory.mktemp("cluster"),
        stack.find_java(),
        stack.ensure_kafka_jars(stack_settings),
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_isolated(stack_settings: Settings, kafka_cluster: KafkaCluster) -> Iterator[Settings]:
    """:func:`isolated` on the private cluster: its topics replicated to every node (a
    majority in sync to acknowledge), a database of its own on the shared server."""
    on_cluster = stack_settings.with_(
        kafka_bootstrap=kafka_cluster.bootstrap, replication_factor=kafka_cluster.size
    )
    with _isolated(on_cluster) as settings:
        yield settings


@pytest.fixture
def store(isolated: Settings) -> Iterator[PolicyStore]:
    """A policy store on the isolated database."""
    pool = open_pool(isolated.dsn, name="policy-test", max_size=2)
    try:
        yield PolicyStore(pool, isolated)
    finally:
        pool.close()
