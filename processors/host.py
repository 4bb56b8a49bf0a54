"""The workers' host: a worker's loop on its own thread, ``/metrics`` and ``/healthz`` (and any
page the worker adds) served by aiohttp, signals, a watchdog; nothing else.

The loop blocks (librdkafka polls, psycopg commits, provider calls), so it runs on its own
thread; the event loop stays free for the web server. If the loop fails, the process exits
non-zero rather than idling with a dead loop: a process that is alive but not working is the
failure the seed warns a heartbeat cannot see. If the loop stops turning (a call that never
returns), the watchdog says where it is and, past ``OPLEDGER_WORKER_STUCK_EXIT_S``, exits so
that the supervisor starts a fresh process (decision 025).

This replaced a faust app as the host (decision 028): the faust app joined a
consumer group of its own that no worker read from, needed a data directory and static member
ids, and replaced the log handlers (and their scrubbing filter) as it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ledger.heap import freeze_startup_heap
from ledger.secrets import redact_handlers
from ledger.settings import Settings
from processors.health import Health, LoopWatchdog, Verdict

log = logging.getLogger("opledger.worker")

_METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST.partition("; charset")[0]
#: How long a stopped loop gets to finish its batch or pass before the process exits anyway
#: (killing the loop mid-batch is safe: offsets commit with rows).
STOP_GRACE_S = 15.0
#: Exit codes: the loop failed; the loop stopped turning; the loop ended by itself.
EXIT_LOOP_FAILED = 1
EXIT_STUCK = 3
EXIT_LOOP_ENDED = 4

Page = Callable[[web.Request], Awaitable[web.StreamResponse]]


class LoopStuckError(RuntimeError):
    """The loop has not turned for longer than OPLEDGER_WORKER_STUCK_EXIT_S: the worker exits so
    that its supervisor starts a fresh process."""


class Loop(Protocol):
    """What a worker's loop offers its host."""

    @property
    def health(self) -> Health: ...

    def run(self) -> None: ...

    def stop(self) -> None: ...


def where_thread_is(thread: threading.Thread) -> str:
    """The stack ``thread`` is running now, innermost call last."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return "  (the thread has ended)"
    return "".join(traceback.format_stack(frame)).rstrip()


@dataclass(frozen=True, slots=True)
class Hosted:
    """A worker wired for its host: its loop, its metrics, its name, its port, its own pages."""

    worker: Loop
    registry: CollectorRegistry
    name: str
    web_port: int
    pages: dict[str, Page] = field(default_factory=dict)


def serve(settings: Settings, hosted: Hosted) -> int:
    """Run the hosted loop and serve its pages until SIGTERM or SIGINT (exit 0), the loop
    failing (:data:`EXIT_LOOP_FAILED`), ending by itself (:data:`EXIT_LOOP_ENDED`) or staying
    stuck (:data:`EXIT_STUCK`); returns the process's exit code."""
    return asyncio.run(
        _Host(
            settings,
            hosted.worker,
            hosted.registry,
            name=hosted.name,
            web_port=hosted.web_port,
            pages=hosted.pages,
        ).serve()
    )


