"""No secret a run used is found in anything it wrote (issue 19): destinations' signing secrets
sealed at rest under the operator's key (decision 033), a legacy clear secret sealed by
`destinations rekey`, and the key rotated by `destinations rotate-key` while a real delivery
worker keeps signing. Everything the run wrote is searched: every record of every topic (keys,
values, headers), a `pg_dump` of the database, the worker's log and metrics, the CLI's output."""

from __future__ import annotations

import base64
import subprocess
import time
import urllib.request
from pathlib import Path

import psycopg
import pytest

from ledger.destinations import DestinationStore, Kind, new_secret
from ledger.pg import open_pool
from ledger.secret_box import SecretBox, SecretKeyError, key_lines, new_key_line, write_key_file
from ledger.settings import Settings
from ledger.topics import topic_specs
from opledger.stack import find_pg_bindir
from producers import TransitionRecorder
from tests.delivery_support import ScriptedReceiver
from tests.process_support import ROOT, kill, run_cli, start_cli, wait_http
from tests.support import (
    env_for,
    free_port,
    grant,
    project_in_process,
    read_with_headers,
)

pytestmark = pytest.mark.integration

TENANT, ACTOR, TOOL = "acme", "agent-7", "send_email"


def _cli(settings: Settings, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_cli(env_for(settings, PYTHONPATH=str(ROOT), **env), "destinations", *argv)


def _dump(settings: Settings) -> bytes:
    bindir = find_pg_bindir()
    assert bindir is not None
    return subprocess.run(
        [str(bindir / "pg_dump"), "--data-only", "--dbname", settings.dsn],
        capture_output=True,
        check=True,
        timeout=120,
    ).stdout


def _everything_written(settings: Settings, *more: bytes) -> dict[str, bytes]:
    """What an attacker who reads the topics, a dump, the logs and the metrics would hold."""
    found = {"pg_dump": _dump(settings)}
    for spec in topic_specs(settings):
        parts = []
        for _p, _o, key, value, headers in read_with_headers(settings, spec.name):
            parts += [key or b"", value or b""] + [k.encode() + (v or b"") for k, v in headers]
        found[spec.name] = b"\x00".join(parts)
    for number, blob in enumerate(more):
        found[f"output {number}"] = blob
    return found


def _forms(secret: str) -> list[bytes]:
    """A secret as it could leak: whole, its base64 body, and the bytes it stands for."""
    body = secret.removeprefix("whsec_")
    return [secret.encode(), body.encode(), base64.b64decode(body)]


def _holders(written: dict[str, bytes], secret: str) -> list[str]:
    return sorted(
        where for where, blob in written.items() if any(f in blob for f in _forms(secret))
    )


def _key_text(path: Path) -> str:
    return path.read_text().strip().split(":", 1)[1]


def _delivered(receiver: ScriptedReceiver, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while sum(r.signature_ok for r in receiver.received) < count:
        assert time.monotonic() < deadline, [r.signature_ok for r in receiver.received]
        time.sleep(0.2)


def test_no_secret_a_run_used_is_found_in_anything_it_wrote(
    isolated: Settings, tmp_path: Path
) -> None:
    # A key file of this test's own: the rotation below must not touch the stack's.
    settings = isolated.with_(
        secrets_key_file=str(tmp_path / "secrets.key"), delivery_web_port=free_port()
    )
    made = _cli(settings, "key", "create", "--out", str(settings.secrets_key_path))
    assert made.returncode == 0, made.stderr
    assert settings.secrets_key_path.stat().st_mode & 0o077 == 0
    again = _cli(settings, "key", "create", "--out", str(settings.secrets_key_path))
    assert again.returncode == 2 and "never overwritten" in again.stderr
    first_key = SecretBox.load(settings.secrets_key_path)
    assert first_key.current_id in made.stdout
    key_texts = [_key_text(settings.secrets_key_path)]
    given, rotated, legacy = new_secret(), new_secret(), new_secret()
    receiver = ScriptedReceiver(rotated)
    grant(settings, TENANT, actor=ACTOR, tool=TOOL, destinations=("crm",))
    outputs = [
        _cli(settings, "add", "--tenant", TENANT, "--name", "crm", "--url", receiver.url,
             "--tool", TOOL, "--secret-env", "S", S=given),
        _cli(settings, "rotate-secret", "--tenant", TENANT, "--name", "crm",
             "--secret-env", "S", S=rotated),
    ]  # fmt: skip
    assert [o.returncode for o in outputs] == [0, 0], [o.stderr for o in outputs]
    # A row as a version before sealing wrote it, in the clear.
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO delivery_destinations (tenant_id, name, kind, target, secret, tools, "
            "changed_by) VALUES ('globex', 'old', 'webhook', 'http://127.0.0.1:9/e', %s, "
            "ARRAY['*'], 'v0')",
            (legacy,),
        )
        stored = conn.execute(
            "SELECT secret, previous_secret FROM delivery_destinations WHERE name = 'crm'"
        ).fetchone()
    assert stored is not None and all(
        v.startswith(f"sealed1:{first_key.current_id}:") for v in stored
    )
    # The search can fail: the clear row is found where it is, and only there.
    assert _holders(_everything_written(settings), legacy) == ["pg_dump"]

    log = tmp_path / "delivery.log"
    env = env_for(
        settings,
        PYTHONPATH=str(ROOT),
        OPLEDGER_DELIVERY_GROUP=f"{settings.topic_prefix}-delivery",
    )
    worker = start_cli(["deliver", "run"], env, log)
    try:
        base = f"http://127.0.0.1:{settings.delivery_web_port}"
        wait_http(f"{base}/healthz")
        with TransitionRecorder.connect(settings, owner="service") as service:

            def succeed(n: int) -> None:
                op = service.intent(TENANT, ACTOR, TOOL, {"to": f"{n}@example.com"})
                service.dispatched(op, provider_ref=op.operation_id)
                service.succeeded(op, b"{}", content_type="application/json")
                project_in_process(settings)

            succeed(1)
            _delivered(receiver, 1)  # signed with the secret it was given: it was used

            outputs.append(_cli(settings, "rekey"))
            assert outputs[-1].returncode == 0, outputs[-1].stderr
            assert outputs[-1].stdout.startswith("1 secrets sealed under key")
            outputs.append(_cli(settings, "rotate-key"))
            assert outputs[-1].returncode == 0, outputs[-1].stderr
            assert "3 secrets sealed again under it; 1 old key(s) dropped" in outputs[-1].stdout
            after = SecretBox.load(settings.secrets_key_path)
            assert after.current_id != first_key.current_id and len(after.keys) == 1

            succeed(2)  # the running worker opens the secrets with the new key, unrestarted
            _delivered(receiver, 2)
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read()
        health = urllib.request.urlopen(f"{base}/healthz", timeout=10).read()
    finally:
        kill(worker)
        receiver.close()
    project_in_process(settings)

    texts = [o.stdout.encode() + o.stderr.encode() for o in outputs]
    written = _everything_written(settings, log.read_bytes(), metrics, health, *texts)
    for secret in (given, rotated, legacy):
        assert _holders(written, secret) == [], "a secret the run used was found"
    # Nor the keys that guard them.
    keys = [
        *key_texts,
        _key_text(settings.secrets_key_path),
        _key_text(settings.policy_signing_key_path),
    ]
    for where, blob in written.items():
        assert not [k for k in keys if k.encode() in blob], f"key material in {where}"


def test_a_rekey_that_meets_a_secret_no_key_opens_changes_nothing(
    isolated: Settings, tmp_path: Path
) -> None:
    """Its docstring promises one transaction: a destination resealed before the one that does
    not open must be rolled back with it (each UPDATE committed on its own before)."""
    old_key, stranger_key, rotated = (tmp_path / n for n in ("old.key", "stranger.key", "new.key"))
    write_key_file(old_key, [new_key_line()])
    write_key_file(stranger_key, [new_key_line()])
    with open_pool(isolated.dsn, name="test-rekey", max_size=2) as pool:
        for name, key in (("a-first", old_key), ("b-second", stranger_key)):
            DestinationStore(pool, isolated.with_(secrets_key_file=str(key))).add(
                tenant_id=TENANT,
                name=name,
                kind=Kind.WEBHOOK,
                target=f"https://{name}.example.com/hook",
                tools=["*"],
                changed_by="test",
            )
        write_key_file(rotated, [new_key_line(), *key_lines(old_key)])
        with psycopg.connect(isolated.dsn) as conn:
            before = conn.execute(
                "SELECT name, secret FROM delivery_destinations ORDER BY name"
            ).fetchall()
        store = DestinationStore(pool, isolated.with_(secrets_key_file=str(rotated)))
        with pytest.raises(SecretKeyError, match="b-second"):
            store.rekey()
        with psycopg.connect(isolated.dsn) as conn:
            after = conn.execute(
                "SELECT name, secret FROM delivery_destinations ORDER BY name"
            ).fetchall()
    assert after == before, "a failed rekey left some secrets resealed"
