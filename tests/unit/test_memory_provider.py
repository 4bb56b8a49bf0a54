"""MemoryProvider: the fake provider in-process. Its counts must be honest: a non-idempotent tool
called twice under one key must break "at most one side effect per key", an idempotent one must
not; lost responses and holds past the timeout raise ContactLost after the effect was counted."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta

import pytest

from ledger.tools import CallOutcome, ContactLost, LookupStatus, Provider, ProviderTerms
from opledger.fakes.memory import MemoryProvider
from opledger.fakes.model import Action, FakeProviderError, Mode, Stats, Step, ToolConfig
from opledger.fakes.state import ProviderState


def terms(timeout_s: float = 5.0) -> ProviderTerms:
    return ProviderTerms(timedelta(seconds=timeout_s), timedelta(days=1), repeat_safe=True)


def outcome_kind(provider: MemoryProvider, key: str, request: object) -> str:
    try:
        outcome = provider.call(request, key)
    except ContactLost:
        return "lost"
    return "ok" if outcome.succeeded else "failed"


def wait_until(predicate: object, timeout: float = 5.0) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_it_is_a_ledger_provider() -> None:
    provider = MemoryProvider("send_email")
    assert isinstance(provider, Provider)
    assert provider.terms.repeat_safe
    assert not MemoryProvider(mode=Mode.NON_IDEMPOTENT).terms.repeat_safe


def test_idempotent_repeat_replays_the_first_outcome_without_a_second_effect() -> None:
    provider = MemoryProvider("send_email")
    first = provider.call({"to": "a"}, "op_1")
    again = provider.call({"to": "a"}, "op_1")
    provider.call({"to": "b"}, "op_2")
    assert first.succeeded and first == again
    stats = provider.stats()
    assert (stats.calls, stats.side_effects, stats.duplicate_keys) == (3, 2, 1)
    assert stats.keys["op_1"].calls == 2 and stats.keys["op_1"].side_effects == 1
    assert stats.received_keys == ("op_1", "op_1", "op_2")
    assert stats.max_side_effects_per_key == 1


def test_non_idempotent_tool_counts_every_call_as_a_change() -> None:
    provider = MemoryProvider("charge_card", mode=Mode.NON_IDEMPOTENT)
    first = provider.call({"amount": 5}, "op_1")
    second = provider.call({"amount": 5}, "op_1")
    assert first.result != second.result  # two separate effects, two separate results
    stats = provider.stats()
    assert (stats.calls, stats.side_effects, stats.duplicate_keys) == (2, 2, 1)
    # The seed's check "at most one non-idempotent change per operation" must fail here.
    assert stats.max_side_effects_per_key == 2


def test_confirmed_failure_has_no_effect_and_is_remembered() -> None:
    provider = MemoryProvider("send_email")
    provider.script("op_1", ["fail"])
    outcome = provider.call({"to": "a"}, "op_1")
    assert not outcome.succeeded and outcome.error
    assert provider.call({"to": "a"}, "op_1") == outcome  # replayed, not redrawn
    assert provider.lookup("op_1", None).status is LookupStatus.FOUND_FAILED
    stats = provider.stats()
    assert (stats.calls, stats.side_effects, stats.failures) == (2, 0, 1)


def test_lost_response_raises_contact_lost_after_the_effect() -> None:
    provider = MemoryProvider("send_email")
    provider.script("op_1", ["lose_response"])
    with pytest.raises(ContactLost):
        provider.call({"to": "a"}, "op_1")
    assert provider.stats().side_effects == 1
    found = provider.lookup("op_1", None)
    assert found.status is LookupStatus.FOUND_SUCCEEDED and found.result
    # A (wrong) blind retry under the same key still changes nothing at an idempotent tool.
    assert provider.call({"to": "a"}, "op_1").result == found.result
    assert provider.stats().side_effects == 1


def test_hang_past_the_timeout_is_contact_lost_and_a_short_hang_answers() -> None:
    provider = MemoryProvider("send_email", terms(timeout_s=0.1))
    provider.script("op_1", [Step(Action.HANG)])  # until released
    started = time.monotonic()
    with pytest.raises(ContactLost):
        provider.call({"to": "a"}, "op_1")
    assert 0.09 < time.monotonic() - started < 2
    assert provider.stats().side_effects == 1
    provider.script("op_2", [{"action": "hang", "seconds": 0.02}])
    assert provider.call({"to": "b"}, "op_2").succeeded


def test_hang_before_effect_performs_the_effect_after_the_caller_gave_up() -> None:
    provider = MemoryProvider("send_email", terms(timeout_s=0.05))
    provider.script("op_1", ["hang_before_effect"])
    with pytest.raises(ContactLost):
        provider.call({"to": "a"}, "op_1")
    assert provider.lookup("op_1", None).status is LookupStatus.NOT_FOUND
    # Meanwhile a repeat of the key is neither an effect nor an answer.
    with pytest.raises(ContactLost):
        provider.call({"to": "a"}, "op_1")
    assert provider.stats().side_effects == 0
    assert provider.release("op_1") == 1
    wait_until(lambda: provider.lookup("op_1", None).status is LookupStatus.FOUND_SUCCEEDED)
    stats = provider.stats()
    assert (stats.calls, stats.side_effects, stats.duplicate_keys) == (2, 1, 1)


def test_a_key_reused_for_another_request_is_refused_without_effect() -> None:
    provider = MemoryProvider("send_email")
    provider.call({"to": "a"}, "op_1")
    with pytest.raises(ContactLost, match="conflict"):
        provider.call({"to": "someone else"}, "op_1")
    assert provider.stats().side_effects == 1


def test_lookups_answer_each_status() -> None:
    provider = MemoryProvider("send_email")
    ok = provider.call({"to": "a"}, "op_ok")
    assert provider.lookup("op_never", None).status is LookupStatus.NOT_FOUND
    found = provider.lookup("op_ok", None)
    assert (found.status, found.result, found.provider_ref) == (
        LookupStatus.FOUND_SUCCEEDED,
        ok.result,
        ok.provider_ref,
    )
    assert provider.lookup("op_other", ok.provider_ref).status is LookupStatus.FOUND_SUCCEEDED
    provider.script("op_ok", ["unavailable", "unavailable"])
    assert [provider.lookup("op_ok", None).status for _ in range(3)] == [
        LookupStatus.UNAVAILABLE,
        LookupStatus.UNAVAILABLE,
        LookupStatus.FOUND_SUCCEEDED,
    ]
    provider.configure(lookup_unavailable_rate=1.0)
    assert provider.lookup("op_ok", None).status is LookupStatus.UNAVAILABLE
    stats = provider.stats()
    assert (stats.lookups, stats.lookups_unavailable) == (7, 3)


def test_forget_makes_lookups_not_found_and_the_next_call_a_new_effect() -> None:
    provider = MemoryProvider("send_email")
    provider.call({"to": "a"}, "op_1")
    assert provider.forget(["op_1"]) == 1
    assert provider.lookup("op_1", None).status is LookupStatus.NOT_FOUND
    provider.call({"to": "a"}, "op_1")
    stats = provider.stats()
    # Retention expired, so even an idempotent tool did it twice, and the counts say so.
    assert stats.keys["op_1"].side_effects == 2 and stats.max_side_effects_per_key == 2


def test_drawn_outcomes_follow_the_rates_and_repeat_with_the_seed() -> None:
    def run(seed: int) -> list[str]:
        provider = MemoryProvider(fail_rate=0.2, lose_response_rate=0.1, seed=seed)
        return [outcome_kind(provider, f"op_{i}", {"i": i}) for i in range(1000)]

    first = run(7)
    assert first == run(7)
    assert first != run(8)
    counts = Counter(first)
    assert 150 < counts["failed"] < 250 and 50 < counts["lost"] < 150


def test_counts_agree_with_what_callers_saw() -> None:
    provider = MemoryProvider(fail_rate=0.3, lose_response_rate=0.2, seed=3)
    seen = Counter(outcome_kind(provider, f"op_{i}", {"i": i}) for i in range(300))
    stats = provider.stats()
    assert stats.side_effects == seen["ok"] + seen["lost"]
    assert stats.failures == seen["failed"] and stats.lost_responses == seen["lost"]


def test_latency_is_really_waited() -> None:
    provider = MemoryProvider(latency_s=0.001)
    started = time.monotonic()
    for i in range(20):
        provider.call({}, f"op_{i}")
    assert time.monotonic() - started >= 0.02


def test_concurrent_callers_get_one_effect_per_key() -> None:
    provider = MemoryProvider("send_email")
    keys = [f"op_{i}" for i in range(50)]
    outcomes: list[CallOutcome] = []
    lock = threading.Lock()

    def worker() -> None:
        for key in keys:
            while True:
                try:
                    outcome = provider.call({"key": key}, key)
                    break
                except ContactLost as exc:
                    # Another thread's call of this key is still in flight: the provider says
                    # so (no effect, not counted as a call), as a real one would; ask again.
                    assert "in_flight" in str(exc)
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = provider.stats()
    assert (stats.calls, stats.side_effects, stats.duplicate_keys) == (400, 50, 350)
    assert stats.max_side_effects_per_key == 1
    assert len({o.result for o in outcomes}) == 50


def test_tools_sharing_a_state_count_apart_and_reset_keeps_their_modes() -> None:
    state = ProviderState()
    mail = MemoryProvider("send_email", state=state)
    card = MemoryProvider("charge_card", mode=Mode.NON_IDEMPOTENT, state=state)
    mail.call({}, "op_1")
    card.call({}, "op_1")
    card.call({}, "op_1")
    stats = state.stats()
    assert (stats.calls, stats.side_effects, stats.max_side_effects_per_key) == (3, 3, 2)
    assert stats.received == (
        ("send_email", "op_1"),
        ("charge_card", "op_1"),
        ("charge_card", "op_1"),
    )
    assert Stats.from_json(stats.to_json()) == stats
    card.reset()
    assert state.stats().calls == 0
    assert card.stats().mode is Mode.NON_IDEMPOTENT


@pytest.mark.parametrize(
    "changes",
    [
        {"fail_rate": 1.5},
        {"fail_rate": 0.6, "lose_response_rate": 0.6},
        {"mode": "sometimes"},
        {"latency_ms": -1},
        {"colour": "red"},
    ],
)
def test_bad_settings_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(FakeProviderError):
        ToolConfig().with_changes(changes)


@pytest.mark.parametrize("raw", ["explode", {"action": "hang", "seconds": -1}, 3, {"x": 1}])
def test_bad_steps_are_refused(raw: object) -> None:
    with pytest.raises(FakeProviderError):
        Step.parse(raw)
