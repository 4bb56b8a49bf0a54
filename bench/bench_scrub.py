"""Cost of scrubbing an error text: ``ledger.secrets.scrub`` (detect-secrets plugins + the
domain shapes) against ``ledger.domain.redact.redact`` alone (the baseline, also what the event
model's check costs), measured in the same run. Not a test; needs no stack.

Texts: 200 and 1000 characters (``MAX_ERROR_LENGTH``) of ordinary error prose with a URL and
an operation id, each without and with one credential (a quoted ``api_key``: the key name wakes
detect-secrets' keyword plugin, the slowest). Also the domain check on short identifier fields
(a destination, an operation id as provider ref), which runs on every event decoded.

    ratio = scrub p50 / redact p50

    PYTHONPATH=. python bench/bench_scrub.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from ledger.domain.redact import looks_secret, redact
from ledger.secrets import scrub

_ORDINARY = (
    "HTTP 503 Service Unavailable from https://api.example.com/v1/refunds after dispatch of "
    "op_01HZX3K5V8Q9R2T4W6Y8Z0A1B3; connection reset by peer; provider rejected the request: "
    "422 (attempt 3 of 5). "
)
_CREDENTIAL = ' upstream echoed {"api_key": "abcd1234efgh5678"}'


def _text(length: int, credential: bool) -> str:
    tail = _CREDENTIAL if credential else ""
    return (_ORDINARY * (length // len(_ORDINARY) + 1))[: length - len(tail)] + tail


TEXTS = {
    "200 chars, ordinary": _text(200, credential=False),
    "200 chars, one credential": _text(200, credential=True),
    "1000 chars, ordinary": _text(1000, credential=False),
    "1000 chars, one credential": _text(1000, credential=True),
}


def p50_us(fn: Callable[[str], object], text: str, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        fn(text)
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    for name, text in TEXTS.items():
        scrub(text)  # warm-up: regex compilation, lazy settings
        base = p50_us(redact, text, args.rounds)
        full = p50_us(scrub, text, args.rounds)
        print(
            f"{name:>26}: scrub p50 {full:7.1f} us   redact p50 {base:6.1f} us   "
            f"ratio {full / base:5.1f}"
        )
    for text in ("webhook:crm", "op_01HZX3K5V8Q9R2T4W6Y8Z0A1B3"):
        print(f"looks_secret({text!r}) p50 {p50_us(looks_secret, text, args.rounds * 5):.1f} us")


if __name__ == "__main__":
    main()
