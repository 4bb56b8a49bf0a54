"""The fake tool provider as its own process (``opledger fake-provider run``).

Kill tests SIGKILL the service that calls a tool; the provider must outlive it and keep counting
what the outside world saw. The behaviour and the counts are :class:`ProviderState`'s; this module
adds HTTP, latency and held responses.

Tools::

    POST /tools/{tool}/call            Idempotency-Key header, JSON body (the request)
         200 {"provider_ref", "result"} | 422 {"error", "provider_ref"} (confirmed, no effect)
         400 bad key/body · 409 key in flight or reused for another request · 413 body too big
    GET  /tools/{tool}/lookup?key=K[&provider_ref=R]
         200 {"status": "succeeded"|"failed"|"not_found", "result"?, "error"?, "provider_ref"?}
         503 {"error"} when unavailable

Control (JSON bodies)::

    POST /_control/configure  {"tool", "mode"?, "fail_rate"?, "lose_response_rate"?,
                               "lookup_unavailable_rate"?, "latency_ms"?, "seed"?}
    POST /_control/script     {"tool", "key", "actions": ["fail", {"action": "hang", "seconds": 2}]}
    POST /_control/forget     {"tool"?, "keys"?}      key retention expired
    POST /_control/release    {"tool"?, "key"?}       end held responses now
    GET  /_control/stats      calls, side effects, duplicate keys per tool and key; totals
    POST /_control/reset      {"keep_config"?}: forget keys, scripts and counts (and tools unless
                              keep_config), and release every hold
    GET  /_control/health

Every control route but ``health`` answers 401 unless the request carries ``Authorization:
Bearer <token>`` with the token of ``opledger.fakes.credentials``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ledger.settings import Settings
from opledger.fakes.credentials import authorized
from opledger.fakes.model import Action, FakeProviderError, Outcome, check_key, check_tool
from opledger.fakes.state import CallKind, ProviderState, Unavailable

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024
#: A hold "until released" still ends, so a forgotten test cannot pin a handler for good.
MAX_HOLD_S = 600.0
IDEMPOTENCY_HEADER = "Idempotency-Key"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Holds:
    """Responses held by ``hang``/``hang_before_effect``, until their time is up or released."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, str], set[asyncio.Event]] = {}

    async def wait(self, tool: str, key: str, seconds: float | None) -> None:
        event = asyncio.Event()
        self._waiting.setdefault((tool, key), set()).add(event)
        try:
            await asyncio.wait_for(event.wait(), MAX_HOLD_S if seconds is None else seconds)
        except TimeoutError:
            pass
        finally:
            waiting = self._waiting.get((tool, key), set())
            waiting.discard(event)
            if not waiting:
                self._waiting.pop((tool, key), None)

    def release(self, tool: str | None = None, key: str | None = None) -> int:
        released = 0
        for (held_tool, held_key), events in list(self._waiting.items()):
            if tool in (None, held_tool) and key in (None, held_key):
                for event in events:
                    event.set()
                    released += 1
        return released


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _json_body(request: web.Request) -> Any:
    body = await request.read()  # beyond client_max_size aiohttp answers 413 itself
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except ValueError:
        raise FakeProviderError("the body must be JSON") from None


async def _control_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise FakeProviderError("the body must be a JSON object")
    return body


@web.middleware
async def _bad_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except FakeProviderError as exc:
        return _error(400, str(exc))


def _answer(outcome: Outcome) -> web.Response:
    if outcome.succeeded:
        return web.json_response({"provider_ref": outcome.provider_ref, "result": outcome.result})
    return web.json_response(
        {"error": outcome.error, "provider_ref": outcome.provider_ref}, status=422
    )


_OPEN_CONTROL = frozenset({"/_control/health"})


