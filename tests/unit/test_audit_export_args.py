"""``opledger audit export|verify`` routed to their own parsers, and their arguments checked
before anything is read."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime, timedelta, timezone

import pytest

from opledger import cli
from opledger import export as audit_export


def test_the_words_after_audit_route_and_an_operation_id_does_not() -> None:
    assert cli._routed(["audit", "export", "--tenant", "acme"]) == [
        "audit-export",
        "--tenant",
        "acme",
    ]
    assert cli._routed(["audit", "verify", "dir"]) == ["audit-verify", "dir"]
    op = "op_01JZZZZZZZZZZZZZZZZZZZZZZZ"
    assert cli._routed(["audit", op, "--tenant", "acme"]) == ["audit", op, "--tenant", "acme"]
    assert cli._routed(["ops", "export"]) == ["ops", "export"]


def test_export_takes_iso_times_and_treats_a_naive_one_as_utc() -> None:
    assert audit_export._moment("2026-12-01") == datetime(2026, 12, 1, tzinfo=UTC)
    assert audit_export._moment("2026-12-01T12:00:00+02:00") == datetime(
        2026, 12, 1, 12, tzinfo=timezone(timedelta(hours=2))
    )
    with pytest.raises(argparse.ArgumentTypeError, match="not an ISO 8601 time"):
        audit_export._moment("yesterday")


def test_export_refuses_a_bad_tenant_before_reading(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(["audit", "export", "--tenant", "no spaces", "--out", "x"])
    assert stopped.value.code == 2
    assert "nothing was recorded or changed" in capsys.readouterr().err


def test_a_record_digest_covers_its_bytes_not_its_decoded_event() -> None:
    fields = {
        "topic": "t",
        "partition": 0,
        "offset": 5,
        "timestamp_ms": 1,
        "key": "aw==",
        "headers": [["h", "dg=="]],
        "value": "dg==",
    }
    same = audit_export.canonical({**fields, "event": {"a": 1}})
    assert same == audit_export.canonical({**fields, "event": {"a": 2}})
    assert same != audit_export.canonical({**fields, "value": "dw=="})
    assert same != audit_export.canonical({**fields, "offset": 6})
