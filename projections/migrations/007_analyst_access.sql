-- Analysts read the projections through roles bound to tenants (decision 030): every role in
-- opledger_analyst sees the rows of the tenants analyst_tenants binds it to, and none of any
-- other tenant's, whatever SQL it writes. The bindings are written by `opledger analysts add`,
-- which an analyst cannot run: it has no right on analyst_tenants but to read its own rows.

-- Roles belong to the cluster, not to one database: a database migrated at the same moment may
-- be creating it too.
DO $$
BEGIN
    CREATE ROLE opledger_analyst NOLOGIN;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL;
END
$$;

CREATE TABLE analyst_tenants (
    role_name  NAME NOT NULL,
    tenant_id  TEXT NOT NULL,
    bound_by   TEXT NOT NULL,
    bound_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (role_name, tenant_id)
);

-- The tenants the current role may read. STABLE, so a query evaluates it once, not per row;
-- SECURITY INVOKER (the default): it reads analyst_tenants under the caller's own policy.
CREATE FUNCTION analyst_tenant_ids() RETURNS SETOF TEXT
    LANGUAGE sql STABLE
    AS $$ SELECT tenant_id FROM analyst_tenants WHERE role_name = current_user $$;

ALTER TABLE analyst_tenants ENABLE ROW LEVEL SECURITY;
CREATE POLICY own_bindings ON analyst_tenants FOR SELECT TO opledger_analyst
    USING (role_name = current_user);

-- The projections an analyst reads. Row-level security applies to every role but the tables'
-- owner and superusers (the ledger's own processes today), so a role outside opledger_analyst
-- that is given SELECT by someone still sees no row: no policy lets it.
DO $$
DECLARE
    t TEXT;
BEGIN
    FOREACH t IN ARRAY ARRAY[
        'agent_operations', 'deliveries', 'operation_history', 'anomalies', 'reconciliations',
        'policy_grants', 'revoked_credentials', 'policy_history'
    ] LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format(
            'CREATE POLICY analyst_own_tenants ON %I FOR SELECT TO opledger_analyst '
            'USING (tenant_id IN (SELECT analyst_tenant_ids()))', t);
        EXECUTE format('GRANT SELECT ON %I TO opledger_analyst', t);
    END LOOP;
END
$$;

GRANT SELECT ON analyst_tenants TO opledger_analyst;
GRANT EXECUTE ON FUNCTION analyst_tenant_ids() TO opledger_analyst;

-- The documented views (README, "Analysts"): the columns an analyst asks about, under the
-- caller's own rights (security_invoker), so the policies above apply to them too.
CREATE SCHEMA analyst;
GRANT USAGE ON SCHEMA analyst TO opledger_analyst;

CREATE VIEW analyst.operations WITH (security_invoker = true) AS
    SELECT operation_id, tenant_id, actor_id, tool_name, execution_state, attempt, provider_ref,
           result_ref, error, parked, decision, decided_at, cancelled, created_at, updated_at,
           state_entered_at
      FROM agent_operations;

CREATE VIEW analyst.deliveries WITH (security_invoker = true) AS
    SELECT operation_id, tenant_id, actor_id, destination, state, attempts, result_ref, error,
           redrives, next_attempt_at, created_at, updated_at, state_entered_at
      FROM deliveries;

CREATE VIEW analyst.history WITH (security_invoker = true) AS
    SELECT *
      FROM operation_history;

CREATE VIEW analyst.reconciliations WITH (security_invoker = true) AS
    SELECT *
      FROM reconciliations;

CREATE VIEW analyst.policy_grants WITH (security_invoker = true) AS
    SELECT *
      FROM policy_grants;

GRANT SELECT ON ALL TABLES IN SCHEMA analyst TO opledger_analyst;

-- Nothing else is granted: the destinations (their signing secrets), leases and stored requests,
-- the result store, the projector's offsets and the dead letters (records of any tenant) stay
-- out of an analyst's reach (PUBLIC holds no right on them either).