class _Host:
    def __init__(
        self,
        settings: Settings,
        worker: Loop,
        registry: CollectorRegistry,
        *,
        name: str,
        web_port: int,
        pages: dict[str, Page] | None,
    ) -> None:
        self._settings = settings
        self._worker = worker
        self._registry = registry
        self._name = name
        self._web_port = web_port
        self._pages = pages or {}
        self._watchdog = LoopWatchdog(
            worker.health, settings.worker_stuck_after_s, settings.worker_stuck_exit_s
        )

    async def serve(self) -> int:
        # A handler a framework or a test put on the root logger since the command added the
        # scrubbing filter gets it too: a provider's words or a destination's answer are logged.
        redact_handlers()
        events = asyncio.get_running_loop()
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            events.add_signal_handler(signum, stop.set)
        runner = web.AppRunner(self._application(), access_log=None, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(
                runner, self._settings.projector_web_bind, self._web_port, reuse_address=True
            )
            await site.start()
            log.info(
                "%s serving http://%s:%d/healthz",
                self._name,
                self._settings.projector_web_bind,
                self._web_port,
            )
            return await self._run_until_done(stop)
        finally:
            with contextlib.suppress(Exception):
                await runner.cleanup()

    async def _run_until_done(self, stop: asyncio.Event) -> int:
        events = asyncio.get_running_loop()
        finished: asyncio.Future[Any] = events.create_future()  # the loop's failure, or None

        def run() -> None:
            outcome: BaseException | None = None
            # The watchdog counts from here: the host's own start-up is not the loop's.
            self._worker.health.beat()
            try:
                self._worker.run()
            except BaseException as exc:  # reported to the event loop, which exits
                outcome = exc
            events.call_soon_threadsafe(finished.set_result, outcome)

        frozen = freeze_startup_heap()  # start-up is over: the clients, the schemas
        log.info("%s: start-up heap frozen (%d objects)", self._name, frozen)
        # A daemon thread: a loop that never returns must not keep the process alive at exit.
        thread = threading.Thread(target=run, name=f"opledger-{self._name}", daemon=True)
        thread.start()
        stopping: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
        watching: asyncio.Future[Any] = asyncio.ensure_future(self._watch(thread))
        try:
            done, _pending = await asyncio.wait(
                {finished, stopping, watching}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stopping.cancel()
            watching.cancel()
        if finished in done:
            failure = finished.result()
            if failure is not None:
                log.error(
                    "%s loop failed; crashing the worker so it is restarted",
                    self._name,
                    exc_info=failure,
                )
                return EXIT_LOOP_FAILED
            log.error("%s loop ended by itself; exiting so that it is restarted", self._name)
            return EXIT_LOOP_ENDED
        if watching in done:
            return EXIT_STUCK
        log.info("%s stopping", self._name)
        self._worker.stop()
        try:
            await asyncio.wait_for(asyncio.shield(finished), STOP_GRACE_S)
        except TimeoutError:
            log.warning(
                "%s loop did not stop within %.0fs; exiting without it:\n%s",
                self._name,
                STOP_GRACE_S,
                where_thread_is(thread),
            )
        return 0

    async def _watch(self, thread: threading.Thread) -> None:
        """A loop blocked in a call that never returns logs nothing and fails nothing: say where
        it is, and past the exit bound return so the host exits for a fresh process."""
        every = max(0.5, min(5.0, self._settings.worker_stuck_after_s / 4))
        while True:
            await asyncio.sleep(every)
            if not thread.is_alive():
                continue
            verdict = self._watchdog.check()
            if verdict is Verdict.NEWLY_STUCK:
                log.error(
                    "%s loop has not turned for %.0fs (OPLEDGER_WORKER_STUCK_AFTER_S); it is "
                    "here:\n%s",
                    self._name,
                    self._settings.worker_stuck_after_s,
                    where_thread_is(thread),
                )
            elif verdict is Verdict.EXIT:
                failure = LoopStuckError(
                    f"{self._name} loop has not turned for "
                    f"{self._settings.worker_stuck_exit_s}s (OPLEDGER_WORKER_STUCK_EXIT_S); "
                    "exiting so that a fresh process takes over"
                )
                log.error("%s; it is here:\n%s", failure, where_thread_is(thread))
                return

    def _application(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        for path, page in self._pages.items():
            app.router.add_get(path, page)
        return app

    async def _metrics(self, _request: web.Request) -> web.Response:
        # aiohttp refuses a charset inside content_type; the exposition format is UTF-8 anyway.
        return web.Response(
            body=generate_latest(self._registry), content_type=_METRICS_CONTENT_TYPE
        )

    async def _healthz(self, _request: web.Request) -> web.Response:
        # 503 while the loop waits for PostgreSQL or the broker: alive is not healthy.
        health = self._worker.health.snapshot()
        return web.json_response(health, status=200 if health["progressing"] else 503)
