"""How far the projector has got: its stored positions, read back for "caught up" checks (the
demo, the tests and the benchmarks compare them with the topics' end offsets)."""

from __future__ import annotations

from collections.abc import Mapping

import psycopg

from ledger import pg


def stored_offsets(dsn: str, consumer: str) -> dict[tuple[str, int], int]:
    """Next offset to project per (topic, partition); empty before the first batch."""
    try:
        with pg.connect(dsn, name="opledger-progress", read_only=True) as conn:
            rows = conn.execute(
                "SELECT topic, partition, next_offset FROM projector_offsets WHERE consumer = %s",
                (consumer,),
            ).fetchall()
    except psycopg.errors.UndefinedTable:
        return {}  # the projector has not created its tables yet
    return {(t, p): n for t, p, n in rows}


def records_behind(
    ends: Mapping[tuple[str, int], int], stored: Mapping[tuple[str, int], int]
) -> int:
    """Records on the topics that the projection does not hold yet."""
    return sum(max(0, high - stored.get(key, 0)) for key, high in ends.items())
