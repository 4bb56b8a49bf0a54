"""``opledger replay``: every projection rebuilt from offset 0 into a database of its own, then
proved equal to the live projections, table by table, at a cut of the log it names.

The cut is the topics' end offsets when the replay starts; the live projector keeps running.
The rebuild is the projector's own fold (``BatchProjector.rebuild_to``), writing nothing to the
log. The comparison (``projections.compare``) counts rows, then compares a digest per row, and
names each differing row with the offsets that made it on each side. What is configuration
rather than history is listed, and the result store is checked against every reference the log
names. Exit 0: equal; 1: a difference (or the live projector never reached the cut); 2: the
replay could not run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from ledger.settings import Settings

EXIT_EQUAL = 0
EXIT_DIFFERENT = 1
EXIT_USAGE = 2

#: The consumer name the rebuild's positions are stored under, in its own database.
REPLAY_CONSUMER = "opledger-replay"


@dataclass(slots=True)
class Report:
    database: str
    cut: dict[str, int]
    records: int
    fold_seconds: float = 0.0
    tables: list[dict[str, Any]] = field(default_factory=list)
    results_checked: int = 0
    results_wrong: list[dict[str, str]] = field(default_factory=list)
    policy_compacted: int = 0
    not_history: list[str] = field(default_factory=list)
    live_behind: str = ""

    @property
    def equal(self) -> bool:
        return (
            not self.live_behind
            and not self.results_wrong
            and all(t["mismatches"] == 0 for t in self.tables)
        )


class Progress:
    """A bar with a rate and an ETA on a terminal; a line every few seconds otherwise."""

    def __init__(
        self,
        total: int,
        out: TextIO,
        clock: Callable[[], float] = time.monotonic,
        *,
        label: str = "replay",
    ):
        self._total, self._out, self._clock, self._label = total, out, clock, label
        self._started = clock()
        self._shown_at = 0.0
        self._tty = out.isatty()

    def __call__(self, done: int, *, final: bool = False) -> None:
        now = self._clock()
        if not final and now - self._shown_at < (0.2 if self._tty else 5.0):
            return
        self._shown_at = now
        elapsed = max(now - self._started, 1e-6)
        rate = done / elapsed
        share = done / self._total if self._total else 1.0
        eta = (self._total - done) / rate if rate > 0 else float("inf")
        bar = "#" * int(share * 30)
        line = (
            f"{self._label}: [{bar:<30}] {share:4.0%} {done:,} of {self._total:,} records, "
            f"{rate:,.0f}/s, ETA {eta:,.0f} s"
        )
        if self._tty:
            self._out.write("\r" + line + ("\n" if final else ""))
        else:
            self._out.write(line + "\n")
        self._out.flush()


def _cut_label(cut: dict[tuple[str, int], int]) -> dict[str, int]:
    return {f"{t}[{p}]": o for (t, p), o in sorted(cut.items())}


def _policy_offsets_on_topic(
    settings: Settings, cut: dict[tuple[str, int], int]
) -> set[tuple[str, int, int]]:
    """The policy topic's offsets still on it below the cut (compaction removes some)."""
    from confluent_kafka import TopicPartition  # noqa: PLC0415

    from ledger.log import new_consumer  # noqa: PLC0415

    wanted = {k: v for k, v in cut.items() if k[0] == settings.policy_topic and v > 0}
    if not wanted:
        return set()
    consumer = new_consumer(
        settings, group_id=settings.readers_group("replay"), client_id="opledger-replay-policy"
    )
    found: set[tuple[str, int, int]] = set()
    try:
        consumer.assign([TopicPartition(t, p, 0) for t, p in wanted])
        remaining = dict(wanted)
        deadline = time.monotonic() + 60
        while remaining and time.monotonic() < deadline:
            for message in consumer.consume(1000, 0.5):
                if message.error() is not None:
                    continue
                key = (str(message.topic()), int(message.partition() or 0))
                offset = int(message.offset() or 0)
                if offset < wanted[key]:
                    found.add((key[0], key[1], offset))
                if offset + 1 >= wanted[key]:
                    remaining.pop(key, None)
            for tp in consumer.position([TopicPartition(t, p) for t, p in list(remaining)]):
                if tp.offset >= wanted[(tp.topic, tp.partition)]:
                    remaining.pop((tp.topic, tp.partition), None)
    finally:
        consumer.close()
    return found


def rebuild_into(
    settings: Settings,
    dsn: str,
    cut: dict[tuple[str, int], int],
    bar: Progress,
    timeout_s: float,
) -> float:
    """Fold the log from the positions stored in ``dsn`` (none, in a fresh database) to
    ``cut`` with the projector's own fold, under ``settings.projector_group``'s name, writing
    nothing to the log; returns the seconds it took."""
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from ledger.codec import default_codec  # noqa: PLC0415
    from ledger.metrics import Metrics  # noqa: PLC0415
    from processors.batch_reader import BatchProjector  # noqa: PLC0415
    from projections.writer import PostgresProjection  # noqa: PLC0415

    sink = PostgresProjection.connect(dsn)
    try:
        projector = BatchProjector(
            settings, sink, default_codec(), Metrics.create(CollectorRegistry()), rebuild=True
        )
        started = time.monotonic()
        projector.rebuild_to(cut, bar, timeout_s=timeout_s)
        seconds = time.monotonic() - started
        bar(sum(cut.values()), final=True)
        return seconds
    finally:
        sink.close()


