"""Policy as the workers read it: the projector's policy tables (``policy_grants``,
``revoked_credentials``, folded from the compacted policy topic), evaluated by the pure
:func:`ledger.domain.policy.evaluate`.

Decisions are only as fresh as the projection: a change counts once the projector has folded
it (``opledger policy grant|revoke`` waits for that by default). The optional cache adds up to
its TTL on top of that, on the dispatch path only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from ledger import pg
from ledger.domain.events import PolicyChanged, policy_signed_bytes
from ledger.domain.policy import (
    CredentialRevocation,
    Grant,
    PolicyChange,
    PolicyDecision,
    PolicyRequest,
    Purpose,
    evaluate,
)
from ledger.pg import retrying
from ledger.policy_keys import TrustedKeys, trusted_keys
from ledger.settings import Settings

#: The refusal when the policy tables do not exist: the projector has never run against this
#: database, so no grant can exist either (default deny), and the caller is told why.
NO_PROJECTION = (
    "no policy projection in this database yet (the projector creates it: "
    "`opledger projector run` or `opledger stack up`)"
)

_GRANT_COLUMNS = (
    "g.tenant_id, g.principal, g.tool_name, g.revoked, g.version, g.destinations, "
    "g.repeat_safe, g.expires_at, g.credential_id, g.credential_scopes, g.credential_expires_at"
)

_SIGNED_COLUMNS = "g.updated_at, g.changed_by, g.reason, g.signed_by, g.signature"

# The matching grants (at most four: actor or '*', tool or '*') and, beside each, the revocation
# of the credential it names, if any: everything evaluate() needs, in one statement, with what
# the grant's signature covers (decision 032). A tenant's
# revocations of credentials no matching grant names cannot change the decision and stay unread.
_MATCHING = f"""
SELECT {_GRANT_COLUMNS}, r.version, {_SIGNED_COLUMNS}
  FROM policy_grants g
  LEFT JOIN revoked_credentials r
    ON r.tenant_id = g.tenant_id AND r.credential_id = g.credential_id
 WHERE g.tenant_id = %s AND g.principal IN (%s, '*') AND g.tool_name IN (%s, '*')
"""

_CURRENT = f"""
SELECT {_GRANT_COLUMNS}, r.version, {_SIGNED_COLUMNS}
  FROM policy_grants g
  LEFT JOIN revoked_credentials r
    ON r.tenant_id = g.tenant_id AND r.credential_id = g.credential_id
 WHERE g.tenant_id = %(tenant)s
   AND (%(actor)s::text IS NULL OR g.principal IN (%(actor)s, '*'))
   AND (%(tool)s::text IS NULL OR g.tool_name IN (%(tool)s, '*'))
 ORDER BY g.principal, g.tool_name
"""

_REVOKED = """
SELECT tenant_id, credential_id, version, revoked_at, revoked_by, reason
  FROM revoked_credentials WHERE tenant_id = %s ORDER BY credential_id
"""


def _grant(row: Sequence[Any]) -> Grant:
    return Grant(
        tenant_id=row[0],
        principal=row[1],
        tool_name=row[2],
        revoked=row[3],
        version=row[4],
        destinations=frozenset(row[5]),
        repeat_safe=row[6],
        expires_at=row[7],
        credential_id=row[8],
        credential_scopes=frozenset(row[9]),
        credential_expires_at=row[10],
    )


@dataclass(frozen=True, slots=True)
class SignedGrant:
    """A projected grant row with what its signature covers, for :meth:`TrustedKeys.refusal`."""

    grant: Grant
    signed_bytes: bytes
    signed_by: str | None
    signature: str | None


#: What evaluate() reads for one (tenant, actor, tool); None: the tables do not exist.
MatchingRows = tuple[list[SignedGrant], list[CredentialRevocation]] | None


def _signed(row: Sequence[Any]) -> SignedGrant:
    """A :data:`_MATCHING` row as a grant with its signature's coverage."""
    grant = _grant(row)
    updated_at, changed_by, reason, signed_by, signature = row[12:17]
    return SignedGrant(
        grant,
        policy_signed_bytes(
            event_id=grant.version,
            tenant_id=grant.tenant_id,
            actor_id=changed_by,
            occurred_at=updated_at,
            change=(PolicyChange.REVOKE if grant.revoked else PolicyChange.GRANT).value,
            principal=grant.principal,
            tool_name=grant.tool_name,
            # The row's arrays keep the record's order, which the signature covers.
            destinations=row[5],
            repeat_safe=grant.repeat_safe,
            expires_at=grant.expires_at,
            credential_id=grant.credential_id,
            credential_scopes=row[9],
            credential_expires_at=grant.credential_expires_at,
            reason=reason,
            signed_by=signed_by,
        ),
        signed_by,
        signature,
    )


