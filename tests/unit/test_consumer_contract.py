"""The receiving side of POST /events without a server: the idempotency key (quoted and bare),
the fingerprint, the body checks, signatures (through standardwebhooks), the problem documents,
and the key store's record layout."""

from __future__ import annotations

import base64
import hashlib
import json
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from consumers import contract
from consumers.contract import (
    PROBLEM_CONTENT_TYPE,
    PROBLEM_TYPE_PREFIX,
    ProblemError,
    fingerprint,
    parse_event,
    parse_idempotency_key,
)
from consumers.keystore import (
    KeyEntry,
    KeyRecordError,
    decode_entry,
    partition_of,
    record_key,
    restored_fingerprint,
)
from consumers.receiver import problem_response
from consumers.signatures import SignatureVerifier
from ledger.domain.ids import operation_id
from ledger.kafka import partition_for
from tests.consumer_support import (
    DESTINATION,
    OTHER_SECRET,
    SECRET,
    event_body,
    new_op_id,
    sign,
    signed_headers,
)

OP = operation_id(1_767_000_000_000, bytes(range(10)))
ids = st.builds(
    operation_id,
    st.integers(min_value=0, max_value=2**48 - 1),
    st.binary(min_size=10, max_size=10),
)


def _refused(call: object, *args: object) -> contract.Problem:
    with pytest.raises(ProblemError) as raised:
        call(*args)  # type: ignore[operator]  # any of the parsing functions
    return raised.value.problem


# --- Idempotency-Key ------------------------------------------------------------------------


@given(ids)
def test_quoted_and_bare_keys_name_the_same_operation(op_id: str) -> None:
    assert parse_idempotency_key([f'"{op_id}"']) == op_id
    assert parse_idempotency_key([op_id]) == op_id
    assert parse_idempotency_key([f'  "{op_id}" ']) == op_id


@pytest.mark.parametrize("values", [[], [""], ["   "], ["", ""]])
def test_a_missing_key_is_400_missing(values: list[str]) -> None:
    problem = _refused(parse_idempotency_key, values)
    assert (problem.status, problem.slug) == (400, "missing-idempotency-key")


@pytest.mark.parametrize(
    "value",
    [
        OP.lower(),
        OP[3:],
        "op_",
        OP + "0",
        OP[:-1],
        "op_01HZZZZZZZZZZZZZZZZZZZZZZI",  # I is not Crockford base32
        f'"{OP}',
        f'{OP}"',
        f'"{OP}";v=1',
        f'"{OP}\\""',
        f'"op_\\{OP[3:]}"',
        f"'{OP}'",
        '""',
        '"',
        f"{OP} {OP}",
        "sha256:" + "0" * 64,
    ],
)
def test_anything_but_an_operation_id_is_400_malformed(value: str) -> None:
    problem = _refused(parse_idempotency_key, [value])
    assert (problem.status, problem.slug) == (400, "malformed-idempotency-key")


def test_two_key_headers_are_malformed_even_when_equal() -> None:
    problem = _refused(parse_idempotency_key, [OP, OP])
    assert problem.slug == "malformed-idempotency-key"


# --- fingerprint ------------------------------------------------------------------------------


def test_fingerprint_is_sha256_of_the_raw_bytes() -> None:
    body = event_body(OP)
    assert fingerprint(body) == hashlib.sha256(body).digest()
    assert (
        contract.fingerprint_text(fingerprint(body)) == "sha256:" + hashlib.sha256(body).hexdigest()
    )


def test_the_same_json_value_in_other_bytes_has_another_fingerprint() -> None:
    body = event_body(OP)
    spaced = json.dumps(json.loads(body), indent=1).encode()
    assert json.loads(spaced) == json.loads(body)
    assert fingerprint(spaced) != fingerprint(body)


@given(st.binary(min_size=1, max_size=200), st.integers(min_value=0, max_value=7))
def test_one_flipped_bit_changes_the_fingerprint(body: bytes, bit: int) -> None:
    flipped = bytes([body[0] ^ (1 << bit)]) + body[1:]
    assert fingerprint(flipped) != fingerprint(body)


# --- body ---------------------------------------------------------------------------------------


def test_a_valid_body_becomes_an_event() -> None:
    body = event_body(OP, result=b"\x00\xffbinary")
    event = parse_event(body, OP, f"{OP}:{DESTINATION}")
    assert (event.operation_id, event.result, event.fingerprint) == (
        OP,
        b"\x00\xffbinary",
        fingerprint(body),
    )
    assert event.body.destination == DESTINATION


def test_unknown_members_are_ignored() -> None:
    data = json.loads(event_body(OP))
    data["added_later"] = {"x": 1}
    assert parse_event(json.dumps(data).encode(), OP, None).operation_id == OP


