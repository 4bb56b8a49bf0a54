-- A database role per service (decision 034): each process signs in as its own role and holds
-- only the rights its work needs, so a leaked SDK password cannot read a destination's sealed
-- secret, rewrite a projection or delete a signed grant. Roles are made NOLOGIN here; the
-- deployment gives each its password (`opledger stack up` does on the local stack).

-- Roles belong to the cluster, not to one database: a database migrated at the same moment may
-- be creating them too.
DO $$
DECLARE
    r TEXT;
BEGIN
    FOREACH r IN ARRAY ARRAY['opledger_sdk', 'opledger_recovery', 'opledger_delivery'] LOOP
        BEGIN
            EXECUTE format('CREATE ROLE %I NOLOGIN', r);
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END LOOP;
END
$$;

-- Every service checks at start that the tables are the ones its code describes.
GRANT SELECT ON schema_migrations TO opledger_sdk, opledger_recovery, opledger_delivery;

-- The SDK and the recovery worker are the callers of tools: they keep results, leases and
-- stored requests. A result and a stored request are written once; a lease is taken, kept and
-- given up by updates. Nobody but the owner deletes any of them.
GRANT SELECT, INSERT ON results, operation_requests TO opledger_sdk, opledger_recovery;
GRANT SELECT, INSERT, UPDATE ON operation_leases TO opledger_sdk, opledger_recovery;

-- The delivery worker reads the results it sends and the destinations it sends them to (the
-- secrets sealed; it holds the key, not the database). It writes only whether a destination is
-- enabled (a 410 Gone disables it): never its target, its secret or its tools.
GRANT SELECT ON results TO opledger_delivery;
GRANT SELECT ON delivery_destinations TO opledger_delivery;
GRANT UPDATE (enabled, disabled_reason, gone, updated_at, changed_by) ON delivery_destinations
    TO opledger_delivery;
