-- A policy change whose event id was folded already, from another offset, is a replay: kept in
-- the history with the reason and not applied (a signed record written again later must not
-- undo what followed it; decision 032).
ALTER TABLE policy_history ADD COLUMN refused_reason TEXT;
