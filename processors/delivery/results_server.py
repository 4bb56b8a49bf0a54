"""The delivery worker's results page: ``GET /results/{operation_id}`` on its web port, a
result delivered by reference fetched by its destination (decision 015). The checks are
:class:`processors.delivery.result_endpoint.ResultEndpoint`'s; this is the web side of them."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from psycopg_pool import ConnectionPool

from ledger.destinations import DestinationStore
from ledger.metrics import Metrics
from ledger.results import ResultStore
from ledger.settings import Settings
from processors.delivery.result_endpoint import ResultEndpoint
from processors.host import Page


class ResultsServer:
    """Answers fetches of results by reference, each counted by its outcome."""

    def __init__(self, pool: ConnectionPool[Any], settings: Settings, metrics: Metrics) -> None:
        self._endpoint = ResultEndpoint(pool, DestinationStore(pool, settings), ResultStore(pool))
        self._metrics = metrics

    @property
    def pages(self) -> dict[str, Page]:
        """The pages to serve beside the worker's own (``processors.host.Hosted``'s pages)."""
        return {"/results/{operation_id}": self.fetch}

    async def fetch(self, request: web.Request) -> web.Response:
        operation_id = request.match_info["operation_id"]
        headers = {name.lower(): value for name, value in request.headers.items()}
        answer = await asyncio.to_thread(
            self._endpoint.fetch, operation_id, dict(request.query), headers
        )
        self._metrics.result_fetches.labels(answer.outcome).inc()
        # As a header: aiohttp's content_type refuses parameters ("; charset=utf-8"), which a
        # stored result's label may carry (validated as a media type when it was stored).
        return web.Response(
            body=answer.body, status=answer.status, headers={"Content-Type": answer.content_type}
        )
