"""``opledger backup`` and ``opledger restore``: what the log cannot give back, kept with
``pg_dump``; everything else rebuilt from the topics, which keep every record (decision 039).

What is kept: the result store, the stored requests and leases, the destinations (their secrets
sealed: the key file is kept apart, never in a backup), the analysts' bindings, and the
consumers' inbox with the changes it guards. Everything else is a projection of the topics.
A backup is one directory: a data-only custom-format dump per database, taken in one snapshot
whose row counts the manifest states, with the sha256 of each file and the log's end offsets
when it was taken. It fails when the operation topics do not keep everything (a finite
``retention.ms``, or records already gone below a partition's start), since a restore could
not rebuild from them.

A restore builds the database under a name nobody uses (``<database>_restoring``): migrates,
loads the dumps, folds every projection from offset 0 with the projector's own fold (stored
under the live projector's name, so it resumes where the restore stopped), raises every lease's
token to the highest the log records (a token lower than one already on the log would be fenced
by the fold), checks every result the log names, and only then renames the database into
place. The workers, which retry their connections, find a complete database or none. A
database that exists is never overwritten.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ledger.settings import Settings

EXIT_OK = 0
EXIT_NOT_WHOLE = 1
EXIT_USAGE = 2

FORMAT = "opledger-backup/1"
MANIFEST = "backup.json"
LEDGER_DUMP = "ledger.dump"
CONSUMER_DUMP = "consumer.dump"

#: The ledger database's tables that are not history (``projections.compare.NOT_HISTORY``).
STATE_TABLES = (
    "results",
    "operation_requests",
    "operation_leases",
    "delivery_destinations",
    "analyst_tenants",
)
#: The consumers' inbox and the changes it guards, wherever the consumer's database is.
CONSUMER_TABLES = ("consumer_inbox", "consumer_applied_changes", "consumer_held_records")

#: The owner a lease restored from the log's record names.
RESTORED_OWNER = "opledger-restore"


class BackupError(RuntimeError):
    """A backup or restore that cannot be done; the message says why and what to do."""


@dataclass(slots=True)
class Restored:
    database: str
    tables: dict[str, int] = field(default_factory=dict)
    records: int = 0
    fold_seconds: float = 0.0
    leases_raised: int = 0
    leases_from_log: int = 0
    results_checked: int = 0
    results_wrong: list[str] = field(default_factory=list)
    consumer_database: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        return not self.results_wrong


def _pg_tool(name: str) -> str:
    from opledger.stack import find_pg_bindir  # noqa: PLC0415

    bindir = find_pg_bindir()
    if bindir is not None and (bindir / name).is_file():
        return str(bindir / name)
    found = shutil.which(name)
    if found is None:
        raise BackupError(f"{name} not found: install PostgreSQL's client (postgresql-client)")
    return found


def client_arguments(dsn: str) -> tuple[str, dict[str, str]]:
    """``dsn`` for a PostgreSQL client's ``--dbname``, and the environment its password goes
    in: a password on a command line is in every process listing of the machine."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo  # noqa: PLC0415

    parts = {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    password = parts.pop("password", None)
    return make_conninfo(**parts), ({"PGPASSWORD": password} if password else {})


def _run(argv: list[str], what: str, dsn: str) -> None:
    """``argv`` with ``--dbname`` for ``dsn`` added (its password in the environment)."""
    dbname, secret = client_arguments(dsn)
    result = subprocess.run(
        [*argv, f"--dbname={dbname}"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **secret},
    )
    if result.returncode != 0:
        from ledger.domain.redact import redact  # noqa: PLC0415

        raise BackupError(f"{what} failed: {redact(result.stderr.strip())[-2000:]}")


def _database(dsn: str) -> str:
    from psycopg.conninfo import conninfo_to_dict  # noqa: PLC0415

    return str(conninfo_to_dict(dsn).get("dbname") or "")


def _on(dsn: str, database: str) -> str:
    from psycopg.conninfo import make_conninfo  # noqa: PLC0415

    return make_conninfo(dsn, dbname=database)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def log_gaps(settings: Settings) -> list[str]:
    """Why the operation topics could not give a restore everything: a retention that deletes,
    or records already deleted below a partition's start."""
    from confluent_kafka import TopicPartition  # noqa: PLC0415

    from ledger.log import end_offsets, new_admin, new_consumer, watermarks  # noqa: PLC0415
    from ledger.topics import topic_configs  # noqa: PLC0415

    topics = (settings.execution_topic, settings.delivery_topic)
    gaps: list[str] = []
    admin = new_admin(settings, client_id="opledger-backup")
    deadline = time.monotonic() + 30
    described = topic_configs(admin, list(topics), 30.0, settings.bootstrap_servers)
    for topic in topics:
        retention = described[topic].get("retention.ms")
        cleanup = described[topic].get("cleanup.policy")
        if retention != "-1" or cleanup != "delete":
            gaps.append(
                f"{topic} has retention.ms={retention}, cleanup.policy={cleanup}: it does not keep "
                "every record (opledger needs -1 and delete)"
            )
    consumer = new_consumer(
        settings, group_id=settings.readers_group("backup"), client_id="opledger-backup"
    )
    try:
        for topic, partition in sorted(end_offsets(settings, topics)):
            low, _high = watermarks(consumer, TopicPartition(topic, partition), deadline)
            if low > 0:
                gaps.append(
                    f"{topic}[{partition}] starts at offset {low}: records before it are gone"
                )
    finally:
        consumer.close()
    return gaps


def _count(conn: Any, table: str) -> int:
    from psycopg import sql  # noqa: PLC0415

    row = conn.execute(
        sql.SQL("SELECT count(*) FROM public.{}").format(sql.Identifier(table))
    ).fetchone()
    return int(row[0])


def _dump(dsn: str, tables: list[str], target: Path) -> dict[str, int]:
    """A data-only dump of ``tables`` in one snapshot, and their row counts in that snapshot."""
    from ledger import pg  # noqa: PLC0415

    with pg.connect(dsn, name="opledger-backup") as conn:
        present = [
            name
            for (name,) in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
                "AND tablename = ANY(%s) ORDER BY 1",
                (tables,),
            )
        ]
        if not present:
            return {}
        # The counts and the dump see the same rows: pg_dump joins this transaction's snapshot.
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            (snapshot,) = conn.execute("SELECT pg_export_snapshot()").fetchone() or ("",)
            counts = {name: _count(conn, name) for name in present}
            argv = [_pg_tool("pg_dump"), "--format=custom", "--data-only", f"--snapshot={snapshot}"]
            argv += [f"--table=public.{name}" for name in present]
            _run([*argv, f"--file={target}"], "pg_dump", dsn)
    os.chmod(target, 0o600)
    return counts


