"""Durable, content-addressed result payloads in PostgreSQL.

Events carry only ``result_ref``; the payload lives here. ``put`` commits before it returns, so a
worker that records ``SUCCEEDED`` (and then acknowledges its job) never points at a result that a
crash could still lose - the seed's "Are result records durable before a worker acknowledges the
job?".
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Self

import psycopg
from psycopg import pq

from ledger import migrate
from ledger.domain.ids import SHA256_REF_RE, content_ref
from producers.errors import ResultStoreError

#: Largest payload accepted. Results are read whole by the delivery worker and sent in one
#: request; anything bigger belongs in an object store with only its address stored here.
MAX_RESULT_BYTES = 16 * 1024 * 1024

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
COMPONENT = "producers"

# type/subtype with optional parameters (RFC 9110 token characters), kept deliberately strict:
# the value is echoed in HTTP headers by the delivery worker.
_CONTENT_TYPE = re.compile(
    r"^[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*"
    r"(\s*;\s*[A-Za-z0-9!#$&^_.+-]+=(\"[^\"\r\n]*\"|[A-Za-z0-9!#$&^_.+-]+))*$"
)
# Same shape as the events' Identifier so a stored result's tenant is one an event can carry.
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")


def _check_tenant(tenant_id: str) -> None:
    if not isinstance(tenant_id, str) or not _TENANT.match(tenant_id):
        raise ResultStoreError(f"tenant_id is not a valid identifier: {tenant_id!r}")


class ResultStore:
    """Tenant-scoped result payloads, keyed by ``(tenant_id, sha256 of the bytes)``."""

    def __init__(self, conn: psycopg.Connection[Any], *, owns_connection: bool = False) -> None:
        self._conn = conn
        self._owns = owns_connection

    @classmethod
    def connect(cls, dsn: str) -> Self:
        """A store over its own autocommit connection to ``dsn`` (closed by :meth:`close`)."""
        return cls(psycopg.connect(dsn, autocommit=True), owns_connection=True)

    def migrate(self) -> list[int]:
        """Create or upgrade the ``results`` table; returns the migration versions applied now."""
        return migrate.apply(self._conn, COMPONENT, MIGRATIONS)

    def put(
        self, tenant_id: str, payload: bytes, content_type: str = "application/octet-stream"
    ) -> str:
        """Store ``payload`` for ``tenant_id``; returns its ``result_ref``, committed and durable.

        Storing the same bytes again is a no-op returning the same ref (retried workers).
        """
        _check_tenant(tenant_id)
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise ResultStoreError(f"payload must be bytes, got {type(payload).__name__}")
        payload = bytes(payload)
        if len(payload) > MAX_RESULT_BYTES:
            raise ResultStoreError(
                f"result is {len(payload)} bytes; the limit is {MAX_RESULT_BYTES} "
                "(store large results elsewhere and record their address)"
            )
        if len(content_type) > 255 or not _CONTENT_TYPE.match(content_type):
            raise ResultStoreError(f"not a valid content type: {content_type!r}")
        self._require_no_open_transaction()
        ref = content_ref(payload)
        try:
            # An explicit transaction on a connection with no transaction open is a real COMMIT
            # (not a savepoint): when this returns, PostgreSQL has the row on disk.
            with self._conn.transaction():
                self._conn.execute(
                    """INSERT INTO results
                           (result_ref, tenant_id, content_type, payload, size_bytes)
                       VALUES (%s, %s, %s, %s, %s)
                       ON CONFLICT (tenant_id, result_ref) DO NOTHING""",
                    (ref, tenant_id, content_type, payload, len(payload)),
                )
        except psycopg.Error as exc:
            raise ResultStoreError(f"could not store result {ref}: {exc}") from exc
        return ref

    def get(self, tenant_id: str, result_ref: str) -> bytes | None:
        """The payload stored under ``result_ref`` *for this tenant*; None if there is none."""
        _check_tenant(tenant_id)
        if not SHA256_REF_RE.match(result_ref):
            raise ResultStoreError(f"not a result ref: {result_ref!r}")
        row = self._conn.execute(
            "SELECT payload FROM results WHERE tenant_id = %s AND result_ref = %s",
            (tenant_id, result_ref),
        ).fetchone()
        if row is None:
            return None
        return bytes(row[0])

    def close(self) -> None:
        """Close the connection if this store opened it."""
        if self._owns:
            self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_no_open_transaction(self) -> None:
        # Inside a caller's transaction our block would only be a savepoint, and "durable before
        # return" would silently become "durable when the caller commits" - refuse instead.
        if self._conn.info.transaction_status != pq.TransactionStatus.IDLE:
            raise ResultStoreError(
                "the result store's connection has a transaction open; put() must commit on its "
                "own to be durable before the transition is recorded"
            )
