-- An anomaly belongs to the operation's owner: tenant_id is now the tenant of the operation
-- (when it is known), so the owner sees every refused event aimed at its operations, including
-- those another tenant sent. That other tenant's id is kept apart, for operators only.
ALTER TABLE anomalies ADD COLUMN kind TEXT NOT NULL DEFAULT 'illegal'
    CHECK (kind IN ('illegal', 'foreign_tenant', 'awaiting_execution'));
ALTER TABLE anomalies ADD COLUMN source_tenant_id TEXT;
COMMENT ON COLUMN anomalies.source_tenant_id IS
    'operators only: the tenant that sent an event for another tenant''s operation';

-- Records too large to republish whole go to the dead-letter topic as a reference (coordinates,
-- size, digest, prefix); the original stays on its source topic.
ALTER TABLE dead_letters ADD COLUMN by_reference BOOLEAN NOT NULL DEFAULT false;
