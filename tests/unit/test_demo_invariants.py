"""The demo's judgement, without a stack: its invariant check must fail when the outside world
counted a second side effect (or a second applied change, or a call nobody allowed), and pass
when the counts are clean. And its plan puts each crash's victim where the crash happens."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rich.console import Console

from ledger.settings import Settings
from opledger.demo import EXIT_INVARIANT, report
from opledger.demo.observe import Decided, DeliveryRow, Observed, OpRow, failures
from opledger.demo.plan import ACTORS, REVOKED, Call, make_plan, routed
from opledger.demo.run import RunReport
from opledger.fakes.model import KeyStats, Mode, Stats, ToolStats

OP_EMAIL = "op_01JAAAAAAAAAAAAAAAAAAAAAAA"
OP_CHARGE = "op_01JBBBBBBBBBBBBBBBBBBBBBBB"
CALLS = {
    OP_EMAIL: Call("acme", "agent-1", "send_email"),
    OP_CHARGE: Call("acme", "agent-2", "charge_card"),
}


def _observed(
    provider: dict[str, KeyStats],
    *,
    applied: dict[tuple[str, str], int] | None = None,
    decisions: tuple[Decided, ...] = (),
    ops: dict[str, OpRow] | None = None,
) -> Observed:
    rows = {
        op: OpRow(op, call.tenant_id, call.actor_id, call.tool_name, "SUCCEEDED", 1)
        for op, call in CALLS.items()
    }
    # Delivered wherever the demo routes them: crm for both, billing for charge_card too.
    deliveries = [
        DeliveryRow(op, call.tenant_id, name, "ACKED", 1)
        for op, call in CALLS.items()
        for name in sorted(routed(call.tenant_id, call.tool_name))
    ]
    consumers = {"crm": "reference", "billing": "billing"}
    return Observed(
        announced=CALLS,
        ops=rows if ops is None else ops,
        deliveries=deliveries,
        decisions=decisions,
        provider=provider,
        applied={(consumers[d.destination], d.operation_id): 1 for d in deliveries}
        if applied is None
        else applied,
        consumers=consumers,
    )


CLEAN = {OP_EMAIL: KeyStats(1, 1), OP_CHARGE: KeyStats(1, 1)}


def test_clean_counts_pass() -> None:
    assert failures(_observed(CLEAN)) == []


def test_a_second_side_effect_counted_by_the_provider_fails() -> None:
    # charge_card is non-idempotent: a second call with the same key is a second charge.
    found = failures(_observed(CLEAN | {OP_CHARGE: KeyStats(2, 2, 1)}))
    assert any("performed its side effect 2 times" in line for line in found), found
    assert any("called 2 times, but reconciliation allowed 1" in line for line in found), found


def test_a_second_call_is_allowed_only_after_a_new_attempt_decision() -> None:
    again = CLEAN | {OP_EMAIL: KeyStats(2, 1, 1)}
    assert any("called 2 times" in line for line in failures(_observed(again)))
    allowed = Decided(OP_EMAIL, "NEW_ATTEMPT", "NOT_FOUND", "policy allows a repeat")
    assert failures(_observed(again, decisions=(allowed,))) == []


def test_a_change_applied_twice_by_a_consumer_fails() -> None:
    twice = {("reference", OP_EMAIL): 2, ("reference", OP_CHARGE): 1, ("billing", OP_CHARGE): 1}
    assert failures(_observed(CLEAN, applied=twice)) == [
        f"{OP_EMAIL}: consumer reference applied it 2 times"
    ]


def test_an_acknowledged_delivery_never_applied_fails() -> None:
    found = failures(
        _observed(CLEAN, applied={("reference", OP_EMAIL): 1, ("billing", OP_CHARGE): 1})
    )
    assert found == [f"{OP_CHARGE}: delivery acknowledged, but consumer reference never applied it"]


def test_a_lost_operation_and_a_disagreement_with_the_provider_fail() -> None:
    only_email = {
        OP_EMAIL: OpRow(OP_EMAIL, "acme", "agent-1", "send_email", "SUCCEEDED", 1),
    }
    found = failures(_observed(CLEAN | {OP_EMAIL: KeyStats(1, 0)}, ops=only_email))
    disagreement = "SUCCEEDED in the projection, but the provider performed its side effect 0"
    assert f"{OP_EMAIL}: {disagreement} times" in found
    assert any(line.startswith("1 operations lost") for line in found), found


def test_a_result_by_reference_applied_short_or_never_fetched_fails() -> None:
    size = 600 * 1024
    whole = replace(
        _observed(CLEAN),
        large_results={OP_EMAIL: size},
        applied_bytes={("reference", OP_EMAIL): size},
    )
    assert failures(whole, fetched=1) == []
    short = replace(whole, applied_bytes={("reference", OP_EMAIL): size - 1})
    assert failures(short, fetched=1) == [
        f"{OP_EMAIL}: consumer reference applied {size - 1} bytes of a {size}-byte result "
        "delivered by reference"
    ]
    # Applied whole, but the consumer fetched nothing: it came inline, not by reference.
    assert any("fetched only 0 by reference" in line for line in failures(whole, fetched=0))


def test_a_large_result_for_the_queue_counts_as_by_reference_at_the_queue_consumer_too() -> None:
    size = 600 * 1024
    both = replace(
        _observed(CLEAN),
        large_results={OP_CHARGE: size},  # routed to the webhook and to the billing queue
        applied_bytes={("reference", OP_CHARGE): size, ("billing", OP_CHARGE): size},
    )
    assert both.by_reference() == [("billing", OP_CHARGE), ("reference", OP_CHARGE)]
    assert failures(both, fetched=2) == []
    assert any("fetched only 1 by reference" in line for line in failures(both, fetched=1))
    short = replace(
        both, applied_bytes={("reference", OP_CHARGE): size, ("billing", OP_CHARGE): 10}
    )
    assert failures(short, fetched=2) == [
        f"{OP_CHARGE}: consumer billing applied 10 bytes of a {size}-byte result delivered by "
        "reference"
    ]


def test_the_summary_shows_the_provider_count_and_the_violation() -> None:
    observed = _observed(CLEAN | {OP_CHARGE: KeyStats(2, 2, 1)})
    console = Console(record=True, width=200)
    stats = Stats(
        tools={
            "charge_card": ToolStats(
                mode=Mode.NON_IDEMPOTENT, calls=2, side_effects=2, duplicate_keys=1, failures=0,
                lost_responses=0, lookups=0, lookups_unavailable=0, max_side_effects_per_key=2,
                keys={OP_CHARGE: KeyStats(2, 2, 1)}, received_keys=(OP_CHARGE, OP_CHARGE),
            )
        },
        received=(),
    )  # fmt: skip
    code = report.render(
        console,
        Settings(home=Path("/nonexistent")),
        observed,
        RunReport(),
        before=Stats(tools={}, received=()),
        after=stats,
        duplicates=0,
        settled_s=1.0,
        failed=failures(observed),
    )
    assert code == EXIT_INVARIANT
    text = console.export_text()
    assert "max side effects per operation: 2" in text
    assert "INVARIANT VIOLATED" in text
    assert "every invariant held" not in text


def test_the_plan_puts_each_victim_where_its_crash_happens() -> None:
    plan = make_plan(300, seed=7, nonce=1)
    assert plan.operations == 300
    for crash in plan.crashes:
        calls = plan.services[crash.service]
        if crash.victim is not None:
            assert calls[crash.nth - 1].subject == crash.victim
        # Nothing before the crash can be refused at dispatch (which would not reach the fault
        # point and shift it): the revoked subject's actor appears only late.
        assert all(c.actor_id in ACTORS for c in calls[: crash.nth - 1])
    late = [c for calls in plan.services for c in calls if c.subject == REVOKED]
    assert len(late) == 3 * 2 + 1, "two late calls per service, plus the victim"
