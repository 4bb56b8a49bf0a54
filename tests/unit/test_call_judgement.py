"""``ledger.domain.call.judge_answer``: what a provider's answer means, for every caller."""

from __future__ import annotations

import pytest

from ledger.domain.call import (
    UNLABELLED,
    CallOutcome,
    judge_answer,
    judge_raised,
    recordable_content_type,
)
from ledger.domain.states import ExecutionState as E

LIMIT = 10


def test_a_success_is_recorded_with_its_result_label_and_reference() -> None:
    judged = judge_answer(
        CallOutcome(True, result=b"ok", content_type="application/json", provider_ref="ch_1"),
        max_result_bytes=LIMIT,
    )
    assert (judged.state, judged.result, judged.content_type, judged.provider_ref) == (
        E.SUCCEEDED,
        b"ok",
        "application/json",
        "ch_1",
    )


def test_a_success_without_a_result_has_an_empty_one() -> None:
    assert judge_answer(CallOutcome(True), max_result_bytes=LIMIT).result == b""


def test_labels_and_references_no_store_or_event_takes_are_dropped_not_fatal() -> None:
    judged = judge_answer(
        CallOutcome(True, result=b"ok", content_type="not a type", provider_ref="has spaces"),
        max_result_bytes=LIMIT,
    )
    assert (judged.state, judged.content_type, judged.provider_ref) == (
        E.SUCCEEDED,
        UNLABELLED,
        None,
    )


def test_a_result_over_the_limit_is_unknown_never_an_error_to_retry() -> None:
    judged = judge_answer(CallOutcome(True, result=b"x" * (LIMIT + 1)), max_result_bytes=LIMIT)
    assert judged.state is E.UNKNOWN
    assert judged.error is not None and "over the result store's limit" in judged.error


def test_a_confirmed_failure_keeps_the_providers_words_storably() -> None:
    judged = judge_answer(CallOutcome(False, error="card\x00declined"), max_result_bytes=LIMIT)
    assert (judged.state, judged.error) == (E.FAILED, "card\ufffddeclined")
    assert judge_answer(CallOutcome(False), max_result_bytes=LIMIT).error


@pytest.mark.parametrize(
    "answer",
    [
        "ok",
        None,
        CallOutcome("yes"),  # type: ignore[arg-type]
        CallOutcome(True, result="text"),  # type: ignore[arg-type]
        CallOutcome(False, error=42),  # type: ignore[arg-type]
    ],
)
def test_an_answer_of_another_shape_cannot_say_and_is_unknown(answer: object) -> None:
    judged = judge_answer(answer, max_result_bytes=LIMIT)
    assert judged.state is E.UNKNOWN
    assert judged.error is not None and "cannot be told" in judged.error


def test_a_bytearray_result_is_taken_as_bytes() -> None:
    judged = judge_answer(CallOutcome(True, result=bytearray(b"ab")), max_result_bytes=LIMIT)  # type: ignore[arg-type]
    assert judged.result == b"ab" and isinstance(judged.result, bytes)


def test_a_call_that_raised_is_unknown_in_words_that_say_how() -> None:
    lost = judge_raised("ContactLost", "timeout", contact_lost=True)
    assert (lost.state, lost.error) == (E.UNKNOWN, "contact lost after dispatch: timeout")
    crash = judge_raised("ValueError", "boom", contact_lost=False)
    assert (crash.state, crash.error) == (E.UNKNOWN, "ValueError: boom")


def test_content_types() -> None:
    assert recordable_content_type("text/plain; charset=utf-8") == "text/plain; charset=utf-8"
    assert recordable_content_type("text/plain\r\nX: y") == UNLABELLED
