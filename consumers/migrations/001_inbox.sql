-- The reference consumer's own tables, in its own database (OPLEDGER_CONSUMER_PG_DSN).

-- One row per accepted key. The primary key, not a prior SELECT, is what makes a concurrent
-- duplicate wait for the first transaction and then find the key taken. Inserted in the same
-- transaction as the change it guards.
CREATE TABLE consumer_inbox (
    consumer     TEXT        NOT NULL,
    operation_id TEXT        NOT NULL,
    -- sha256 of the raw body bytes: same key, other fingerprint = the key reused (422)
    fingerprint  BYTEA       NOT NULL CHECK (octet_length(fingerprint) = 32),
    received_at  TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    via          TEXT        NOT NULL CHECK (via IN ('http', 'queue')),
    -- what the change did: 'applied', or 'refused' by a change that declines an event (a
    -- resend then gets the same receipt and is not applied either)
    outcome      TEXT        NOT NULL CHECK (outcome IN ('applied', 'refused')),
    -- written to the key store and acknowledged by the broker
    published    BOOLEAN     NOT NULL DEFAULT false,
    published_at TIMESTAMPTZ,
    PRIMARY KEY (consumer, operation_id)
);

-- What the publisher's sweep looks for: rows whose key-store write a crash interrupted.
CREATE INDEX consumer_inbox_unpublished ON consumer_inbox (consumer, received_at)
    WHERE NOT published;

-- The reference consumer's change: one appended row per applied delivery. Deliberately NOT
-- unique on the operation: appending is not idempotent, so only the inbox keeps it once, and a
-- test counting these rows sees any duplicate the inbox let through.
CREATE TABLE consumer_applied_changes (
    change_id    BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer     TEXT        NOT NULL,
    operation_id TEXT        NOT NULL,
    tenant_id    TEXT        NOT NULL,
    tool_name    TEXT        NOT NULL,
    destination  TEXT        NOT NULL,
    result_ref   TEXT        NOT NULL,
    content_type TEXT        NOT NULL,
    result_bytes INTEGER     NOT NULL,
    applied_at   TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX consumer_applied_changes_operation ON consumer_applied_changes (consumer, operation_id);
