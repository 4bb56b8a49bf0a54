"""``ledger.tools.Provider`` and ``AsyncProvider`` over HTTP, and a client for the fake provider's
control API.

The protocol is the fake provider server's (see :mod:`opledger.fakes.provider_server`): the
idempotency key travels as the ``Idempotency-Key`` header. What a caller may conclude from each
answer:

=============================================  ==============================================
answer to a call                               outcome
=============================================  ==============================================
200 with a readable body                       succeeded (result, provider_ref)
422, or any other 4xx but 408/409/425/429      confirmed failure: nothing happened
timeout, reset, refused, unreadable body, 5xx, :class:`ContactLost`: it may have happened;
408/409/425/429, anything else                 the caller records UNKNOWN and reconciles
=============================================  ==============================================

A lookup never raises: anything but a readable 200 is ``UNAVAILABLE``.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import aiohttp

from ledger.domain.ids import canonical_json
from ledger.settings import Settings
from ledger.tools import CallOutcome, ContactLost, LookupResult, LookupStatus, ProviderTerms
from opledger.fakes.http_wire import Wires, readable
from opledger.fakes.model import FakeProviderError, Mode, Stats, Step

IDEMPOTENCY_HEADER = "Idempotency-Key"
#: 4xx answers that do not say the call did not happen: a timeout, the key in use by a call
#: still running, too early, rate limited. Only reconciliation can tell.
UNKNOWN_4XX = frozenset({408, 409, 425, 429})
_LOOKUP_STATUS = {
    "succeeded": LookupStatus.FOUND_SUCCEEDED,
    "failed": LookupStatus.FOUND_FAILED,
    "not_found": LookupStatus.NOT_FOUND,
}


def _json_object(payload: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(payload)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _optional_str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def call_outcome(tool_name: str, status: int, payload: bytes) -> CallOutcome:
    """What an answer to a call means (see the module's table); raises :class:`ContactLost`."""
    body = _json_object(payload)
    if status == 200:
        if body is None or "result" not in body:
            raise ContactLost(f"{tool_name}: unreadable response to a call (HTTP 200)")
        return CallOutcome(
            True,
            result=canonical_json(body["result"]),
            provider_ref=_optional_str(body.get("provider_ref")),
        )
    if 400 <= status < 500 and status not in UNKNOWN_4XX:
        error = _optional_str((body or {}).get("error")) or "no reason given"
        return CallOutcome(
            False,
            error=f"{tool_name}: HTTP {status}: {error}",
            provider_ref=_optional_str((body or {}).get("provider_ref")),
        )
    raise ContactLost(f"{tool_name}: HTTP {status} to a call: outcome unknown")


def lookup_result(tool_name: str, status: int, payload: bytes) -> LookupResult:
    """What an answer to a lookup means; anything unreadable is ``UNAVAILABLE``."""
    body = _json_object(payload) or {}
    found = _LOOKUP_STATUS.get(str(body.get("status"))) if status == 200 else None
    if found is None:
        reason = _optional_str(body.get("error")) or "no readable answer"
        return LookupResult(
            LookupStatus.UNAVAILABLE, reason=f"{tool_name}: HTTP {status}: {reason}"
        )
    if found is LookupStatus.FOUND_SUCCEEDED and "result" not in body:
        return LookupResult(LookupStatus.UNAVAILABLE, reason=f"{tool_name}: success without result")
    return LookupResult(
        found,
        result=canonical_json(body["result"]) if found is LookupStatus.FOUND_SUCCEEDED else None,
        reason=_optional_str(body.get("error")),
        provider_ref=_optional_str(body.get("provider_ref")),
    )


#: What a pooled connection the server had closed looks like once a request is sent on it.
_CLOSED_BY_SERVER = (
    http.client.RemoteDisconnected,
    ConnectionResetError,
    BrokenPipeError,
    ConnectionAbortedError,
)


class _Endpoint:
    """Where one tool lives: host, port and the paths of its call and lookup."""

    def __init__(self, base_url: str, tool_name: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected an http:// base URL, got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        tool_path = f"{parts.path.rstrip('/')}/tools/{quote(tool_name, safe='')}"
        self.call_path = f"{tool_path}/call"
        self.lookup_path = f"{tool_path}/lookup"
        #: the Host header: host and port, without any user information
        self.netloc = parts.netloc.rpartition("@")[2]
        origin = f"http://{parts.netloc}"
        self.call_url = origin + self.call_path
        self.lookup_url = origin + self.lookup_path

    @staticmethod
    def query(idempotency_key: str, provider_ref: str | None) -> dict[str, str]:
        return {"key": idempotency_key} | ({"provider_ref": provider_ref} if provider_ref else {})


class HttpToolProvider:
    """:class:`ledger.tools.Provider` over HTTP, with the standard library, on kept-alive
    connections (thread-safe; each exchange has a connection to itself).

    A connection goes back to the pool only after an exchange that read a whole answer: one that
    failed or timed out is closed, so a response that comes late on it can never be read as the
    next exchange's answer. A pooled connection idle longer than ``max_idle_s`` is closed
    instead of reused (a server that drops idle connections sooner costs a lookup one resend,
    and a call nothing, as follows).
    A pooled connection is reused only while it is quiet: one the server closed, or that holds
    bytes nobody asked for, is dropped. A call is sent once (should the server close the
    connection at the very moment it is reused, the call ends as :class:`ContactLost`, never
    as a second send); a lookup that meets such a connection is asked again on a new one.

    :meth:`lookup_many` asks many keys at once from one thread (:mod:`opledger.fakes.http_wire`),
    at most ``max_in_flight`` at a time, on connections of its own, kept alive the same way.
    """

    def __init__(
        self,
        base_url: str,
        tool_name: str,
        terms: ProviderTerms,
        *,
        max_idle: int = 64,
        max_idle_s: float = 2.0,
        max_in_flight: int = 32,
    ) -> None:
        self.tool_name = tool_name
        self.terms = terms
        self._endpoint = _Endpoint(base_url, tool_name)
        self._wires = Wires(
            self._endpoint.host, self._endpoint.port, max_idle=max_idle, max_idle_s=max_idle_s
        )
        self._max_in_flight = max_in_flight
        self._max_idle = max_idle
        self._max_idle_s = max_idle_s
        self._lock = threading.Lock()
        #: (connection, when it was put back): the last one put back is reused first
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._opened = 0

    def close(self) -> None:
        """Close the idle connections (those in use close when their exchange ends)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()
        self._wires.close()

    @property
    def connections_opened(self) -> int:
        """Connections opened so far, by single exchanges and by :meth:`lookup_many`."""
        return self._opened + self._wires.connections_opened

    def _pooled(self) -> http.client.HTTPConnection | None:
        """An idle connection young enough to reuse and still quiet (not closed by the server,
        no bytes nobody asked for), else None; the others met on the way are closed."""
        while True:
            with self._lock:
                if not self._idle:
                    return None
                conn, idle_since = self._idle.pop()
            if (
                time.monotonic() - idle_since <= self._max_idle_s
                and conn.sock is not None
                and not readable(conn.sock)
            ):
                return conn
            conn.close()

    def _put_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    def _open(self, timeout: float) -> http.client.HTTPConnection:
        with self._lock:
            self._opened += 1
        return http.client.HTTPConnection(self._endpoint.host, self._endpoint.port, timeout=timeout)

    def _exchange(
        self,
        method: str,
        path: str,
        body: bytes | None,
        headers: Mapping[str, str],
        *,
        resend_on_closed: bool,
    ) -> tuple[int, bytes]:
        timeout = self.terms.call_timeout.total_seconds()
        deadline = time.monotonic() + timeout
        while True:
            pooled = self._pooled()
            conn = pooled or self._open(timeout)
            try:
                if pooled is not None and pooled.sock is not None:  # checked by _pooled
                    # The socket keeps the wait its last exchange was given, at most what is
                    # left now; it is set again (a syscall) only when far below it.
                    left = deadline - time.monotonic()
                    if (pooled.sock.gettimeout() or 0.0) < left / 2:
                        pooled.sock.settimeout(left)
                conn.request(method, path, body=body, headers=dict(headers))
                # http.client's timeout bounds each blocking step; the wait for the answer gets
                # only what is left, so connect + send + wait stay within call_timeout.
                if conn.sock is not None:
                    conn.sock.settimeout(max(deadline - time.monotonic(), 0.001))
                response = conn.getresponse()
                payload = response.read()
            except BaseException as exc:
                conn.close()
                if (
                    pooled is not None
                    and resend_on_closed
                    and isinstance(exc, _CLOSED_BY_SERVER)
                    and time.monotonic() < deadline
                ):
                    continue  # the server closed it while it sat in the pool
                raise
            if response.will_close:
                conn.close()
            else:
                self._put_back(conn)
            return response.status, payload

    def call(self, request: Any, idempotency_key: str) -> CallOutcome:
        """See :class:`ledger.tools.Provider`; the table in this module's docstring."""
        body = canonical_json(request)  # a ValueError here is ours, and nothing has left yet
        headers = {IDEMPOTENCY_HEADER: idempotency_key, "Content-Type": "application/json"}
        try:
            status, payload = self._exchange(
                "POST", self._endpoint.call_path, body, headers, resend_on_closed=False
            )
        except (OSError, http.client.HTTPException) as exc:
            # OSError covers timeouts, resets and refusals. A refused connect means nothing left,
            # so a confirmed failure would be true too; ContactLost is safe either way: the
            # reconciler's lookup answers NOT_FOUND and policy decides on a new attempt under
            # the same key, which costs one lookup and can never double an effect.
            raise ContactLost(f"{self.tool_name}: {type(exc).__name__}: {exc}") from exc
        return call_outcome(self.tool_name, status, payload)

    def lookup(self, idempotency_key: str, provider_ref: str | None) -> LookupResult:
        """See :class:`ledger.tools.Provider`; never raises."""
        path = f"{self._endpoint.lookup_path}?"
        path += urlencode(self._endpoint.query(idempotency_key, provider_ref))
        try:
            # A lookup changes nothing: asking again on a new connection is always safe.
            status, payload = self._exchange("GET", path, None, {}, resend_on_closed=True)
        except Exception as exc:  # "I cannot tell" is an answer, whatever went wrong
            return LookupResult(
                LookupStatus.UNAVAILABLE, reason=f"{self.tool_name}: {type(exc).__name__}: {exc}"
            )
        return lookup_result(self.tool_name, status, payload)

    def lookup_many(
        self, requests: Sequence[tuple[str, str | None]]
    ) -> Iterator[tuple[int, LookupResult]]:
        """:meth:`lookup` for each ``(idempotency_key, provider_ref)``, many at once; yields
        ``(index in requests, answer)`` as the answers come, one per request. Never raises
        for "I cannot tell": that is ``UNAVAILABLE``."""
        host = f"Host: {self._endpoint.netloc}\r\nAccept-Encoding: identity\r\n\r\n"
        wire_requests = [
            (
                f"GET {self._endpoint.lookup_path}?{urlencode(self._endpoint.query(key, ref))} "
                f"HTTP/1.1\r\n{host}"
            ).encode("ascii")
            for key, ref in requests
        ]
        unanswered = set(range(len(requests)))
        try:
            for reply in self._wires.get_many(
                wire_requests,
                timeout_s=self.terms.call_timeout.total_seconds(),
                in_flight=self._max_in_flight,
            ):
                unanswered.discard(reply.index)
                if reply.error is not None:
                    reason = f"{self.tool_name}: {reply.error}"
                    yield reply.index, LookupResult(LookupStatus.UNAVAILABLE, reason=reason)
                else:
                    yield reply.index, lookup_result(self.tool_name, reply.status, reply.body)
        except Exception as exc:  # "I cannot tell" is an answer, whatever went wrong
            reason = f"{self.tool_name}: {type(exc).__name__}: {exc}"
            for index in sorted(unanswered):
                yield index, LookupResult(LookupStatus.UNAVAILABLE, reason=reason)


class AsyncHttpToolProvider:
    """:class:`ledger.tools.AsyncProvider` over HTTP with aiohttp. Uses the given session, or
    one of its own (closed by :meth:`close` or ``async with``)."""

    def __init__(
        self,
        base_url: str,
        tool_name: str,
        terms: ProviderTerms,
        *,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.tool_name = tool_name
        self.terms = terms
        self._endpoint = _Endpoint(base_url, tool_name)
        self._session = session
        self._owns_session = session is None

    async def __aenter__(self) -> AsyncHttpToolProvider:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def _exchange(
        self,
        method: str,
        url: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
    ) -> tuple[int, bytes]:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=self.terms.call_timeout.total_seconds())
        async with self._session.request(
            method, url, data=body, headers=headers, params=params, timeout=timeout
        ) as response:
            return response.status, await response.read()

    async def call(self, request: Any, idempotency_key: str) -> CallOutcome:
        """See :class:`ledger.tools.AsyncProvider`; as :meth:`HttpToolProvider.call`."""
        body = canonical_json(request)
        headers = {IDEMPOTENCY_HEADER: idempotency_key, "Content-Type": "application/json"}
        try:
            status, payload = await self._exchange(
                "POST", self._endpoint.call_url, body=body, headers=headers
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            # Refused before connecting is ContactLost too: see HttpToolProvider.call.
            raise ContactLost(f"{self.tool_name}: {type(exc).__name__}: {exc}") from exc
        return call_outcome(self.tool_name, status, payload)

    async def lookup(self, idempotency_key: str, provider_ref: str | None) -> LookupResult:
        """See :class:`ledger.tools.AsyncProvider`; never raises."""
        try:
            status, payload = await self._exchange(
                "GET",
                self._endpoint.lookup_url,
                params=self._endpoint.query(idempotency_key, provider_ref),
            )
        except Exception as exc:  # "I cannot tell" is an answer, whatever went wrong
            return LookupResult(
                LookupStatus.UNAVAILABLE, reason=f"{self.tool_name}: {type(exc).__name__}: {exc}"
            )
        return lookup_result(self.tool_name, status, payload)


class FakeProviderControl:
    """Client of the fake provider's ``/_control/`` API (tests, chaos runs, the demo), with the
    control token (``opledger.fakes.credentials``)."""

    def __init__(self, base_url: str, token: str, timeout: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._authorization = f"Bearer {token}"

    @classmethod
    def of(cls, settings: Settings, base_url: str | None = None) -> FakeProviderControl:
        """The client of ``base_url`` (default: the installation's provider), with the token
        ``settings`` name (made here if the server has not started yet: it reads the same)."""
        from opledger.fakes.credentials import ensure_control_token  # noqa: PLC0415

        return cls(base_url or settings.fake_provider_url, ensure_control_token(settings))

    def _send(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(
            f"{self.base_url}/_control/{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json", "Authorization": self._authorization},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            error = (_json_object(exc.read()) or {}).get("error", exc.reason)
            raise FakeProviderError(f"fake provider: HTTP {exc.code}: {error}") from None

    def configure(
        self,
        tool: str,
        *,
        mode: Mode | str | None = None,
        fail_rate: float | None = None,
        lose_response_rate: float | None = None,
        lookup_unavailable_rate: float | None = None,
        latency_ms: float | None = None,
        seed: int | None = None,
        attachment_rate: float | None = None,
    ) -> dict[str, Any]:
        """Change the given settings of ``tool``; returns its whole configuration."""
        given = {
            "mode": None if mode is None else str(mode),
            "fail_rate": fail_rate,
            "lose_response_rate": lose_response_rate,
            "lookup_unavailable_rate": lookup_unavailable_rate,
            "latency_ms": latency_ms,
            "seed": seed,
            "attachment_rate": attachment_rate,
        }
        body = {"tool": tool} | {k: v for k, v in given.items() if v is not None}
        config: dict[str, Any] = self._send("POST", "configure", body)["config"]
        return config

    def script(
        self, tool: str, key: str, actions: Sequence[str | Step | Mapping[str, Any]]
    ) -> None:
        """Queue the next actions of ``key`` (see :class:`opledger.fakes.model.Action`)."""
        steps = [a.to_json() if isinstance(a, Step) else a for a in actions]
        self._send("POST", "script", {"tool": tool, "key": key, "actions": steps})

    def forget(self, tool: str | None = None, keys: Sequence[str] | None = None) -> int:
        body: dict[str, Any] = {"tool": tool} if tool else {}
        if keys is not None:
            body["keys"] = list(keys)
        return int(self._send("POST", "forget", body)["forgotten"])

    def release(self, tool: str | None = None, key: str | None = None) -> int:
        body = {k: v for k, v in {"tool": tool, "key": key}.items() if v is not None}
        return int(self._send("POST", "release", body)["released"])

    def stats(self) -> Stats:
        return Stats.from_json(self._send("GET", "stats"))

    def reset(self, *, keep_config: bool = False) -> None:
        """Forget keys, scripts and counts (and every tool's settings unless ``keep_config``)."""
        self._send("POST", "reset", {"keep_config": keep_config})

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Poll ``/_control/health`` until the server answers."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._send("GET", "health")
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
