-- The projector reports the age of the oldest unfinished operation per state and of the oldest
-- unfinished delivery per destination every few seconds (opledger_*_oldest_age_seconds). Partial
-- indexes over the unfinished rows keep those reads small when most operations are finished.
CREATE INDEX agent_operations_open_age ON agent_operations (execution_state, state_entered_at)
    WHERE execution_state IN ('INTENT_RECORDED', 'DISPATCHED', 'UNKNOWN');
CREATE INDEX deliveries_open_age ON deliveries (destination, state, state_entered_at)
    WHERE state IN ('PENDING', 'SENT');
