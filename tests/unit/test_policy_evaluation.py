"""Policy, pure: the evaluation (exhaustively over which of the four grants a request can match
exist and are revoked), the PolicyChanged contract, the policy-topic keys, how the projector's
edge classifies policy records, and the CLI's refusal of bad input before anything is written."""

from __future__ import annotations

import argparse
import itertools
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from ledger.codec import DecodeError, default_codec
from ledger.domain.events import READING, PolicyChanged
from ledger.domain.ids import event_id
from ledger.domain.policy import (
    WILDCARD,
    CredentialRevocation,
    Grant,
    PolicyChange,
    PolicyRequest,
    Purpose,
    credential_key,
    evaluate,
    grant_key,
)
from ledger.domain.states import ExecutionState
from ledger.policy_keys import OperatorKey, PolicyKeyError, TrustedKeys, ensure_local_keys
from ledger.records import DeadLetter, SourcedEvent, SourcedPolicyChange
from ledger.settings import Settings
from opledger import policy as cli_policy
from opledger.cli import build_parser
from processors.batch_reader import classify
from tests.unit.factories import T0, T0_MS, execution, fresh_event_id

TENANT = "acme"
OTHER_TENANT = "globex"
ACTOR = "agent-7"
TOOL = "send_email"
NOW = T0


def _grant(principal: str = ACTOR, tool: str = TOOL, **fields: Any) -> Grant:
    values: dict[str, Any] = {
        "tenant_id": TENANT,
        "principal": principal,
        "tool_name": tool,
        "revoked": False,
        "version": f"v:{principal}:{tool}",
    }
    values.update(fields)
    return Grant(**values)


def _request(purpose: Purpose = Purpose.DISPATCH, **fields: Any) -> PolicyRequest:
    values: dict[str, Any] = {
        "tenant_id": TENANT,
        "actor_id": ACTOR,
        "tool_name": TOOL,
        "purpose": purpose,
        "now": NOW,
    }
    values.update(fields)
    return PolicyRequest(**values)


# -- evaluation --------------------------------------------------------------------------------

#: The four subjects a request for (ACTOR, TOOL) can match, most specific first.
SUBJECTS = [(ACTOR, TOOL), (ACTOR, WILDCARD), (WILDCARD, TOOL), (WILDCARD, WILDCARD)]


def _cases() -> list[tuple[tuple[tuple[str, str], bool], ...]]:
    """Every non-empty set of the four subjects, with every revoked/active assignment (80)."""
    cases = []
    for size in range(1, 5):
        for subset in itertools.combinations(SUBJECTS, size):
            for revoked in itertools.product((False, True), repeat=size):
                cases.append(tuple(zip(subset, revoked, strict=True)))
    return cases


@pytest.mark.parametrize("case", _cases(), ids=str)
def test_the_most_specific_grant_decides_whether_revoked_or_not(
    case: tuple[tuple[tuple[str, str], bool], ...],
) -> None:
    grants = [_grant(p, t, revoked=r) for (p, t), r in case]
    # Named independently of Grant.specificity: the first of SUBJECTS present decides.
    deciding = min(case, key=lambda c: SUBJECTS.index(c[0]))
    (principal, tool), revoked = deciding
    for order in (grants, list(reversed(grants))):  # input order never matters
        decision = evaluate(order, _request())
        assert decision.version == f"v:{principal}:{tool}"
        assert decision.allowed is not revoked
        if revoked:
            assert "revoked" in decision.reason


def test_a_revoked_specific_grant_is_not_overridden_by_a_broader_one() -> None:
    grants = [
        _grant(ACTOR, TOOL, revoked=True, version="ev-revoke"),
        _grant(WILDCARD, TOOL, version="ev-everyone"),
        _grant(WILDCARD, WILDCARD, version="ev-all"),
    ]
    decision = evaluate(grants, _request())
    assert not decision.allowed and decision.version == "ev-revoke"
    # Another actor of the tenant still has the broader grant.
    assert evaluate(grants, _request(actor_id="agent-8")).version == "ev-everyone"