def backup(settings: Settings, out: Path) -> dict[str, Any]:
    """Write a backup of ``settings``' databases to ``out``; returns its manifest."""
    from ledger.log import end_offsets  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).exists():
        raise BackupError(f"{out / MANIFEST} exists: back up into an empty directory")
    gaps = log_gaps(settings)
    if gaps:
        raise BackupError(
            "the topics do not keep what a restore rebuilds from, so no backup of the rest "
            "would be whole: " + "; ".join(gaps)
        )
    cut = end_offsets(settings, (settings.execution_topic, settings.delivery_topic))
    ledger_db, consumer_db = _database(settings.dsn), _database(settings.consumer_dsn)
    separate = consumer_db != ledger_db
    tables = {
        LEDGER_DUMP: _dump(
            settings.dsn,
            list(STATE_TABLES) + ([] if separate else list(CONSUMER_TABLES)),
            out / LEDGER_DUMP,
        )
    }
    if separate:
        tables[CONSUMER_DUMP] = _dump(
            settings.consumer_dsn, list(CONSUMER_TABLES), out / CONSUMER_DUMP
        )
    manifest = {
        "format": FORMAT,
        "created_at": datetime.now(UTC).isoformat(),
        "databases": {LEDGER_DUMP: ledger_db, CONSUMER_DUMP: consumer_db if separate else None},
        "tables": {name: counts for name, counts in tables.items() if counts},
        "files": {name: _sha256(out / name) for name, counts in tables.items() if counts},
        "log_ends": {f"{t}[{p}]": o for (t, p), o in sorted(cut.items())},
        "keep_apart": [
            f"{settings.secrets_key_path} (opens the destinations' sealed secrets)",
            f"{settings.policy_trusted_keys_path} (the keys policy changes are checked with)",
        ],
    }
    path = out / MANIFEST
    path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.chmod(path, 0o600)
    return manifest


def read_backup(source: Path) -> dict[str, Any]:
    """The manifest of the backup in ``source``, each file checked against its sha256."""
    try:
        manifest = json.loads((source / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BackupError(f"{source} holds no backup manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BackupError(f"{source / MANIFEST} is not an {FORMAT} manifest")
    for name, digest in manifest["files"].items():
        if not (source / name).is_file() or _sha256(source / name) != digest:
            raise BackupError(f"{source / name} is missing or not the file the backup wrote")
    return manifest


def _exists(admin: Any, database: str) -> bool:
    return bool(
        admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone()
    )


def _fresh(admin: Any, database: str) -> str:
    from psycopg import sql  # noqa: PLC0415

    staging = f"{database[:50]}_restoring"
    admin.execute(
        sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(staging))
    )
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(staging)))
    return staging


