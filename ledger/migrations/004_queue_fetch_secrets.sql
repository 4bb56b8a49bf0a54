-- A queue destination may now hold a secret too: not to sign its records (the broker guards
-- the topic) but for its consumer to sign fetches of results delivered by reference
-- (decision 016). A webhook still needs one.
ALTER TABLE delivery_destinations
    DROP CONSTRAINT delivery_destinations_check,
    ADD CONSTRAINT delivery_destinations_webhook_has_secret
        CHECK (kind = 'queue' OR secret IS NOT NULL);