@dataclass(frozen=True, slots=True)
class GrantRow:
    """A grant as ``opledger policy show`` lists it."""

    grant: Grant
    updated_at: datetime
    changed_by: str
    reason: str | None
    #: the version of the revocation of the grant's credential, if it is revoked
    credential_revoked_by: str | None
    #: the row with what its signature covers (who signed it, and whether that holds)
    signed: SignedGrant


@dataclass(frozen=True, slots=True)
class RevokedCredentialRow:
    revocation: CredentialRevocation
    revoked_at: datetime
    revoked_by: str
    reason: str | None


@dataclass(frozen=True, slots=True)
class CurrentPolicy:
    """One tenant's current policy, as projected."""

    grants: list[GrantRow]
    revoked_credentials: list[RevokedCredentialRow]


@dataclass(frozen=True, slots=True)
class FoldState:
    """How far the projector has got with one policy change."""

    #: the change is in policy_history: the projector folded it
    folded: bool
    #: the version its subject has now (the change's own event id, or a later change's)
    current_version: str | None


def read_matching(
    conn: psycopg.Connection[Any], tenant_id: str, actor_id: str, tool_name: str
) -> MatchingRows:
    """The grants that can match (tenant, actor, tool) and the revocations of the credentials
    they name, in one round trip; None when the policy tables do not exist."""
    try:
        rows = conn.execute(_MATCHING, (tenant_id, actor_id, tool_name)).fetchall()
    except psycopg.errors.UndefinedTable:
        return None
    grants = [_signed(row) for row in rows]
    revoked = [CredentialRevocation(row[0], row[8], row[11]) for row in rows if row[11] is not None]
    return grants, revoked


def read_current(
    conn: psycopg.Connection[Any],
    tenant_id: str,
    *,
    actor_id: str | None = None,
    tool_name: str | None = None,
) -> CurrentPolicy | None:
    """The tenant's grants (those that apply to ``actor_id`` / ``tool_name`` when given: their
    own and the ``*`` ones) and revoked credentials; None when the policy tables do not exist."""
    try:
        grants = conn.execute(
            _CURRENT, {"tenant": tenant_id, "actor": actor_id, "tool": tool_name}
        ).fetchall()
        revoked = conn.execute(_REVOKED, (tenant_id,)).fetchall()
    except psycopg.errors.UndefinedTable:
        return None
    return CurrentPolicy(
        grants=[GrantRow(_grant(r), r[12], r[13], r[14], r[11], _signed(r)) for r in grants],
        revoked_credentials=[
            RevokedCredentialRow(CredentialRevocation(r[0], r[1], r[2]), r[3], r[4], r[5])
            for r in revoked
        ],
    )


