"""The demo's summary: the projections first, then what the outside world counted, then the
invariants, each a line a reader (and the tests) can find."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from textwrap import shorten
from typing import TYPE_CHECKING

from rich.table import Table

from ledger.domain.redact import redact
from ledger.settings import Settings
from opledger.demo import EXIT_INVARIANT
from opledger.demo.observe import (
    DELIVERED,
    Observed,
    disagreements,
    excess_calls,
    lost_or_unfinished,
    truncated,
)
from opledger.demo.plan import QUEUE, QUEUE_CONSUMER, TENANTS, WEBHOOK
from opledger.demo.run import RunReport
from opledger.terminal import shown

if TYPE_CHECKING:
    from rich.console import Console

    from opledger.fakes.model import Stats


def render(
    console: Console,
    settings: Settings,
    observed: Observed,
    ran: RunReport,
    *,
    before: Stats,
    after: Stats,
    duplicates: float,
    settled_s: float,
    failed: Sequence[str],
) -> int:
    """Print the summary; the demo's exit code (EXIT_INVARIANT when ``failed`` is not empty)."""
    console.print()
    console.rule("[bold]what the projections say")
    console.print(
        f"PostgreSQL {redact(settings.dsn)}, this run's {len(observed.announced)} operations"
    )
    console.print(_executions(observed))
    console.print(_decisions(observed))
    console.print(_deliveries(observed))
    repeats = ", ".join(
        f"{machine} {n}"
        for (machine, outcome), n in sorted(observed.outcomes.items())
        if outcome == "duplicate"
    )
    anomalies = sum(observed.anomalies.values())
    console.print(
        f"repeated appends recognised (counted once, never applied twice): {repeats or 'none'}; "
        f"anomalies (illegal transitions refused): {anomalies}"
    )
    console.print()
    console.rule("[bold]the crashes, and what recovery made of them")
    for crashed in ran.crashes:
        row = observed.ops.get(crashed.operation_id)
        steps = " -> ".join(
            f"{d.decision} ({d.lookup})"
            for d in observed.decisions
            if d.operation_id == crashed.operation_id
        )
        now = "not projected" if row is None else f"{row.state} (attempt {row.attempt})"
        if row is not None and row.parked:
            now += f", parked: {row.parked}"
        counts = observed.provider.get(crashed.operation_id)
        calls = 0 if counts is None else counts.calls
        effects = 0 if counts is None else counts.side_effects
        call = crashed.call
        console.print(
            f"service-{crashed.crash.service + 1} killed at [bold]{crashed.crash.point}[/] "
            f"with {crashed.operation_id} in flight ({call.tenant_id} {call.actor_id} "
            f"{call.tool_name})" + (" and its grant revoked" if crashed.revoked else "")
        )
        console.print(f"    expected: {shown(crashed.crash.expect)}")
        console.print(
            f"    recovery: {shown(steps or 'no decision')}; now {shown(now)}; "
            f"provider calls {calls}, side effects {effects}"
        )
    kill = ran.delivery_kill
    if kill is not None and kill.skipped is None:
        back = (
            "not serving again yet"
            if kill.back_after_s is None
            else f"restarted by the supervisor, serving again {kill.back_after_s:.1f}s later"
        )
        console.print(f"delivery worker SIGKILLed (pid {kill.pid}) {kill.at_s:.1f}s in: {back}")
    console.print()
    console.rule("[bold]what the outside world counted")
    console.print(_provider(observed, before, after))
    console.print(_consumers(observed, duplicates))
    console.print()
    console.rule("[bold]invariants")
    excess = excess_calls(observed)
    disagree = disagreements(observed)
    unfinished = lost_or_unfinished(observed)
    console.print(
        f"[bold]max side effects per operation: {observed.max_side_effects()}[/] "
        "(the provider's own count; charge_card counts every call)"
    )
    console.print(
        f"[bold]provider calls beyond what reconciliation allowed: {len(excess)}[/] "
        "(no blind retry; nothing on the delivery path calls a tool)"
    )
    console.print(
        f"[bold]max applied changes per operation at a consumer: {observed.max_applied()}[/]"
    )
    by_reference = observed.by_reference()
    whole = len(by_reference) - len(truncated(observed))
    console.print(
        f"[bold]results over {settings.delivery_inline_max_bytes // 1024} KiB delivered by "
        f"reference: {len(by_reference)}, applied whole: {whole}[/] (the receiver and the queue "
        "consumer fetched each from the delivery workers and checked its size and sha256)"
    )
    console.print(
        f"[bold]operations lost or unfinished: {unfinished} of {len(observed.announced)}[/]"
    )
    console.print(
        "[bold]projections agree with the provider (SUCCEEDED: one side effect, FAILED: "
        f"none): {'yes' if not disagree else f'no, {len(disagree)} differ'}[/]"
    )
    console.print(
        f"run {ran.seconds:.1f}s, everything final {settled_s:.1f}s later, "
        f"{ran.processes} service processes"
    )
    if failed:
        for line in failed[:20]:
            console.print(f"[bold red]INVARIANT VIOLATED: {shown(line)}[/]")
        if len(failed) > 20:
            console.print(f"[bold red]... and {len(failed) - 20} more[/]")
        return EXIT_INVARIANT
    console.print("[bold green]every invariant held[/]")
    _explore(console, settings, ran, observed)
    return 0


