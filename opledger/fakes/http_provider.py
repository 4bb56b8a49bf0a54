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
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import aiohttp

from ledger.domain.ids import canonical_json
from ledger.tools import CallOutcome, ContactLost, LookupResult, LookupStatus, ProviderTerms
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
        origin = f"http://{parts.netloc}"
        self.call_url = origin + self.call_path
        self.lookup_url = origin + self.lookup_path

    @staticmethod
    def query(idempotency_key: str, provider_ref: str | None) -> dict[str, str]:
        return {"key": idempotency_key} | ({"provider_ref": provider_ref} if provider_ref else {})


class HttpToolProvider:
    """:class:`ledger.tools.Provider` over HTTP, with the standard library; a new connection per
    call, so a response lost on one connection cannot confuse the next call."""

    def __init__(self, base_url: str, tool_name: str, terms: ProviderTerms) -> None:
        self.tool_name = tool_name
        self.terms = terms
        self._endpoint = _Endpoint(base_url, tool_name)

    def _exchange(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> tuple[int, bytes]:
        timeout = self.terms.call_timeout.total_seconds()
        deadline = time.monotonic() + timeout
        conn = http.client.HTTPConnection(self._endpoint.host, self._endpoint.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=dict(headers))
            # http.client's timeout bounds each blocking step; the wait for the answer gets only
            # what is left, so connect + send + wait stay within call_timeout.
            if conn.sock is not None:
                conn.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def call(self, request: Any, idempotency_key: str) -> CallOutcome:
        """See :class:`ledger.tools.Provider`; the table in this module's docstring."""
        body = canonical_json(request)  # a ValueError here is ours, and nothing has left yet
        headers = {IDEMPOTENCY_HEADER: idempotency_key, "Content-Type": "application/json"}
        try:
            status, payload = self._exchange("POST", self._endpoint.call_path, body, headers)
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
            status, payload = self._exchange("GET", path, None, {})
        except Exception as exc:  # "I cannot tell" is an answer, whatever went wrong
            return LookupResult(
                LookupStatus.UNAVAILABLE, reason=f"{self.tool_name}: {type(exc).__name__}: {exc}"
            )
        return lookup_result(self.tool_name, status, payload)


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
    """Client of the fake provider's ``/_control/`` API (tests, chaos runs, the demo)."""

    def __init__(self, base_url: str, timeout: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _send(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(
            f"{self.base_url}/_control/{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
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
    ) -> dict[str, Any]:
        """Change the given settings of ``tool``; returns its whole configuration."""
        given = {
            "mode": None if mode is None else str(mode),
            "fail_rate": fail_rate,
            "lose_response_rate": lose_response_rate,
            "lookup_unavailable_rate": lookup_unavailable_rate,
            "latency_ms": latency_ms,
            "seed": seed,
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