def read_fold_state(conn: psycopg.Connection[Any], change: PolicyChanged) -> FoldState:
    """Whether the projector has folded ``change``, and the version its subject has now."""
    if change.change is PolicyChange.REVOKE_CREDENTIAL:
        current = (
            "SELECT version FROM revoked_credentials WHERE tenant_id = %s AND credential_id = %s"
        )
        subject: tuple[Any, ...] = (change.tenant_id, change.credential_id)
    else:
        current = (
            "SELECT version FROM policy_grants "
            "WHERE tenant_id = %s AND principal = %s AND tool_name = %s"
        )
        subject = (change.tenant_id, change.principal, change.tool_name)
    try:
        row = conn.execute(
            f"SELECT EXISTS (SELECT 1 FROM policy_history WHERE event_id = %s), ({current})",
            (change.event_id, *subject),
        ).fetchone()
    except psycopg.errors.UndefinedTable:
        return FoldState(False, None)
    assert row is not None  # a SELECT without FROM returns one row
    return FoldState(bool(row[0]), row[1])


class PolicyStore:
    """Evaluates policy requests against the projected policy, over a psycopg pool.

    ``cache_ttl_s`` > 0 caches, per (tenant, actor, tool), the rows read for DISPATCH requests
    only, for that many seconds (at most ``cache_size`` subjects). A revocation then stops new
    dispatches up to ``cache_ttl_s`` after the projector folded it, on top of the projector's
    lag. NEW_ATTEMPT and DELIVER requests (reconciliation, delivery) always read the table:
    the seed's rule 3 asks for *current* policy there. The decision itself is computed on each
    call (the time, the purpose, the destination and the scope are the request's); only the
    rows are cached. Off by default.
    """

    def __init__(
        self,
        pool: ConnectionPool[Any],
        settings: Settings,
        *,
        cache_ttl_s: float = 0.0,
        cache_size: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cache_ttl_s < 0 or cache_size < 1:
            raise ValueError("cache_ttl_s must be >= 0 and cache_size >= 1")
        self._pool = pool
        self._settings = settings
        self._ttl_s = cache_ttl_s
        self._size = cache_size
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str, str], tuple[float, MatchingRows]] = {}

    def evaluate(self, request: PolicyRequest) -> PolicyDecision:
        """The decision for ``request`` now. "No grant" is a refusal with a reason, never an
        exception; raises only when PostgreSQL cannot be reached (``ledger.pg.retrying``)."""
        subject = (request.tenant_id, request.actor_id, request.tool_name)
        use_cache = self._ttl_s > 0 and request.purpose is Purpose.DISPATCH
        hit = self._cached(subject) if use_cache else None
        if hit is not None:
            (rows,) = hit
        else:
            rows = retrying(
                self._pool, "read the policy", lambda conn: read_matching(conn, *subject)
            )
            if use_cache:
                self._remember(subject, rows)
        return self._decide(rows, request, self._trusted())

    def evaluate_many(self, requests: Sequence[PolicyRequest]) -> list[PolicyDecision]:
        """The decisions for ``requests`` (in order), reading each distinct (tenant, actor,
        tool) once, on one connection: a worker checking a batch of deliveries pays one round
        trip per subject, not per delivery. Never cached: the policy is read as it is now."""
        subjects = sorted({(r.tenant_id, r.actor_id, r.tool_name) for r in requests})
        if not subjects:
            return []

        def work(conn: psycopg.Connection[Any]) -> dict[tuple[str, str, str], MatchingRows]:
            return {subject: read_matching(conn, *subject) for subject in subjects}

        rows = retrying(self._pool, "read the policy", work)
        keys = self._trusted()
        return [
            self._decide(rows[(r.tenant_id, r.actor_id, r.tool_name)], r, keys) for r in requests
        ]

    @staticmethod
    def _decide(rows: MatchingRows, request: PolicyRequest, keys: TrustedKeys) -> PolicyDecision:
        if rows is None:
            return PolicyDecision(False, NO_PROJECTION, None)
        signed, revoked = rows
        # Every grant that could match is checked, not only the one that would decide: a
        # specific revocation altered into a grant, or removed from its signature, must not
        # hand the decision to a broader grant.
        for row in signed:
            refusal = keys.refusal(row.signed_bytes, row.signed_by, row.signature)
            if refusal is not None:
                g = row.grant
                return PolicyDecision(
                    False,
                    f"the projected grant for actor {g.principal}, tool {g.tool_name} is not "
                    f"the operator's: {refusal}",
                    g.version,
                )
        return evaluate([row.grant for row in signed], request, revoked)

    def current(
        self, tenant_id: str, *, actor_id: str | None = None, tool_name: str | None = None
    ) -> CurrentPolicy | None:
        """The tenant's current grants and revoked credentials (see :func:`read_current`)."""
        return retrying(
            self._pool,
            "read the policy",
            lambda conn: read_current(conn, tenant_id, actor_id=actor_id, tool_name=tool_name),
        )

    def _trusted(self) -> TrustedKeys:
        return trusted_keys(self._settings)

    def _cached(self, subject: tuple[str, str, str]) -> tuple[MatchingRows] | None:
        """``(rows,)`` while a fresh entry exists, else None (rows themselves may be None)."""
        with self._lock:
            entry = self._cache.get(subject)
            if entry is None or entry[0] <= self._clock():
                return None
            return (entry[1],)

    def _remember(self, subject: tuple[str, str, str], rows: MatchingRows) -> None:
        with self._lock:
            self._cache.pop(subject, None)
            while len(self._cache) >= self._size:
                # Insertion order is expiry order (one TTL for all): drop the oldest.
                del self._cache[next(iter(self._cache))]
            self._cache[subject] = (self._clock() + self._ttl_s, rows)


