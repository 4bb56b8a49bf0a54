-- A secret rotation keeps the secret it replaced for an overlap (decision 021): webhooks are
-- signed with both until then (Standard Webhooks carries several signatures, space-separated),
-- and a queue consumer's fetches may be signed with either, so a receiver switches to the new
-- secret when it is ready, not at the moment of the rotation.
ALTER TABLE delivery_destinations
    ADD COLUMN previous_secret TEXT
        CHECK (previous_secret IS NULL OR previous_secret ~ '^whsec_[A-Za-z0-9+/=]{16,}$'),
    ADD COLUMN previous_secret_until TIMESTAMPTZ,
    ADD CONSTRAINT delivery_destinations_previous_secret_until
        CHECK ((previous_secret IS NULL) = (previous_secret_until IS NULL));

-- Why a destination is disabled decides what its deliveries do (decision 021): disabled by an
-- operator, they wait and resume once it is enabled; disabled because it answered 410 Gone,
-- they are dead-lettered (it said it is gone), for a redrive once someone fixed it. Rows the
-- worker disabled before this column existed were disabled for a 410.
ALTER TABLE delivery_destinations ADD COLUMN gone BOOLEAN NOT NULL DEFAULT false;
UPDATE delivery_destinations SET gone = true
 WHERE NOT enabled AND changed_by = 'delivery-worker';
