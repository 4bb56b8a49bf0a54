-- Scope results by tenant. With result_ref alone as the key, tenant B storing the same bytes as
-- tenant A would hit ON CONFLICT DO NOTHING and could then never read its own result (the row is
-- A's), and the conflict itself would tell B that A holds that content. One row per
-- (tenant, content) costs some duplicate bytes and keeps tenants apart.
ALTER TABLE results DROP CONSTRAINT IF EXISTS results_pkey;
ALTER TABLE results ADD PRIMARY KEY (tenant_id, result_ref);
