-- Where results are delivered: per tenant, a named destination (a webhook URL or a Kafka
-- topic), for some tools (or '*'). The webhook signing secret (whsec_...) lives here, never in an
-- event or a log line: events name the destination, this table says where it is. Operational
-- configuration, changed by `opledger destinations`; who changed it and when is kept.
CREATE TABLE delivery_destinations (
    tenant_id       TEXT NOT NULL,
    name            TEXT NOT NULL CHECK (name ~ '^[a-z0-9][a-z0-9._-]{0,63}$'),
    kind            TEXT NOT NULL CHECK (kind IN ('webhook', 'queue')),
    target          TEXT NOT NULL,               -- the URL, or the topic
    secret          TEXT CHECK (secret IS NULL OR secret ~ '^whsec_[A-Za-z0-9+/=]{16,}$'),
    tools           TEXT[] NOT NULL CHECK (cardinality(tools) >= 1),  -- tool names, or '*'
    timeout_ms      INTEGER NOT NULL DEFAULT 10000 CHECK (timeout_ms BETWEEN 100 AND 120000),
    enabled         BOOLEAN NOT NULL DEFAULT true,
    disabled_reason TEXT,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    changed_by      TEXT NOT NULL,
    PRIMARY KEY (tenant_id, name),
    CHECK ((kind = 'webhook') = (secret IS NOT NULL))
);
CREATE INDEX delivery_destinations_tools ON delivery_destinations USING gin (tools);
