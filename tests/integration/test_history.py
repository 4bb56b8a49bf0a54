"""The history reader's view and advance against the real broker and database: moving a view on
reads only the log after it, and gives what a fresh load gives."""

from __future__ import annotations

import psycopg

from ledger.history import HistoryReader
from ledger.pg import open_pool
from ledger.settings import Settings
from opledger.workload import Workload
from tests.support import produce, project_in_process


def test_advance_reads_only_the_log_after_the_view_and_equals_a_fresh_load(
    isolated: Settings,
) -> None:
    operations = list(Workload(seed=17).operations(40))
    first = [op[: len(op) // 2] for op in operations]
    rest = [op[len(op) // 2 :] for op in operations]
    produce(isolated, [e for op in first for e in op[:1]])
    project_in_process(isolated)  # the first event of each is projected, the others are not
    produce(isolated, [e for op in first for e in op[1:]])
    pairs = [(op[0].operation_id, op[0].tenant_id) for op in operations]
    pool = open_pool(isolated.dsn, name="test-history")
    reader = HistoryReader(isolated, pool)
    try:
        view = reader.view(pairs)
        assert view.snapshots == reader.load(pairs)
        produce(isolated, [e for op in rest for e in op])
        expected = reader.load(pairs)
        # From here on the projection is useless: advance must not read it.
        with psycopg.connect(isolated.dsn) as conn:
            conn.execute("TRUNCATE agent_operations, deliveries")
        moved = reader.advance(view, [op for op, _tenant in pairs])
        assert moved == expected
        assert sum(s.execution is not None for s in moved.values()) == len(pairs)
        assert reader.load(pairs) != expected, "a load does read the (emptied) projection"
        # Once moved on, a view has nothing more to read.
        assert reader.advance(view, [op for op, _tenant in pairs]) == expected
    finally:
        reader.close()
        pool.close()
