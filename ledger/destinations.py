"""The destinations registry: per tenant, where results of which tools are delivered.

Events carry only a destination's *name*; this table says where it is (a webhook URL or a Kafka
topic) and holds the webhook's signing secret, which must never travel in an event or a log
line, sealed under the operator's key (``ledger.secret_box``, decision 033): this module seals
every secret it writes and opens every one it reads, so no other code sees the stored form.
A destination that answers 410 Gone is disabled here by the delivery worker; an operator
enables it again with ``opledger destinations enable``.
"""

from __future__ import annotations

import base64
import ipaddress
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg_pool import ConnectionPool

from ledger.domain.events import recordable_destination
from ledger.domain.names import InvalidNameError, NameKind, check_name, check_tools
from ledger.pg import retrying
from ledger.secret_box import SecretBox, secret_box
from ledger.settings import Network, Settings

# \Z, not $: "$" also matches before a final newline, which the database's checks refuse
# (and then print the whole row, secret included, in their error and the server's log).
TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}\Z")
SECRET_RE = re.compile(r"^whsec_[A-Za-z0-9+/=]{16,}\Z")
WILDCARD = "*"
MAX_URL = 2048
_NOT_IN_A_URL = re.compile(r"[^!-~]")


class DestinationError(ValueError):
    """A destination's configuration is invalid; the message says which part."""


class Kind(StrEnum):
    WEBHOOK = "webhook"
    QUEUE = "queue"


@dataclass(frozen=True, slots=True)
class Destination:
    tenant_id: str
    name: str
    kind: Kind
    target: str
    tools: tuple[str, ...]
    timeout_ms: int
    enabled: bool
    disabled_reason: str | None
    #: disabled because it answered 410 Gone: its deliveries are dead-lettered, not held
    gone: bool = False
    updated_at: datetime | None = None
    changed_by: str | None = None
    #: the webhook signing secret, or the secret a queue's consumer signs its fetches of
    #: results delivered by reference with (optional for queues); never printed
    secret: str | None = field(default=None, repr=False)
    #: the secret a rotation replaced, still signed with (and accepted) until
    #: ``previous_secret_until``; never printed
    previous_secret: str | None = field(default=None, repr=False)
    previous_secret_until: datetime | None = None

    def signing_secrets(self, now: datetime) -> tuple[str, ...]:
        """The secrets a send at ``now`` is signed with (and a fetch may be signed with):
        the current one, then the one a rotation replaced while its overlap lasts."""
        if self.secret is None:
            return ()
        if (
            self.previous_secret is not None
            and self.previous_secret_until is not None
            and now < self.previous_secret_until
        ):
            return (self.secret, self.previous_secret)
        return (self.secret,)


#: How long a rotated-out secret is still signed with unless the operator says otherwise.
ROTATION_OVERLAP = timedelta(hours=24)
#: The longest overlap a rotation may keep: an old secret that lingers is a leaked one's friend.
MAX_ROTATION_OVERLAP = timedelta(days=30)


