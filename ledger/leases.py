"""One owner per operation: leases with fencing tokens in PostgreSQL (decision 004).

A lease says which process may advance an operation until when, and carries a *token* that only
grows: every event the owner appends carries it, and the fold refuses (fences) an event whose
token is lower than one already recorded for the operation. A new owner takes an expired lease
with the next token and first appends :class:`~ledger.domain.events.OwnershipTaken`, so from
that point in the log on, nothing the previous owner still writes is applied.

Time: expiry is decided by the database's clock (``now()``), the only clock every process shares.
Locally a holder stops acting at its *deadline*: the monotonic time it asked for the lease plus
the TTL minus a safety margin, which is always before the database considers it expired.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from ledger.errors import LeaseLostError
from ledger.pg import retrying

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
COMPONENT = "ledger"

#: Largest stored request (canonical JSON of the arguments).
MAX_REQUEST_BYTES = 1024 * 1024
#: The largest token an event can carry (``ledger.domain.events.LeaseToken``). A lease whose
#: token reached it (a restored or hand-edited row: a token grows by one per take-over) is never
#: taken over again: the next token could be recorded by no one, and raising it would fail every
#: take-over of the statement it is in.
MAX_TOKEN = 2**62


#: A new operation's lease (token 1) and its request, in one statement (see LeaseStore.create).
_CREATE_SQL = """
WITH lease AS (
    INSERT INTO operation_leases (operation_id, tenant_id, token, owner, expires_at)
    VALUES (%(op)s, %(tenant)s, 1, %(owner)s, now() + %(ttl)s)
    ON CONFLICT (operation_id) DO UPDATE SET updated_at = now()
        WHERE operation_leases.owner = EXCLUDED.owner
    RETURNING token, owner
), request AS (
    INSERT INTO operation_requests (operation_id, tenant_id, tool_name, request_hash, body)
    VALUES (%(op)s, %(tenant)s, %(tool)s, %(hash)s, %(body)s)
    ON CONFLICT (operation_id) DO NOTHING
)
SELECT token, owner FROM lease
"""


def process_identity(role: str) -> str:
    """A readable, unique name for this process as a lease owner: role@host:pid/random."""
    return f"{role}@{socket.gethostname()}:{os.getpid()}/{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, slots=True)
class Lease:
    operation_id: str
    tenant_id: str
    token: int
    owner: str
    #: monotonic time after which the holder must not act (before the database's expiry)
    deadline: float

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def valid(self) -> bool:
        return time.monotonic() < self.deadline


def _safety(ttl: timedelta) -> float:
    # Clock rates differ a little between processes; a tenth of the TTL (at least 0.5 s, at most
    # 5 s) is kept in hand so the holder always stops before anyone else may start.
    return min(5.0, max(0.5, ttl.total_seconds() / 10))


class LeaseStore:
    """Leases and stored requests over a connection pool (idempotent work only)."""

    def __init__(self, pool: ConnectionPool[Any], owner: str) -> None:
        self._pool = pool
        self.owner = owner

    def create(
        self,
        operation_id: str,
        tenant_id: str,
        ttl: timedelta,
        *,
        tool_name: str,
        request_hash: str,
        request: bytes,
    ) -> Lease:
        """The first lease of a new operation (token 1), stored with its request in one commit.

        Asking again for an operation this owner already holds returns the same token (a retry
        after a lost acknowledgement); an operation someone else holds raises LeaseLostError.
        """
        if len(request) > MAX_REQUEST_BYTES:
            raise ValueError(
                f"the request is {len(request)} bytes; at most {MAX_REQUEST_BYTES} are stored"
            )
        started = time.monotonic()

        def work(conn: psycopg.Connection[Any]) -> tuple[int, str] | None:
            # One statement on an autocommit connection: its own transaction, one round trip
            # and one commit (BEGIN, two INSERTs and COMMIT were four round trips on the path
            # of every execute). PostgreSQL runs a data-modifying WITH to completion whether or
            # not the outer query reads it, so the request is stored as before.
            row = conn.execute(
                _CREATE_SQL,
                {
                    "op": operation_id,
                    "tenant": tenant_id,
                    "owner": self.owner,
                    "ttl": ttl,
                    "tool": tool_name,
                    "hash": request_hash,
                    "body": request,
                },
            ).fetchone()
            return None if row is None else (int(row[0]), str(row[1]))

        found = retrying(self._pool, f"take the lease of {operation_id}", work)
        if found is None:
            raise LeaseLostError(f"{operation_id} is already owned by another process")
        return Lease(
            operation_id, tenant_id, found[0], self.owner, started + _ttl_s(ttl) - _safety(ttl)
        )

    def take_over(
        self,
        operations: Iterable[tuple[str, str]],
        ttl: timedelta,
        *,
        force: bool = False,
    ) -> dict[str, Lease]:
        """Take the leases of ``(operation_id, tenant_id)`` pairs that expired or that this owner
        already holds (all of them with ``force``, which a cancel uses), with a higher token;
        returns the ones taken. An operation with no lease row gets token 2: token 1 is its
        creator's, which its intent may carry though the lease was never stored (a fresh
        operation's lease is committed while its intent is in flight, and may fail), and a
        claim with the token already recorded would be fenced. (A writer without leases
        records no token: 2 is above that too.)

        A lease row held under another tenant's name (an intent that tenant recorded under
        this operation's id, refused by the projector as a tenant mismatch) owns nothing: it is
        taken whatever its expiry, and given back to ``tenant_id``, but only where the
        projection says the operation is ``tenant_id``'s. The caller's word is not enough:
        a tenant naming itself for another's operation would otherwise take a live lease. A
        lease whose token reached ``MAX_TOKEN`` is never taken."""
        pairs = list(operations)
        if not pairs:
            return {}
        started = time.monotonic()

        def work(conn: psycopg.Connection[Any]) -> list[tuple[str, str, int]]:
            with conn.transaction():
                rows = conn.execute(
                    """WITH wanted AS (
                           SELECT op, tenant FROM unnest(%s::text[], %s::text[]) AS x(op, tenant)
                       ), fresh AS (
                           INSERT INTO operation_leases
                               (operation_id, tenant_id, token, owner, expires_at)
                           SELECT op, tenant, 2, %s, now() + %s FROM wanted
                           ON CONFLICT (operation_id) DO NOTHING
                           RETURNING operation_id, tenant_id, token
                       ), taken AS (
                           UPDATE operation_leases l
                              SET token = l.token + 1, owner = %s, expires_at = now() + %s,
                                  updated_at = now(), tenant_id = w.tenant
                             FROM wanted w
                            WHERE l.operation_id = w.op
                              AND l.token < %s
                              AND CASE WHEN l.tenant_id = w.tenant
                                       THEN l.expires_at <= now() OR %s OR l.owner = %s
                                       -- another tenant's row: taken only where the projection
                                       -- (the log) says the operation is the caller's tenant's
                                       ELSE EXISTS (SELECT 1 FROM agent_operations o
                                                     WHERE o.operation_id = w.op
                                                       AND o.tenant_id = w.tenant)
                                  END
                              AND l.operation_id NOT IN (SELECT operation_id FROM fresh)
                           RETURNING l.operation_id, l.tenant_id, l.token
                       )
                       SELECT * FROM fresh UNION ALL SELECT * FROM taken""",
                    (
                        [p[0] for p in pairs],
                        [p[1] for p in pairs],
                        self.owner,
                        ttl,
                        self.owner,
                        ttl,
                        MAX_TOKEN,
                        force,
                        self.owner,
                    ),
                ).fetchall()
            return [(str(r[0]), str(r[1]), int(r[2])) for r in rows]

        taken = retrying(self._pool, f"take over {len(pairs)} leases", work)
        deadline = started + _ttl_s(ttl) - _safety(ttl)
        return {op: Lease(op, tenant, token, self.owner, deadline) for op, tenant, token in taken}

    def holds(self, lease: Lease) -> bool:
        """Whether ``lease`` is still this owner's and unexpired, asked of the database."""
        if not lease.valid():
            return False

        def work(conn: psycopg.Connection[Any]) -> bool:
            row = conn.execute(
                "SELECT 1 FROM operation_leases WHERE operation_id = %s AND token = %s "
                "AND owner = %s AND expires_at > now()",
                (lease.operation_id, lease.token, lease.owner),
            ).fetchone()
            return row is not None

        return retrying(self._pool, f"check the lease of {lease.operation_id}", work)

    def renew(self, lease: Lease, ttl: timedelta) -> Lease:
        """Extend a lease still held; raises LeaseLostError when it is not."""
        started = time.monotonic()
        if not lease.valid() or not self._extend(lease, ttl, "renew", expired_too=False):
            raise LeaseLostError(f"the lease on {lease.operation_id} expired")
        return _extended(lease, started, ttl)

    def reclaim(self, lease: Lease, ttl: timedelta) -> Lease:
        """Extend a lease this owner still holds, expired or not; raises LeaseLostError when
        another process took it over.

        The token and the owner unchanged prove that nobody acted on the operation since: every
        other writer takes it over first, which raises the token (``take_over``). So a holder
        whose appends stalled past its lease (a broker fenced after a SIGKILL takes longer than
        a short lease) may carry on, where refusing would leave an intent for the recovery
        worker and an error for a caller who did nothing wrong. Row locks order this against a
        concurrent take-over: whichever commits first wins, the other finds no row."""
        started = time.monotonic()
        if not self._extend(lease, ttl, "reclaim", expired_too=True):
            raise LeaseLostError(
                f"{lease.operation_id}: another process took the operation over (its lease "
                f"token is no longer {lease.token})"
            )
        return _extended(lease, started, ttl)

    def _extend(self, lease: Lease, ttl: timedelta, verb: str, *, expired_too: bool) -> bool:
        unexpired = "" if expired_too else " AND expires_at > now()"

        def work(conn: psycopg.Connection[Any]) -> bool:
            row = conn.execute(
                "UPDATE operation_leases SET expires_at = now() + %s, updated_at = now() "
                "WHERE operation_id = %s AND token = %s AND owner = %s" + unexpired + " "
                "RETURNING 1",
                (ttl, lease.operation_id, lease.token, lease.owner),
            ).fetchone()
            return row is not None

        return retrying(self._pool, f"{verb} the lease of {lease.operation_id}", work)

    def release(self, leases: Sequence[Lease]) -> None:
        """Let others take these operations at once instead of waiting for the expiry."""
        if not leases:
            return

        def work(conn: psycopg.Connection[Any]) -> None:
            conn.execute(
                "UPDATE operation_leases l SET expires_at = now(), updated_at = now() "
                "FROM unnest(%s::text[], %s::bigint[]) AS x(op, token) "
                "WHERE l.operation_id = x.op AND l.token = x.token AND l.owner = %s",
                ([x.operation_id for x in leases], [x.token for x in leases], self.owner),
            )

        retrying(self._pool, f"release {len(leases)} leases", work)

    def tenant_of(self, operation_id: str) -> str | None:
        """The tenant whose operation ``operation_id`` is, if a lease was ever created for it
        (an id taken by one tenant is never another's)."""

        def work(conn: psycopg.Connection[Any]) -> str | None:
            row = conn.execute(
                "SELECT tenant_id FROM operation_leases WHERE operation_id = %s", (operation_id,)
            ).fetchone()
            return None if row is None else str(row[0])

        return retrying(self._pool, f"look up the lease of {operation_id}", work)

    def requests(self, operations: Iterable[tuple[str, str]]) -> dict[str, bytes]:
        """The stored requests of ``(operation_id, tenant_id)`` pairs (tenant-scoped)."""
        pairs = list(operations)
        if not pairs:
            return {}

        def work(conn: psycopg.Connection[Any]) -> dict[str, bytes]:
            rows = conn.execute(
                "SELECT r.operation_id, r.body FROM operation_requests r "
                "JOIN unnest(%s::text[], %s::text[]) AS x(op, tenant) "
                "ON r.operation_id = x.op AND r.tenant_id = x.tenant",
                ([p[0] for p in pairs], [p[1] for p in pairs]),
            ).fetchall()
            return {str(op): bytes(body) for op, body in rows}

        return retrying(self._pool, "read stored requests", work)


def _ttl_s(ttl: timedelta) -> float:
    return ttl.total_seconds()


def _extended(lease: Lease, started: float, ttl: timedelta) -> Lease:
    """``lease`` with a local deadline ``ttl`` from ``started`` (less the safety margin)."""
    return Lease(
        lease.operation_id,
        lease.tenant_id,
        lease.token,
        lease.owner,
        started + _ttl_s(ttl) - _safety(ttl),
    )
