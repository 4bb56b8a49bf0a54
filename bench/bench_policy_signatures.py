"""Cost of checking a grant's signature where a decision reads it (decision 032), against the
decision itself (``ledger.domain.policy.evaluate`` of one grant: the baseline), measured in the
same run. Not a test; needs no stack.

Per grant row a decision reads, ``PolicyStore`` rebuilds the bytes the signature covers
(``policy_signed_bytes``) and asks ``TrustedKeys.refusal``: an Ed25519 verification the first
time it sees those bytes and that signature, a dictionary lookup after. The projector verifies
each change it reads once. Signing is what `opledger policy grant` adds to a write.

    ratio = step p50 / evaluate p50

    PYTHONPATH=. python bench/bench_policy_signatures.py [--rows 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from ledger.domain.events import PolicyChanged
from ledger.domain.policy import Grant, PolicyChange, PolicyRequest, Purpose, evaluate
from ledger.policy_keys import OperatorKey, TrustedKeys


def _change(n: int, now: datetime) -> PolicyChanged:
    return PolicyChanged(
        event_id=f"ev_01M96{n:021d}",
        tenant_id="acme",
        actor_id="cli:bench",
        occurred_at=now,
        change=PolicyChange.GRANT,
        principal="agent-7",
        tool_name=f"tool_{n}",
        destinations=("crm", "billing"),
        repeat_safe=True,
        expires_at=now + timedelta(days=1),
        reason="bench",
    )


def _grant(change: PolicyChanged) -> Grant:
    return Grant(
        tenant_id=change.tenant_id,
        principal=change.principal,
        tool_name=change.tool_name,
        revoked=False,
        destinations=frozenset(change.destinations),
        repeat_safe=change.repeat_safe,
        expires_at=change.expires_at,
        version=change.event_id,
    )


def _p50_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _each(items: list[object], step: Callable[[object], object]) -> list[float]:
    times = []
    for item in items:
        started = time.perf_counter()
        step(item)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    args = parser.parse_args()
    now = datetime.now(UTC)
    key = OperatorKey.generate()
    trusted = TrustedKeys([key.public])
    unsigned = [_change(n, now) for n in range(args.rows)]
    signed = [key.sign(c) for c in unsigned]
    grants = [_grant(c) for c in signed]
    request = PolicyRequest(
        tenant_id="acme",
        actor_id="agent-7",
        tool_name="tool_0",
        purpose=Purpose.DISPATCH,
        now=now,
    )

    def decide(grant: object) -> object:
        assert isinstance(grant, Grant)
        return evaluate([grant], request)

    def covered(change: object) -> object:
        assert isinstance(change, PolicyChanged)
        return change.signed_bytes()

    def verify(change: object) -> object:
        assert isinstance(change, PolicyChanged)
        refusal = trusted.refusal(change.signed_bytes(), change.signed_by, change.signature)
        assert refusal is None, refusal
        return refusal

    def sign(change: object) -> object:
        assert isinstance(change, PolicyChanged)
        return key.sign(change)

    baseline = _p50_us(_each(list(grants), decide))
    rows = [
        ("evaluate() of one grant (baseline)", baseline),
        ("rebuild the signed bytes of a row", _p50_us(_each(list(signed), covered))),
        ("first check of a row (Ed25519 verify)", _p50_us(_each(list(signed), verify))),
        ("check again (memoised)", _p50_us(_each(list(signed), verify))),
        ("sign a change (`policy grant`)", _p50_us(_each(list(unsigned), sign))),
    ]
    print(f"{args.rows} grant rows, p50 per row")
    for name, p50 in rows:
        print(f"  {name:<40} {p50:8.2f} µs   ratio {p50 / baseline:6.2f}x")


if __name__ == "__main__":
    main()