def new_secret() -> str:
    """A fresh Standard Webhooks signing secret: ``whsec_`` + base64 of 24 random bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode("ascii")


def check_webhook_url(url: str) -> str:
    """The URL if a delivery may be POSTed to it: http(s), a host, no credentials in it (they
    would be logged and shown), no fragment."""
    if len(url) > MAX_URL:
        raise DestinationError(f"the URL is longer than {MAX_URL} characters")
    if _NOT_IN_A_URL.search(url):
        # urlsplit drops tabs and line breaks without a word (WHATWG), so the URL stored would
        # not be the URL sent; a space or a non-ASCII character has a percent-encoded form.
        raise DestinationError(
            "a webhook URL is printable ASCII without spaces: percent-encode the rest "
            "(a host name in its xn-- form)"
        )
    try:
        parts = urlsplit(url)
        port = parts.port  # raises for a port that is not a number
    except ValueError as exc:
        raise DestinationError(f"not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise DestinationError("a webhook URL must be http:// or https://")
    if not parts.hostname:
        raise DestinationError("a webhook URL needs a host")
    if parts.username is not None or parts.password is not None:
        raise DestinationError(
            "a webhook URL must not carry credentials; deliveries are signed with the "
            "destination's whsec_ secret instead"
        )
    if parts.fragment:
        raise DestinationError("a webhook URL has no use for a #fragment")
    del port
    return url


# -- where a webhook may be sent (decision 019) -------------------------------------------------

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

#: The variable that allows a refused network; every refusal names it.
ALLOW_VARIABLE = "OPLEDGER_DELIVERY_ALLOW_NETWORKS"

_V4 = ipaddress.IPv4Network
_V6 = ipaddress.IPv6Network
#: IPv4 networks a webhook is never sent to unless allowed, with the rule each one falls under.
REFUSED_IPV4: tuple[tuple[ipaddress.IPv4Network, str], ...] = (
    (_V4("0.0.0.0/8"), "unspecified"),  # "this network": 0.0.0.0 reaches the local host
    (_V4("10.0.0.0/8"), "private, RFC 1918"),
    (_V4("100.64.0.0/10"), "shared address space, RFC 6598"),
    (_V4("127.0.0.0/8"), "loopback"),
    (_V4("169.254.0.0/16"), "link-local"),  # cloud metadata: 169.254.169.254
    (_V4("172.16.0.0/12"), "private, RFC 1918"),
    (_V4("192.168.0.0/16"), "private, RFC 1918"),
    (_V4("224.0.0.0/4"), "multicast"),
    (_V4("240.0.0.0/4"), "reserved"),  # with the broadcast 255.255.255.255
)
#: IPv6 networks refused the same way (checked after the IPv4 address an IPv6 one embeds).
REFUSED_IPV6: tuple[tuple[ipaddress.IPv6Network, str], ...] = (
    (_V6("::/128"), "unspecified"),
    (_V6("::1/128"), "loopback"),
    (_V6("fe80::/10"), "link-local"),
    (_V6("fec0::/10"), "site-local, deprecated"),
    (_V6("fc00::/7"), "private, unique local"),
    (_V6("ff00::/8"), "multicast"),
)
_NAT64 = (_V6("64:ff9b::/96"), _V6("64:ff9b:1::/48"))


def embedded_ipv4(address: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, str] | None:
    """The IPv4 address an IPv6 address carries to (IPv4-mapped, IPv4-compatible, 6to4, NAT64,
    Teredo) and the form's name; None for an ordinary IPv6 address."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped, "IPv4-mapped"
    if address.sixtofour is not None:
        return address.sixtofour, "6to4"
    if address.teredo is not None:
        return address.teredo[1], "Teredo"
    low = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if any(address in prefix for prefix in _NAT64):
        return low, "NAT64"
    if int(address) >> 32 == 0 and int(address) > 1:  # ::a.b.c.d, not :: nor ::1
        return low, "IPv4-compatible"
    return None


def refused_rule(address: Address) -> str | None:
    """Why a webhook must not be sent to ``address`` by default (the rule's name), or None."""
    if isinstance(address, ipaddress.IPv4Address):
        for network, rule in REFUSED_IPV4:
            if address in network:
                return rule
        return None
    embedded = embedded_ipv4(address)
    if embedded is not None:
        ipv4, form = embedded
        carried = refused_rule(ipv4)
        if carried is not None:
            return f"{carried}, as {form} {ipv4}"
        if form != "IPv4-compatible":
            # ::ffff:a.b.c.d is a.b.c.d itself; 64:ff9b::a.b.c.d is how an IPv6-only host
            # (DNS64) reaches it. Both lie in ::/8, which is reserved as an IPv6 network.
            return None
    for network6, rule in REFUSED_IPV6:
        if address in network6:
            return rule
    if address.is_reserved:
        return "reserved"
    return None


@dataclass(frozen=True, slots=True)
class AddressGuard:
    """Where webhooks may go: nowhere :func:`refused_rule` names, unless inside ``allow``."""

    allow: tuple[Network, ...] = ()

    def refusal(self, address: Address) -> str | None:
        """The rule refusing ``address``, or None when a webhook may be sent there."""
        rule = refused_rule(address)
        if rule is None:
            return None
        if any(address in network for network in self.allow):
            return None
        if isinstance(address, ipaddress.IPv6Address):
            # An allowed IPv4 network allows its IPv6 forms (::ffff:127.0.0.1 is 127.0.0.1).
            embedded = embedded_ipv4(address)
            if embedded is not None and any(embedded[0] in network for network in self.allow):
                return None
        return rule


