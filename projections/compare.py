"""Two databases' projections compared at one cut of the log (``opledger replay``).

A cut is an end offset per partition of the topics the projector folds. Rows are compared only
where both sides must agree at that cut: a row named by its coordinates (history, anomalies,
reconciliations, dead letters) when its offset is before the cut; an operation's rows
(``agent_operations``, ``deliveries``) when neither side has seen an event of that operation
at or after the cut; the policy's state when no policy record at or after the cut has been
folded on either side. Everything else is counted as moved on, never silently skipped.

Each side's rows are read in key order by a server-side cursor as (key, digest of every
column but the time of projection), and merged: counts first, then the keys that differ, with
the offsets that made them on each side.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg
from psycopg import sql

#: The log's coordinates (topic, partition) -> the cut's end offset there.
Cut = Mapping[tuple[str, int], int]

Scope = Literal["coordinates", "operation", "policy"]

#: How many differing keys a table's report names.
SHOWN = 20


@dataclass(frozen=True, slots=True)
class TableSpec:
    name: str
    key: tuple[str, ...]
    scope: Scope
    #: When the projector wrote the row, not what the log says: differs by nature.
    volatile: tuple[str, ...] = ()


TABLES: tuple[TableSpec, ...] = (
    TableSpec("agent_operations", ("operation_id",), "operation"),
    TableSpec("deliveries", ("operation_id", "destination"), "operation"),
    TableSpec(
        "operation_history", ("topic", "partition", "offset"), "coordinates", ("projected_at",)
    ),
    TableSpec("anomalies", ("topic", "partition", "offset"), "coordinates", ("detected_at",)),
    TableSpec("reconciliations", ("topic", "partition", "offset"), "coordinates"),
    TableSpec("dead_letters", ("topic", "partition", "offset"), "coordinates", ("recorded_at",)),
    TableSpec("policy_history", ("topic", "partition", "offset"), "coordinates", ("projected_at",)),
    TableSpec("policy_grants", ("tenant_id", "principal", "tool_name"), "policy"),
    TableSpec("revoked_credentials", ("tenant_id", "credential_id"), "policy"),
)

#: What a replay cannot rebuild, because it is not history: checked otherwise or not at all.
NOT_HISTORY = (
    "results (the result store: every result_ref the log names is checked there instead)",
    "delivery_destinations and their secrets (configuration)",
    "operation_leases and operation_requests (the SDK's and the workers' own state)",
    "analyst_tenants (configuration)",
    "projector_offsets (each projector's own position)",
)


@dataclass(slots=True)
class TableResult:
    name: str
    live_rows: int = 0
    replay_rows: int = 0
    only_live: list[tuple[Any, ...]] = field(default_factory=list)
    only_replay: list[tuple[Any, ...]] = field(default_factory=list)
    differing: list[tuple[Any, ...]] = field(default_factory=list)
    #: rows left out of the comparison, and why
    not_compared: str = ""
    mismatches: int = 0

    @property
    def equal(self) -> bool:
        return self.mismatches == 0


def prepare(conn: psycopg.Connection[Any], cut: Cut) -> None:
    """The cut as a temporary table of ``conn``'s session (both sides get the same)."""
    conn.execute(
        "CREATE TEMP TABLE IF NOT EXISTS replay_cut "
        "(topic TEXT, partition INTEGER, end_offset BIGINT, PRIMARY KEY (topic, partition))"
    )
    conn.execute("TRUNCATE replay_cut")
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO replay_cut VALUES (%s, %s, %s)",
            [(t, p, o) for (t, p), o in sorted(cut.items())],
        )
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS replay_moved_on (operation_id TEXT PRIMARY KEY)")


def moved_on(conn: psycopg.Connection[Any]) -> set[str]:
    """Operations of which ``conn``'s side has folded an event at or after the cut."""
    rows = conn.execute(
        "SELECT DISTINCT h.operation_id FROM operation_history h "
        "JOIN replay_cut c ON c.topic = h.topic AND c.partition = h.partition "
        'WHERE h."offset" >= c.end_offset'
    ).fetchall()
    return {r[0] for r in rows}


def policy_moved_on(conn: psycopg.Connection[Any], policy_topic: str) -> bool:
    """Whether ``conn``'s side has folded a policy record at or after the cut."""
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM policy_history h JOIN replay_cut c "
        "ON c.topic = h.topic AND c.partition = h.partition "
        'WHERE h.topic = %s AND h."offset" >= c.end_offset)',
        (policy_topic,),
    ).fetchone()
    return bool(row and row[0])


def exclude(conn: psycopg.Connection[Any], operations: set[str]) -> None:
    conn.execute("TRUNCATE replay_moved_on")
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO replay_moved_on VALUES (%s)", [(op,) for op in sorted(operations)]
        )


def _columns(conn: psycopg.Connection[Any], table: str) -> list[str]:
    rows = conn.execute(
        "SELECT column_name FROM information_schema.columns "
        "WHERE table_schema = current_schema() AND table_name = %s ORDER BY ordinal_position",
        (table,),
    ).fetchall()
    return [r[0] for r in rows]