# -- freshness (decision 022) ---------------------------------------------------------------------

# How long a reader acts on the view after it last saw it current, and how often it looks:
# ``Settings.policy_max_staleness_ms`` and ``policy_freshness_refresh_ms`` (5 s and 0.5 s).
#: A freshness probe never waits longer than this for Kafka (its caller may be a tool call).
_PROBE_TIMEOUT_S = 2.0

#: Where the policy topic ends, and where the projector has folded it to, per partition.
Offsets = tuple[dict[int, int], dict[int, int]]


class PolicyViewStaleError(RuntimeError):
    """The policy view cannot be vouched for: nothing is decided with it (decision 022)."""


class PolicyFreshness:
    """Whether the projected policy is known to hold every change on the policy topic.

    The view is *verified* at an instant when the projector's committed offsets of the policy
    topic, read after the topic's end offsets were sampled, reach those ends: every change
    acknowledged before the sample is then in the tables. A reader may act on the view while
    the last verification is at most ``max_staleness_s`` old. A stopped projector alone costs
    nothing (nothing unfolded, still verified); an unfolded change does. Kafka or PostgreSQL
    that cannot be asked never verifies, so the view ages out (fail closed).

    One probe (a watermark query, one indexed SELECT) at most every ``refresh_s`` seconds, on
    the calling thread; other calls read two floats. Thread-safe.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        max_staleness_s: float | None = None,
        refresh_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        probe: Callable[[], Offsets] | None = None,
    ) -> None:
        if max_staleness_s is None:
            max_staleness_s = settings.policy_max_staleness_ms / 1000
        if refresh_s is None:
            refresh_s = settings.policy_freshness_refresh_ms / 1000
        if max_staleness_s <= 0 or refresh_s <= 0:
            raise ValueError("max_staleness_s and refresh_s must be > 0")
        self._settings = settings
        self._max_s = max_staleness_s
        self._refresh_s = refresh_s
        self._clock = clock
        self._probe = probe or self._offsets
        self._lock = threading.Lock()
        self._checked_at: float | None = None
        self._verified_at: float | None = None
        self._problem = "not checked yet"
        self._consumer: Any = None
        self._partitions: list[int] | None = None
        self._conn: psycopg.Connection[Any] | None = None

    def stale_reason(self) -> str | None:
        """None while the view may be acted on; else why not, in one sentence."""
        # A caller whose view is still vouched for never queues behind a probe in flight.
        if self._due() and self._lock.acquire(blocking=self._age(self._clock()) is None):
            try:
                if self._due():
                    self._refresh()
            finally:
                self._lock.release()
        now = self._clock()
        if self._age(now) is not None:
            return None
        seen = (
            "never seen current"
            if self._verified_at is None
            else f"last seen current {now - self._verified_at:.1f}s ago"
        )
        return (
            f"the policy view cannot be vouched for ({seen}, limit {self._max_s:g}s: "
            f"{self._problem}); a revocation may not be folded yet"
        )

    def _due(self) -> bool:
        return self._checked_at is None or self._clock() - self._checked_at >= self._refresh_s

    def _age(self, now: float) -> float | None:
        if self._verified_at is None or now - self._verified_at > self._max_s:
            return None
        return now - self._verified_at

    def _refresh(self) -> None:
        sampled = self._clock()
        try:
            ends, folded = self._probe()
        except Exception as exc:  # any failure to look is "cannot tell", never "current"
            self._problem = f"could not be checked: {type(exc).__name__}: {exc}"
            self._close_clients()
        else:
            behind = {
                p: end - folded.get(p, 0) for p, end in ends.items() if folded.get(p, 0) < end
            }
            if ends and not behind:
                self._verified_at = sampled
                self._problem = "current"
            elif not ends:
                self._problem = f"no partitions found for {self._settings.policy_topic}"
            else:
                self._problem = (
                    f"the projector is {sum(behind.values())} policy records behind the topic"
                )
        self._checked_at = self._clock()

    def _offsets(self) -> Offsets:
        from confluent_kafka import TopicPartition  # noqa: PLC0415

        from ledger.log import new_consumer  # noqa: PLC0415

        topic = self._settings.policy_topic
        if self._consumer is None:
            # Never subscribes nor commits: it only asks for watermarks.
            self._consumer = new_consumer(
                self._settings,
                group_id=self._settings.readers_group("policy-freshness"),
                client_id="opledger-policy-freshness",
            )
        if self._partitions is None:
            meta = self._consumer.list_topics(topic, timeout=_PROBE_TIMEOUT_S).topics.get(topic)
            if meta is None or meta.error is not None or not meta.partitions:
                raise PolicyViewStaleError(f"topic {topic} not found")
            self._partitions = sorted(meta.partitions)
        ends: dict[int, int] = {}
        for p in self._partitions:
            _low, high = self._consumer.get_watermark_offsets(
                TopicPartition(topic, p), timeout=_PROBE_TIMEOUT_S, cached=False
            )
            ends[p] = int(high)
        # Read after the ends were sampled: offsets folded by then cover every change before.
        if self._conn is None:
            self._conn = pg.connect(
                self._settings.dsn,
                name="opledger-policy-freshness",
                connect_timeout=int(_PROBE_TIMEOUT_S),
                # A look that cannot finish is "cannot tell" (stale), never a caller held for as
                # long as another session locks the offsets table.
                lock_timeout_ms=int(_PROBE_TIMEOUT_S * 500),
                statement_timeout_ms=int(_PROBE_TIMEOUT_S * 1000),
            )
        try:
            rows = self._conn.execute(
                "SELECT partition, next_offset FROM projector_offsets "
                "WHERE consumer = %s AND topic = %s",
                (self._settings.projector_group, topic),
            ).fetchall()
        except psycopg.errors.UndefinedTable:
            rows = []
        return ends, {int(p): int(o) for p, o in rows}

    def _close_clients(self) -> None:
        consumer, self._consumer, self._partitions = self._consumer, None, None
        conn, self._conn = self._conn, None
        if consumer is not None:
            consumer.close()
        if conn is not None:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._close_clients()
