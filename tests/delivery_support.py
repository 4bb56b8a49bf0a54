"""A webhook receiver for delivery tests: a real HTTP server on 127.0.0.1 that answers with a
script (statuses, Retry-After, or no answer at all), checks each request's Standard Webhooks
signature, and keeps every request it received, so a test counts what the outside saw."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from standardwebhooks import Webhook, WebhookVerificationError

from tests.support import free_port


@dataclass(frozen=True)
class Received:
    at: float
    headers: dict[str, str]
    body: bytes
    signature_ok: bool


@dataclass(frozen=True)
class Answer:
    status: int = 202
    retry_after: str | None = None
    #: seconds to wait before answering (longer than the sender's timeout: no answer)
    delay: float = 0.0


class ScriptedReceiver:
    """``POST /events`` answered by ``script`` in order, then by ``then`` for ever."""

    def __init__(self, secret: str, script: Iterable[Answer] = (), then: Answer = Answer()):
        self.secret = secret
        self.script: deque[Answer] = deque(script)
        self.then = then
        self.received: list[Received] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/events"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "receiver did not start"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/events", self._events)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()

    async def _events(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = dict(request.headers)
        try:
            Webhook(self.secret).verify(body, headers)
            ok = True
        except WebhookVerificationError:
            ok = False
        self.received.append(Received(time.monotonic(), headers, body, ok))
        answer = self.script.popleft() if self.script else self.then
        if answer.delay:
            await asyncio.sleep(answer.delay)
        extra: dict[str, Any] = {}
        if answer.retry_after is not None:
            extra["Retry-After"] = answer.retry_after
        return web.json_response({"ok": answer.status < 300}, status=answer.status, headers=extra)

    def close(self) -> None:
        async def stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
