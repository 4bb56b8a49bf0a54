"""The pure parts of delivery: the retry schedule, the verdict on a send, the outbox's derived
PENDINGs, a redrive, and what a destination may be."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.destinations import DestinationError, Kind, check, new_secret
from ledger.domain.delivery import (
    MAX_RETRY_AFTER,
    Outcome,
    SendResult,
    judge,
    outbox_pendings,
    parse_retry_after,
    redrive,
    take_connections,
)
from ledger.domain.fold import Applied, DeliveryRecord, ExecutionRecord, apply_delivery
from ledger.domain.ids import content_ref, event_id
from ledger.domain.schedule import DEFAULT_SCHEDULE, RetryPolicy, parse_schedule
from ledger.domain.states import DeliveryState, ExecutionState

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
POLICY = RetryPolicy(jitter=0.0)


def _judge(status: int | None, attempts: int = 1, **kw: object) -> object:
    values: dict[str, object] = {
        "round_attempts": attempts,
        "round_start": NOW,
        "now": NOW,
        "policy": POLICY,
        "unit_random": 0.5,
    }
    values.update(kw)
    return judge(SendResult(status, "detail"), **values)  # type: ignore[arg-type]


@pytest.mark.parametrize("status", [200, 201, 202, 204, 299])
def test_2xx_is_acknowledged(status: int) -> None:
    assert _judge(status).outcome is Outcome.ACKED  # type: ignore[attr-defined]


def test_410_disables_and_says_so() -> None:
    verdict = _judge(410)
    assert verdict.outcome is Outcome.DISABLED  # type: ignore[attr-defined]
    assert "410" in verdict.reason  # type: ignore[attr-defined]


def test_413_dead_letters_at_once_since_the_same_bytes_would_be_refused_again() -> None:
    verdict = _judge(413, attempts=1)
    assert verdict.outcome is Outcome.DEAD_LETTERED  # type: ignore[attr-defined]
    assert verdict.next_attempt_at is None  # type: ignore[attr-defined]
    assert "413" in verdict.reason and "redrive" in verdict.reason  # type: ignore[attr-defined]


def test_a_body_too_large_to_send_dead_letters_at_once_whatever_the_attempt() -> None:
    result = SendResult(None, "a record of 1400000 bytes", too_large=True)
    values = {"round_start": NOW, "now": NOW, "policy": POLICY, "unit_random": 0.5}
    verdict = judge(result, round_attempts=1, **values)  # type: ignore[arg-type]
    assert verdict.outcome is Outcome.DEAD_LETTERED and verdict.next_attempt_at is None
    assert verdict.reason is not None and "too large" in verdict.reason
    assert "1400000 bytes" in verdict.reason and "redrive" in verdict.reason


@pytest.mark.parametrize("status", [429, 502, 504])
def test_throttle_statuses_wait_and_are_told_apart(status: int) -> None:
    verdict = _judge(status)
    assert verdict.outcome is Outcome.THROTTLED  # type: ignore[attr-defined]
    assert verdict.next_attempt_at == NOW + DEFAULT_SCHEDULE[0]  # type: ignore[attr-defined]


@pytest.mark.parametrize("status", [None, 301, 302, 307, 400, 401, 404, 500, 503])
def test_other_answers_retry_on_the_schedule(status: int | None) -> None:
    for attempts in range(1, len(DEFAULT_SCHEDULE) + 1):
        verdict = _judge(status, attempts)
        assert verdict.outcome is Outcome.RETRY  # type: ignore[attr-defined]
        wait = DEFAULT_SCHEDULE[attempts - 1]
        assert verdict.next_attempt_at == NOW + wait  # type: ignore[attr-defined]


def test_a_redirect_is_named_as_not_followed() -> None:
    assert "not followed" in _judge(307).reason  # type: ignore[attr-defined]


def test_max_attempts_dead_letters_with_the_last_failure() -> None:
    verdict = _judge(503, POLICY.max_attempts)
    assert verdict.outcome is Outcome.DEAD_LETTERED  # type: ignore[attr-defined]
    assert "8 attempts" in verdict.reason and "503" in verdict.reason  # type: ignore[attr-defined]


def test_the_horizon_dead_letters_before_a_send_would_be_scheduled_past_it() -> None:
    start = NOW - POLICY.horizon + timedelta(seconds=1)
    verdict = _judge(None, 1, round_start=start)
    assert verdict.outcome is Outcome.DEAD_LETTERED  # type: ignore[attr-defined]
    assert "horizon" in verdict.reason  # type: ignore[attr-defined]


def test_retry_after_lengthens_but_never_shortens_the_wait() -> None:
    long = judge(
        SendResult(503, "", timedelta(hours=1)),
        round_attempts=1,
        round_start=NOW,
        now=NOW,
        policy=POLICY,
        unit_random=0.5,
    )
    short = judge(
        SendResult(503, "", timedelta(seconds=1)),
        round_attempts=1,
        round_start=NOW,
        now=NOW,
        policy=POLICY,
        unit_random=0.5,
    )
    capped = judge(
        SendResult(429, "", timedelta(days=30)),
        round_attempts=1,
        round_start=NOW,
        now=NOW,
        policy=RetryPolicy(horizon=timedelta(days=60)),
        unit_random=0.5,
    )
    assert long.next_attempt_at == NOW + timedelta(hours=1)
    assert short.next_attempt_at == NOW + DEFAULT_SCHEDULE[0]
    assert capped.next_attempt_at == NOW + timedelta(hours=24)


@given(
    st.integers(1, 50),
    st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=30)),
    st.sampled_from([None, timedelta(seconds=1), timedelta(days=2)]),
)
def test_a_send_that_never_left_the_worker_is_not_an_attempt(
    attempts: int, since_start: timedelta, retry_after: timedelta | None
) -> None:
    # Decision 026: whatever the budget left, the horizon or a stale Retry-After, a send no
    # connection was free for is sent again at once and never dead-letters nor throttles.
    policy = RetryPolicy(schedule=(timedelta(seconds=1), timedelta(seconds=2)), max_attempts=3)
    never_left = SendResult(
        None, "not sent: no connection came free within 5 s", retry_after, no_connection=True
    )
    values = {"round_start": NOW - since_start, "now": NOW, "policy": policy, "unit_random": 0.5}
    verdict = judge(never_left, round_attempts=attempts, **values)  # type: ignore[arg-type]
    assert verdict.outcome is Outcome.NOT_SENT
    assert verdict.next_attempt_at == NOW
    assert verdict.reason == "not sent: no connection came free within 5 s"
    # The same words from a send that left (no answer in time) spend the budget as before.
    timed_out = replace(never_left, no_connection=False)
    spent = judge(timed_out, round_attempts=attempts, **values)  # type: ignore[arg-type]
    if attempts >= policy.max_attempts:
        assert spent.outcome is Outcome.DEAD_LETTERED


@given(st.lists(st.booleans(), max_size=40), st.integers(0, 45))
def test_a_send_is_taken_only_with_a_connection_in_the_order_they_fell_due(
    needs: list[bool], free: int
) -> None:
    due = list(enumerate(needs))  # (the order it fell due, whether it needs a connection)
    going, waiting = take_connections(due, free, lambda send: send[1])
    # Nothing lost or repeated, and each part keeps the order the sends fell due in.
    assert sorted(going + waiting) == due
    assert going == sorted(going) and waiting == sorted(waiting)
    # A send that needs no connection always goes; no more connections taken than are free.
    assert all(need for _i, need in waiting)
    connected = [i for i, need in going if need]
    assert len(connected) == min(free, sum(needs))
    # Those that wait fell due after every one that got a connection.
    assert all(i > max(connected, default=-1) for i, _need in waiting)


@given(st.integers(1, 20), st.floats(0, 0.999999))
def test_jitter_stays_within_its_band(attempts: int, unit: float) -> None:
    policy = RetryPolicy()
    base = DEFAULT_SCHEDULE[min(attempts, len(DEFAULT_SCHEDULE)) - 1]
    delay = policy.delay(attempts, unit)
    assert base * 0.8 <= delay <= base * 1.2


def test_retry_after_parses_seconds_and_http_dates() -> None:
    assert parse_retry_after("120", NOW) == timedelta(seconds=120)
    assert parse_retry_after("Mon, 30 Nov 2026 12:00:30 GMT", NOW) == timedelta(seconds=30)
    assert parse_retry_after("Mon, 30 Nov 2026 11:00:00 GMT", NOW) == timedelta(0)
    assert parse_retry_after("soon", NOW) is None
    assert parse_retry_after(None, NOW) is None


@pytest.mark.parametrize(
    ("value", "delay"),
    [
        ("\u00b2", None),  # superscript two: str.isdigit() says yes, int() refuses
        ("\u0663", None),  # Arabic-Indic three: int() would read 3
        ("99999999999999999999", MAX_RETRY_AFTER),  # past timedelta's range
        ("Fri, 31 Dec 9999 23:59:59 GMT", MAX_RETRY_AFTER),
        ("1" * 65, None),  # longer than any real value
        ("", None),
    ],
    ids=["superscript", "arabic-indic", "huge", "far-date", "long", "empty"],
)
def test_retry_after_from_a_hostile_destination_never_raises(
    value: str, delay: timedelta | None
) -> None:
    assert parse_retry_after(value, NOW) == delay


@given(st.text(max_size=80))
def test_any_retry_after_is_none_or_a_bounded_delay(value: str) -> None:
    delay = parse_retry_after(value, NOW)
    assert delay is None or timedelta(0) <= delay <= MAX_RETRY_AFTER


def test_schedules_parse_with_units_and_refuse_nonsense() -> None:
    assert parse_schedule("500ms, 5s,5m,2h,1d") == (
        timedelta(milliseconds=500),
        timedelta(seconds=5),
        timedelta(minutes=5),
        timedelta(hours=2),
        timedelta(days=1),
    )
    for bad in ("", "5x", "-5s", "0s", "abc"):
        with pytest.raises(ValueError):
            parse_schedule(bad)


def _succeeded() -> ExecutionRecord:
    ok = event_id(1_764_504_000_000, b"succeeded!")
    return ExecutionRecord(
        operation_id="op_01KDYAK3SE000G40R40M30E209",
        tenant_id="acme",
        actor_id="agent-7",
        tool_name="send_email",
        request_hash=content_ref(b"request"),
        state=ExecutionState.SUCCEEDED,
        attempt=1,
        provider_ref=None,
        result_ref=content_ref(b"result"),
        error=None,
        created_at=NOW,
        updated_at=NOW,
        state_entered_at=NOW,
        version=3,
        seen=MappingProxyType({(ExecutionState.SUCCEEDED, 1): ok}),
    )


def test_the_outbox_derives_the_same_pendings_every_time() -> None:
    execution = _succeeded()
    first = outbox_pendings(execution, ["crm", "billing", "crm"])
    again = outbox_pendings(execution, ["billing", "crm"])
    assert first == again, "a repeat after a crash writes the very same events"
    assert [p.destination for p in first] == ["billing", "crm"]
    assert len({p.event_id for p in first}) == 2
    assert all(p.state is DeliveryState.PENDING and p.attempt == 0 for p in first)
    assert all(p.result_ref == execution.result_ref for p in first)
    with pytest.raises(ValueError):
        outbox_pendings(replace(execution, state=ExecutionState.FAILED), ["crm"])


def _dead_lettered() -> tuple[DeliveryRecord, ExecutionRecord]:
    execution = _succeeded()
    (pending,) = outbox_pendings(execution, ["crm"])
    outcome = apply_delivery(None, pending, execution)
    assert isinstance(outcome, Applied)
    dead = pending.model_copy(
        update={
            "event_id": event_id(1_764_504_000_001, b"deadletter"),
            "state": DeliveryState.DEAD_LETTERED,
            "error": "destination answered 410 Gone",
        }
    )
    outcome = apply_delivery(outcome.record, dead, execution)
    assert isinstance(outcome, Applied)
    return outcome.record, execution


def test_two_redrives_of_one_dead_letter_are_one_event() -> None:
    record, execution = _dead_lettered()
    ann = redrive(record, actor_id="ops:ann", reason="fixed", now=NOW)
    bob = redrive(record, actor_id="ops:bob", reason="fixed too", now=NOW + timedelta(seconds=3))
    assert ann.event_id == bob.event_id
    applied = apply_delivery(record, ann, execution)
    assert isinstance(applied, Applied) and applied.record.redrives == 1
    assert type(apply_delivery(applied.record, bob, execution)).__name__ == "Duplicate"
    assert "ops:ann" in (ann.error or "")


def test_only_a_dead_letter_with_a_reason_is_redriven() -> None:
    record, _execution = _dead_lettered()
    with pytest.raises(ValueError):
        redrive(record, actor_id="ops:ann", reason="  ", now=NOW)
    with pytest.raises(ValueError):
        redrive(replace(record, state=DeliveryState.ACKED), actor_id="a", reason="r", now=NOW)


SECRET = new_secret()


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"name": "Bad Name"}, "destination name"),
        ({"target": "ftp://example.com/x"}, "http"),
        ({"target": "https://user:pw@example.com/x"}, "credentials"),
        ({"target": "https:///nohost"}, "host"),
        ({"target": "https://example.com/x#frag"}, "fragment"),
        ({"secret": None}, "secret"),
        ({"secret": "not-a-secret"}, "secret"),
        ({"tools": []}, "tool"),
        ({"timeout_ms": 10}, "timeout"),
        ({"kind": Kind.QUEUE, "target": "bad topic!", "secret": None}, "topic"),
        ({"kind": Kind.QUEUE, "target": "results", "secret": "whsec_short"}, "fetch secret"),
        # An outside probe's cases: each was stored by `destinations add` (and printed back raw
        # by `destinations list`) while the SDK refused the same tenant.
        ({"tenant_id": "x'--"}, "not a tenant id"),
        ({"tenant_id": "t\x1b[2J"}, r"not a tenant id: 't\\x1b\[2J'"),
        ({"tools": ["x\x1b]52;c;SGVsbG8=\x07\x1b[2J"]}, "not a tool name"),
        ({"tools": ["send_email", "a\r\nforged line"]}, "not a tool name"),
        ({"target": "https://hooks.example.com/a\r\nb"}, "printable ASCII"),
        ({"target": "https://hooks.example.com/a b"}, "printable ASCII"),
        ({"target": "https://hooks.example.com/\tevents"}, "printable ASCII"),
        ({"target": "https://hooks.exämple.com/events"}, "xn--"),
        ({"changed_by": "ops\x1b[2J"}, "not an actor id"),
        ({"name": "crm\n"}, "not a destination name"),
    ],
)
def test_a_bad_destination_is_refused_with_the_reason(
    fields: dict[str, object], problem: str
) -> None:
    values: dict[str, object] = {
        "tenant_id": "acme",
        "changed_by": "cli:ann",
        "name": "crm",
        "kind": Kind.WEBHOOK,
        "target": "https://hooks.example.com/events",
        "tools": ["send_email"],
        "secret": SECRET,
        "timeout_ms": 10_000,
    }
    values.update(fields)
    with pytest.raises(DestinationError, match=problem):
        check(**values)  # type: ignore[arg-type]


def test_a_good_destination_passes_and_its_secret_is_never_in_its_repr() -> None:
    from ledger.destinations import Destination  # noqa: PLC0415

    check(
        tenant_id="acme",
        changed_by="cli:ann",
        name="crm",
        kind=Kind.WEBHOOK,
        target="http://127.0.0.1:8080/events",
        tools=["*"],
        secret=SECRET,
        timeout_ms=1000,
    )
    shown = repr(Destination("acme", "crm", Kind.WEBHOOK, "http://x", ("*",), 1000, True, None,
                             secret=SECRET))  # fmt: skip
    assert SECRET not in shown


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no secret", "fetch secret"])
def test_a_queue_destination_passes_with_or_without_a_fetch_secret(secret: str | None) -> None:
    check(
        tenant_id="acme",
        changed_by="cli:ann",
        name="results-queue",
        kind=Kind.QUEUE,
        target="acme.results",
        tools=["*"],
        secret=secret,
        timeout_ms=1000,
    )