def test_no_grant_is_a_refusal_with_a_reason_not_an_error() -> None:
    decision = evaluate([], _request())
    assert not decision.allowed and decision.version is None
    assert ACTOR in decision.reason and TOOL in decision.reason
    # Grants for other actors or tools do not match either.
    others = [_grant("agent-8", TOOL), _grant(ACTOR, "other_tool"), _grant("agent-8", WILDCARD)]
    assert evaluate(others, _request()).version is None


def test_another_tenants_grants_never_match() -> None:
    theirs = [
        _grant(WILDCARD, WILDCARD, tenant_id=OTHER_TENANT, version="theirs-all"),
        _grant(ACTOR, TOOL, tenant_id=OTHER_TENANT, version="theirs-exact"),
    ]
    decision = evaluate(theirs, _request())
    assert not decision.allowed and decision.version is None
    # ... nor does their revocation take ours away.
    ours = _grant(WILDCARD, WILDCARD, version="ours")
    revoked_there = _grant(ACTOR, TOOL, tenant_id=OTHER_TENANT, revoked=True)
    assert evaluate([revoked_there, ours], _request()).allowed


def test_expiry_is_an_instant_the_grant_no_longer_covers() -> None:
    grant = _grant(expires_at=NOW + timedelta(seconds=1))
    assert evaluate([grant], _request()).allowed
    at = evaluate([grant], _request(now=NOW + timedelta(seconds=1)))
    after = evaluate([grant], _request(now=NOW + timedelta(days=1)))
    for decision in (at, after):
        assert not decision.allowed and "expired" in decision.reason
        assert decision.version == grant.version


def test_an_expired_specific_grant_is_not_overridden_by_a_broader_one() -> None:
    grants = [_grant(expires_at=NOW), _grant(WILDCARD, WILDCARD)]
    decision = evaluate(grants, _request())
    assert not decision.allowed and decision.version == grants[0].version


def test_a_revoked_credential_refuses_and_cites_the_revocation() -> None:
    grant = _grant(credential_id="mail-key", credential_scopes=frozenset({"mail.send"}))
    assert evaluate([grant], _request(required_scope="mail.send")).allowed
    revocation = CredentialRevocation(TENANT, "mail-key", "ev-cred-revoked")
    decision = evaluate([grant], _request(required_scope="mail.send"), [revocation])
    assert not decision.allowed and decision.version == "ev-cred-revoked"
    assert "mail-key" in decision.reason and "revoked" in decision.reason


def test_another_tenants_credential_revocation_of_the_same_name_does_not_count() -> None:
    grant = _grant(credential_id="mail-key")
    theirs = CredentialRevocation(OTHER_TENANT, "mail-key", "ev-theirs")
    assert evaluate([grant], _request(), [theirs]).allowed
    other_name = CredentialRevocation(TENANT, "other-key", "ev-other")
    assert evaluate([grant], _request(), [other_name]).allowed


def test_an_expired_credential_refuses() -> None:
    grant = _grant(credential_id="mail-key", credential_expires_at=NOW + timedelta(hours=1))
    assert evaluate([grant], _request()).allowed
    decision = evaluate([grant], _request(now=NOW + timedelta(hours=1)))
    assert not decision.allowed and "expired" in decision.reason
    assert decision.version == grant.version


def test_a_missing_scope_refuses() -> None:
    with_scope = _grant(credential_id="k", credential_scopes=frozenset({"mail.read"}))
    decision = evaluate([with_scope], _request(required_scope="mail.send"))
    assert not decision.allowed and "mail.send" in decision.reason
    no_credential = _grant()
    assert not evaluate([no_credential], _request(required_scope="mail.send")).allowed
    assert evaluate([no_credential], _request()).allowed  # no scope asked: none needed


