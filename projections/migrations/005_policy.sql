-- Policy, folded from the compacted policy topic. Each row is a function of the LAST record of
-- its subject (the topic's key) only, so a replay of the compacted topic rebuilds the same rows.

-- Current state per (tenant, principal, tool): a grant, or its revocation.
CREATE TABLE policy_grants (
    tenant_id             TEXT NOT NULL,
    principal             TEXT NOT NULL,           -- an actor id, or '*'
    tool_name             TEXT NOT NULL,           -- a tool name, or '*'
    revoked               BOOLEAN NOT NULL,
    destinations          TEXT[] NOT NULL,
    repeat_safe           BOOLEAN NOT NULL,
    expires_at            TIMESTAMPTZ,
    credential_id         TEXT,
    credential_scopes     TEXT[] NOT NULL,
    credential_expires_at TIMESTAMPTZ,
    version               TEXT NOT NULL,           -- event id of the record that set this state
    updated_at            TIMESTAMPTZ NOT NULL,    -- that record's occurred_at
    changed_by            TEXT NOT NULL,           -- that record's actor_id
    reason                TEXT,
    PRIMARY KEY (tenant_id, principal, tool_name)
);
COMMENT ON COLUMN policy_grants.version IS
    'event_id of the policy record that set this state: the policy version decisions cite';

-- A tenant's revoked credentials (credential ids are the tenant's own names).
CREATE TABLE revoked_credentials (
    tenant_id     TEXT NOT NULL,
    credential_id TEXT NOT NULL,
    revoked_at    TIMESTAMPTZ NOT NULL,
    version       TEXT NOT NULL,
    revoked_by    TEXT NOT NULL,
    reason        TEXT,
    PRIMARY KEY (tenant_id, credential_id)
);

-- Every policy record consumed, with its Kafka coordinates: the audit trail survives the
-- compaction of the topic (which keeps only the last record per subject).
CREATE TABLE policy_history (
    topic                 TEXT NOT NULL,
    partition             INTEGER NOT NULL,
    "offset"              BIGINT NOT NULL,
    event_id              TEXT NOT NULL,
    tenant_id             TEXT NOT NULL,
    actor_id              TEXT NOT NULL,
    change                TEXT NOT NULL CHECK (change IN ('GRANT', 'REVOKE', 'REVOKE_CREDENTIAL')),
    principal             TEXT NOT NULL,
    tool_name             TEXT NOT NULL,
    destinations          TEXT[] NOT NULL,
    repeat_safe           BOOLEAN NOT NULL,
    expires_at            TIMESTAMPTZ,
    credential_id         TEXT,
    credential_scopes     TEXT[] NOT NULL,
    credential_expires_at TIMESTAMPTZ,
    reason                TEXT,
    occurred_at           TIMESTAMPTZ NOT NULL,
    projected_at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition, "offset")
);
CREATE INDEX policy_history_tenant ON policy_history (tenant_id, occurred_at);
CREATE INDEX policy_history_event ON policy_history (event_id);
