-- Who signed each policy change (decision 032): the operator key's id and its signature, kept
-- with the state it set, so every reader can check a grant again before it allows anything.
-- Rows folded before signatures existed have none and allow nothing.
ALTER TABLE policy_grants ADD COLUMN signed_by TEXT, ADD COLUMN signature TEXT;
ALTER TABLE revoked_credentials ADD COLUMN signed_by TEXT, ADD COLUMN signature TEXT;
ALTER TABLE policy_history ADD COLUMN signed_by TEXT, ADD COLUMN signature TEXT;
