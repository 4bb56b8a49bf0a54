-- Durable, content-addressed results. Events carry only result_ref (sha256 of the payload), never
-- the payload: the seed's rule "store a durable result reference, then make delivery retryable".
CREATE TABLE IF NOT EXISTS results (
    result_ref   TEXT PRIMARY KEY CHECK (result_ref ~ '^sha256:[0-9a-f]{64}$'),
    tenant_id    TEXT NOT NULL,
    content_type TEXT NOT NULL,
    payload      BYTEA NOT NULL,
    size_bytes   INTEGER NOT NULL,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now()
);