def _with(**changes: object) -> bytes:
    data = json.loads(event_body(OP))
    for name, value in changes.items():
        if value is None:
            del data[name]
        else:
            data[name] = value
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"not json", b"[1, 2]", b'"op"', b"null", b"42", b"\xff\xfe{}", b"{}}"],
)
def test_what_is_not_a_json_object_is_400(raw: bytes) -> None:
    problem = _refused(parse_event, raw, OP, None)
    assert (problem.status, problem.slug) == (400, "malformed-body")


@pytest.mark.parametrize(
    "raw",
    [
        b"{}",
        _with(tenant_id=None),
        _with(tenant_id=7),
        _with(tenant_id=""),
        _with(tool_name="1bad tool"),
        _with(destination=["a"]),
        _with(result_ref="sha256:xyz"),
        _with(content_type="not a type"),
        _with(result_b64="***"),
        _with(result_b64=base64.b64encode(b"other").decode()),
        _with(operation_id="op_nope"),
    ],
)
def test_a_json_object_that_is_no_valid_event_is_422(raw: bytes) -> None:
    problem = _refused(parse_event, raw, OP, None)
    assert (problem.status, problem.slug) == (422, "invalid-event")


def test_a_body_for_another_operation_is_422_key_mismatch() -> None:
    other = operation_id(1_767_000_000_001, bytes(range(10)))
    problem = _refused(parse_event, event_body(other), OP, None)
    assert (problem.status, problem.slug) == (422, "key-mismatch")


@pytest.mark.parametrize("webhook_id", [OP, f"{OP}:webhook:other", f"{OP}:", "x"])
def test_a_webhook_id_naming_another_delivery_is_422(webhook_id: str) -> None:
    problem = _refused(parse_event, event_body(OP), OP, webhook_id)
    assert (problem.status, problem.slug) == (422, "key-mismatch")


def test_details_never_echo_the_body() -> None:
    marker = "MARKER-7f3a"
    for raw in (
        _with(tenant_id=f"{marker} with space"),
        _with(tool_name=f"1{marker}"),
        f'{{"x": "{marker}"'.encode(),
    ):
        problem = _refused(parse_event, raw, OP, None)
        assert marker not in json.dumps(problem.document())


# --- signatures ---------------------------------------------------------------------------------

# standardwebhooks reads the real clock (its window cannot be given a clock), so the verifier's
# own clock is pinned to the real time as each test starts (not at import: a whole suite takes
# longer than the library's 5-minute window): both agree for the moment a test takes.
NOW = int(time.time())


@pytest.fixture(autouse=True)
def _pin_now() -> None:
    global NOW  # noqa: PLW0603 - read by the helpers below and by the verifier's clock
    NOW = int(time.time())


def _verifier(*secrets: str, tolerance_s: int = 300) -> SignatureVerifier:
    return SignatureVerifier(secrets or (SECRET,), tolerance_s=tolerance_s, clock=lambda: NOW)


def _headers(body: bytes, **overrides: object) -> dict[str, str]:
    headers = signed_headers(OP, body, timestamp=NOW)
    for option, value in overrides.items():
        name = option.replace("_", "-")
        if value is None:
            del headers[name]
        else:
            headers[name] = str(value)
    return headers


def test_a_correct_signature_passes_and_returns_the_webhook_id() -> None:
    body = event_body(OP)
    assert _verifier().verify(_headers(body), body) == f"{OP}:{DESTINATION}"


def test_the_signature_covers_every_byte_of_the_body() -> None:
    body = event_body(OP)
    headers = _headers(body)
    tampered = body.replace(b"acme", b"acmf")
    problem = _refused(_verifier().verify, headers, tampered)
    assert (problem.status, problem.slug) == (401, "bad-signature")
    problem = _refused(_verifier().verify, headers, body + b" ")
    assert problem.slug == "bad-signature"


def test_the_signature_covers_id_and_timestamp() -> None:
    body = event_body(OP)
    for change in ({"webhook_id": f"{OP}:webhook:other"}, {"webhook_timestamp": NOW - 1}):
        problem = _refused(_verifier().verify, _headers(body, **change), body)
        assert problem.slug == "bad-signature", change


def test_another_secret_does_not_verify_but_a_rotation_list_does() -> None:
    body = event_body(OP)
    headers = signed_headers(OP, body, timestamp=NOW, secret=OTHER_SECRET)
    assert _refused(_verifier().verify, headers, body).slug == "bad-signature"
    assert _verifier(SECRET, OTHER_SECRET).verify(headers, body) == f"{OP}:{DESTINATION}"


