"""The fake provider as a real process (``opledger fake-provider run``), seen through the
``ledger.tools`` adapters: what a caller concludes, and what the provider counted. No Kafka or
PostgreSQL needed."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from ledger.settings import Settings
from ledger.tools import (
    AsyncProvider,
    ContactLost,
    LookupStatus,
    Provider,
    ProviderTerms,
)
from opledger.fakes.http_provider import (
    AsyncHttpToolProvider,
    FakeProviderControl,
    HttpToolProvider,
    call_outcome,
    lookup_result,
)
from opledger.fakes.model import FakeProviderError, Mode
from tests.support import free_port

ROOT = Path(__file__).resolve().parents[2]


def terms(timeout_s: float = 5.0) -> ProviderTerms:
    return ProviderTerms(timedelta(seconds=timeout_s), timedelta(days=1), repeat_safe=True)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "opledger.cli", "fake-provider", "run", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        FakeProviderControl.of(Settings.from_env(), url).wait_ready(timeout=20)
        yield url
    finally:
        server.kill()
        server.wait(10)


@pytest.fixture
def control(base_url: str) -> FakeProviderControl:
    control = FakeProviderControl.of(Settings.from_env(), base_url)
    control.reset()
    return control


def kind(provider: HttpToolProvider, key: str, request: object) -> str:
    try:
        return "ok" if provider.call(request, key).succeeded else "failed"
    except ContactLost:
        return "lost"


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def raw_post(base_url: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_port_zero_is_reported_and_sigterm_stops_the_server() -> None:
    server = subprocess.Popen(
        [sys.executable, "-m", "opledger.cli", "fake-provider", "run", "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line.startswith("fake provider listening on http://127.0.0.1:")
        FakeProviderControl.of(Settings.from_env(), line.split()[-1]).wait_ready()
        server.send_signal(signal.SIGTERM)
        assert server.wait(10) == 0
    finally:
        server.kill()
        server.wait(10)


def test_adapters_are_ledger_providers(base_url: str) -> None:
    assert isinstance(HttpToolProvider(base_url, "t", terms()), Provider)
    assert isinstance(AsyncHttpToolProvider(base_url, "t", terms()), AsyncProvider)


def test_idempotent_tool_dedups_a_repeated_key(base_url: str, control: FakeProviderControl) -> None:
    provider = HttpToolProvider(base_url, "send_email", terms())
    first = provider.call({"to": "a@example.com"}, "op_1")
    again = provider.call({"to": "a@example.com"}, "op_1")
    assert first.succeeded and first.provider_ref and first == again
    stats = control.stats().tools["send_email"]
    assert (stats.mode, stats.calls, stats.side_effects, stats.duplicate_keys) == (
        Mode.IDEMPOTENT,
        2,
        1,
        1,
    )
    assert stats.received_keys == ("op_1", "op_1")
    assert stats.max_side_effects_per_key == 1
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as response:
        exposed = response.read().decode()
    assert 'opledger_provider_duplicate_keys_total{tool="send_email"} 1' in exposed
    assert 'opledger_provider_side_effects_total{tool="send_email"} 1' in exposed
    assert 'opledger_provider_calls_received_total{tool="send_email"} 2' in exposed


def test_non_idempotent_tool_counts_every_call(base_url: str, control: FakeProviderControl) -> None:
    control.configure("charge_card", mode=Mode.NON_IDEMPOTENT)
    provider = HttpToolProvider(base_url, "charge_card", terms())
    first = provider.call({"amount": 5}, "op_1")
    second = provider.call({"amount": 5}, "op_1")
    assert first.succeeded and second.succeeded and first.result != second.result
    stats = control.stats()
    assert (stats.calls, stats.side_effects, stats.duplicate_keys) == (2, 2, 1)
    # The seed's assertion "at most one non-idempotent change per operation" must fail here.
    assert stats.max_side_effects_per_key == 2
    control.reset(keep_config=True)
    assert control.stats().calls == 0
    provider.call({"amount": 5}, "op_1")
    assert control.stats().tools["charge_card"].mode is Mode.NON_IDEMPOTENT
    control.reset()
    provider.call({"amount": 5}, "op_1")
    assert control.stats().tools["charge_card"].mode is Mode.IDEMPOTENT


def test_lost_response_is_contact_lost_and_the_effect_is_counted(
    base_url: str, control: FakeProviderControl
) -> None:
    provider = HttpToolProvider(base_url, "send_email", terms())
    control.script("send_email", "op_1", ["lose_response"])
    with pytest.raises(ContactLost):
        provider.call({"to": "a"}, "op_1")
    stats = control.stats().tools["send_email"]
    assert (stats.side_effects, stats.lost_responses) == (1, 1)
    # On the wire: the connection closes with no response at all, not an error status.
    control.script("send_email", "op_raw", ["lose_response"])
    headers = {"Idempotency-Key": "op_raw", "Content-Type": "application/json"}
    with pytest.raises(http.client.RemoteDisconnected):
        raw_post(base_url, "/tools/send_email/call", b"{}", headers)
    found = provider.lookup("op_1", None)
    assert found.status is LookupStatus.FOUND_SUCCEEDED and b'"side_effect":1' in (
        found.result or b""
    )


def test_hang_beyond_call_timeout_is_contact_lost(
    base_url: str, control: FakeProviderControl
) -> None:
    provider = HttpToolProvider(base_url, "send_email", terms(timeout_s=0.3))
    control.script("send_email", "op_1", ["hang"])  # until released
    started = time.monotonic()
    with pytest.raises(ContactLost):
        provider.call({"to": "a"}, "op_1")
    assert 0.25 < time.monotonic() - started < 3
    assert control.stats().side_effects == 1
    assert provider.lookup("op_1", None).status is LookupStatus.FOUND_SUCCEEDED
    assert control.release("send_email", "op_1") == 1


def test_hang_before_effect_happens_after_the_caller_gave_up(
    base_url: str, control: FakeProviderControl
) -> None:
    provider = HttpToolProvider(base_url, "send_email", terms(timeout_s=0.3))
    control.script("send_email", "op_1", [{"action": "hang_before_effect", "seconds": 30}])
    with pytest.raises(ContactLost):
        provider.call({"to": "a"}, "op_1")
    assert provider.lookup("op_1", None).status is LookupStatus.NOT_FOUND
    with pytest.raises(ContactLost):  # 409: the first call with this key is still running
        provider.call({"to": "a"}, "op_1")
    assert control.stats().side_effects == 0
    control.release("send_email", "op_1")
    wait_until(lambda: provider.lookup("op_1", None).status is LookupStatus.FOUND_SUCCEEDED)
    stats = control.stats()
    assert (stats.calls, stats.side_effects, stats.duplicate_keys) == (2, 1, 1)


def test_lookups_say_succeeded_failed_not_found_or_unavailable(
    base_url: str, control: FakeProviderControl
) -> None:
    provider = HttpToolProvider(base_url, "send_email", terms())
    ok = provider.call({"to": "a"}, "op_ok")
    control.script("send_email", "op_no", ["fail"])
    failed = provider.call({"to": "b"}, "op_no")
    assert not failed.succeeded and "HTTP 422" in (failed.error or "")
    found = provider.lookup("op_ok", None)
    assert (found.status, found.result, found.provider_ref) == (
        LookupStatus.FOUND_SUCCEEDED,
        ok.result,
        ok.provider_ref,
    )
    assert provider.lookup("op_no", None).status is LookupStatus.FOUND_FAILED
    assert provider.lookup("op_never", None).status is LookupStatus.NOT_FOUND
    assert provider.lookup("op_other", ok.provider_ref).status is LookupStatus.FOUND_SUCCEEDED
    control.script("send_email", "op_ok", ["unavailable"])
    assert provider.lookup("op_ok", None).status is LookupStatus.UNAVAILABLE
    assert provider.lookup("op_ok", None).status is LookupStatus.FOUND_SUCCEEDED
    control.configure("send_email", lookup_unavailable_rate=1.0)
    unavailable = provider.lookup("op_ok", None)
    assert unavailable.status is LookupStatus.UNAVAILABLE and "503" in (unavailable.reason or "")
    assert control.stats().tools["send_email"].side_effects == 1


def test_forget_turns_lookups_into_not_found(base_url: str, control: FakeProviderControl) -> None:
    provider = HttpToolProvider(base_url, "send_email", terms())
    provider.call({"to": "a"}, "op_1")
    assert control.forget("send_email", ["op_1"]) == 1
    assert provider.lookup("op_1", None).status is LookupStatus.NOT_FOUND
    provider.call({"to": "a"}, "op_1")  # retention expired: a new effect, and it is counted
    assert control.stats().max_side_effects_per_key == 2


def test_stats_match_what_callers_saw_and_repeat_with_the_seed(
    base_url: str, control: FakeProviderControl
) -> None:
    def run() -> list[str]:
        control.reset()
        control.configure("send_email", fail_rate=0.3, lose_response_rate=0.2, seed=11)
        provider = HttpToolProvider(base_url, "send_email", terms())
        return [kind(provider, f"op_{i}", {"i": i}) for i in range(60)]

    first = run()
    seen = Counter(first)
    stats = control.stats()
    tool = stats.tools["send_email"]
    assert seen["ok"] and seen["failed"] and seen["lost"]
    assert tool.side_effects == seen["ok"] + seen["lost"]
    assert (tool.failures, tool.lost_responses) == (seen["failed"], seen["lost"])
    assert stats.received == tuple(("send_email", f"op_{i}") for i in range(60))
    assert run() == first


def test_requests_without_a_key_or_json_are_refused_and_not_counted(
    base_url: str, control: FakeProviderControl
) -> None:
    json_type = {"Content-Type": "application/json"}
    status, body = raw_post(base_url, "/tools/send_email/call", b"{}", json_type)
    assert status == 400 and "Idempotency-Key" in json.loads(body)["error"]
    with_key = json_type | {"Idempotency-Key": "op_1"}
    assert raw_post(base_url, "/tools/send_email/call", b"{not json", with_key)[0] == 400
    assert raw_post(base_url, "/tools/send_email/call", b"1" * 300_000, with_key)[0] == 413
    assert control.stats().calls == 0
    with pytest.raises(FakeProviderError, match="unknown mode"):
        control.configure("send_email", mode="sometimes")


def test_a_key_reused_for_another_request_is_contact_lost_without_effect(
    base_url: str, control: FakeProviderControl
) -> None:
    provider = HttpToolProvider(base_url, "send_email", terms())
    provider.call({"to": "a"}, "op_1")
    with pytest.raises(ContactLost, match="409"):
        provider.call({"to": "b"}, "op_1")
    assert control.stats().side_effects == 1


def test_unreachable_provider_is_contact_lost_for_calls_and_unavailable_for_lookups() -> None:
    provider = HttpToolProvider(f"http://127.0.0.1:{free_port()}", "send_email", terms(1))
    with pytest.raises(ContactLost):
        provider.call({}, "op_1")
    assert provider.lookup("op_1", None).status is LookupStatus.UNAVAILABLE


def test_the_provider_outlives_a_killed_caller(base_url: str, control: FakeProviderControl) -> None:
    # The caller is SIGKILLed while its call is held after the effect: the provider still knows.
    control.script("send_email", "op_1", ["hang"])
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                from datetime import timedelta
                from ledger.tools import ProviderTerms
                from opledger.fakes.http_provider import HttpToolProvider
                terms = ProviderTerms(timedelta(seconds=60), timedelta(days=1), True)
                HttpToolProvider({base_url!r}, "send_email", terms).call({{"to": "a"}}, "op_1")
            """),
        ],
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    try:
        wait_until(lambda: control.stats().side_effects == 1, timeout=20)
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait(10)
    provider = HttpToolProvider(base_url, "send_email", terms())
    assert provider.lookup("op_1", None).status is LookupStatus.FOUND_SUCCEEDED
    assert control.stats().calls == 1