def _executions(observed: Observed) -> Table:
    table = Table(title="executions by tenant", title_justify="left")
    columns = (
        "tenant",
        "SUCCEEDED",
        "FAILED",
        "refused at dispatch",
        "parked (UNKNOWN)",
        "not final",
        "total",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "tenant" else "right")
    for tenant in TENANTS:
        rows = [r for r in observed.ops.values() if r.tenant_id == tenant]
        table.add_row(
            tenant,
            str(sum(r.state == "SUCCEEDED" for r in rows)),
            str(sum(r.state == "FAILED" and not r.refused_at_dispatch for r in rows)),
            str(sum(r.refused_at_dispatch for r in rows)),
            str(sum(r.parked is not None for r in rows)),
            str(sum(not r.settled for r in rows)),
            str(len(rows)),
        )
    return table


def _decisions(observed: Observed) -> Table:
    table = Table(
        title=f"reconciliation decisions ({observed.went_unknown} operations went UNKNOWN: "
        "responses lost, or dispatches whose service died)",
        title_justify="left",
    )
    for column in ("decision", "provider lookup", "count", "example reason"):
        table.add_column(column, justify="right" if column == "count" else "left")
    counted = Counter((d.decision, d.lookup) for d in observed.decisions)
    reasons = {(d.decision, d.lookup): d.reason for d in observed.decisions}
    for (decision, lookup), n in sorted(counted.items()):
        table.add_row(
            decision,
            lookup,
            str(n),
            shown(shorten(reasons[(decision, lookup)], 100, placeholder=" ...")),
        )
    return table


def _deliveries(observed: Observed) -> Table:
    table = Table(title="deliveries by destination", title_justify="left")
    for column in (
        "destination",
        "ACKED",
        "DEAD_LETTERED",
        "not final",
        "sends",
        "sent more than once",
        "why dead-lettered",
    ):
        table.add_column(column, justify="left" if column[0] in "dw" else "right")
    for destination in sorted({d.destination for d in observed.deliveries}):
        rows = [d for d in observed.deliveries if d.destination == destination]
        why = Counter(d.error or "-" for d in rows if d.state == "DEAD_LETTERED")
        table.add_row(
            destination,
            str(sum(d.state == "ACKED" for d in rows)),
            str(sum(d.state == "DEAD_LETTERED" for d in rows)),
            str(sum(d.state not in DELIVERED for d in rows)),
            str(sum(d.attempts for d in rows)),
            str(sum(d.attempts > 1 for d in rows)),
            shown(
                "; ".join(
                    f"{n}x {shorten(r, 110, placeholder=' ...')}" for r, n in why.most_common(2)
                )
            ),
        )
    return table


def _provider(observed: Observed, before: Stats, after: Stats) -> Table:
    table = Table(
        title="the fake provider's own counts (per idempotency key = operation id)",
        title_justify="left",
    )
    for column in (
        "tool",
        "mode",
        "operations called",
        "calls",
        "side effects",
        "most for one operation",
        "responses lost",
        "lookups (unavailable)",
    ):
        table.add_column(column, justify="left" if column in ("tool", "mode") else "right")
    for tool in sorted(after.tools):
        ops = [op for op, call in observed.announced.items() if call.tool_name == tool]
        counts = [observed.provider[op] for op in ops if op in observed.provider]
        now, then = after.tools[tool], before.tools.get(tool)

        def delta(name: str, now: object = now, then: object = then) -> int:
            return max(0, int(getattr(now, name)) - (int(getattr(then, name)) if then else 0))

        table.add_row(
            tool,
            str(now.mode),
            str(len(counts)),
            str(sum(c.calls for c in counts)),
            str(sum(c.side_effects for c in counts)),
            str(max((c.side_effects for c in counts), default=0)),
            str(delta("lost_responses")),
            f"{delta('lookups')} ({delta('lookups_unavailable')})",
        )
    return table


def _consumers(observed: Observed, duplicates: float) -> Table:
    table = Table(
        title="the consumers' own records (changes applied, deduplicated on operation id)",
        title_justify="left",
    )
    for column in ("consumer", "receives", "changes applied", "most for one operation", "repeats"):
        table.add_column(column, justify="left" if column in ("consumer", "receives") else "right")
    receives = {WEBHOOK: "webhook POST /events", QUEUE: "queue (consumer queue)"}
    for destination, consumer in sorted(observed.consumers.items()):
        applied = [n for (c, _op), n in observed.applied.items() if c == consumer]
        repeats = f"{duplicates:.0f} recognised, not applied" if consumer != QUEUE_CONSUMER else "-"
        table.add_row(
            consumer,
            f"{destination}: {receives.get(destination, '?')}",
            str(sum(applied)),
            str(max(applied, default=0)),
            repeats,
        )
    return table


def _explore(console: Console, settings: Settings, ran: RunReport, observed: Observed) -> None:
    console.print()
    console.print("[bold]explore further[/]")
    refused = next((c for c in ran.crashes if c.revoked), None)
    if refused is not None:
        call = refused.call
        console.print(f"  opledger ops show {refused.operation_id} --tenant {call.tenant_id}")
    console.print("  opledger ops list --tenant globex --state UNKNOWN")
    dead = next((d for d in observed.deliveries if d.state == "DEAD_LETTERED"), None)
    if dead is not None:
        console.print(
            f"  opledger deliveries redrive {dead.operation_id} --tenant {dead.tenant_id} "
            f"--destination {dead.destination} --reason 'try again'   (refused again by policy)"
        )
    console.print("  opledger policy show --tenant globex --actor agent-9")
    console.print(
        f"  psql '{redact(settings.dsn)}' -c \"SELECT decision, lookup, count(*) FROM "
        'reconciliations GROUP BY 1, 2"'
    )
    console.print("  opledger stack status      # the workers, the restarts the supervisor made")
