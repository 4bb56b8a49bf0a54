"""The workers' faust application: worker lifecycle, signal handling and a web server that
serves ``/metrics`` and ``/healthz``, hosting a worker's loop (the projector's batch reader, the
recovery worker) as a service.

The loop blocks (librdkafka polls, psycopg commits, provider calls), so it runs on its own thread;
faust's event loop stays free for the web server and the worker's housekeeping. If the loop
fails, the worker crashes rather than idling with a dead loop: a process that is alive but not
working is the failure the seed warns a heartbeat cannot see.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import traceback
from typing import Any, Protocol

import faust
import mode
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ledger.heap import freeze_startup_heap
from ledger.secrets import redact_handlers
from ledger.settings import Settings
from processors.health import Health, LoopWatchdog, Verdict

log = logging.getLogger("opledger.worker")

_METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST.partition("; charset")[0]


class LoopStuckError(RuntimeError):
    """The loop has not turned for longer than OPLEDGER_WORKER_STUCK_EXIT_S: the worker exits so
    that its supervisor starts a fresh process."""


def where_thread_is(thread: threading.Thread) -> str:
    """The stack ``thread`` is running now, innermost call last."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return "  (the thread has ended)"
    return "".join(traceback.format_stack(frame)).rstrip()


class Loop(Protocol):
    """What a worker's loop offers its host."""

    @property
    def health(self) -> Health: ...

    def run(self) -> None: ...

    def stop(self) -> None: ...


def create_app(
    settings: Settings,
    projector: Loop,
    registry: CollectorRegistry,
    *,
    name: str = "projector",
    web_port: int | None = None,
    instance_id: str = "0",
) -> Any:
    """A faust App hosting ``projector`` (any :class:`Loop`) as worker ``name``.

    Run it with ``faust.Worker(app).execute_from_commandline()``. ``instance_id`` must differ
    between processes of the same worker that run at once (the recovery worker scales out).
    """
    app_id = f"{settings.topic_prefix}-{name}-host"
    datadir = settings.home / "faust" / app_id
    # faust creates only the last level of its data directory.
    datadir.mkdir(parents=True, exist_ok=True)
    app = faust.App(
        # Not the worker's own consumer group name (the recovery group, the projector's
        # commits): faust joins this group with its own protocol, and two protocols in one
        # group are refused by the broker.
        app_id,
        broker=f"kafka://{settings.bootstrap_servers}",
        store="memory://",
        # faust keeps a data directory even for memory tables; by default it lands in the
        # current directory, so it goes with the rest of the local state.
        datadir=str(datadir),
        web_enabled=True,
        web_bind=settings.projector_web_bind,
        web_port=settings.projector_web_port if web_port is None else web_port,
        web_in_thread=False,
        # faust's own consumer group (its leader topic) would make a restarted worker wait out
        # the killed member's session before services start; a static member id replaces the
        # dead member at once. Workers keep their own positions, not in this group.
        consumer_group_instance_id=f"{settings.topic_prefix}-{name}-{instance_id}",
        broker_session_timeout=10.0,
    )

    watchdog = LoopWatchdog(
        projector.health, settings.worker_stuck_after_s, settings.worker_stuck_exit_s
    )
    #: the loop's thread, once started
    loop_threads: list[threading.Thread] = []

    class ProjectorService(mode.Service):
        @mode.Service.timer(max(0.5, min(5.0, settings.worker_stuck_after_s / 4)))
        async def _watch(self) -> None:
            """A loop blocked in a call that never returns logs nothing and fails nothing: say
            where it is, and past the exit bound crash so the supervisor starts a fresh one."""
            if not loop_threads or not loop_threads[0].is_alive():
                return
            loop_thread = loop_threads[0]
            verdict = watchdog.check()
            if verdict is Verdict.NEWLY_STUCK:
                log.error(
                    "%s loop has not turned for %.0fs (OPLEDGER_WORKER_STUCK_AFTER_S); it is "
                    "here:\n%s",
                    name,
                    settings.worker_stuck_after_s,
                    where_thread_is(loop_thread),
                )
            elif verdict is Verdict.EXIT:
                failure = LoopStuckError(
                    f"{name} loop has not turned for {settings.worker_stuck_exit_s}s "
                    "(OPLEDGER_WORKER_STUCK_EXIT_S); exiting so that a fresh process takes over"
                )
                log.error("%s; it is here:\n%s", failure, where_thread_is(loop_thread))
                await self.crash(failure)
                raise failure

        @mode.Service.task
        async def _project(self) -> None:
            loop = asyncio.get_running_loop()
            finished: asyncio.Future[BaseException | None] = loop.create_future()

            def run() -> None:
                outcome: BaseException | None = None
                # The watchdog counts from here: faust's own start-up is not the loop's.
                projector.health.beat()
                try:
                    projector.run()
                except BaseException as exc:  # reported to the event loop, which crashes
                    outcome = exc
                loop.call_soon_threadsafe(finished.set_result, outcome)

            # faust's mode replaced the root handlers as it started, and the scrubbing filter
            # the command put on them with them: put it back before the loop logs anything
            # (a provider's words, a destination's answer).
            redact_handlers()
            frozen = freeze_startup_heap()  # start-up is over: faust, the clients, the schemas
            log.info("%s: start-up heap frozen (%d objects)", name, frozen)
            # A daemon thread, not the default executor: a SIGTERM that arrives while faust is
            # still starting may never reach on_stop, and a non-daemon thread would then keep
            # the process alive. Killing the loop mid-batch is safe: offsets commit with rows.
            thread = threading.Thread(target=run, name=f"opledger-{name}", daemon=True)
            loop_threads.append(thread)
            thread.start()
            try:
                failure = await finished
            finally:
                projector.stop()
            if failure is not None:
                log.error(
                    "%s loop failed; crashing the worker so it is restarted",
                    name,
                    exc_info=failure,
                )
                await self.crash(failure)
                raise failure

        async def on_stop(self) -> None:
            projector.stop()

    app.service(ProjectorService)

    @app.page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        # aiohttp refuses a charset inside content_type; the exposition format is UTF-8 anyway.
        return web.bytes(generate_latest(registry), content_type=_METRICS_CONTENT_TYPE)

    @app.page("/healthz")
    async def healthz(web: Any, request: Any) -> Any:
        # 503 while the loop waits for PostgreSQL or the broker: alive is not healthy.
        health = projector.health.snapshot()
        return web.json(health, status=200 if health["progressing"] else 503)

    return app