def test_one_matching_entry_among_several_signatures_passes() -> None:
    body = event_body(OP)
    wrong = sign(body, f"{OP}:{DESTINATION}", NOW, OTHER_SECRET)
    right = sign(body, f"{OP}:{DESTINATION}", NOW)
    headers = _headers(body, webhook_signature=f"v2,abc {wrong} {right}")
    assert _verifier().verify(headers, body)


@pytest.mark.parametrize("offset", [-301, 301, -100_000, 10**9])
def test_timestamps_outside_the_tolerance_are_stale(offset: int) -> None:
    body = event_body(OP)
    headers = signed_headers(OP, body, timestamp=NOW + offset)
    problem = _refused(_verifier().verify, headers, body)
    assert (problem.status, problem.slug) == (401, "stale-signature")


def test_a_tighter_tolerance_is_ours_to_set() -> None:
    body = event_body(OP)
    headers = signed_headers(OP, body, timestamp=NOW - 20)
    assert _verifier(tolerance_s=30).verify(headers, body)
    assert _refused(_verifier(tolerance_s=10).verify, headers, body).slug == "stale-signature"


@pytest.mark.parametrize("name", ["webhook_id", "webhook_timestamp", "webhook_signature"])
def test_a_missing_signature_header_is_401(name: str) -> None:
    body = event_body(OP)
    problem = _refused(_verifier().verify, _headers(body, **{name: None}), body)
    assert (problem.status, problem.slug) == (401, "missing-signature")


@pytest.mark.parametrize(
    "signature", ["v1", "v1,", "v1,!!!not-base64", "garbage", "v1,a,b", ",", "v1,YQ"]
)
def test_malformed_signatures_are_401_not_a_crash(signature: str) -> None:
    body = event_body(OP)
    problem = _refused(_verifier().verify, _headers(body, webhook_signature=signature), body)
    assert (problem.status, problem.slug) == (401, "bad-signature")


@pytest.mark.parametrize(
    "timestamp",
    ["1.767e9", f"0{NOW}", f"{NOW}.5", "-1", "now", "nan"],
    # Fixed ids: every pytest-xdist process must collect the same ones, and NOW moves.
    ids=["exponent", "leading zero", "fraction", "negative", "word", "nan"],
)
def test_timestamps_other_than_whole_seconds_are_refused(timestamp: str) -> None:
    body = event_body(OP)
    problem = _refused(_verifier().verify, _headers(body, webhook_timestamp=timestamp), body)
    assert problem.status == 401


def test_a_body_that_is_not_utf8_is_400_before_the_library_sees_it() -> None:
    body = b'{"x": "\xff"}'
    headers = _headers(event_body(OP))  # the library cannot even sign such a body
    problem = _refused(_verifier().verify, headers, body)
    assert (problem.status, problem.slug) == (400, "malformed-body")


def test_the_real_clock_accepts_a_fresh_request() -> None:
    body = event_body(OP)
    verifier = SignatureVerifier([SECRET])
    assert verifier.verify(signed_headers(OP, body, timestamp=int(time.time())), body)


# --- problem+json -------------------------------------------------------------------------------

FACTORIES = [
    contract.missing_key(),
    contract.malformed_key("d"),
    contract.missing_signature("d"),
    contract.bad_signature("d"),
    contract.stale_signature("d"),
    contract.unsupported_media_type("d"),
    contract.body_too_large(10),
    contract.malformed_body("d"),
    contract.invalid_event("d"),
    contract.key_mismatch("d"),
    contract.key_reused(OP),
    contract.in_progress(OP),
    contract.not_ready("d"),
    contract.unavailable("d"),
]


@pytest.mark.parametrize("error", FACTORIES, ids=lambda e: e.problem.slug)
def test_every_problem_is_an_rfc9457_document(error: ProblemError) -> None:
    problem = error.problem
    document = json.loads(problem.body())
    assert set(document) == {"type", "title", "status", "detail"}
    assert document["type"] == PROBLEM_TYPE_PREFIX + problem.slug
    assert document["status"] == problem.status and 400 <= problem.status < 600
    assert document["title"] and document["detail"]
    response = problem_response(problem)
    assert response.status == problem.status
    assert response.content_type == PROBLEM_CONTENT_TYPE
    assert ("Retry-After" in response.headers) == (problem.status in (409, 503))


def test_statuses_of_the_contract() -> None:
    statuses = {e.problem.slug: e.problem.status for e in FACTORIES}
    assert statuses == {
        "missing-idempotency-key": 400,
        "malformed-idempotency-key": 400,
        "missing-signature": 401,
        "bad-signature": 401,
        "stale-signature": 401,
        "unsupported-media-type": 415,
        "body-too-large": 413,
        "malformed-body": 400,
        "invalid-event": 422,
        "key-mismatch": 422,
        "key-reused": 422,
        "in-progress": 409,
        "not-ready": 503,
        "unavailable": 503,
    }


