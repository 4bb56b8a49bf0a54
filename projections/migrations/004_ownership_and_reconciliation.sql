-- Recovery: who owns an operation (the highest lease token seen), what reconciliation decided,
-- and on which partition the operation lives (the recovery worker works on the partitions its
-- consumer group assigned to it).
ALTER TABLE agent_operations
    ADD COLUMN lease_token     BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN permit_attempt  INTEGER,          -- the attempt a NEW_ATTEMPT decision permits
    ADD COLUMN permit_decision TEXT,             -- ... and that decision's event id
    ADD COLUMN parked          TEXT,             -- why it waits for a person (PARK / REFUSE)
    ADD COLUMN cancelled       BOOLEAN NOT NULL DEFAULT false,
    ADD COLUMN decision        TEXT,             -- the last reconciliation decision
    ADD COLUMN decided_at      TIMESTAMPTZ,
    ADD COLUMN controls        TEXT[] NOT NULL DEFAULT '{}',  -- ownership/decision event ids
    ADD COLUMN kafka_partition INTEGER;
COMMENT ON COLUMN agent_operations.seen IS
    'STATE:attempt:event_id of every transition recorded (STATE:attempt in rows written before '
    'event ids were kept): a resend of the same event is a duplicate, another event a conflict';
CREATE INDEX agent_operations_recovery ON agent_operations (kafka_partition, execution_state)
    WHERE execution_state IN ('INTENT_RECORDED', 'DISPATCHED', 'UNKNOWN');
CREATE INDEX agent_operations_parked ON agent_operations (tenant_id, decided_at)
    WHERE parked IS NOT NULL;

-- Ownership changes and decisions are history too.
ALTER TABLE operation_history DROP CONSTRAINT operation_history_machine_check;
ALTER TABLE operation_history ADD CONSTRAINT operation_history_machine_check
    CHECK (machine IN ('execution', 'delivery', 'control'));

ALTER TABLE anomalies DROP CONSTRAINT anomalies_kind_check;
ALTER TABLE anomalies ADD CONSTRAINT anomalies_kind_check CHECK (kind IN
    ('illegal', 'foreign_tenant', 'awaiting_execution', 'conflict', 'fenced'));

-- Every reconciliation decision with its evidence: what the provider said, which policy
-- version decided, and why. One row per decision event.
CREATE TABLE reconciliations (
    topic          TEXT NOT NULL,
    partition      INTEGER NOT NULL,
    "offset"       BIGINT NOT NULL,
    event_id       TEXT NOT NULL,
    operation_id   TEXT NOT NULL,
    tenant_id      TEXT NOT NULL,
    actor_id       TEXT NOT NULL,
    attempt        INTEGER NOT NULL,
    decision       TEXT NOT NULL,
    lookup         TEXT NOT NULL,
    provider_ref   TEXT,
    result_ref     TEXT,
    policy_version TEXT,
    policy_allowed BOOLEAN NOT NULL,
    lease_token    BIGINT,
    reason         TEXT NOT NULL,
    occurred_at    TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (topic, partition, "offset")
);
CREATE INDEX reconciliations_operation ON reconciliations (tenant_id, operation_id, occurred_at);
