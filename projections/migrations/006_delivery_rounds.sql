-- Redrive: a person sends a dead-lettered delivery again (DEAD_LETTERED -> PENDING, with a
-- reason). That starts a new round of sends: its own attempt budget and retry horizon. The steps
-- of earlier rounds stay recognisable, so a late copy of one is a duplicate, not news.
ALTER TABLE deliveries
    ADD COLUMN redrives         INTEGER NOT NULL DEFAULT 0,
    ADD COLUMN retired          TEXT[] NOT NULL DEFAULT '{}',  -- event ids of earlier rounds
    ADD COLUMN round_started_at TIMESTAMPTZ;                   -- NULL: the first round

-- The delivery worker asks, every pass, for the deliveries that are due on its partitions.
CREATE INDEX deliveries_due ON deliveries (next_attempt_at, operation_id)
    WHERE state IN ('PENDING', 'SENT');
-- ... and an operator for the dead letters of a period (opledger deliveries redrive --since).
CREATE INDEX deliveries_dead_lettered ON deliveries (tenant_id, state_entered_at)
    WHERE state = 'DEAD_LETTERED';

-- The backoff a delivery waits is part of its history: when the next send was due.
ALTER TABLE operation_history ADD COLUMN next_attempt_at TIMESTAMPTZ;