def test_deliver_needs_the_destination_in_the_grant() -> None:
    grant = _grant(destinations=frozenset({"webhook:crm"}))
    allowed = evaluate([grant], _request(Purpose.DELIVER, destination="webhook:crm"))
    assert allowed.allowed and "destination" in allowed.checks
    for destination in ("webhook:other", None):
        decision = evaluate([grant], _request(Purpose.DELIVER, destination=destination))
        assert not decision.allowed and decision.version == grant.version
    # A dispatch is not a delivery: destinations are not checked for it.
    assert evaluate([_grant()], _request(Purpose.DISPATCH, destination="anywhere")).allowed


def test_a_new_attempt_needs_repeat_safe() -> None:
    plain, repeatable = _grant(), _grant(repeat_safe=True)
    refused = evaluate([plain], _request(Purpose.NEW_ATTEMPT))
    assert not refused.allowed and "repeat" in refused.reason
    assert refused.version == plain.version
    allowed = evaluate([repeatable], _request(Purpose.NEW_ATTEMPT))
    assert allowed.allowed and "repeat allowed" in allowed.checks
    # The first dispatch does not need it.
    assert evaluate([plain], _request(Purpose.DISPATCH)).allowed


def test_a_cancelled_operation_is_refused_whatever_the_grants() -> None:
    full = _grant(repeat_safe=True, destinations=frozenset({"d"}))
    for purpose in Purpose:
        decision = evaluate([full], _request(purpose, destination="d", cancelled=True))
        assert not decision.allowed and "cancelled" in decision.reason
        assert decision.version is None


def test_an_allowed_decision_lists_every_check_it_made() -> None:
    grant = _grant(
        credential_id="k",
        credential_scopes=frozenset({"s"}),
        destinations=frozenset({"d"}),
        expires_at=NOW + timedelta(days=1),
    )
    decision = evaluate([grant], _request(Purpose.DELIVER, destination="d", required_scope="s"))
    assert decision.allowed
    assert decision.checks == (
        "tenant, actor and tool",
        "grant not expired",
        "credential valid",
        "credential scope",
        "destination",
    )


def test_a_request_without_a_time_zone_is_refused_where_it_is_made() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        _request(now=datetime(2026, 1, 1))  # the mistake under test


_ids = st.sampled_from(["a", "b", ACTOR, WILDCARD])
_tools = st.sampled_from(["t", TOOL, WILDCARD])
_foreign_grants = st.lists(
    st.builds(
        Grant,
        tenant_id=st.sampled_from([OTHER_TENANT, "initech"]),
        principal=_ids,
        tool_name=_tools,
        revoked=st.booleans(),
        version=st.text(min_size=1, max_size=5),
        repeat_safe=st.booleans(),
        credential_id=st.sampled_from([None, "k"]),
    ),
    max_size=8,
)
_own_grants = st.lists(
    st.builds(
        Grant,
        tenant_id=st.just(TENANT),
        principal=_ids,
        tool_name=_tools,
        revoked=st.booleans(),
        version=st.text(min_size=1, max_size=5),
        repeat_safe=st.booleans(),
        credential_id=st.sampled_from([None, "k"]),
    ),
    max_size=4,
    unique_by=lambda g: (g.principal, g.tool_name),
)


@given(
    ours=_own_grants,
    theirs=_foreign_grants,
    foreign_revoked=st.booleans(),
    purpose=st.sampled_from(list(Purpose)),
)
def test_other_tenants_policy_never_changes_a_decision(
    ours: list[Grant], theirs: list[Grant], foreign_revoked: bool, purpose: Purpose
) -> None:
    request = _request(purpose)
    alone = evaluate(ours, request)
    revocations = [CredentialRevocation(OTHER_TENANT, "k", "x")] if foreign_revoked else []
    assert evaluate([*theirs, *ours, *theirs], request, revocations) == alone
    if alone.allowed:
        assert alone.version is not None


# -- the record, its keys and its wire form ----------------------------------------------------


