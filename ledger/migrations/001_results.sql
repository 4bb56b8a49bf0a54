-- Durable, content-addressed results. Events carry only result_ref (sha256 of the payload), never
-- the payload: the seed's rule "store a durable result reference, then make delivery retryable".
-- Keyed by (tenant, content): with result_ref alone, tenant B storing the same bytes as tenant A
-- would hit ON CONFLICT DO NOTHING, could never read its own copy, and would learn that A holds
-- that content. One row per (tenant, content) costs some duplicate bytes and keeps tenants apart.
CREATE TABLE IF NOT EXISTS results (
    tenant_id    TEXT NOT NULL,
    result_ref   TEXT NOT NULL CHECK (result_ref ~ '^sha256:[0-9a-f]{64}$'),
    content_type TEXT NOT NULL,
    payload      BYTEA NOT NULL,
    size_bytes   INTEGER NOT NULL,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, result_ref)
);