def refused_text(address: Address, rule: str, host: str | None = None) -> str:
    """Why a send (or a registration) to ``address`` is refused, naming the rule and the way
    out; ``host`` is the name that resolved to it, if the URL named a host."""
    shown = str(address)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        shown = f"::ffff:{address.ipv4_mapped}"  # as written, not ::ffff:7f00:1
    where = (
        f"the destination's address {shown} is"
        if host is None
        else f"the destination's host {host} resolves to {shown}, which is"
    )
    return f"{where} in a refused network ({rule}); allow it with {ALLOW_VARIABLE}"


def literal_address(host: str) -> Address | None:
    """``host`` (a URL's host, brackets removed) as an IP address if it is one."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def check_webhook_address(url: str, guard: AddressGuard) -> None:
    """Raise DestinationError if ``url``'s host is a literal IP ``guard`` refuses. A host name
    is checked at every new connection only: what it resolves to may change."""
    check_webhook_url(url)
    host = urlsplit(url).hostname or ""
    address = literal_address(host)
    if address is None:
        return
    rule = guard.refusal(address)
    if rule is not None:
        raise DestinationError(refused_text(address, rule))


def check(
    *,
    tenant_id: str,
    name: str,
    kind: Kind,
    target: str,
    tools: Sequence[str],
    secret: str | None,
    timeout_ms: int,
    changed_by: str,
) -> None:
    """Raise DestinationError unless this is a valid destination: every name checked as the
    SDK and the event contract check it (:mod:`ledger.domain.names`)."""
    try:
        check_name(NameKind.TENANT, tenant_id)
        check_name(NameKind.DESTINATION_NAME, name)
        check_name(NameKind.ACTOR, changed_by)
    except InvalidNameError as exc:
        # The name is a metric label and part of every delivery's webhook-id.
        raise DestinationError(str(exc)) from None
    if not recordable_destination(name):
        # Not echoed: it looks like a credential.
        raise DestinationError(
            "that destination name looks like a credential (a key or token); every delivery "
            "event names its destination, so choose a name that is not a secret"
        )
    if kind is Kind.WEBHOOK:
        check_webhook_url(target)
        if secret is None or not SECRET_RE.match(secret):
            raise DestinationError("a webhook destination needs a whsec_ signing secret")
    else:
        if not TOPIC_RE.match(target):
            raise DestinationError(f"not a Kafka topic name: {target!r}")
        if secret is not None and not SECRET_RE.match(secret):
            # Optional: a queue's records are not signed (the broker's ACLs guard the topic);
            # the secret signs only its consumer's fetches of large results (decision 016).
            raise DestinationError("a queue destination's fetch secret must be a whsec_ secret")
    if not tools:
        raise DestinationError("name at least one tool (or '*' for every tool)")
    try:
        check_tools(list(tools), wildcard=WILDCARD)
    except InvalidNameError as exc:
        raise DestinationError(f"{exc}, or '*' for every tool") from None
    if not 100 <= timeout_ms <= 120_000:
        raise DestinationError("the request timeout must be between 100 ms and 120 s")


_COLUMNS = (
    "tenant_id, name, kind, target, tools, timeout_ms, enabled, disabled_reason, gone, "
    "updated_at, changed_by, secret, previous_secret, previous_secret_until"
)


def _destination(row: Sequence[Any], box: SecretBox | None) -> Destination:
    """The row as a destination; ``box`` None: its secrets left out."""
    (tenant, name, kind, target, tools, timeout, enabled, reason, gone, updated, by) = row[:11]
    sealed, sealed_previous, until = row[11:]
    secret = previous = None
    if box is not None:
        secret = None if sealed is None else box.open(sealed, tenant_id=tenant, name=name)
        if sealed_previous is not None:
            previous = box.open(sealed_previous, tenant_id=tenant, name=name)
    return Destination(
        tenant_id=tenant,
        name=name,
        kind=Kind(kind),
        target=target,
        tools=tuple(tools),
        timeout_ms=timeout,
        enabled=enabled,
        disabled_reason=reason,
        gone=gone,
        updated_at=updated,
        changed_by=by,
        secret=secret,
        previous_secret=previous,
        previous_secret_until=until,
    )


@dataclass(frozen=True, slots=True)
class Rekeyed:
    """What :meth:`DestinationStore.rekey` did."""

    sealed: int  # secrets sealed again under the current key (or sealed for the first time)
    current: int  # already under the current key
    key_id: str


class DestinationStore:
    """Reads and changes the registry over a psycopg pool (every read is tenant-scoped)."""

    def __init__(self, pool: ConnectionPool[Any], settings: Settings) -> None:
        self._pool = pool
        self._settings = settings

    def _box(self) -> SecretBox:
        # Looked up on each use: a rotation's new key file is picked up without a restart.
        return secret_box(self._settings)

    def add(
        self,
        *,
        tenant_id: str,
        name: str,
        kind: Kind,
        target: str,
        tools: Sequence[str],
        changed_by: str,
        secret: str | None = None,
        timeout_ms: int = 10_000,
    ) -> Destination:
        """Create or replace ``name`` for ``tenant_id`` (a webhook without a secret gets a new
        one, returned in the result and nowhere else). A replacement leaves a disabled
        destination disabled: changing its URL or tools does not send what an operator held."""
        if kind is Kind.WEBHOOK and secret is None:
            secret = new_secret()
        check(
            tenant_id=tenant_id,
            name=name,
            kind=kind,
            target=target,
            tools=tools,
            secret=secret,
            timeout_ms=timeout_ms,
            changed_by=changed_by,
        )

        box = self._box()
        sealed = None if secret is None else box.seal(secret, tenant_id=tenant_id, name=name)

        def work(conn: psycopg.Connection[Any]) -> Any:
            return conn.execute(
                f"""INSERT INTO delivery_destinations
                      (tenant_id, name, kind, target, secret, tools, timeout_ms, changed_by)
                   VALUES (%s, %s, %s, %s, %s, %s, %s, %s)
                   ON CONFLICT (tenant_id, name) DO UPDATE SET
                      kind = EXCLUDED.kind, target = EXCLUDED.target, secret = EXCLUDED.secret,
                      tools = EXCLUDED.tools, timeout_ms = EXCLUDED.timeout_ms,
                      updated_at = now(),
                      -- a replacement is not a rotation: no overlap with what it replaced
                      previous_secret = NULL, previous_secret_until = NULL,
                      changed_by = EXCLUDED.changed_by
                   RETURNING {_COLUMNS}""",
                (tenant_id, name, kind.value, target, sealed, list(tools), timeout_ms, changed_by),
            ).fetchone()

        return _destination(retrying(self._pool, "store a destination", work), box)

    def set_enabled(
        self,
        tenant_id: str,
        name: str,
        *,
        enabled: bool,
        changed_by: str,
        reason: str | None,
        gone: bool = False,
    ) -> bool:
        """Enable or disable one destination; False if the tenant has no such destination.
        Disabled, its deliveries wait until it is enabled again, unless ``gone`` (it answered
        410 Gone): then they are dead-lettered (decision 021)."""

        def work(conn: psycopg.Connection[Any]) -> int:
            return conn.execute(
                """UPDATE delivery_destinations
                      SET enabled = %s, disabled_reason = %s, gone = %s, updated_at = now(),
                          changed_by = %s
                    WHERE tenant_id = %s AND name = %s""",
                (
                    enabled,
                    None if enabled else reason,
                    gone and not enabled,
                    changed_by,
                    tenant_id,
                    name,
                ),
            ).rowcount

        return retrying(self._pool, "change a destination", work) > 0

    def list(self, tenant_id: str) -> list[Destination]:
        """The tenant's destinations, secrets left out."""

        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(
                f"SELECT {_COLUMNS} FROM delivery_destinations WHERE tenant_id = %s ORDER BY name",
                (tenant_id,),
            ).fetchall()

        rows = retrying(self._pool, "list destinations", work)
        return [_destination(row, None) for row in rows]

    def rotate_secret(
        self,
        tenant_id: str,
        name: str,
        *,
        changed_by: str,
        secret: str | None = None,
        overlap: timedelta = ROTATION_OVERLAP,
    ) -> Destination | None:
        """Give ``name`` a new secret (``secret``, or a fresh one, returned in the result and
        nowhere else), keeping the one it replaces for ``overlap``: sends are signed with both
        until then. A second rotation within the overlap drops the oldest. None if the tenant
        has no such destination with a secret to rotate."""
        secret = new_secret() if secret is None else secret
        if not SECRET_RE.match(secret):
            raise DestinationError("a signing secret is whsec_ and base64")
        if not timedelta(0) <= overlap <= MAX_ROTATION_OVERLAP:
            raise DestinationError(
                f"the overlap must be between 0 and {MAX_ROTATION_OVERLAP.days} days"
            )

        box = self._box()
        sealed = box.seal(secret, tenant_id=tenant_id, name=name)

        def work(conn: psycopg.Connection[Any]) -> Any:
            # The right-hand sides read the row as it was: the old secret becomes the previous
            # (sealed for this tenant and name, so it opens where it is moved).
            return conn.execute(
                f"""UPDATE delivery_destinations
                      SET previous_secret = CASE WHEN %(overlap)s > interval '0' THEN secret END,
                          previous_secret_until =
                              CASE WHEN %(overlap)s > interval '0' THEN now() + %(overlap)s END,
                          secret = %(secret)s, updated_at = now(), changed_by = %(by)s
                    WHERE tenant_id = %(tenant)s AND name = %(name)s AND secret IS NOT NULL
                RETURNING {_COLUMNS}""",
                {
                    "overlap": overlap,
                    "secret": sealed,
                    "by": changed_by,
                    "tenant": tenant_id,
                    "name": name,
                },
            ).fetchone()

        row = retrying(self._pool, "rotate a destination's secret", work)
        return None if row is None else _destination(row, box)

    def get_many(self, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], Destination]:
        """``(tenant_id, name)`` -> destination (with its secret), for those that exist."""
        wanted = sorted(set(keys))
        if not wanted:
            return {}

        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(
                f"""SELECT {_COLUMNS} FROM delivery_destinations
                     WHERE (tenant_id, name) IN (SELECT * FROM unnest(%s::text[], %s::text[]))""",
                ([k[0] for k in wanted], [k[1] for k in wanted]),
            ).fetchall()

        box = self._box()
        rows = retrying(self._pool, "read destinations", work)
        found = (_destination(row, box) for row in rows)
        return {(d.tenant_id, d.name): d for d in found}

    def configured(
        self, subjects: Iterable[tuple[str, str]]
    ) -> dict[tuple[str, str], tuple[str, ...]]:
        """``(tenant_id, tool_name)`` -> the names of the destinations its results go to
        (enabled or not: a disabled destination's deliveries are dead-lettered with the reason,
        not silently skipped)."""
        wanted = sorted(set(subjects))
        if not wanted:
            return {}

        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(
                """SELECT s.tenant_id, s.tool_name, d.name
                     FROM unnest(%s::text[], %s::text[]) AS s(tenant_id, tool_name)
                     JOIN delivery_destinations d
                       ON d.tenant_id = s.tenant_id
                      AND (s.tool_name = ANY(d.tools) OR '*' = ANY(d.tools))
                    ORDER BY d.name""",
                ([s[0] for s in wanted], [s[1] for s in wanted]),
            ).fetchall()

        names: dict[tuple[str, str], list[str]] = {s: [] for s in wanted}
        for tenant, tool, name in retrying(self._pool, "read configured destinations", work):
            names[(tenant, tool)].append(name)
        return {k: tuple(v) for k, v in names.items()}

    def rekey(self) -> Rekeyed:
        """Seal every stored secret under the key file's first key, in one transaction: what
        a rotation runs after adding its new key, before the old one is dropped. A secret that
        no key of the file opens stops it (nothing changed) with the destination named."""
        box = self._box()

        def work(conn: psycopg.Connection[Any]) -> Rekeyed:
            # One transaction, as promised: pooled connections autocommit, so without it the
            # row locks ended with the SELECT (a secret rotated meanwhile was overwritten by
            # the old one resealed) and a secret that does not open left the rows before it
            # resealed.
            with conn.transaction():
                return reseal(conn)

        def reseal(conn: psycopg.Connection[Any]) -> Rekeyed:
            rows = conn.execute(
                """SELECT tenant_id, name, secret, previous_secret FROM delivery_destinations
                    WHERE secret IS NOT NULL OR previous_secret IS NOT NULL
                    ORDER BY tenant_id, name FOR UPDATE"""
            ).fetchall()
            changed = current = 0
            for tenant, name, stored, stored_previous in rows:
                resealed = []
                for value in (stored, stored_previous):
                    if value is None or box.is_current(value):
                        resealed.append(value)
                        current += value is not None
                        continue
                    plain = box.open(value, tenant_id=tenant, name=name)
                    resealed.append(box.seal(plain, tenant_id=tenant, name=name))
                    changed += 1
                if resealed != [stored, stored_previous]:
                    conn.execute(
                        """UPDATE delivery_destinations SET secret = %s, previous_secret = %s
                            WHERE tenant_id = %s AND name = %s""",
                        (*resealed, tenant, name),
                    )
            return Rekeyed(changed, current, box.current_id)

        return retrying(self._pool, "seal destinations' secrets", work)
