-- Current execution state per operation: the seed's agent_operations plus tenant, actor,
-- attempt, when the current state was entered, and the bookkeeping the fold needs.
CREATE TABLE agent_operations (
    operation_id     TEXT PRIMARY KEY,
    tenant_id        TEXT NOT NULL,
    actor_id         TEXT NOT NULL,
    tool_name        TEXT NOT NULL,
    request_hash     TEXT NOT NULL,
    execution_state  TEXT NOT NULL CHECK (execution_state IN
                       ('INTENT_RECORDED', 'DISPATCHED', 'SUCCEEDED', 'FAILED', 'UNKNOWN')),
    attempt          INTEGER NOT NULL,
    provider_ref     TEXT,
    result_ref       TEXT,
    error            TEXT,
    created_at       TIMESTAMPTZ NOT NULL,
    updated_at       TIMESTAMPTZ NOT NULL,
    state_entered_at TIMESTAMPTZ NOT NULL,
    version          INTEGER NOT NULL,          -- events applied; the optimistic-concurrency guard
    seen             TEXT[] NOT NULL            -- 'STATE:attempt' already recorded (duplicate check)
);
CREATE INDEX agent_operations_tenant_state ON agent_operations (tenant_id, execution_state, state_entered_at);
CREATE INDEX agent_operations_tenant_tool ON agent_operations (tenant_id, tool_name);

-- Current delivery state per (operation, destination).
CREATE TABLE deliveries (
    operation_id     TEXT NOT NULL,
    destination      TEXT NOT NULL,
    tenant_id        TEXT NOT NULL,
    actor_id         TEXT NOT NULL,
    state            TEXT NOT NULL CHECK (state IN ('PENDING', 'SENT', 'ACKED', 'DEAD_LETTERED')),
    attempts         INTEGER NOT NULL DEFAULT 0,
    result_ref       TEXT,
    next_attempt_at  TIMESTAMPTZ,
    error            TEXT,
    created_at       TIMESTAMPTZ NOT NULL,
    updated_at       TIMESTAMPTZ NOT NULL,
    state_entered_at TIMESTAMPTZ NOT NULL,
    version          INTEGER NOT NULL,
    seen             TEXT[] NOT NULL,
    PRIMARY KEY (operation_id, destination)
);
CREATE INDEX deliveries_tenant_state ON deliveries (tenant_id, state, state_entered_at);

-- Every event consumed, applied or not, with where it came from: the audit trail an analyst can
-- join to Kafka coordinates. (topic, partition, offset) is unique, so a redelivered record can
-- never be stored twice even if offset tracking were bypassed.
CREATE TABLE operation_history (
    topic          TEXT NOT NULL,
    partition      INTEGER NOT NULL,
    "offset"       BIGINT NOT NULL,
    event_id       TEXT NOT NULL,
    operation_id   TEXT NOT NULL,
    tenant_id      TEXT NOT NULL,
    actor_id       TEXT NOT NULL,
    machine        TEXT NOT NULL CHECK (machine IN ('execution', 'delivery')),
    destination    TEXT,                       -- delivery events only
    state          TEXT NOT NULL,
    attempt        INTEGER NOT NULL,
    outcome        TEXT NOT NULL CHECK (outcome IN ('applied', 'duplicate', 'anomaly')),
    provider_ref   TEXT,
    result_ref     TEXT,
    error          TEXT,
    occurred_at    TIMESTAMPTZ NOT NULL,
    projected_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition, "offset")
);
CREATE INDEX operation_history_operation ON operation_history (operation_id, occurred_at);

-- Illegal transitions: stored with the event and the reason, never applied.
CREATE TABLE anomalies (
    topic        TEXT NOT NULL,
    partition    INTEGER NOT NULL,
    "offset"     BIGINT NOT NULL,
    operation_id TEXT NOT NULL,
    tenant_id    TEXT NOT NULL,
    machine      TEXT NOT NULL,
    reason       TEXT NOT NULL,
    event        JSONB NOT NULL,
    detected_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition, "offset")
);
CREATE INDEX anomalies_tenant ON anomalies (tenant_id, detected_at);

-- The projector's consumed positions, committed in the same transaction as the rows they
-- produced (pyeventsourcing's tracking table). This, not Kafka's group offset, is where the
-- projector resumes.
CREATE TABLE projector_offsets (
    consumer     TEXT NOT NULL,
    topic        TEXT NOT NULL,
    partition    INTEGER NOT NULL,
    next_offset  BIGINT NOT NULL,
    updated_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, topic, partition)
);

-- Undecodable records sent to the dead-letter topic (kept here too so analysts can count them).
CREATE TABLE dead_letters (
    topic       TEXT NOT NULL,
    partition   INTEGER NOT NULL,
    "offset"    BIGINT NOT NULL,
    reason      TEXT NOT NULL,
    size_bytes  INTEGER NOT NULL,
    recorded_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition, "offset")
);