def test_async_adapter_sees_the_same(base_url: str, control: FakeProviderControl) -> None:
    async def scenario() -> None:
        async with AsyncHttpToolProvider(base_url, "send_email", terms(0.3)) as provider:
            first = await provider.call({"to": "a"}, "op_1")
            assert first == await provider.call({"to": "a"}, "op_1")
            control.script("send_email", "op_2", ["lose_response"])
            with pytest.raises(ContactLost):
                await provider.call({"to": "b"}, "op_2")
            control.script("send_email", "op_3", ["hang"])
            with pytest.raises(ContactLost):
                await provider.call({"to": "c"}, "op_3")
            control.script("send_email", "op_4", ["fail"])
            assert not (await provider.call({"to": "d"}, "op_4")).succeeded
            statuses = [
                (await provider.lookup(key, None)).status
                for key in ("op_1", "op_2", "op_4", "op_5")
            ]
            assert statuses == [
                LookupStatus.FOUND_SUCCEEDED,
                LookupStatus.FOUND_SUCCEEDED,
                LookupStatus.FOUND_FAILED,
                LookupStatus.NOT_FOUND,
            ]
            control.script("send_email", "op_1", ["unavailable"])
            assert (await provider.lookup("op_1", None)).status is LookupStatus.UNAVAILABLE

    asyncio.run(scenario())
    control.release()
    stats = control.stats().tools["send_email"]
    assert (stats.calls, stats.side_effects, stats.duplicate_keys, stats.failures) == (5, 3, 1, 1)


# -- what an answer means (no server needed) -------------------------------------------------


@pytest.mark.parametrize("status", [500, 502, 503, 408, 409, 425, 429, 204, 302])
def test_answers_that_leave_the_outcome_unknown(status: int) -> None:
    with pytest.raises(ContactLost):
        call_outcome("t", status, b'{"error": "x"}')


def test_an_unreadable_success_is_unknown_and_a_4xx_is_a_confirmed_failure() -> None:
    with pytest.raises(ContactLost):
        call_outcome("t", 200, b"<html>")
    failed = call_outcome("t", 404, b"not json")
    assert not failed.succeeded and "HTTP 404" in (failed.error or "")
    ok = call_outcome("t", 200, b'{"result": {"b": 1, "a": 2}, "provider_ref": "r"}')
    assert (ok.result, ok.provider_ref) == (b'{"a":2,"b":1}', "r")


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (503, b"{}"),
        (200, b"garbage"),
        (200, b'{"status": "maybe"}'),
        (200, b'{"status": "succeeded"}'),
    ],
)
def test_unreadable_lookups_are_unavailable(status: int, body: bytes) -> None:
    assert lookup_result("t", status, body).status is LookupStatus.UNAVAILABLE
