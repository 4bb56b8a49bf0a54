"""Where a webhook may be sent (decision 019): the pure address check, the setting that allows
refused networks, the registration check, the local stack's allowance, and the sender's check
at connection time against a real listener on loopback (no Kafka, no PostgreSQL)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.destinations import (
    AddressGuard,
    DestinationError,
    check_webhook_address,
    embedded_ipv4,
    refused_rule,
)
from ledger.settings import Settings, SettingsError, parse_networks
from opledger import supervisor
from opledger.cli import build_parser
from opledger.deliver import with_allowed
from processors.delivery.senders import AddressRefused, WebhookSend, WebhookSender
from tests.delivery_support import RawListener

HOME = {"OPLEDGER_HOME": "/srv/opledger"}
IP = ipaddress.ip_address


@pytest.mark.parametrize(
    ("address", "rule"),
    [
        ("127.0.0.1", "loopback"),
        ("127.255.255.254", "loopback"),
        ("10.0.0.1", "private, RFC 1918"),
        ("172.16.0.1", "private, RFC 1918"),
        ("172.31.255.255", "private, RFC 1918"),
        ("192.168.1.1", "private, RFC 1918"),
        ("169.254.169.254", "link-local"),
        ("100.64.0.0", "shared address space, RFC 6598"),
        ("100.127.255.255", "shared address space, RFC 6598"),
        ("0.0.0.0", "unspecified"),
        ("0.1.2.3", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("239.255.255.250", "multicast"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "reserved"),
        ("::", "unspecified"),
        ("::1", "loopback"),
        ("fe80::1", "link-local"),
        ("fe80::1%2", "link-local"),
        ("fc00::1", "private, unique local"),
        ("fd12:3456::1", "private, unique local"),
        ("fec0::1", "site-local, deprecated"),
        ("ff02::1", "multicast"),
        ("100::1", "reserved"),
        ("::ffff:127.0.0.1", "loopback, as IPv4-mapped 127.0.0.1"),
        ("::ffff:169.254.169.254", "link-local, as IPv4-mapped 169.254.169.254"),
        ("::ffff:10.0.0.1", "private, RFC 1918, as IPv4-mapped 10.0.0.1"),
        ("::127.0.0.1", "loopback, as IPv4-compatible 127.0.0.1"),
        ("::8.8.8.8", "reserved"),  # IPv4-compatible, deprecated: ::/8 is reserved
        ("2002:7f00:1::", "loopback, as 6to4 127.0.0.1"),
        ("2002:a9fe:a9fe::1", "link-local, as 6to4 169.254.169.254"),
        ("64:ff9b::a9fe:a9fe", "link-local, as NAT64 169.254.169.254"),
        ("64:ff9b::10.0.0.1", "private, RFC 1918, as NAT64 10.0.0.1"),
        ("64:ff9b:1::7f00:1", "loopback, as NAT64 127.0.0.1"),
        # Teredo: the client address is stored inverted.
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback, as Teredo 127.0.0.1"),
    ],
)
def test_refused_addresses_name_their_rule(address: str, rule: str) -> None:
    assert refused_rule(IP(address)) == rule


@pytest.mark.parametrize(
    "address",
    [
        "8.8.8.8",
        "1.1.1.1",
        "9.255.255.255",
        "11.0.0.0",
        "100.63.255.255",
        "100.128.0.0",
        "126.255.255.255",
        "128.0.0.0",
        "169.253.255.255",
        "169.255.0.0",
        "172.15.255.255",
        "172.32.0.0",
        "192.167.255.255",
        "192.169.0.0",
        "223.255.255.255",
        "2606:4700:4700::1111",
        "::ffff:8.8.8.8",
        "2002:808:808::1",
        "64:ff9b::8.8.8.8",
    ],
)
def test_public_addresses_are_not_refused(address: str) -> None:
    assert refused_rule(IP(address)) is None
    assert AddressGuard().refusal(IP(address)) is None


@given(st.ip_addresses(v=4))
def test_every_ipv4_address_the_ipaddress_module_calls_special_is_refused(
    address: ipaddress.IPv4Address,
) -> None:
    special = (
        address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_unspecified
        or address.is_reserved
        or any(address in ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12"))
        or address in ipaddress.ip_network("192.168.0.0/16")
        or address in ipaddress.ip_network("100.64.0.0/10")
        or address in ipaddress.ip_network("0.0.0.0/8")  # "this network"
    )
    assert (refused_rule(address) is not None) == special
    # Its IPv6 forms are refused exactly when it is.
    mapped = ipaddress.IPv6Address(f"::ffff:{address}")
    nat64 = ipaddress.IPv6Address(f"64:ff9b::{address}")
    sixtofour = ipaddress.IPv6Address((0x2002 << 112) | (int(address) << 80) | 1)
    for form in (mapped, nat64, sixtofour):
        assert (refused_rule(form) is not None) == special, form


@given(st.ip_addresses(v=6))
def test_every_ipv6_address_the_ipaddress_module_calls_special_is_refused(
    address: ipaddress.IPv6Address,
) -> None:
    if embedded_ipv4(address) is not None:
        return  # decided by the IPv4 address it carries (above)
    special = (
        address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_unspecified
        or address.is_reserved
        or address.is_site_local
        or address in ipaddress.ip_network("fc00::/7")
    )
    assert (refused_rule(address) is not None) == special


def test_an_allowance_allows_its_networks_and_their_ipv6_forms_only() -> None:
    guard = AddressGuard(parse_networks("127.0.0.0/8"))
    assert guard.refusal(IP("127.0.0.1")) is None
    assert guard.refusal(IP("127.9.9.9")) is None
    assert guard.refusal(IP("::ffff:127.0.0.1")) is None  # the same address
    assert guard.refusal(IP("::1")) == "loopback"
    assert guard.refusal(IP("10.0.0.1")) == "private, RFC 1918"
    both = AddressGuard(parse_networks("127.0.0.0/8, ::1/128 ,10.1.0.0/16"))
    assert both.refusal(IP("::1")) is None
    assert both.refusal(IP("10.1.2.3")) is None
    assert both.refusal(IP("10.2.0.1")) == "private, RFC 1918"
    assert both.refusal(IP("169.254.169.254")) == "link-local"
    # An allowance cannot refuse a public address, and a narrow one allows only itself.
    assert AddressGuard(parse_networks("127.0.0.2/32")).refusal(IP("127.0.0.1")) == "loopback"
    assert AddressGuard(parse_networks("127.0.0.2/32")).refusal(IP("8.8.8.8")) is None


# -- the setting ---------------------------------------------------------------------------------


def test_the_setting_is_empty_by_default_and_parses_cidrs() -> None:
    assert Settings.from_env(HOME).delivery_allowed_networks == ()
    s = Settings.from_env(
        {**HOME, "OPLEDGER_DELIVERY_ALLOW_NETWORKS": " 10.0.0.0/8, fd00::/8,127.0.0.1 ,"}
    )
    assert s.delivery_allowed_networks == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("fd00::/8"),
        ipaddress.ip_network("127.0.0.1/32"),
    )


@pytest.mark.parametrize(
    "raw",
    ["10.0.0.1/8", "10.0.0.0/33", "localhost", "10.0.0.0/8;fd00::/8", "fe80::/129", "*"],
)
def test_a_bad_network_is_a_settings_error_naming_the_variable(raw: str) -> None:
    with pytest.raises(SettingsError, match="OPLEDGER_DELIVERY_ALLOW_NETWORKS"):
        Settings.from_env({**HOME, "OPLEDGER_DELIVERY_ALLOW_NETWORKS": raw})
    with pytest.raises(SettingsError, match="OPLEDGER_DELIVERY_ALLOW_NETWORKS"):
        Settings(home=Path("/x")).with_(delivery_allow_networks=raw)


# -- registration ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://169.254.169.254/latest/meta-data/", "address 169.254.169.254 is in a refused "
         "network (link-local); allow it with OPLEDGER_DELIVERY_ALLOW_NETWORKS"),
        ("http://127.0.0.1:15432/", "(loopback)"),
        ("http://[::ffff:10.0.0.1]/", "address ::ffff:10.0.0.1 is in a refused network"),
        ("https://[::1]:16069/metrics", "(loopback)"),
        ("http://0.0.0.0:16066/", "(unspecified)"),
    ],
)  # fmt: skip
def test_registration_refuses_a_literal_address_in_a_refused_network(url: str, words: str) -> None:
    with pytest.raises(DestinationError) as refused:
        check_webhook_address(url, AddressGuard())
    assert words in str(refused.value)
    check_webhook_address(url, AddressGuard(parse_networks("0.0.0.0/0,::/0")))


def test_registration_leaves_host_names_to_send_time_and_still_checks_the_url() -> None:
    check_webhook_address("http://localhost:9/events", AddressGuard())
    check_webhook_address("https://hooks.example.com/in", AddressGuard())
    check_webhook_address("https://203.0.113.7/in", AddressGuard())
    with pytest.raises(DestinationError, match="not a URL"):
        check_webhook_address("http://[::1/", AddressGuard())
    with pytest.raises(DestinationError, match="credentials"):
        check_webhook_address("http://u:p@8.8.8.8/", AddressGuard())


# -- the local stack's delivery worker ---------------------------------------------------------


def test_the_local_stacks_delivery_worker_allows_loopback_and_nothing_else() -> None:
    spec = next(s for s in supervisor.WORKERS if s.name == "delivery")
    args = build_parser().parse_args(list(spec.args))
    assert args.handler == "opledger.deliver:run"
    settings = with_allowed(Settings.from_env(HOME), args.allow_networks)
    guard = AddressGuard(settings.delivery_allowed_networks)
    assert guard.refusal(IP("127.0.0.1")) is None
    assert guard.refusal(IP("::1")) is None
    assert guard.refusal(IP("10.0.0.1")) is not None
    assert guard.refusal(IP("169.254.169.254")) is not None
    # Added to what the operator allows, never instead of it.
    given_env = Settings.from_env({**HOME, "OPLEDGER_DELIVERY_ALLOW_NETWORKS": "10.0.0.0/8"})
    merged = AddressGuard(with_allowed(given_env, args.allow_networks).delivery_allowed_networks)
    assert merged.refusal(IP("10.0.0.1")) is None and merged.refusal(IP("127.0.0.1")) is None
    with pytest.raises(SettingsError, match="--allow-networks"):
        with_allowed(Settings.from_env(HOME), "127.0.0.1/8")


# -- the sender, at connection time ---------------------------------------------------------------


@pytest.fixture
def listener() -> Iterator[RawListener]:
    """Counts connections on 127.0.0.1 and answers every request on them 202, keeping them
    alive, and each request's head."""
    made = RawListener(b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n")
    yield made
    made.close()


@pytest.fixture
def sender() -> Iterator[WebhookSender]:
    made = WebhookSender(concurrency=4)
    yield made
    made.close()


def _resolving(sender: WebhookSender, answers: dict[str, list[str]]) -> Any:
    """Make the sender's loop resolve the names in ``answers`` to those addresses (others as
    usual); what the resolver was asked, in order."""
    loop: Any = sender._loop
    real = loop.getaddrinfo
    asked: list[str] = []

    async def getaddrinfo(host: str, port: int, **kwargs: Any) -> Any:
        asked.append(host)
        if host not in answers:
            return await real(host, port, **kwargs)
        return [
            (
                socket.AF_INET6 if ":" in a else socket.AF_INET,
                socket.SOCK_STREAM,
                socket.IPPROTO_TCP,
                "",
                (a, port, 0, 0) if ":" in a else (a, port),
            )
            for a in answers[host]
        ]

    loop.getaddrinfo = getaddrinfo
    return asked


def _send(sender: WebhookSender, url: str, guard: AddressGuard | None) -> Any:
    return sender.send_many([WebhookSend(url, {}, b"{}", 3.0)], guard=guard)[0]


def test_a_name_with_any_refused_address_is_refused_before_any_connection(
    sender: WebhookSender, listener: RawListener
) -> None:
    """A name whose answer mixes a public address and loopback (a rebinding resolver's
    favourite) is refused as a whole, whatever order the answer comes in."""
    _resolving(sender, {"mixed.test": ["203.0.113.7", "127.0.0.1"]})
    result = _send(sender, f"http://mixed.test:{listener.port}/", AddressGuard())
    assert isinstance(result, AddressRefused), result
    assert "host mixed.test resolves to 127.0.0.1" in result.detail
    assert listener.connections == 0


def test_the_connection_goes_to_the_address_checked_with_the_host_header_kept(
    sender: WebhookSender, listener: RawListener
) -> None:
    """The name is resolved once per connection, by the check, and the connection is made to
    the address that passed it (a second lookup could answer otherwise): the resolver is asked
    once, the listener sees one connection, and the request still names the host."""
    asked = _resolving(sender, {"hooks.test": ["127.0.0.1"]})
    guard = AddressGuard(parse_networks("127.0.0.1/32"))
    url = f"http://hooks.test:{listener.port}/in"
    assert _send(sender, url, guard).status == 202
    assert asked == ["hooks.test"]
    assert listener.connections == 1
    assert f"Host: hooks.test:{listener.port}".encode() in listener.heads[0]


def test_a_connection_opened_without_a_guard_is_not_reused_under_one(
    sender: WebhookSender, listener: RawListener
) -> None:
    url = f"http://127.0.0.1:{listener.port}/in"
    assert _send(sender, url, None).status == 202  # a caller that vouches for its URL
    assert _send(sender, url, None).status == 202  # on the same, kept-alive connection
    assert listener.connections == 1
    refused = _send(sender, url, AddressGuard())
    assert isinstance(refused, AddressRefused), refused
    assert (listener.connections, len(listener.heads)) == (1, 2)
