"""Results by reference (decision 015) without a server: the body the worker builds, how a
receiver parses and checks it, and the fetch signature both sides compute."""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from consumers.contract import ProblemError, parse_event
from ledger.destinations import Destination, Kind, new_secret
from ledger.pg import DatabaseUnavailableError
from ledger.result_fetch import fetch_signed, fetch_target, result_url, sign_fetch
from processors.delivery import result_endpoint
from processors.delivery.payload import Delivery
from processors.delivery.result_endpoint import ResultEndpoint

SECRET = "whsec_" + base64.b64encode(b"unit-by-reference-secret-01").decode()
OTHER = "whsec_" + base64.b64encode(b"unit-another-secret-0123456").decode()
OP = "op_01JD8Z8Z8Z8Z8Z8Z8Z8Z8Z8Z8Z"
RESULT = bytes(range(256)) * 300


def _delivery(url: str | None) -> Delivery:
    return Delivery(
        operation_id=OP,
        tenant_id="acme",
        tool_name="render_report",
        destination="crm",
        result_ref="sha256:" + hashlib.sha256(RESULT).hexdigest(),
        content_type="application/pdf",
        result=RESULT,
        result_url=url,
    )


URL = result_url("https://ledger.example/", "acme", "crm", OP)


def test_the_body_by_reference_names_the_url_and_size_and_carries_no_result() -> None:
    body = json.loads(_delivery(URL).body())
    assert (
        body["result_url"]
        == URL
        == f"https://ledger.example/results/{OP}?tenant=acme&destination=crm"
    )
    assert body["result_size"] == len(RESULT)
    assert "result_b64" not in body
    assert _delivery(URL).body() == _delivery(URL).body()  # every send: the same bytes
    inline = json.loads(_delivery(None).body())
    assert base64.b64decode(inline["result_b64"]) == RESULT and "result_url" not in inline


def test_a_receiver_takes_a_reference_only_where_it_can_fetch_and_checks_what_it_fetched() -> None:
    raw = _delivery(URL).body()
    with pytest.raises(ProblemError) as refused:
        parse_event(raw, OP, f"{OP}:crm")  # a queue consumer: no fetching there
    assert refused.value.problem.status == 422
    event = parse_event(raw, OP, f"{OP}:crm", by_reference=True)
    assert event.result is None
    assert event.with_result(RESULT).result == RESULT
    for wrong in (RESULT[:-1], RESULT + b"x", b"\x01" + RESULT[1:]):
        with pytest.raises(ProblemError) as mismatch:
            event.with_result(wrong)
        assert mismatch.value.problem.status == 422


@pytest.mark.parametrize(
    "change",
    [
        {"result_b64": "AAAA"},  # both forms at once
        {"result_size": None},  # a reference without its size
        {"result_size": -1},
        {"result_size": 16 * 1024 * 1024 + 1},
        {"result_url": "file:///etc/passwd"},
        {"result_url": "https://ledger.example/results/x y"},
    ],
)
def test_malformed_references_are_refused(change: dict[str, object]) -> None:
    body = json.loads(_delivery(URL).body())
    body.update(change)
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(ProblemError) as refused:
        parse_event(json.dumps(body).encode(), OP, None, by_reference=True)
    assert refused.value.problem.status == 422


def test_a_size_without_a_url_is_refused() -> None:
    body = json.loads(_delivery(None).body())
    body["result_size"] = len(RESULT)
    with pytest.raises(ProblemError):
        parse_event(json.dumps(body).encode(), OP, None, by_reference=True)