class FakeProviderServer:
    """The routes over one :class:`ProviderState`; control routes need ``control_token``."""

    def __init__(self, control_token: str, state: ProviderState | None = None) -> None:
        self.state = state or ProviderState()
        self.holds = Holds()
        self._token = control_token

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        guarded = request.path.startswith("/_control/") and request.path not in _OPEN_CONTROL
        if guarded and not authorized(request.headers.get("Authorization"), self._token):
            response = _error(401, "the control routes need the control token")
            response.headers["WWW-Authenticate"] = 'Bearer realm="fake-provider control"'
            return response
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=MAX_BODY_BYTES, middlewares=[self._guard, _bad_requests]
        )
        app.router.add_post("/tools/{tool}/call", self.call)
        app.router.add_get("/tools/{tool}/lookup", self.lookup)
        app.router.add_post("/_control/configure", self.configure)
        app.router.add_post("/_control/script", self.script)
        app.router.add_post("/_control/forget", self.forget)
        app.router.add_post("/_control/release", self.release)
        app.router.add_get("/_control/stats", self.stats)
        app.router.add_post("/_control/reset", self.reset)
        app.router.add_get("/_control/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.on_shutdown.append(self._release_all)
        return app

    async def _release_all(self, _app: web.Application) -> None:
        self.holds.release()

    async def call(self, request: web.Request) -> web.StreamResponse:
        tool = check_tool(request.match_info["tool"])
        key = request.headers.get(IDEMPOTENCY_HEADER)
        if not key:
            return _error(400, f"missing {IDEMPOTENCY_HEADER} header")
        check_key(key)
        payload = await _json_body(request)
        plan = self.state.begin_call(tool, key, payload)
        if plan.latency_s:
            await asyncio.sleep(plan.latency_s)
        if plan.kind is CallKind.CONFLICT:
            return _error(409, f"idempotency key {key} was used for another request")
        if plan.kind is CallKind.IN_FLIGHT:
            return _error(409, f"a call with idempotency key {key} is still in progress")
        if plan.kind is CallKind.REPLAY:
            assert plan.outcome is not None
            return _answer(plan.outcome)
        if plan.step.action is Action.HANG_BEFORE_EFFECT:
            # aiohttp does not cancel a handler whose client went away: the effect happens
            # after the hold even when the caller gave up, as a slow real provider's would.
            await self.holds.wait(tool, key, plan.step.seconds)
        outcome = self.state.complete(plan)
        if plan.step.action is Action.LOSE_RESPONSE:
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=200)  # written to a closed transport: nobody sees it
        if plan.step.action is Action.HANG:
            await self.holds.wait(tool, key, plan.step.seconds)
        return _answer(outcome)

    async def lookup(self, request: web.Request) -> web.Response:
        tool = check_tool(request.match_info["tool"])
        key = request.query.get("key")
        if not key:
            return _error(400, "missing key query parameter")
        latency = self.state.lookup_latency(tool)
        if latency:
            await asyncio.sleep(latency)
        try:
            outcome = self.state.lookup(tool, key, request.query.get("provider_ref"))
        except Unavailable as exc:
            return _error(503, str(exc))
        if outcome is None:
            return web.json_response({"status": "not_found"})
        if outcome.succeeded:
            body = {"status": "succeeded", "result": outcome.result}
        else:
            body = {"status": "failed", "error": outcome.error}
        return web.json_response(body | {"provider_ref": outcome.provider_ref})

    async def configure(self, request: web.Request) -> web.Response:
        body = await _control_body(request)
        tool = body.pop("tool", None)
        if not isinstance(tool, str):
            raise FakeProviderError("configure needs a tool")
        config = self.state.configure(tool, **body)
        return web.json_response({"tool": tool, "config": config.to_json()})

    async def script(self, request: web.Request) -> web.Response:
        body = await _control_body(request)
        tool, key, actions = body.get("tool"), body.get("key"), body.get("actions")
        if not isinstance(tool, str) or not isinstance(key, str) or not isinstance(actions, list):
            raise FakeProviderError("script needs a tool, a key and a list of actions")
        self.state.script(tool, key, actions)
        return web.json_response({"queued": len(actions)})

    async def forget(self, request: web.Request) -> web.Response:
        body = await _control_body(request)
        keys = body.get("keys")
        if keys is not None and not (
            isinstance(keys, list) and all(isinstance(k, str) for k in keys)
        ):
            raise FakeProviderError("keys must be a list of strings")
        tool = body.get("tool")
        if tool is not None and not isinstance(tool, str):
            raise FakeProviderError("tool must be a string")
        return web.json_response({"forgotten": self.state.forget(tool, keys)})

    async def release(self, request: web.Request) -> web.Response:
        body = await _control_body(request)
        tool, key = body.get("tool"), body.get("key")
        if not all(v is None or isinstance(v, str) for v in (tool, key)):
            raise FakeProviderError("tool and key must be strings")
        return web.json_response({"released": self.holds.release(tool, key)})

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response(self.state.stats().to_json())

    async def reset(self, request: web.Request) -> web.Response:
        keep_config = (await _control_body(request)).get("keep_config", False)
        if not isinstance(keep_config, bool):
            raise FakeProviderError("keep_config must be true or false")
        released = self.holds.release()
        self.state.reset(keep_config=keep_config)
        return web.json_response({"released": released})

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def metrics(self, _request: web.Request) -> web.Response:
        """What the outside world saw, for Prometheus: per tool, the calls received, the side
        effects performed, and the calls that repeated an idempotency key already seen."""
        stats = self.state.stats()
        lines = []
        for name, help_text, value in (
            ("opledger_provider_calls_received_total", "Calls the provider received.", "calls"),
            (
                "opledger_provider_side_effects_total",
                "Side effects the provider performed.",
                "side_effects",
            ),
            (
                "opledger_provider_duplicate_keys_total",
                "Calls that repeated an idempotency key the provider had seen before.",
                "duplicate_keys",
            ),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            lines += [
                f'{name}{{tool="{tool}"}} {getattr(t, value)}' for tool, t in stats.tools.items()
            ]
        return web.Response(
            text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8"
        )


async def serve(
    host: str, port: int, control_token: str, stop: asyncio.Event | None = None
) -> None:
    """Serve until SIGTERM/SIGINT (or ``stop``); prints the address once listening."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop.set)
    server = FakeProviderServer(control_token)
    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0][1]  # the real port when asked for port 0
        print(f"fake provider listening on http://{host}:{bound}", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


def run_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger fake-provider run``."""
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    port = args.port
    if port is None:
        # The URL every adapter of this installation uses (OPLEDGER_FAKE_PROVIDER_URL).
        port = urllib.parse.urlsplit(settings.fake_provider_url).port or 80
    from opledger.fakes.credentials import ensure_control_token  # noqa: PLC0415

    asyncio.run(serve(args.host, port, ensure_control_token(settings)))
    return 0
