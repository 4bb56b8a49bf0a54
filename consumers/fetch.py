"""Fetching a result delivered by reference (decision 015): the receiver's signed ``GET`` of the
``result_url`` an event names, before the event is recorded.

The URL comes from a signed body, and is used only if it ends with the target the ledger's
endpoint serves for this very event (:func:`ledger.result_fetch.fetch_target`): a body cannot
point the receiver at another resource. The answer must be 200 and exactly ``result_size``
bytes (read no further) whose sha256 is ``result_ref``. Anything else refuses the delivery for
now (503, so the sender tries again later) or for good (422, the bytes are not the result).

A queue record is not signed, so its URL is no better than the broker's write ACLs. Whoever could
write one could name a host of theirs, receive the signed ``GET`` and replay it to the ledger
within its time tolerance. So a fetcher may be given the one results URL it trusts
(``base_url``): a reference anywhere else is refused without a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import aiohttp

from consumers.contract import Event, ProblemError, invalid_event, result_unavailable
from ledger.result_fetch import RESULTS_PATH, fetch_target, sign_fetch

log = logging.getLogger("opledger.consumer.fetch")

#: Time for one fetch, from the request to the last byte.
FETCH_TIMEOUT_S = 20.0
#: Fetches at once; more wait. Each holds up to a whole result (16 MiB) in memory.
MAX_CONCURRENT_FETCHES = 8


class ResultFetcher:
    """One aiohttp session for the receiver's fetches; :meth:`start` and :meth:`close` on the
    receiver's event loop."""

    def __init__(
        self,
        secrets: Sequence[str],
        *,
        timeout_s: float = FETCH_TIMEOUT_S,
        concurrency: int = MAX_CONCURRENT_FETCHES,
        clock: Callable[[], float] = time.time,
        base_url: str | None = None,
    ) -> None:
        if not secrets:
            raise ValueError("fetches are signed with the receiver's webhook secrets")
        self._secrets = tuple(secrets)
        #: None: any URL ending with the event's target (the URL came in a signed body)
        self._trusted = None if base_url is None else base_url.rstrip("/") + RESULTS_PATH
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._slots = asyncio.Semaphore(concurrency)

    async def start(self) -> None:
        # auto_decompress off: the size and hash are checked over the bytes as sent.
        self._session = aiohttp.ClientSession(timeout=self._timeout, auto_decompress=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, event: Event) -> Event:
        """``event`` with its result. Raises :class:`ProblemError`: 503 when the result
        could not be fetched now, 422 when the bytes fetched are not the result."""
        async with self._slots:
            return await self._fetch(event)

    async def _fetch(self, event: Event) -> Event:
        body = event.body
        url, size = body.result_url, body.result_size
        assert url is not None and size is not None  # parse_event's by-reference shape
        target = fetch_target(body.tenant_id, body.destination, body.operation_id)
        if not url.endswith(target):
            raise invalid_event("result_url does not name this event's result; not fetched")
        if self._trusted is not None and not url.startswith(self._trusted):
            raise invalid_event(
                f"result_url is not under this consumer's results URL {self._trusted}; not fetched"
            )
        now = datetime.fromtimestamp(self._clock(), UTC)
        headers = sign_fetch(
            self._secrets, body.tenant_id, body.destination, body.operation_id, now
        )
        if self._session is None:
            raise result_unavailable("the receiver is not started")
        try:
            async with self._session.get(url, headers=headers, allow_redirects=False) as answer:
                if answer.status != 200:
                    raise result_unavailable(f"the result's URL answered {answer.status}")
                # One byte more than promised is enough to refuse; never read further.
                result = b""
                while len(result) <= size:
                    more = await answer.content.read(size + 1 - len(result))
                    if not more:
                        break
                    result += more
        except ProblemError:
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("fetching %s's result failed: %s", body.operation_id, type(exc).__name__)
            raise result_unavailable(
                f"the result could not be fetched: {type(exc).__name__}"
            ) from None
        return event.with_result(result)
