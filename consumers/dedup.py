"""Deduplication on operation_id, shared by the HTTP receiver and the queue consumer.

For each event: the key view first (keys restored from the key store, and this instance's own),
which answers repeats without touching the database, and is what still refuses old keys when the
database was wiped; then the inbox transaction (:mod:`consumers.inbox`), which decides for new
keys; then, after the commit, the key goes to the key store. The order of the last steps is
where a crash can land, so each boundary is a named fault point:

- ``consumer.after_commit_before_publish``: committed, key not handed to the key store. A restart
  republishes it (the publisher's sweep of unpublished inbox rows); the sender, having no answer,
  resends and is told 202 duplicate.
- ``consumer.after_commit_before_response``: committed and handed over, no answer sent. Same
  recovery; the key may or may not have reached the broker, and the sweep covers both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from consumers.contract import Event
from consumers.inbox import Recorded, Verdict
from consumers.keystore import KeyEntry, KeyStorePublisher, KeyView
from consumers.metrics import ConsumerMetrics
from ledger.faults import fault_point

log = logging.getLogger("opledger.consumer")


@dataclass(frozen=True, slots=True)
class Decision:
    """What to tell the sender about one event, and where that was decided."""

    verdict: Verdict
    seen_in: str  # "view", "inbox", or "new" for a first receipt


class Deduplicator:
    """Known-key checks and settling for one consumer; the inbox transaction between them is
    :class:`consumers.inbox.Inbox`'s. Not thread-safe: the receiver calls it from its event
    loop only, the queue consumer from its one thread."""

    def __init__(
        self,
        consumer: str,
        view: KeyView,
        publisher: KeyStorePublisher,
        metrics: ConsumerMetrics,
    ) -> None:
        self.consumer = consumer
        self.view = view
        self._publisher = publisher
        self._metrics = metrics
        self._bound: dict[tuple[str, str], _Counters] = {}

    def known(self, event: Event) -> Decision | None:
        """The answer for a key in the view, or None when the inbox must decide."""
        seen = self.view.get(event.operation_id)
        if seen is None:
            return None
        verdict = Verdict.DUPLICATE if seen == event.fingerprint else Verdict.CONFLICT
        return Decision(verdict, "view")

    def settle(self, event: Event, decision: Decision, recorded: Recorded | None, via: str) -> None:
        """Count, remember, and (for a first receipt) publish the key; call before answering."""
        counters = self._counters(via, decision.seen_in)
        if decision.verdict is Verdict.CONFLICT:
            counters.conflicts.inc()
            log.debug("receipt refused: %s reused with another body", event.operation_id)
            return
        self.view.put(event.operation_id, event.fingerprint)
        if decision.verdict is Verdict.DUPLICATE:
            counters.duplicates.inc()
            log.debug(
                "receipt %s: duplicate (found in %s), change not applied again",
                event.operation_id,
                decision.seen_in,
            )
            return
        assert recorded is not None and recorded.received_at is not None
        outcome = recorded.outcome or "applied"
        counters.accepted.inc()
        self._metrics.changes.labels(self.consumer, outcome).inc()
        log.debug("receipt %s: accepted; change %s", event.operation_id, outcome)
        fault_point("consumer.after_commit_before_publish")
        entry = KeyEntry(
            self.consumer, event.operation_id, event.fingerprint, recorded.received_at, outcome
        )
        self._publisher.publish(entry)
        fault_point("consumer.after_commit_before_response")

    def _counters(self, via: str, seen_in: str) -> _Counters:
        # Label lookups cost a lock and a dict each; the combinations are few, so keep them.
        key = (via, seen_in)
        counters = self._bound.get(key)
        if counters is None:
            m, labels = self._metrics, (self.consumer, via)
            counters = _Counters(
                m.accepted.labels(*labels),
                m.duplicate_keys.labels(*labels, seen_in),
                m.key_conflicts.labels(*labels),
            )
            self._bound[key] = counters
        return counters


@dataclass(frozen=True, slots=True)
class _Counters:
    accepted: Any
    duplicates: Any
    conflicts: Any