def replay(settings: Settings, args: argparse.Namespace, progress_out: TextIO) -> Report:
    """Rebuild, compare, and say what was found (the database is dropped unless kept)."""
    from psycopg import sql  # noqa: PLC0415
    from psycopg.conninfo import make_conninfo  # noqa: PLC0415

    from ledger import pg  # noqa: PLC0415
    from ledger.log import end_offsets  # noqa: PLC0415
    from projections import compare, progress  # noqa: PLC0415

    topics = (settings.execution_topic, settings.delivery_topic, settings.policy_topic)
    cut = end_offsets(settings, topics)
    name = args.into or f"{settings.pg_database}_replay_{time.strftime('%Y%m%d%H%M%S')}"
    report = Report(database=name, cut=_cut_label(cut), records=sum(cut.values()))
    report.not_history = list(compare.NOT_HISTORY)
    live_dsn = settings.dsn
    replay_dsn = make_conninfo(live_dsn, dbname=name)
    admin_dsn = make_conninfo(live_dsn, dbname="postgres")
    with pg.connect(admin_dsn, name="opledger-replay") as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        bar = Progress(report.records, progress_out)
        report.fold_seconds = rebuild_into(
            settings.with_(projector_group=REPLAY_CONSUMER), replay_dsn, cut, bar, args.timeout
        )
        # The live projector must have folded everything below the cut, or its lag would
        # read as differences.
        deadline = time.monotonic() + args.timeout
        while (
            behind := progress.records_behind(
                cut, progress.stored_offsets(live_dsn, settings.projector_group)
            )
        ) > 0:
            if time.monotonic() > deadline:
                report.live_behind = (
                    f"the live projector ({settings.projector_group}) is {behind} records "
                    "short of the cut: is it running?"
                )
                return report
            time.sleep(0.2)
        with (
            pg.connect(live_dsn, name="opledger-replay-live") as live,
            pg.connect(replay_dsn, name="opledger-replay") as rebuilt,
        ):
            _compare(settings, cut, (live, rebuilt), report)
            report.results_checked, wrong = _results(live, rebuilt)
            report.results_wrong = [
                {"tenant": t, "result_ref": r, "problem": why} for t, r, why in wrong
            ]
    finally:
        if not args.keep:
            with pg.connect(admin_dsn, name="opledger-replay") as admin:
                admin.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
    return report


def _results(live: Any, rebuilt: Any) -> tuple[int, list[tuple[str, str, str]]]:
    from projections import compare  # noqa: PLC0415

    named = rebuilt.execute(
        "SELECT count(*) FROM (SELECT tenant_id, result_ref FROM agent_operations "
        "WHERE result_ref IS NOT NULL UNION SELECT tenant_id, result_ref FROM deliveries "
        "WHERE result_ref IS NOT NULL UNION SELECT tenant_id, result_ref FROM operation_history "
        "WHERE result_ref IS NOT NULL UNION SELECT tenant_id, result_ref FROM reconciliations "
        "WHERE result_ref IS NOT NULL) named"
    ).fetchone()
    return int(named[0]), compare.missing_results(live, rebuilt)


def _compare(
    settings: Settings, cut: dict[tuple[str, int], int], sides: tuple[Any, Any], report: Report
) -> None:
    from projections import compare  # noqa: PLC0415

    live, rebuilt = sides
    for conn in (live, rebuilt):
        compare.prepare(conn, cut)
    moved = compare.moved_on(live) | compare.moved_on(rebuilt)
    policy_moved = compare.policy_moved_on(live, settings.policy_topic) or compare.policy_moved_on(
        rebuilt, settings.policy_topic
    )
    on_topic: set[tuple[str, int, int]] | None = None
    for conn in (live, rebuilt):
        compare.exclude(conn, moved)
    for spec in compare.TABLES:
        if spec.scope == "policy" and policy_moved:
            report.tables.append(
                {
                    "table": spec.name,
                    "live_rows": None,
                    "replay_rows": None,
                    "mismatches": 0,
                    "note": "not compared: a policy record past the cut was folded",
                    "differences": [],
                }
            )
            continue
        result = compare.compare_table(live, rebuilt, spec)
        differences = []
        only_live = list(result.only_live)
        if spec.name == "policy_history" and only_live:
            # Compaction keeps a subject's last record only: the live projection keeps the
            # history of what it removed, which no replay can read again.
            if on_topic is None:
                on_topic = _policy_offsets_on_topic(settings, cut)
            compacted = [k for k in only_live if (k[0], int(k[1]), int(k[2])) not in on_topic]
            report.policy_compacted = len(compacted)
            result.mismatches -= len(compacted)
            only_live = [k for k in only_live if k not in compacted]
        for kind, keys in (
            ("only in the live projections", only_live),
            ("missing from the live projections", result.only_replay),
            ("differs", result.differing),
        ):
            for key in keys:
                differences.append(
                    {
                        "key": [str(k) for k in key],
                        "what": kind,
                        "log_offsets": [
                            f"{t}[{p}]@{o}" for t, p, o in compare.offsets_of(rebuilt, spec, key)
                        ],
                        "live_offsets": [
                            f"{t}[{p}]@{o}" for t, p, o in compare.offsets_of(live, spec, key)
                        ],
                    }
                )
        note = result.not_compared
        if spec.scope == "operation" and moved:
            note = f"{len(moved)} operations with events past the cut not compared"
        report.tables.append(
            {
                "table": spec.name,
                "live_rows": result.live_rows,
                "replay_rows": result.replay_rows,
                "mismatches": result.mismatches,
                "note": note,
                "differences": differences,
            }
        )