def digest_query(spec: TableSpec, columns: Sequence[str]) -> sql.Composed:
    """``SELECT key..., md5(row)`` of the rows this side must agree on, in key order (bytewise,
    as Python orders strings)."""
    compared = [c for c in columns if c not in spec.volatile]
    key = sql.SQL(", ").join(sql.SQL("t.{}").format(sql.Identifier(k)) for k in spec.key)
    order = sql.SQL(", ").join(
        sql.SQL('t.{} COLLATE "C"').format(sql.Identifier(k))
        if k not in ("partition", "offset")
        else sql.SQL("t.{}").format(sql.Identifier(k))
        for k in spec.key
    )
    row = sql.SQL(", ").join(sql.SQL("t.{}").format(sql.Identifier(c)) for c in compared)
    where: sql.Composable
    if spec.scope == "coordinates":
        where = sql.SQL(
            "JOIN replay_cut c ON c.topic = t.topic AND c.partition = t.partition "
            'WHERE t."offset" < c.end_offset'
        )
    elif spec.scope == "operation":
        where = sql.SQL(
            "WHERE NOT EXISTS "
            "(SELECT 1 FROM replay_moved_on m WHERE m.operation_id = t.operation_id)"
        )
    else:
        where = sql.SQL("")
    return sql.SQL(
        "SELECT {key}, md5(ROW({row})::text) FROM {table} t {where} ORDER BY {order}"
    ).format(key=key, row=row, table=sql.Identifier(spec.name), where=where, order=order)


def _rows(
    conn: psycopg.Connection[Any], query: sql.Composed, width: int, name: str
) -> Iterator[tuple[tuple[Any, ...], str]]:
    with conn.cursor(name=f"replay_{name}") as cur:
        cur.itersize = 5000
        cur.execute(query)
        for row in cur:
            yield tuple(row[:width]), row[width]


def compare_table(
    live: psycopg.Connection[Any], replay: psycopg.Connection[Any], spec: TableSpec
) -> TableResult:
    """Merge both sides' (key, digest) streams in key order."""
    result = TableResult(spec.name)
    columns = _columns(replay, spec.name)
    if columns != _columns(live, spec.name):
        result.mismatches = 1
        result.not_compared = "the two databases' columns differ (migrations?)"
        return result
    query = digest_query(spec, columns)
    width = len(spec.key)
    # Server-side cursors live in a transaction; read-only ones here.
    with live.transaction(), replay.transaction():
        merge_digests(
            result, _rows(live, query, width, spec.name), _rows(replay, query, width, spec.name)
        )
    return result


def merge_digests(
    result: TableResult,
    left: Iterator[tuple[tuple[Any, ...], str]],
    right: Iterator[tuple[tuple[Any, ...], str]],
) -> None:
    a, b = next(left, None), next(right, None)
    while a is not None or b is not None:
        if b is None or (a is not None and a[0] < b[0]):
            assert a is not None
            result.live_rows += 1
            _note(result.only_live, a[0], result)
            a = next(left, None)
        elif a is None or b[0] < a[0]:
            result.replay_rows += 1
            _note(result.only_replay, b[0], result)
            b = next(right, None)
        else:
            result.live_rows += 1
            result.replay_rows += 1
            if a[1] != b[1]:
                _note(result.differing, a[0], result)
            a, b = next(left, None), next(right, None)


def _note(into: list[tuple[Any, ...]], key: tuple[Any, ...], result: TableResult) -> None:
    result.mismatches += 1
    if len(into) < SHOWN:
        into.append(key)


def offsets_of(
    conn: psycopg.Connection[Any], spec: TableSpec, key: tuple[Any, ...]
) -> list[tuple[str, int, int]]:
    """The log's coordinates that made the row ``key`` of ``spec`` on ``conn``'s side."""
    if spec.scope == "coordinates":
        return [(str(key[0]), int(key[1]), int(key[2]))]
    if spec.scope == "operation":
        rows = conn.execute(
            'SELECT topic, partition, "offset" FROM operation_history WHERE operation_id = %s '
            + ("AND destination = %s " if spec.name == "deliveries" else "AND destination IS NULL ")
            + 'ORDER BY topic, partition, "offset"',
            key if spec.name == "deliveries" else (key[0],),
        ).fetchall()
        return [(r[0], r[1], r[2]) for r in rows]
    subject = (
        "principal = %s AND tool_name = %s"
        if spec.name == "policy_grants"
        else "change = 'REVOKE_CREDENTIAL' AND credential_id = %s"
    )
    rows = conn.execute(
        'SELECT topic, partition, "offset" FROM policy_history WHERE tenant_id = %s AND '
        + subject
        + ' ORDER BY topic, partition, "offset"',
        key,
    ).fetchall()
    return [(r[0], r[1], r[2]) for r in rows]


def missing_results(
    live: psycopg.Connection[Any], replay: psycopg.Connection[Any]
) -> list[tuple[str, str, str]]:
    """Every (tenant, result_ref) the replayed projections name that the live result store
    lacks or holds with other bytes: (tenant, ref, what is wrong)."""
    named = replay.execute(
        "SELECT tenant_id, result_ref FROM agent_operations WHERE result_ref IS NOT NULL "
        "UNION SELECT tenant_id, result_ref FROM deliveries WHERE result_ref IS NOT NULL "
        "UNION SELECT tenant_id, result_ref FROM operation_history WHERE result_ref IS NOT NULL "
        "UNION SELECT tenant_id, result_ref FROM reconciliations WHERE result_ref IS NOT NULL "
        "ORDER BY 1, 2"
    ).fetchall()
    if not named:
        return []
    tenants = [r[0] for r in named]
    refs = [r[1] for r in named]
    found = live.execute(
        "SELECT w.tenant_id, w.result_ref, r.result_ref IS NOT NULL, "
        "coalesce('sha256:' || encode(sha256(r.payload), 'hex') = w.result_ref, false) "
        "FROM unnest(%s::text[], %s::text[]) AS w(tenant_id, result_ref) "
        "LEFT JOIN results r ON r.tenant_id = w.tenant_id AND r.result_ref = w.result_ref",
        (tenants, refs),
    ).fetchall()
    wrong = []
    for tenant, ref, present, intact in found:
        if not present:
            wrong.append((tenant, ref, "not in the result store"))
        elif not intact:
            wrong.append((tenant, ref, "stored bytes do not hash to it"))
    return wrong