def _change(change: PolicyChange = PolicyChange.GRANT, **fields: Any) -> PolicyChanged:
    values: dict[str, Any] = {
        "event_id": fresh_event_id(),
        "tenant_id": TENANT,
        "actor_id": "cli:ops",
        "occurred_at": T0,
        "change": change,
        "principal": ACTOR,
        "tool_name": TOOL,
    }
    values.update(fields)
    return PolicyChanged(**values)


def test_the_key_formats_are_pinned() -> None:
    # Durable contracts: compaction keys on them. If this fails, add a new function instead.
    assert grant_key("acme", "agent-7", "send_email") == b'["grant","acme","agent-7","send_email"]'
    assert grant_key("acme", "*", "*") == b'["grant","acme","*","*"]'
    assert credential_key("acme", "mail-key") == b'["credential","acme","mail-key"]'


def test_keys_of_different_subjects_never_collide() -> None:
    # Ids may hold "/", ":" and "@": a joined string would make these two one key.
    assert grant_key("a/b", "c", "t") != grant_key("a", "b/c", "t")
    assert grant_key("a:b", "c", "t") != grant_key("a", "b:c", "t")
    assert credential_key("acme", "grant") != grant_key("acme", "grant", "x")


def test_a_change_is_keyed_by_its_subject() -> None:
    assert _change().subject_key() == grant_key(TENANT, ACTOR, TOOL)
    assert _change(PolicyChange.REVOKE, principal="*").subject_key() == grant_key(TENANT, "*", TOOL)
    revocation = _change(
        PolicyChange.REVOKE_CREDENTIAL, principal="*", tool_name="*", credential_id="mail-key"
    )
    assert revocation.subject_key() == credential_key(TENANT, "mail-key")


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"tenant_id": "*"}, "tenant_id"),
        ({"tenant_id": "a b"}, "tenant_id"),
        ({"principal": "**"}, "principal"),
        ({"principal": ""}, "principal"),
        ({"tool_name": "9tool"}, "tool_name"),
        ({"event_id": "ev_nope"}, "event_id"),
        ({"occurred_at": datetime(2026, 1, 1)}, "timezone-aware"),
        ({"destinations": ["a b"]}, "destinations"),
        ({"destinations": ["d", "d"]}, "more than once"),
        ({"destinations": [f"d{i}" for i in range(65)]}, "destinations"),
        ({"credential_scopes": ["s"]}, "needs credential_id"),
        ({"credential_expires_at": T0}, "needs credential_id"),
        ({"credential_id": "k", "credential_scopes": [f"s{i}" for i in range(65)]}, "scopes"),
        ({"credential_id": "k", "credential_scopes": ["s", "s"]}, "more than once"),
        ({"reason": "password=hunter2hunter2"}, "credential"),
        ({"reason": "x" * 1001}, "reason"),
        ({"reason": "nul\x00"}, "NUL"),
        ({"credential_id": "ghp_" + "a1B2c3D4e5" * 4}, "credential"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_an_invalid_grant_is_refused(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        _change(**fields)


@pytest.mark.parametrize(
    ("change", "fields", "problem"),
    [
        (PolicyChange.REVOKE, {"repeat_safe": True}, "no grant content"),
        (PolicyChange.REVOKE, {"destinations": ["d"]}, "no grant content"),
        (PolicyChange.REVOKE, {"expires_at": T0}, "no grant content"),
        (PolicyChange.REVOKE, {"credential_id": "k"}, "names no credential"),
        (PolicyChange.REVOKE_CREDENTIAL, {"principal": "*", "tool_name": "*"}, "credential_id"),
        (PolicyChange.REVOKE_CREDENTIAL, {"credential_id": "k"}, "principal and tool"),
        (
            PolicyChange.REVOKE_CREDENTIAL,
            {"credential_id": "k", "principal": "*", "tool_name": "*", "credential_scopes": ["s"]},
            "no grant content",
        ),
    ],
)
def test_a_revocation_carries_nothing_of_a_grant(
    change: PolicyChange, fields: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ValidationError, match=problem):
        _change(change, **fields)


def test_every_change_round_trips_through_the_codec() -> None:
    codec = default_codec()
    changes = [
        _change(
            destinations=["webhook:crm", "mailto:ops@example.com"],
            repeat_safe=True,
            expires_at=T0 + timedelta(days=30),
            credential_id="vault:mail/send",
            credential_scopes=["https://mail.example.com/auth/send", "mail.send"],
            credential_expires_at=T0 + timedelta(days=7),
            reason="quarterly review",
        ),
        _change(principal="*", tool_name="*"),
        _change(PolicyChange.REVOKE, reason="left the team"),
        _change(PolicyChange.REVOKE_CREDENTIAL, principal="*", tool_name="*", credential_id="k-1"),
    ]
    for change in changes:
        data = codec.encode(change)
        assert data[2:10] == codec.fingerprint("opledger.v1.PolicyChanged")
        assert codec.decode(data) == change
        with pytest.raises(DecodeError, match="policy change"):
            codec.decode_operation(data)


def test_history_is_read_as_it_is_even_where_a_writer_would_now_refuse() -> None:
    # The credential check is the writers' (see ledger.domain.events.READING).
    text = "password=hunter2hunter2"
    with pytest.raises(ValidationError):
        _change(reason=text)
    read = PolicyChanged.model_validate({**_change().model_dump(), "reason": text}, context=READING)
    assert read.reason == text


# -- the projector's edge ------------------------------------------------------------------------

POLICY_TOPIC = "acme-test.policy.v1"
EXECUTION_TOPIC = "acme-test.execution.v1"


OPERATOR = OperatorKey.generate()
TRUSTED = TrustedKeys([OPERATOR.public])


def _classify(topic: str, key: bytes | None, value: bytes | None) -> Any:
    return classify(
        default_codec(),
        topic=topic,
        partition=0,
        offset=7,
        key=key,
        value=value,
        timestamp_ms=T0_MS,
        policy_refusal=TRUSTED.refuses,
    )


def test_a_policy_record_keyed_by_its_subject_is_accepted_on_the_policy_topic() -> None:
    change = OPERATOR.sign(_change())
    item = _classify(POLICY_TOPIC, change.subject_key(), default_codec().encode(change))
    assert isinstance(item, SourcedPolicyChange) and item.event == change
    assert change.signed_by == OPERATOR.id and change.signature is not None


def _resigned(change: PolicyChanged, **fields: Any) -> PolicyChanged:
    """``change`` with ``fields`` changed after it was signed: what a forger who has a signed
    record but not the key can write."""
    return PolicyChanged.model_validate({**change.model_dump(), **fields})


@pytest.mark.parametrize(
    ("forged", "because"),
    [
        # the probe's forgery: written with the project's own codec, no key at all
        (lambda: _change(principal="*", tool_name="*", repeat_safe=True), "not signed"),
        (lambda: OperatorKey.generate().sign(_change()), "not a trusted operator key"),
        # a signed grant whose content was changed afterwards, field by field
        (lambda: _resigned(OPERATOR.sign(_change()), tool_name="wire_money"), "does not verify"),
        (lambda: _resigned(OPERATOR.sign(_change()), principal="*"), "does not verify"),
        (lambda: _resigned(OPERATOR.sign(_change()), repeat_safe=True), "does not verify"),
        (
            lambda: _resigned(OPERATOR.sign(_change()), destinations=("webhook:evil",)),
            "does not verify",
        ),
        (lambda: _resigned(OPERATOR.sign(_change()), actor_id="cli:ciso"), "does not verify"),
        (lambda: _resigned(OPERATOR.sign(_change()), reason="approved"), "does not verify"),
        (
            lambda: _resigned(
                OPERATOR.sign(_change()), occurred_at=datetime(2030, 1, 1, tzinfo=UTC)
            ),
            "does not verify",
        ),
        # a valid signature moved to another key's name
        (
            lambda: _resigned(OPERATOR.sign(_change()), signed_by=OperatorKey.generate().id),
            "not a trusted operator key",
        ),
        # the signature of one change on another
        (
            lambda: _resigned(
                OPERATOR.sign(_change(tool_name="other")),
                signature=OPERATOR.sign(_change()).signature,
            ),
            "does not verify",
        ),
    ],
)
def test_a_policy_change_not_signed_by_a_trusted_key_is_a_dead_letter(
    forged: Any, because: str
) -> None:
    change = forged()
    item = _classify(POLICY_TOPIC, change.subject_key(), default_codec().encode(change))
    assert isinstance(item, DeadLetter), item
    assert item.reason.startswith("policy change refused: ") and because in item.reason


def test_without_trusted_keys_no_policy_change_counts() -> None:
    change = OPERATOR.sign(_change())
    item = classify(
        default_codec(),
        topic=POLICY_TOPIC,
        partition=0,
        offset=7,
        key=change.subject_key(),
        value=default_codec().encode(change),
        timestamp_ms=T0_MS,
    )
    assert isinstance(item, DeadLetter) and "no trusted operator keys" in item.reason
    assert TrustedKeys([]).refuses(change) is not None


def test_a_signature_survives_the_codec_and_covers_every_field() -> None:
    change = OPERATOR.sign(
        _change(
            destinations=("webhook:crm", "queue:ops"),
            repeat_safe=True,
            expires_at=datetime(2031, 1, 1, tzinfo=UTC),
            credential_id="key-1",
            credential_scopes=("mail.send",),
            reason="ticket 42",
        )
    )
    read = default_codec().decode(default_codec().encode(change))
    assert TRUSTED.refuses(read) is None
    # Every field but the signature (and the Python-only kind) is in what the key signed: a
    # field added to the record and forgotten here would be one a forger could change.
    signed_fields = set(PolicyChanged.model_fields) - {"kind", "signature"}
    assert len(json.loads(change.signed_bytes())) == len(signed_fields) + 1  # + the format tag


def test_key_files_round_trip_and_are_private(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    key = ensure_local_keys(settings)
    assert settings.policy_signing_key_path.stat().st_mode & 0o077 == 0
    assert OperatorKey.load(settings.policy_signing_key_path).id == key.id
    assert TrustedKeys.load(settings.policy_trusted_keys_path).ids == (key.id,)
    assert ensure_local_keys(settings).id == key.id  # idempotent: the key is kept
    assert TrustedKeys.load(settings.policy_trusted_keys_path).ids == (key.id,)
    settings.policy_trusted_keys_path.write_text("ed25519:not-base64!\n")
    with pytest.raises(PolicyKeyError, match="line 1"):
        TrustedKeys.load(settings.policy_trusted_keys_path)
    assert TrustedKeys.load(tmp_path / "absent").ids == ()


@pytest.mark.parametrize(
    "key",
    [None, b"", grant_key(TENANT, ACTOR, "other"), grant_key(TENANT, "*", TOOL), b"op_x"],
)
def test_a_policy_record_keyed_otherwise_is_a_dead_letter(key: bytes | None) -> None:
    change = _change()
    item = _classify(POLICY_TOPIC, key, default_codec().encode(change))
    assert isinstance(item, DeadLetter) and "subject" in item.reason


def test_records_on_the_wrong_topic_are_dead_letters() -> None:
    codec = default_codec()
    change = _change()
    on_execution = _classify(EXECUTION_TOPIC, change.subject_key(), codec.encode(change))
    assert isinstance(on_execution, DeadLetter)
    assert on_execution.reason == "policy event on the execution topic"
    transition = execution(ExecutionState.INTENT_RECORDED, 0)
    on_policy = _classify(POLICY_TOPIC, transition.operation_id.encode(), codec.encode(transition))
    assert isinstance(on_policy, DeadLetter)
    assert on_policy.reason == "execution event on the policy topic"
    garbage = _classify(POLICY_TOPIC, change.subject_key(), b"not avro")
    assert isinstance(garbage, DeadLetter) and "C3 01" in garbage.reason
    tombstone = _classify(POLICY_TOPIC, change.subject_key(), None)
    assert isinstance(tombstone, DeadLetter) and tombstone.reason == "empty record value"
    # Operation records still take their own path.
    own = _classify(EXECUTION_TOPIC, transition.operation_id.encode(), codec.encode(transition))
    assert isinstance(own, SourcedEvent)


# -- the CLI refuses bad input before writing ------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["policy", *argv])


def test_the_cli_builds_the_change_it_is_asked_for() -> None:
    args = _args(
        "grant", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL,
        "--destination", "webhook:crm", "--repeat-safe", "--expires", "2d",
        "--credential", "mail-key", "--scope", "mail.send",
        "--credential-expires", "2030-01-01T00:00:00+02:00", "--by", "ops:alice",
    )  # fmt: skip
    change = cli_policy.grant_change(args, T0, bytes(10))
    assert args.handler == "opledger.policy:grant_command"
    assert change.change is PolicyChange.GRANT and change.actor_id == "ops:alice"
    assert change.destinations == ("webhook:crm",) and change.repeat_safe
    assert change.expires_at == T0 + timedelta(days=2)
    assert change.credential_expires_at == datetime(2029, 12, 31, 22, tzinfo=UTC)
    assert change.event_id == event_id(T0_MS, bytes(10))
    revoke = cli_policy.revoke_change(
        _args("revoke", "--tenant", TENANT, "--credential", "mail-key"), T0, bytes(10)
    )
    assert revoke.change is PolicyChange.REVOKE_CREDENTIAL
    assert revoke.subject_key() == credential_key(TENANT, "mail-key")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["grant", "--tenant", "a b", "--actor", ACTOR, "--tool", TOOL], "--tenant"),
        (["grant", "--tenant", TENANT, "--actor", "**", "--tool", TOOL], "--actor"),
        (["grant", "--tenant", TENANT, "--actor", ACTOR, "--tool", "1x"], "--tool"),
        (["grant", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL, "--expires", "1x"],
         "--expires"),
        (["grant", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL, "--expires",
          "2030-01-01T00:00:00"], "time zone"),
        (["grant", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL, "--expires",
          "2020-01-01T00:00:00Z"], "not in the future"),
        (["grant", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL, "--scope", "s"],
         "--credential"),
        (["grant", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL, "--destination",
          "d", "--destination", "d"], "more than once"),
        (["grant", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL, "--reason",
          "token=ghp_" + "a1B2c3D4e5" * 4], "--reason"),
        (["grant", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL, "--by", "no one"],
         "--by"),
        (["revoke", "--tenant", TENANT], "say what to revoke"),
        (["revoke", "--tenant", TENANT, "--actor", ACTOR], "say what to revoke"),
        (["revoke", "--tenant", TENANT, "--actor", ACTOR, "--tool", TOOL, "--credential", "k"],
         "not both"),
        (["revoke", "--tenant", TENANT, "--credential", "a b"], "--credential"),
    ],
)  # fmt: skip
def test_the_cli_refuses_bad_input_with_the_option_named(argv: list[str], message: str) -> None:
    args = _args(*argv)
    build = cli_policy.grant_change if argv[0] == "grant" else cli_policy.revoke_change
    with pytest.raises(cli_policy.InputError, match=message):
        build(args, T0, bytes(10))


def test_every_problem_is_reported_at_once() -> None:
    args = _args(
        "grant", "--tenant", "a b", "--actor", "**", "--tool", TOOL, "--expires", "1x",
    )  # fmt: skip
    with pytest.raises(cli_policy.InputError) as raised:
        cli_policy.grant_change(args, T0, bytes(10))
    assert {"--tenant", "--actor", "--expires"} <= {
        line.split(":")[0] for line in str(raised.value).splitlines()
    }
