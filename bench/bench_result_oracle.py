"""Does a refused fetch of a result by reference tell whether its destination exists?

``GET /results/{op}?tenant=T&destination=D`` answers 401 to a request not signed with the
destination's secret, and the same 401 to a destination that does not exist (decision 015). An
outside probe measured those 401s on the running stack: a median 1.160 ms for an existing
(tenant, destination), 1.070 ms for an unknown one, because the unknown one skipped the
signature check. This script asks :class:`processors.delivery.result_endpoint.ResultEndpoint`
(the handler the delivery worker's web server runs, on the local stack's PostgreSQL) both
questions, interleaved, and prints each median and their ratio; 1.00 is the goal.

    .venv/bin/python bench/bench_result_oracle.py [-n 600]
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime

from benchenv import isolated
from ledger.destinations import DestinationStore, Kind, new_secret
from ledger.domain.ids import operation_id
from ledger.pg import open_pool
from ledger.result_fetch import sign_fetch
from ledger.results import ResultStore
from ledger.settings import Settings
from processors.delivery.result_endpoint import ResultEndpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=600, help="requests of each kind")
    args = parser.parse_args()
    with (
        isolated(Settings.from_env(), "oracle") as env,
        open_pool(env.settings.dsn, name="bench-oracle", max_size=2) as pool,
    ):
        store = DestinationStore(pool, env.settings)
        store.add(
            tenant_id="acme",
            name="crm",
            kind=Kind.WEBHOOK,
            target="https://hooks.example.com/events",
            tools=["*"],
            changed_by="bench",
        )
        endpoint = ResultEndpoint(pool, store, ResultStore(pool))
        op = operation_id(int(time.time() * 1000), bytes(10))
        timings: dict[str, list[float]] = {"known": [], "unknown": []}
        names = {"known": "crm", "unknown": "billing"}
        for i in range(args.n * 2 + 100):
            kind = "known" if i % 2 == 0 else "unknown"
            name = names[kind]
            forged = sign_fetch([new_secret()], "acme", name, op, datetime.now(UTC))
            started = time.perf_counter()
            answer = endpoint.fetch(op, {"tenant": "acme", "destination": name}, forged)
            elapsed = time.perf_counter() - started
            assert answer.status == 401, answer
            if i >= 100:  # the first requests warm the pool and the caches
                timings[kind].append(elapsed)
    known = statistics.median(timings["known"]) * 1000
    unknown = statistics.median(timings["unknown"]) * 1000
    print(f"401 for an existing destination   median {known:.3f} ms  ({args.n} requests)")
    print(f"401 for an unknown destination    median {unknown:.3f} ms  ({args.n} requests)")
    print(f"ratio unknown / existing          {unknown / known:.2f}  (goal 1.00: no oracle)")


if __name__ == "__main__":
    main()
