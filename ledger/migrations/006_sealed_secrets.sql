-- Destinations' secrets are sealed at rest (decision 033): AES-256-GCM under a key the operator
-- provides, outside the database, so a dump, a backup or a reader of this table holds only
-- ciphertext. A secret stored in the clear before this migration stays readable until
-- `opledger destinations rekey` seals it; every new or rotated secret is sealed.
ALTER TABLE delivery_destinations
    DROP CONSTRAINT delivery_destinations_secret_check,
    DROP CONSTRAINT delivery_destinations_previous_secret_check,
    ADD CONSTRAINT delivery_destinations_secret_form CHECK (
        secret IS NULL
        OR secret ~ '^sealed1:[0-9a-f]{16}:[A-Za-z0-9_-]{40,}$'
        OR secret ~ '^whsec_[A-Za-z0-9+/=]{16,}$'),
    ADD CONSTRAINT delivery_destinations_previous_secret_form CHECK (
        previous_secret IS NULL
        OR previous_secret ~ '^sealed1:[0-9a-f]{16}:[A-Za-z0-9_-]{40,}$'
        OR previous_secret ~ '^whsec_[A-Za-z0-9+/=]{16,}$');