def _load(dump: Path, dsn: str) -> None:
    _run(
        [
            _pg_tool("pg_restore"),
            "--data-only",
            "--single-transaction",
            "--exit-on-error",
            str(dump),
        ],
        "pg_restore",
        dsn,
    )


def _into_place(admin: Any, staging: str, database: str) -> None:
    from psycopg import sql  # noqa: PLC0415

    admin.execute(
        sql.SQL("ALTER DATABASE {} RENAME TO {}").format(
            sql.Identifier(staging), sql.Identifier(database)
        )
    )


def _drop(admin: Any, database: str) -> None:
    from psycopg import sql  # noqa: PLC0415

    admin.execute(
        sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
    )


def _repair_leases(conn: Any) -> tuple[int, int]:
    """Every lease's token at least the highest the log records for its operation, and a lease
    (expired) for every operation the log names an owner of: a take-over then goes above it."""
    raised = conn.execute(
        "UPDATE operation_leases l SET token = o.lease_token, owner = %s, "
        "expires_at = least(l.expires_at, now()), updated_at = now() "
        "FROM agent_operations o WHERE o.operation_id = l.operation_id "
        "AND o.lease_token > l.token",
        (RESTORED_OWNER,),
    ).rowcount
    added = conn.execute(
        "INSERT INTO operation_leases (operation_id, tenant_id, token, owner, expires_at) "
        "SELECT o.operation_id, o.tenant_id, o.lease_token, %s, now() FROM agent_operations o "
        "WHERE o.lease_token > 0 AND NOT EXISTS "
        "(SELECT 1 FROM operation_leases l WHERE l.operation_id = o.operation_id)",
        (RESTORED_OWNER,),
    ).rowcount
    return int(raised), int(added)


def restore(settings: Settings, source: Path, progress_out: Any, timeout_s: float) -> Restored:
    """Restore the backup in ``source`` into ``settings``' databases, which must not exist."""
    from consumers.runtime import migrate_database as migrate_consumer  # noqa: PLC0415
    from ledger import pg  # noqa: PLC0415
    from ledger.log import end_offsets  # noqa: PLC0415
    from opledger.db import migrate  # noqa: PLC0415
    from opledger.replay import Progress, rebuild_into  # noqa: PLC0415
    from projections import compare  # noqa: PLC0415

    manifest = read_backup(source)
    database = _database(settings.dsn)
    report = Restored(database)
    admin_dsn = _on(settings.dsn, "postgres")
    with pg.connect(admin_dsn, name="opledger-restore") as admin:
        # One restore of a database at a time: a second would drop the first's staging
        # database under it. The lock is the session's, released when it ends however it ends.
        (alone,) = admin.execute(
            "SELECT pg_try_advisory_lock(hashtext(%s))", (f"opledger-restore:{database}",)
        ).fetchone() or (False,)
        if not alone:
            raise BackupError(f"another restore of {database} is running; nothing was changed")
        if _exists(admin, database):
            raise BackupError(
                f"database {database} exists: a restore builds a database that is gone, never "
                "over one in use (drop it first, or set OPLEDGER_PG_DATABASE to a new name)"
            )
        gaps = log_gaps(settings)
        if gaps:
            raise BackupError("the topics cannot rebuild the projections: " + "; ".join(gaps))
        staging = _fresh(admin, database)
        try:
            staging_dsn = _on(settings.dsn, staging)
            migrate(staging_dsn)
            if CONSUMER_DUMP not in manifest["files"] and any(
                t in manifest["tables"].get(LEDGER_DUMP, {}) for t in CONSUMER_TABLES
            ):
                migrate_consumer(staging_dsn)
            if LEDGER_DUMP in manifest["files"]:
                _load(source / LEDGER_DUMP, staging_dsn)
            report.tables = dict(manifest["tables"].get(LEDGER_DUMP, {}))
            cut = end_offsets(
                settings,
                (settings.execution_topic, settings.delivery_topic, settings.policy_topic),
            )
            report.records = sum(cut.values())
            bar = Progress(report.records, progress_out, label="restore")
            report.fold_seconds = rebuild_into(settings, staging_dsn, cut, bar, timeout_s)
            with pg.connect(staging_dsn, name="opledger-restore") as conn:
                with conn.transaction():
                    report.leases_raised, report.leases_from_log = _repair_leases(conn)
                wrong = compare.missing_results(conn, conn)
                (named,) = conn.execute(
                    "SELECT count(*) FROM (SELECT tenant_id, result_ref FROM agent_operations "
                    "WHERE result_ref IS NOT NULL UNION SELECT tenant_id, result_ref "
                    "FROM operation_history WHERE result_ref IS NOT NULL) named"
                ).fetchone() or (0,)
            report.results_checked = int(named)
            report.results_wrong = [f"{tenant} {ref}: {why}" for tenant, ref, why in wrong]
            _into_place(admin, staging, database)
        except BaseException:
            _drop(admin, staging)
            raise
        if CONSUMER_DUMP in manifest["files"]:
            report.consumer_database = _database(settings.consumer_dsn)
            if _exists(admin, report.consumer_database):
                report.notes.append(
                    f"the consumer's database {report.consumer_database} exists: its inbox was "
                    "left as it is, not restored"
                )
            else:
                staging = _fresh(admin, report.consumer_database)
                try:
                    migrate_consumer(_on(settings.consumer_dsn, staging))
                    _load(source / CONSUMER_DUMP, _on(settings.consumer_dsn, staging))
                    _into_place(admin, staging, report.consumer_database)
                except BaseException:
                    _drop(admin, staging)
                    raise
    if report.results_wrong:
        report.notes.append(
            "results the log names are missing from the restored store: they were stored after "
            "the backup was taken, or the backup is not this log's"
        )
    return report


