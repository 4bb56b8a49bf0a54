"""The replay's comparison and progress without a database (``projections.compare``,
``opledger.replay``); the real comparison is tests/integration/test_replay.py."""

from __future__ import annotations

import io
from typing import Any

from opledger.replay import Progress, Report
from projections.compare import TABLES, TableResult, merge_digests


def _stream(rows: list[tuple[tuple[Any, ...], str]]) -> Any:
    return iter(rows)


def test_the_merge_counts_both_sides_and_names_each_kind_of_difference() -> None:
    result = TableResult("t")
    live = [(("a",), "1"), (("b",), "2"), (("d",), "4"), (("e",), "5")]
    replay = [(("a",), "1"), (("b",), "X"), (("c",), "3"), (("e",), "5"), (("f",), "6")]
    merge_digests(result, _stream(live), _stream(replay))
    assert (result.live_rows, result.replay_rows) == (4, 5)
    assert result.differing == [("b",)]
    assert result.only_live == [("d",)]
    assert result.only_replay == [("c",), ("f",)]
    assert result.mismatches == 4 and not result.equal


def test_equal_sides_are_equal_and_an_empty_side_is_all_missing() -> None:
    same = [((1, 2), "x"), ((1, 3), "y")]
    result = TableResult("t")
    merge_digests(result, _stream(same), _stream(list(same)))
    assert result.equal and result.live_rows == result.replay_rows == 2
    empty = TableResult("t")
    merge_digests(empty, _stream([]), _stream(same))
    assert empty.only_replay == [(1, 2), (1, 3)] and empty.mismatches == 2


def test_a_report_names_at_most_twenty_keys_but_counts_every_mismatch() -> None:
    result = TableResult("t")
    merge_digests(result, _stream([]), _stream([((n,), "d") for n in range(50)]))
    assert result.mismatches == 50 and len(result.only_replay) == 20


def test_every_projection_table_is_compared_and_time_of_projection_is_left_out() -> None:
    names = {spec.name for spec in TABLES}
    assert {
        "agent_operations",
        "deliveries",
        "operation_history",
        "anomalies",
        "reconciliations",
        "dead_letters",
        "policy_history",
        "policy_grants",
        "revoked_credentials",
    } == names
    volatile = {spec.name: spec.volatile for spec in TABLES}
    assert volatile["operation_history"] == ("projected_at",)
    assert volatile["agent_operations"] == ()


def test_progress_shows_a_rate_and_an_eta() -> None:
    now = [0.0]
    out = io.StringIO()
    bar = Progress(1000, out, clock=lambda: now[0])
    now[0] = 10.0
    bar(250)
    line = out.getvalue()
    assert "25%" in line and "250 of 1,000 records" in line and "25/s" in line
    assert "ETA 30 s" in line


def test_a_report_is_equal_only_with_no_difference_anywhere() -> None:
    report = Report(database="d", cut={}, records=0)
    report.tables = [{"mismatches": 0}]
    assert report.equal
    report.results_wrong = [{"tenant": "t", "result_ref": "r", "problem": "p"}]
    assert not report.equal
    report.results_wrong = []
    report.live_behind = "behind"
    assert not report.equal


def test_the_printed_report_groups_the_cut_by_topic_and_names_each_difference() -> None:
    from opledger.replay import _print  # noqa: PLC0415

    report = Report(
        database="d",
        cut={"p.execution.v1[0]": 5, "p.execution.v1[1]": 0, "p.policy.v1[0]": 2},
        records=7,
    )
    report.tables = [
        {
            "table": "agent_operations",
            "live_rows": 3,
            "replay_rows": 3,
            "mismatches": 1,
            "note": "",
            "differences": [
                {
                    "key": ["op_1"],
                    "what": "differs",
                    "log_offsets": ["p.execution.v1[0]@1", "p.execution.v1[0]@2"],
                    "live_offsets": ["p.execution.v1[0]@1"],
                }
            ],
        }
    ]
    out = io.StringIO()
    _print(report, out)
    text = out.getvalue()
    assert "  p.execution.v1 [0]5 [1]0\n" in text and "  p.policy.v1 [0]2\n" in text
    assert "agent_operations" in text and "1 differ" in text
    assert (
        "op_1: differs; the log's offsets p.execution.v1[0]@1, p.execution.v1[0]@2; "
        "live made by p.execution.v1[0]@1"
    ) in text
    assert text.rstrip().endswith("replay: the projections differ from the log (above)")