def _print(report: Report, out: TextIO) -> None:
    from ledger.domain.display import displayable  # noqa: PLC0415

    by_topic: dict[str, list[str]] = {}
    for label, offset in report.cut.items():
        topic, _, partition = label.rpartition("[")
        by_topic.setdefault(topic, []).append(f"[{partition.rstrip(']')}]{offset}")
    out.write(f"replay: cut at {report.records:,} records, the topics' ends when it started:\n")
    for topic, ends in by_topic.items():
        out.write(f"  {topic} {' '.join(ends)}\n")
    if report.fold_seconds:
        rate = report.records / report.fold_seconds if report.fold_seconds else 0
        out.write(
            f"replay: folded into {report.database} in {report.fold_seconds:.1f} s "
            f"({rate:,.0f} records/s)\n"
        )
    if report.live_behind:
        out.write(f"replay: {report.live_behind}\n")
        return
    out.write(f"{'table':<22}{'live':>10}{'replay':>10}  result\n")
    for table in report.tables:
        live = "-" if table["live_rows"] is None else f"{table['live_rows']:,}"
        rebuilt = "-" if table["replay_rows"] is None else f"{table['replay_rows']:,}"
        verdict = "equal" if table["mismatches"] == 0 else f"{table['mismatches']} differ"
        note = f" ({table['note']})" if table["note"] else ""
        out.write(f"{table['table']:<22}{live:>10}{rebuilt:>10}  {verdict}{note}\n")
        for difference in table["differences"]:
            out.write(
                f"  {displayable(' '.join(difference['key']))}: {difference['what']}; "
                f"the log's offsets {', '.join(difference['log_offsets']) or 'none'}; "
                f"live made by {', '.join(difference['live_offsets']) or 'none'}\n"
            )
    if report.policy_compacted:
        out.write(
            f"policy_history: {report.policy_compacted} rows of records compaction removed "
            "from the topic, kept by the live projections only\n"
        )
    out.write(
        f"result store: {report.results_checked} result_refs the log names, "
        f"{len(report.results_wrong)} missing or altered\n"
    )
    for wrong in report.results_wrong[: compare_shown()]:
        out.write(f"  {wrong['tenant']} {wrong['result_ref']}: {wrong['problem']}\n")
    if len(report.results_wrong) > compare_shown():
        out.write(f"  and {len(report.results_wrong) - compare_shown()} more (--json has all)\n")
    out.write("not rebuilt, because not history: " + "; ".join(report.not_history) + "\n")
    out.write(
        "replay: every projection equal at the cut\n"
        if report.equal
        else "replay: the projections differ from the log (above)\n"
    )


def compare_shown() -> int:
    from projections.compare import SHOWN  # noqa: PLC0415

    return SHOWN


def replay_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger replay``."""
    import psycopg  # noqa: PLC0415
    from confluent_kafka import KafkaException  # noqa: PLC0415

    from processors.batch_reader import ProjectorError  # noqa: PLC0415

    try:
        report = replay(settings, args, sys.stderr)
    except (psycopg.Error, KafkaException, ProjectorError) as exc:
        print(f"opledger: replay could not run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps({**asdict(report), "equal": report.equal}, indent=2))
    else:
        _print(report, sys.stdout)
    return EXIT_EQUAL if report.equal else EXIT_DIFFERENT


def register(commands: Any) -> None:
    """``opledger replay``."""
    parser = commands.add_parser(
        "replay",
        help="rebuild every projection from offset 0 into a database of its own and prove it "
        "equal to the live one at a cut of the log",
    )
    parser.add_argument(
        "--into",
        metavar="DATABASE",
        type=_database_name,
        help="the new database to rebuild into (default: <database>_replay_<time>)",
    )
    parser.add_argument("--keep", action="store_true", help="keep that database afterwards")
    parser.add_argument("--json", action="store_true", help="the report as JSON")
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds the rebuild may take"
    )
    parser.set_defaults(handler="opledger.replay:replay_command")


def _database_name(raw: str) -> str:
    import re  # noqa: PLC0415

    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", raw):
        raise argparse.ArgumentTypeError(
            "a database name of lower-case letters, digits and '_', starting with a letter"
        )
    return raw
