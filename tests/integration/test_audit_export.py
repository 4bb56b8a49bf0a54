"""``opledger audit export`` and ``opledger audit verify`` against the real broker: the export
holds every record of its tenant in its ranges and no other tenant's; verification re-reads the
topics, so a removed, added or changed record fails it, even when the manifest was rewritten to
match the altered file."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ledger.codec import default_codec
from ledger.domain.policy import PolicyDecision, PolicyRequest
from ledger.log import TENANT_HEADER
from ledger.settings import Settings
from ledger.tools import ProviderTerms
from opledger import export as audit_export
from opledger.fakes.memory import MemoryProvider
from opledger.fakes.model import Mode
from producers import TransitionRecorder
from tests.process_support import run_cli
from tests.support import env_for, read_with_headers

pytestmark = pytest.mark.integration

TERMS = ProviderTerms(
    call_timeout=timedelta(seconds=2), key_retention=timedelta(hours=1), repeat_safe=True
)


def _allow(request: PolicyRequest) -> PolicyDecision:
    return PolicyDecision(True, "allowed by the test", None)


def _verify(settings: Settings, directory: Path) -> tuple[int, dict[str, Any]]:
    result = run_cli(env_for(settings), "audit", "verify", str(directory), "--json")
    assert result.stdout.strip(), result.stderr
    return result.returncode, json.loads(result.stdout)


def _tenant_on_topics(settings: Settings, tenant: str) -> list[tuple[str, int, int]]:
    """The tenant's records as the tests' own reader finds them on the topics."""
    found = []
    for topic in (settings.execution_topic, settings.delivery_topic, settings.policy_topic):
        for partition, offset, _key, _value, headers in read_with_headers(settings, topic):
            if dict(headers).get(TENANT_HEADER) == tenant.encode():
                found.append((topic, partition, offset))
    return found


def _lines(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (directory / "events.jsonl").read_text().splitlines()]


def _write(directory: Path, lines: list[dict[str, Any]], *, fix_manifest: bool) -> None:
    """Write ``lines`` as the export; with ``fix_manifest``, as a forger would: every digest in
    the manifest recomputed to match."""
    text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines)
    (directory / "events.jsonl").write_text(text)
    if not fix_manifest:
        return
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["file_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    for span in manifest["ranges"]:
        mine = [
            line
            for line in lines
            if (line["topic"], line["partition"]) == (span["topic"], span["partition"])
        ]
        digest = hashlib.sha256()
        for line in mine:
            digest.update(audit_export.canonical(line))
        span["sha256"], span["records"] = digest.hexdigest(), len(mine)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _copy(source: Path, target: Path) -> Path:
    target.mkdir()
    for name in ("events.jsonl", "manifest.json"):
        (target / name).write_bytes((source / name).read_bytes())
    return target


def test_an_export_is_verified_and_every_alteration_fails(
    isolated: Settings, tmp_path: Path
) -> None:
    provider = MemoryProvider("send_email", TERMS, mode=Mode.NON_IDEMPOTENT)
    with TransitionRecorder.connect(isolated, providers=[provider]) as recorder:
        recorder.collaborators.policy = _allow
        for n in range(6):
            recorder.execute("acme", "agent-7", "send_email", {"n": n})
            recorder.execute("globex", "agent-9", "send_email", {"n": n})
    out = tmp_path / "acme"
    made = run_cli(env_for(isolated), "audit", "export", "--tenant", "acme", "--out", str(out))
    assert made.returncode == 0, made.stderr
    lines = _lines(out)
    # The tenant's data, readable by whoever exported it only.
    assert {(out / n).stat().st_mode & 0o777 for n in ("events.jsonl", "manifest.json")} == {0o600}
    # Complete by the tests' own reader, and nothing of another tenant's.
    assert [(x["topic"], x["partition"], x["offset"]) for x in lines] == sorted(
        _tenant_on_topics(isolated, "acme")
    )
    assert len(lines) == 18  # intent, dispatch, success of 6 operations
    assert {line["event"]["tenant_id"] for line in lines} == {"acme"}
    assert all(line["decode_error"] is None for line in lines)
    code, verdict = _verify(isolated, out)
    assert (code, verdict["problems"], verdict["records"]) == (0, [], 18)
    again = run_cli(env_for(isolated), "audit", "export", "--tenant", "acme", "--out", str(out))
    assert again.returncode == 2 and "exists" in again.stderr

    # A record removed: the file no longer matches its manifest, and the log names the offset.
    removed = _copy(out, tmp_path / "removed")
    _write(removed, lines[:4] + lines[5:], fix_manifest=False)
    code, verdict = _verify(isolated, removed)
    gone = f"{lines[4]['topic']}[{lines[4]['partition']}]@{lines[4]['offset']}"
    assert code == 1
    assert f"{gone}: on the topic, missing from the export" in verdict["problems"]

    # The same removal with the manifest rewritten to match: only the log can tell.
    forged = _copy(out, tmp_path / "forged-removal")
    _write(forged, lines[:4] + lines[5:], fix_manifest=True)
    code, verdict = _verify(isolated, forged)
    assert code == 1
    assert verdict["problems"] == [f"{gone}: on the topic, missing from the export"]

    # A record's bytes changed (its decoded event changed to match), manifest rewritten.
    changed_lines = [dict(line) for line in lines]
    victim = changed_lines[1]
    codec = default_codec()
    event = codec.decode(base64.b64decode(victim["value"]))
    altered = event.model_copy(update={"actor_id": "agent-innocent"})
    victim["value"] = base64.b64encode(codec.encode(altered)).decode()
    victim["event"] = altered.model_dump(mode="json")
    changed = _copy(out, tmp_path / "changed")
    _write(changed, changed_lines, fix_manifest=True)
    code, verdict = _verify(isolated, changed)
    at = f"{victim['topic']}[{victim['partition']}]@{victim['offset']}"
    assert code == 1
    assert verdict["problems"] == [f"{at}: the export's record differs from the topic's (value)"]

    # Only the decoded event changed: the line disagrees with its own bytes.
    decoded_only = [dict(line) for line in lines]
    decoded_only[2] = {**decoded_only[2], "event": {**decoded_only[2]["event"], "attempt": 7}}
    edited = _copy(out, tmp_path / "decoded")
    _write(edited, decoded_only, fix_manifest=True)
    code, verdict = _verify(isolated, edited)
    assert code == 1 and any(
        "the decoded event is not what the record's bytes hold" in p for p in verdict["problems"]
    )

    # Another tenant's record slipped in, manifest rewritten: not the tenant's on the topic.
    theirs = tmp_path / "globex"
    made = run_cli(env_for(isolated), "audit", "export", "--tenant", "globex", "--out", str(theirs))
    assert made.returncode == 0, made.stderr
    planted = _copy(out, tmp_path / "planted")
    _write(
        planted,
        sorted(
            [*lines, _lines(theirs)[0]], key=lambda x: (x["topic"], x["partition"], x["offset"])
        ),
        fix_manifest=True,
    )
    code, verdict = _verify(isolated, planted)
    first = _lines(theirs)[0]
    assert code == 1
    assert verdict["problems"] == [
        f"{first['topic']}[{first['partition']}]@{first['offset']}: in the export, not the "
        "tenant's record on the topic"
    ]


def _window(settings: Settings, since: datetime, until: datetime, out: Path) -> Any:
    return run_cli(
        env_for(settings),
        *("audit", "export", "--tenant", "acme", "--since", since.isoformat()),
        *("--until", until.isoformat(), "--out", str(out)),
    )


def test_since_and_until_choose_the_ranges_by_the_records_times(
    isolated: Settings, tmp_path: Path
) -> None:
    provider = MemoryProvider("send_email", TERMS, mode=Mode.NON_IDEMPOTENT)
    batches: list[list[str]] = []
    marks: list[datetime] = []
    with TransitionRecorder.connect(isolated, providers=[provider]) as recorder:
        recorder.collaborators.policy = _allow
        for batch in range(3):
            if batch:
                time.sleep(0.05)
                marks.append(datetime.now(UTC))
                time.sleep(0.05)
            batches.append(
                [
                    recorder.execute(
                        "acme", "agent-7", "send_email", {"b": batch, "n": n}
                    ).operation_id
                    for n in range(4)
                ]
            )
    out = tmp_path / "window"
    made = _window(isolated, marks[0], marks[1], out)
    assert made.returncode == 0, made.stderr
    exported = {line["event"]["operation_id"] for line in _lines(out)}
    assert exported == set(batches[1])
    code, verdict = _verify(isolated, out)
    assert (code, verdict["records"]) == (0, 12), verdict
    backwards = _window(isolated, marks[1], marks[0], tmp_path / "backwards")
    assert backwards.returncode == 2 and "--since must be before --until" in backwards.stderr