def test_titles_do_not_vary_with_the_occurrence() -> None:
    assert contract.malformed_key("a").problem.title == contract.malformed_key("b").problem.title


def test_the_202_body_says_receipt_only() -> None:
    assert contract.accepted_document(OP) == {"operation_id": OP, "delivery": "accepted"}


# --- key-store records --------------------------------------------------------------------------


def test_key_store_records_round_trip_and_name_consumer_and_operation() -> None:
    from datetime import UTC, datetime  # noqa: PLC0415

    entry = KeyEntry("reference", OP, bytes(range(32)), datetime(2026, 1, 2, tzinfo=UTC), "applied")
    key = record_key("reference", OP)
    assert key == f"reference/{OP}".encode()
    assert decode_entry(key, entry.encode()) == entry
    with pytest.raises(KeyRecordError):
        decode_entry(record_key("other", OP), entry.encode())
    for broken in (b"{}", b"[]", b"\xff", entry.encode().replace(b"sha256:", b"md5:")):
        with pytest.raises(KeyRecordError):
            decode_entry(key, broken)


def test_restore_reads_the_fingerprint_and_checks_the_value_against_the_key() -> None:
    from datetime import UTC, datetime  # noqa: PLC0415

    digest = bytes(range(32))
    value = KeyEntry("reference", OP, digest, datetime(2026, 1, 2, tzinfo=UTC), "applied").encode()
    assert restored_fingerprint("reference", OP, value) == digest
    other = operation_id(1_767_000_000_001, bytes(range(10)))
    for consumer, op, raw in (
        ("billing", OP, value),
        ("reference", other, value),
        ("reference", OP, b"not json"),
        ("reference", OP, b"[]"),
        ("reference", OP, value.replace(b"sha256:", b"sha1:")),
        ("reference", OP, value.replace(b"sha256:0001", b"sha256:01")),
    ):
        with pytest.raises(KeyRecordError):
            restored_fingerprint(consumer, op, raw)
    # Valid JSON in another layout (spaces, key order) is read too, by the JSON path.
    reordered = json.dumps(dict(reversed(json.loads(value).items())), indent=1).encode()
    assert reordered != value
    assert restored_fingerprint("reference", OP, reordered) == digest


@given(st.text(st.characters(codec="ascii", exclude_characters='"\\'), max_size=40))
def test_the_positional_read_agrees_with_json(accepted_at: str) -> None:
    import json as json_  # noqa: PLC0415

    digest = bytes(range(32))
    value = json_.dumps(
        {
            "accepted_at": accepted_at,
            "consumer": "reference",
            "fingerprint": "sha256:" + digest.hex(),
            "operation_id": OP,
            "outcome": "applied",
            "v": 1,
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    assert restored_fingerprint("reference", OP, value) == digest


@given(ids, st.integers(min_value=1, max_value=64))
def test_keys_are_on_their_operations_partition(op_id: str, partitions: int) -> None:
    # The key store is co-partitioned with the ledger's topics: the partition librdkafka puts
    # an operation's records on (ledger.kafka.partition_for, checked against the broker in
    # tests/integration/test_producer.py, and against Kafka's own vectors in
    # tests/unit/test_partitioner.py).
    assert partition_of(op_id, partitions) == partition_for(op_id.encode(), partitions)


def test_fresh_ids_parse() -> None:
    assert parse_idempotency_key([new_op_id()]).startswith("op_")


# --- the sender's side ----------------------------------------------------------------------------


def test_what_the_delivery_worker_sends_is_what_the_receiver_accepts() -> None:
    # The two halves of the wire contract, built by different people: the delivery worker's own
    # payload and header functions against the receiver's checks.
    from datetime import UTC, datetime  # noqa: PLC0415

    payload = pytest.importorskip("processors.delivery.payload")
    from ledger.domain.ids import content_ref  # noqa: PLC0415

    result = b'{"status":"sent","id":42}'
    delivery = payload.Delivery(
        OP, "acme", "send_email", "webhook:crm", content_ref(result), "application/json", result
    )
    body = delivery.body()
    headers = payload.webhook_headers(delivery, body, SECRET, datetime.now(UTC))
    key = parse_idempotency_key([headers["Idempotency-Key"]])
    webhook_id = SignatureVerifier([SECRET]).verify(headers, body)
    event = parse_event(body, key, webhook_id)
    assert (event.operation_id, event.result) == (OP, result)
    queue = {name.lower(): value.decode() for name, value in payload.queue_headers(delivery)}
    assert parse_event(body, parse_idempotency_key([queue["idempotency-key"]]), queue["webhook-id"])
