"""DBOS baseline of ``bench_sdk_calls.py``: one durable workflow with one step per tool call.

Run by ``bench_sdk_calls.py`` with the Python of DBOS's own virtualenv (DBOS 3.4 needs
``croniter>=6.2.4``, faust's ``mode-streaming`` needs ``croniter<6``, so it cannot share ours),
against a system database that the caller created and drops. DBOS keeps its defaults (pool,
durability, LISTEN/NOTIFY); only the application name, the system database URL and a quieter
log level are set. Timed with the same ``callbench`` code as the opledger side. Prints one JSON
line: the versions and one summary per mode.

    <venv>/bin/python bench/dbos_calls.py --url postgresql://opledger@127.0.0.1:15432/<db>
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from importlib.metadata import version

from dbos import DBOS, DBOSConfig

from callbench import Summary, mode_names, run_tasks, run_threads, tool_result

_numbers = itertools.count()


@DBOS.step()
def send_email(to: str, number: int) -> str:
    return tool_result(number).decode()


@DBOS.workflow()
def tool_call(to: str, number: int) -> str:
    return send_email(to, number)


@DBOS.step()
async def send_email_async(to: str, number: int) -> str:
    return tool_result(number).decode()


@DBOS.workflow()
async def tool_call_async(to: str, number: int) -> str:
    return await send_email_async(to, number)


def call() -> None:
    number = next(_numbers)
    result = tool_call(f"user{number}@example.com", number)
    if result != tool_result(number).decode():
        raise RuntimeError(f"workflow returned {result!r}")


async def call_async() -> None:
    number = next(_numbers)
    result = await tool_call_async(f"user{number}@example.com", number)
    if result != tool_result(number).decode():
        raise RuntimeError(f"workflow returned {result!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="system database URL (must exist)")
    parser.add_argument("--sequential", type=int, default=300)
    parser.add_argument("--concurrent", type=int, default=3000)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()

    sequential, threaded, tasks = mode_names(args.callers)
    config: DBOSConfig = {
        "name": "opledger-bench-calls",
        "system_database_url": args.url,
        "log_level": "WARNING",
    }
    DBOS(config=config)
    DBOS.launch()
    sizes = {"warmup": args.warmup, "timeout_s": args.timeout}
    summaries: list[Summary] = []
    try:
        summaries.append(run_threads(sequential, call, calls=args.sequential, callers=1, **sizes))
        summaries.append(
            run_threads(threaded, call, calls=args.concurrent, callers=args.callers, **sizes)
        )
        summaries.append(
            asyncio.run(
                run_tasks(tasks, call_async, calls=args.concurrent, callers=args.callers, **sizes)
            )
        )
    finally:
        DBOS.destroy(destroy_registry=True)
    versions = {name: version(name) for name in ("dbos", "sqlalchemy", "psycopg")}
    print(json.dumps({"versions": versions, "modes": [s.to_json() for s in summaries]}))


if __name__ == "__main__":
    main()