def backup_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger backup``."""
    import psycopg  # noqa: PLC0415
    from confluent_kafka import KafkaException  # noqa: PLC0415

    try:
        manifest = backup(settings, args.out)
    except (BackupError, KafkaException, psycopg.Error, OSError) as exc:
        print(f"opledger: backup could not run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for name, counts in manifest["tables"].items():
        rows = ", ".join(f"{table} {count}" for table, count in counts.items())
        print(f"{args.out / name}: {rows}")
    ends = sum(manifest["log_ends"].values())
    print(
        f"backup: {args.out / MANIFEST} (the topics held {ends:,} operation records; they keep "
        "every record, so the projections are rebuilt from them on restore)"
    )
    for kept in manifest["keep_apart"]:
        print(f"keep apart from the backup, in your secret store: {kept}")
    return EXIT_OK


def restore_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger restore``."""
    import psycopg  # noqa: PLC0415
    from confluent_kafka import KafkaException  # noqa: PLC0415

    from processors.batch_reader import ProjectorError  # noqa: PLC0415

    try:
        report = restore(settings, args.source, sys.stderr, args.timeout)
    except (BackupError, KafkaException, psycopg.Error, ProjectorError, OSError) as exc:
        print(f"opledger: restore could not run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps({**asdict(report), "whole": report.whole}, indent=2))
    else:
        rows = ", ".join(f"{table} {count}" for table, count in report.tables.items())
        print(f"restore: {report.database}: loaded {rows}")
        print(
            f"restore: every projection folded from {report.records:,} records in "
            f"{report.fold_seconds:.1f} s; {report.leases_raised} lease tokens raised and "
            f"{report.leases_from_log} leases recorded from the log"
        )
        print(
            f"restore: {report.results_checked} result_refs the log names, "
            f"{len(report.results_wrong)} missing or altered"
        )
        for line in report.results_wrong[:20]:
            print(f"  {line}")
        if report.consumer_database:
            print(f"restore: the consumer's database {report.consumer_database}")
        for note in report.notes:
            print(f"restore: {note}")
        print("restore: next, `opledger replay` proves the projections equal to the log")
    return EXIT_OK if report.whole else EXIT_NOT_WHOLE


def register(commands: Any) -> None:
    """``opledger backup`` and ``opledger restore``."""
    parser = commands.add_parser(
        "backup",
        help="dump what the log cannot rebuild (results, requests, leases, destinations, the "
        "consumers' inbox) to a directory, with a manifest",
    )
    parser.add_argument("--out", required=True, type=Path, help="an empty directory")
    parser.set_defaults(handler="opledger.backup:backup_command")
    restore_parser = commands.add_parser(
        "restore",
        help="rebuild a database that is gone: the backup loaded, every projection folded from "
        "the topics, then the database put in place",
    )
    restore_parser.add_argument("source", type=Path, help="the backup's directory")
    restore_parser.add_argument("--json", action="store_true", help="the report as JSON")
    restore_parser.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds the rebuild may take"
    )
    restore_parser.set_defaults(handler="opledger.backup:restore_command")