def test_a_fetch_signature_answers_for_one_operation_destination_and_tenant() -> None:
    now = datetime.now(UTC)
    headers = sign_fetch([SECRET], "acme", "crm", OP, now)
    assert fetch_signed(SECRET, headers, "acme", "crm", OP)
    assert not fetch_signed(OTHER, headers, "acme", "crm", OP)
    assert not fetch_signed(SECRET, headers, "globex", "crm", OP)
    assert not fetch_signed(SECRET, headers, "acme", "billing", OP)
    assert not fetch_signed(SECRET, headers, "acme", "crm", OP[:-1] + "0")
    stale = sign_fetch([SECRET], "acme", "crm", OP, now - timedelta(minutes=6))
    assert not fetch_signed(SECRET, stale, "acme", "crm", OP)
    rotating = sign_fetch([OTHER, SECRET], "acme", "crm", OP, now)
    assert fetch_signed(SECRET, rotating, "acme", "crm", OP)
    for broken in (
        {},
        dict(headers, **{"webhook-signature": "v1"}),
        dict(headers, **{"webhook-signature": "v1,@@@"}),
        dict(headers, **{"webhook-timestamp": "1e9"}),
        dict(headers, **{"webhook-timestamp": " " + headers["webhook-timestamp"]}),
    ):
        assert not fetch_signed(SECRET, broken, "acme", "crm", OP)


def test_the_signed_target_quotes_what_a_url_would_misread() -> None:
    target = fetch_target("acme", "team/crm:eu@x", OP)
    assert target == f"/results/{OP}?tenant=acme&destination=team%2Fcrm%3Aeu%40x"


class _DatabaseDown:
    """A destination store whose database does not answer (the edge's own error)."""

    def get_many(self, keys: object) -> dict[object, object]:
        raise DatabaseUnavailableError("the database does not answer")


def test_the_endpoint_answers_503_while_the_database_does_not_answer() -> None:
    endpoint = ResultEndpoint(None, _DatabaseDown(), None)  # type: ignore[arg-type]
    headers = sign_fetch([SECRET], "acme", "crm", OP, datetime.now(UTC))
    answer = endpoint.fetch(OP, {"tenant": "acme", "destination": "crm"}, headers)
    assert (answer.status, answer.content_type) == (503, "application/problem+json")
    assert endpoint.fetch("op_x", {"tenant": "acme", "destination": "crm"}, headers).status == 400


class _Registry:
    """A destination store holding ``destinations`` (no database)."""

    def __init__(self, *destinations: Destination) -> None:
        self._held = {(d.tenant_id, d.name): d for d in destinations}

    def get_many(self, keys: list[tuple[str, str]]) -> dict[tuple[str, str], Destination]:
        return {k: self._held[k] for k in keys if k in self._held}


_AN_HOUR_ON = datetime.now(UTC) + timedelta(hours=1)


def _crm(**fields: Any) -> Destination:
    return Destination(
        "acme", "crm", Kind.WEBHOOK, "https://x", ("*",), 1000, True, None, secret=SECRET,
        **fields,
    )  # fmt: skip


@pytest.mark.parametrize(
    "registry",
    [
        _Registry(),
        _Registry(_crm()),
        _Registry(_crm(previous_secret=OTHER, previous_secret_until=_AN_HOUR_ON)),
    ],
    ids=["unknown destination", "one secret", "in a rotation's overlap"],
)  # fmt: skip
def test_a_refusal_makes_the_same_checks_whether_the_destination_exists_or_not(
    registry: _Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Decision 015: a 401 must not tell which destinations exist. An unknown destination used
    # to skip the signature checks, and answered measurably faster.
    checked: list[str] = []
    real = result_endpoint.fetch_signed

    def counting(secret: str, *args: Any) -> bool:
        checked.append(secret)
        return real(secret, *args)

    monkeypatch.setattr(result_endpoint, "fetch_signed", counting)
    endpoint = result_endpoint.ResultEndpoint(None, registry, None)  # type: ignore[arg-type]
    forged = sign_fetch([new_secret()], "acme", "crm", OP, datetime.now(UTC))
    answer = endpoint.fetch(OP, {"tenant": "acme", "destination": "crm"}, forged)
    assert answer.status == 401
    assert len(checked) == 2 and len(set(checked)) == 2
