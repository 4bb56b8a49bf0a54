-- A database role per service (decision 034). The projector is the one writer of the
-- projections (it inserts and updates them; nobody but the owner deletes a row); the SDK and
-- the workers read them. Roles are made NOLOGIN here; the deployment
-- gives each its password (`opledger stack up` does on the local stack).

DO $$
DECLARE
    r TEXT;
BEGIN
    FOREACH r IN ARRAY ARRAY[
        'opledger_projector', 'opledger_sdk', 'opledger_recovery', 'opledger_delivery'
    ] LOOP
        BEGIN
            EXECUTE format('CREATE ROLE %I NOLOGIN', r);
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END LOOP;
END
$$;

-- The projector writes every tenant's rows with COPY, which row-level security does not allow
-- for a role it holds: the projector bypasses it (it folds the log; it answers no tenant's
-- question). Only a superuser may give that attribute. Changed only when missing: an ALTER ROLE
-- on every run races the same one in a database migrated at the same moment ("tuple
-- concurrently updated"), and the loser of that race finds the winner's change committed.
DO $$
BEGIN
    IF NOT (SELECT rolbypassrls FROM pg_roles WHERE rolname = 'opledger_projector') THEN
        BEGIN
            ALTER ROLE opledger_projector BYPASSRLS;
        EXCEPTION WHEN internal_error THEN
            NULL;
        END;
    END IF;
    IF NOT (SELECT rolbypassrls FROM pg_roles WHERE rolname = 'opledger_projector') THEN
        RAISE EXCEPTION 'role opledger_projector lacks BYPASSRLS after its migration';
    END IF;
END
$$;

GRANT SELECT ON schema_migrations
    TO opledger_projector, opledger_sdk, opledger_recovery, opledger_delivery;

DO $$
DECLARE
    t TEXT;
BEGIN
    FOREACH t IN ARRAY ARRAY[
        'agent_operations', 'deliveries', 'operation_history', 'anomalies', 'reconciliations',
        'policy_grants', 'revoked_credentials', 'policy_history', 'projector_offsets',
        'dead_letters'
    ] LOOP
        EXECUTE format('GRANT SELECT, INSERT, UPDATE ON %I TO opledger_projector', t);
        EXECUTE format(
            'GRANT SELECT ON %I TO opledger_sdk, opledger_recovery, opledger_delivery', t);
    END LOOP;
    -- The tables under row-level security (migration 007) let the services read every
    -- tenant's rows: they scope by tenant in their own queries, as the projector writes.
    FOREACH t IN ARRAY ARRAY[
        'agent_operations', 'deliveries', 'operation_history', 'anomalies', 'reconciliations',
        'policy_grants', 'revoked_credentials', 'policy_history'
    ] LOOP
        EXECUTE format(
            'CREATE POLICY services_read ON %I FOR SELECT '
            'TO opledger_sdk, opledger_recovery, opledger_delivery USING (true)', t);
    END LOOP;
END
$$;

GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO opledger_projector;
