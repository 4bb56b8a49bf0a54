"""``GET /results/{operation_id}?tenant=T&destination=D``: a result delivered by reference,
served by the delivery workers to the destination it was delivered to (decision 015).

Checked from the outside in; the first failed check answers (``application/problem+json``):
400 for malformed parameters; 401 unless the request is signed with the destination's secret
(:func:`ledger.result_fetch.fetch_signed`; an unknown destination gets the same 401, so the
answer tells nobody which destinations exist); 403 for a disabled destination; 404 unless the
tenant's operation has a delivery to that destination with a stored result. A destination
therefore reads only results delivered to it, and only its own tenant's. 503 while the
database does not answer. Nothing is logged of a result or a secret.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from psycopg_pool import ConnectionPool

from ledger.destinations import DestinationStore, new_secret
from ledger.domain.names import NameKind, is_name
from ledger.faults import fault_point
from ledger.pg import DatabaseUnavailableError, retrying
from ledger.result_fetch import fetch_signed
from ledger.results import ResultStore

_PROBLEM = "application/problem+json"


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    content_type: str
    #: the metrics label: a fixed word per kind of answer
    outcome: str


def _problem(status: int, outcome: str, detail: str) -> Answer:
    document = {
        "type": f"tag:opledger,2025:problem:{outcome}",
        "title": outcome.replace("-", " ").capitalize(),
        "status": status,
        "detail": detail,
    }
    return Answer(status, json.dumps(document).encode(), _PROBLEM, outcome)


class ResultEndpoint:
    """The checks and reads of one fetch; synchronous (the web handler runs it in a thread)."""

    def __init__(
        self, pool: ConnectionPool[Any], destinations: DestinationStore, results: ResultStore
    ) -> None:
        self._pool = pool
        self._destinations = destinations
        self._results = results
        #: secrets nobody holds, checked in place of those a destination does not have
        self._decoys = (new_secret(), new_secret())

    def fetch(
        self, operation_id: str, query: Mapping[str, str], headers: Mapping[str, str]
    ) -> Answer:
        tenant = query.get("tenant", "")
        destination = query.get("destination", "")
        if not is_name(NameKind.OPERATION_ID, operation_id):
            return _problem(400, "malformed-request", "the path does not name an operation id")
        if not is_name(NameKind.TENANT, tenant) or not is_name(NameKind.DESTINATION, destination):
            return _problem(400, "malformed-request", "tenant and destination are required")
        try:
            return self._fetch(operation_id, tenant, destination, headers)
        except DatabaseUnavailableError:
            return _problem(503, "unavailable", "the ledger's database does not answer; retry")

    def _fetch(
        self, operation_id: str, tenant: str, name: str, headers: Mapping[str, str]
    ) -> Answer:
        destination = self._destinations.get_many([(tenant, name)]).get((tenant, name))
        # Either secret during a rotation's overlap: a consumer switches when it is ready.
        secrets = () if destination is None else destination.signing_secrets(datetime.now(UTC))
        # Every refusal costs the same checks: as many as a destination in a rotation's overlap
        # makes, against decoys where it has fewer secrets or none. An unknown destination that
        # skipped them answered 401 in 1.070 ms against 1.160 ms for a known one (an outside
        # probe's medians), which told which destinations exist (decision 015 says it must not).
        keys = (*secrets, *self._decoys)[: max(len(self._decoys), len(secrets))]
        signed = [fetch_signed(key, headers, tenant, name, operation_id) for key in keys]
        if destination is None or not any(signed[: len(secrets)]):
            return _problem(
                401, "bad-signature", "not signed with the destination's secret in the last 5 min"
            )
        if not destination.enabled:
            return _problem(403, "destination-disabled", f"destination {name} is disabled")

        def delivered_ref(conn: Any) -> str | None:
            row = conn.execute(
                "SELECT result_ref FROM deliveries "
                "WHERE operation_id = %s AND destination = %s AND tenant_id = %s",
                (operation_id, name, tenant),
            ).fetchone()
            return None if row is None else row[0]

        result_ref = retrying(self._pool, "read a delivery", delivered_ref)
        stored = (
            None
            if result_ref is None
            else self._results.get_many([(tenant, result_ref)]).get((tenant, result_ref))
        )
        if stored is None:
            return _problem(404, "not-found", "no result delivered to this destination")
        fault_point("deliver.result_read_before_answer")
        return Answer(200, stored.payload, stored.content_type, "served")
