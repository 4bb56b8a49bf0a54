-- One owner per operation: a lease with a fencing token. Whoever advances an operation holds
-- its lease; a new owner can take it only after it expired (or by force, for a cancel), and
-- takes it with a higher token. Events carry the token; the fold fences lower ones once a
-- higher one is recorded. Short-lived operational state: not an event, rebuilt by nobody.
CREATE TABLE operation_leases (
    operation_id TEXT PRIMARY KEY,
    tenant_id    TEXT NOT NULL,
    token        BIGINT NOT NULL CHECK (token >= 1),
    owner        TEXT NOT NULL,             -- process identity: name@host:pid/random
    expires_at   TIMESTAMPTZ NOT NULL,      -- by the database's clock, the only clock it trusts
    updated_at   TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX operation_leases_expired ON operation_leases (expires_at);

-- The request of each operation (canonical JSON of its arguments), stored with the lease
-- before the intent is recorded: a worker that resumes an intent whose owner went away needs
-- it, and events carry only its hash. Tenant-scoped, like results.
CREATE TABLE operation_requests (
    operation_id TEXT PRIMARY KEY,
    tenant_id    TEXT NOT NULL,
    tool_name    TEXT NOT NULL,
    request_hash TEXT NOT NULL CHECK (request_hash ~ '^sha256:[0-9a-f]{64}$'),
    body         BYTEA NOT NULL,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now()
);
