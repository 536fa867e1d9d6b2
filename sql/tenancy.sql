-- outbox_delivery: roles, tenants and row-level security (docs/security.md).
--
-- The role that acts is the session's role (`session_user`, or the role named by SET ROLE),
-- read by outbox._caller_oid() even inside SECURITY DEFINER functions; inside a sql effect
-- it is the effect's run_as role, acting for its message's tenant alone
-- (outbox._effect_tenant()). A role acts for the tenants it is bound to, directly or
-- through membership; a superuser for any.

-- Roles are cluster-wide: a second database (or a second CREATE EXTENSION) reuses them.
-- The worker's role bypasses row-level security: it alone works across tenants, and
-- PostgreSQL cannot use an index for a non-leakproof condition (such as a state = 'queued'
-- on an enum) under a policy, even one that lets every row through.
--
-- A role of these names that outbox_delivery did not create (its comment says who did) is
-- adopted only while it is as bare as the one it would create: no members, no memberships
-- and no attributes. Otherwise whoever made it would be handed the rights the extension
-- gives it (outbox_worker reads every tenant's rows). Any of the roles, ours included, that
-- has gained an attribute the extension never gives (LOGIN, SUPERUSER, CREATEROLE, ...) is
-- refused too.
DO $roles$
DECLARE
    v_marker constant text := 'Created by outbox_delivery; see docs/security.md.';
    r        text;
    v_role   record;
    v_extra  text[];
BEGIN
    FOREACH r IN ARRAY ARRAY['outbox_writer', 'outbox_operator', 'outbox_admin', 'outbox_worker'] LOOP
        SELECT a.oid, a.rolsuper, a.rolcreaterole, a.rolcreatedb, a.rolcanlogin,
               a.rolreplication, a.rolbypassrls,
               pg_catalog.shobj_description(a.oid, 'pg_authid') IS NOT DISTINCT FROM v_marker AS ours,
               EXISTS (SELECT FROM pg_catalog.pg_auth_members m WHERE m.roleid = a.oid) AS has_members,
               EXISTS (SELECT FROM pg_catalog.pg_auth_members m WHERE m.member = a.oid) AS is_member
          INTO v_role
          FROM pg_catalog.pg_roles a WHERE a.rolname = r;
        IF NOT FOUND THEN
            IF r = 'outbox_worker' THEN
                CREATE ROLE outbox_worker NOLOGIN BYPASSRLS;
            ELSE
                EXECUTE pg_catalog.format('CREATE ROLE %I NOLOGIN', r);
            END IF;
            EXECUTE pg_catalog.format('COMMENT ON ROLE %I IS %L', r, v_marker);
            CONTINUE;
        END IF;
        v_extra := array_remove(ARRAY[
            CASE WHEN v_role.rolsuper THEN 'SUPERUSER' END,
            CASE WHEN v_role.rolcreaterole THEN 'CREATEROLE' END,
            CASE WHEN v_role.rolcreatedb THEN 'CREATEDB' END,
            CASE WHEN v_role.rolcanlogin THEN 'LOGIN' END,
            CASE WHEN v_role.rolreplication THEN 'REPLICATION' END,
            CASE WHEN v_role.rolbypassrls AND r <> 'outbox_worker' THEN 'BYPASSRLS' END,
            CASE WHEN NOT v_role.ours AND v_role.has_members THEN 'members' END,
            CASE WHEN NOT v_role.ours AND v_role.is_member THEN 'memberships' END
        ], NULL);
        IF cardinality(v_extra) > 0 THEN
            RAISE EXCEPTION 'role % already exists with % that outbox_delivery does not give it',
                            r, array_to_string(v_extra, ', ')
                USING ERRCODE = '42710',
                      DETAIL = CASE WHEN v_role.ours THEN 'The role was created by outbox_delivery and changed since.'
                                    ELSE 'The role was not created by outbox_delivery.' END,
                      HINT = pg_catalog.format('Drop or rename role %I, or remove what is listed (ALTER ROLE %I NOLOGIN ..., REVOKE ...), then create the extension again.', r, r);
        END IF;
        IF NOT v_role.ours THEN
            -- A bare role of our name: adopted, and marked as ours from now on.
            IF r = 'outbox_worker' AND NOT v_role.rolbypassrls THEN
                ALTER ROLE outbox_worker BYPASSRLS;
            END IF;
            EXECUTE pg_catalog.format('COMMENT ON ROLE %I IS %L', r, v_marker);
        ELSIF r = 'outbox_worker' AND NOT v_role.rolbypassrls THEN
            ALTER ROLE outbox_worker BYPASSRLS;
        END IF;
    END LOOP;
END
$roles$;

-- Which tenants a role acts for. '*' means any tenant, one at a time, named by
-- SET outbox.tenant.
-- A binding holds the role itself (regrole: its oid), not its name: a role dropped and
-- created again under the same name is another role and inherits none of its bindings.
-- (pg_dump writes a regrole as the role's name, so a restore binds the roles of that name
-- in the target cluster.) role_name is the name it had when bound, for messages.
CREATE TABLE outbox._tenant_bindings (
    role_name  text        NOT NULL,
    role       regrole     NOT NULL,
    tenant     text        NOT NULL,
    bound_at   timestamptz NOT NULL DEFAULT pg_catalog.now(),
    bound_by   text        NOT NULL DEFAULT session_user,
    PRIMARY KEY (role, tenant)
);
COMMENT ON TABLE outbox._tenant_bindings IS
    'Which tenants each role acts for (private; change with outbox.bind_tenant / unbind_tenant).';
SELECT pg_catalog.pg_extension_config_dump('outbox._tenant_bindings', '');
-- enqueue caches a role's bindings for the session (src/config_cache.rs).
CREATE TRIGGER _tenant_bindings_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON outbox._tenant_bindings
    FOR EACH STATEMENT EXECUTE FUNCTION outbox._config_changed();

-- The effect key as providers see it, outbox._provider_key(tenant, effect_key), and a time
-- as milliseconds or microseconds since the Unix epoch, outbox._epoch_ms(t) and
-- outbox._epoch_us(t), are functions of the extension's library (src/effect_key.rs,
-- src/clock.rs). The claim reads every message's times through them, and the worker
-- qualifies each claimed key with the same Rust function as outbox._provider_key.

-- A tenant name: 1 to 128 bytes, no control characters; '*' only where allowed
-- (bindings): outbox._check_tenant_name(tenant, argument, star_allowed), in src/tenancy.rs.

-- The tenants the calling role is bound to, directly or through membership ('*' included).
-- Runs only inside the SECURITY DEFINER functions below and inside enqueue
-- (src/tenancy.rs), which caches its answer for the session.
-- PL/pgSQL, not SQL: PL/pgSQL keeps the query's plan for the session, where a SQL function
-- plans it again in every call.
CREATE FUNCTION outbox._caller_bindings() RETURNS text[]
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RETURN (SELECT coalesce(array_agg(DISTINCT b.tenant), '{}')
              FROM outbox._tenant_bindings b
              JOIN pg_catalog.pg_roles r ON r.oid = b.role
             WHERE pg_catalog.pg_has_role(outbox._caller_oid(), r.oid, 'USAGE'));
END
$fn$;

-- The tenants whose rows the calling role sees (row-level security calls this once per
-- query). A superuser bypasses row-level security and never needs it.
CREATE FUNCTION outbox._visible_tenants() RETURNS text[]
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_named  text := nullif(current_setting('outbox.tenant', true), '');
    v_effect text := outbox._effect_tenant();
    v_bound  text[];
BEGIN
    -- A sql effect sees its message's tenant alone, whatever its role is bound to.
    IF v_effect IS NOT NULL THEN
        RETURN CASE WHEN v_named IS NULL OR v_named = v_effect THEN ARRAY[v_effect] ELSE '{}' END;
    END IF;
    v_bound := outbox._caller_bindings();
    IF v_named IS NOT NULL THEN
        IF v_named = ANY (v_bound) OR ('*' = ANY (v_bound) AND v_named <> '*') THEN
            RETURN ARRAY[v_named];
        END IF;
        RETURN '{}';
    END IF;
    RETURN array_remove(v_bound, '*');
END
$fn$;
COMMENT ON FUNCTION outbox._visible_tenants() IS
    'The tenants whose rows the calling role may see: its bindings, or the one named by outbox.tenant.';

-- May the calling role see a channel? Admins see every channel, writers and operators
-- those whose option tenants lists one of their tenants (or '*'): outbox.channels, and the
-- operator log's rows about channels.
CREATE FUNCTION outbox._channel_visible(tenants jsonb) RETURNS boolean
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT outbox._caller_is_superuser()
        OR pg_catalog.pg_has_role(outbox._caller_oid(), 'outbox_admin', 'USAGE')
        OR tenants IS NULL
        OR tenants ? '*'
        OR tenants ?| outbox._visible_tenants()
$fn$;
COMMENT ON FUNCTION outbox._channel_visible(jsonb) IS
    'May the calling role see a channel that serves these tenants? Admins see every channel.';

-- A channel's option tenants as the calling role is shown them (outbox.channels and the
-- operator log's rows about channels): an admin sees the whole list; anyone else the
-- tenants of the list it may see itself, so that a tenant served by a shared channel does
-- not learn which other tenants it serves. ["*"] (every tenant) names no one and is shown.
CREATE FUNCTION outbox._shown_tenants(tenants jsonb) RETURNS jsonb
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT CASE WHEN outbox._caller_is_superuser()
                  OR pg_catalog.pg_has_role(outbox._caller_oid(), 'outbox_admin', 'USAGE')
                  OR pg_catalog.jsonb_typeof(tenants) IS DISTINCT FROM 'array'
                  OR tenants = '["*"]'::jsonb
                THEN tenants
                ELSE coalesce((SELECT pg_catalog.jsonb_agg(t.tenant ORDER BY t.n)
                                 FROM pg_catalog.jsonb_array_elements_text(tenants) WITH ORDINALITY AS t(tenant, n)
                                WHERE t.tenant = ANY (outbox._visible_tenants())),
                              '[]'::jsonb)
           END
$fn$;
COMMENT ON FUNCTION outbox._shown_tenants(jsonb) IS
    'A channel''s option tenants as the calling role is shown them: all of them to an admin, its own to anyone else.';

-- The channels whose rows of the operator log (its creation, a change of its options, a
-- pause, its circuit: rows without a tenant) the calling role may read: for an operator or
-- an admin, those outbox.channels shows it, as their option tenants stands now; for any
-- other role, none. The log's row-level security reads it once per query (a hashed
-- subquery), so it is granted to PUBLIC as outbox._visible_tenants is, and it answers
-- about the caller alone. A row about a channel deleted by hand is a superuser's to read.
CREATE FUNCTION outbox._visible_channels() RETURNS SETOF text
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT c.name FROM outbox._channels c
     WHERE (pg_catalog.pg_has_role(outbox._caller_oid(), 'outbox_operator', 'USAGE')
            OR pg_catalog.pg_has_role(outbox._caller_oid(), 'outbox_admin', 'USAGE'))
       AND outbox._channel_visible(c.options -> 'tenants')
$fn$;
COMMENT ON FUNCTION outbox._visible_channels() IS
    'The channels whose rows of the operator log the calling role may read: those outbox.channels shows an operator or an admin.';

-- May the calling role see a row of this tenant? (Used inside SECURITY DEFINER functions,
-- where row-level security does not apply. The helpers below run only inside those
-- functions: no one else may execute them. They pin their search path all the same, so that
-- none of them depends on its caller's for what its body names.)
CREATE FUNCTION outbox._tenant_visible(tenant text) RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT outbox._caller_is_superuser() OR _tenant_visible.tenant = ANY (outbox._visible_tenants())
$fn$;

-- The tenant the calling role writes for is resolved by enqueue itself
-- (tenancy::acting_tenant_of_caller in src/tenancy.rs).

-- The arguments of bind_tenant / unbind_tenant.
CREATE FUNCTION outbox._check_binding(role name, tenant text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF role IS NULL OR role = '' THEN
        RAISE EXCEPTION 'role must not be NULL or empty' USING ERRCODE = '22023',
            HINT = 'Name the role whose sessions act for the tenant, for example bind_tenant(''app_writer'', ''acme'').';
    END IF;
    PERFORM outbox._check_tenant_name(tenant, 'tenant', true);
END
$fn$;

CREATE FUNCTION outbox.bind_tenant(role name, tenant text) RETURNS void
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM outbox._check_binding(bind_tenant.role, bind_tenant.tenant);
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles r WHERE r.rolname = bind_tenant.role) THEN
        RAISE EXCEPTION 'role "%" does not exist', bind_tenant.role
            USING ERRCODE = '42704', HINT = 'Create the role first; bindings name existing roles.';
    END IF;
    INSERT INTO outbox._tenant_bindings (role_name, role, tenant)
    VALUES (bind_tenant.role, pg_catalog.quote_ident(bind_tenant.role)::regrole, bind_tenant.tenant)
    ON CONFLICT DO NOTHING;
    IF FOUND THEN
        INSERT INTO outbox._operator_log (action, tenant, detail)
        VALUES ('bind_tenant', bind_tenant.tenant, jsonb_build_object('role', bind_tenant.role::text));
    END IF;
END
$fn$;
COMMENT ON FUNCTION outbox.bind_tenant(name, text) IS
    'Lets a role (and its members) act for a tenant; ''*'' lets it act for any tenant named by SET outbox.tenant.';

CREATE FUNCTION outbox.unbind_tenant(role name, tenant text) RETURNS void
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM outbox._check_binding(unbind_tenant.role, unbind_tenant.tenant);
    -- The role of that name now, or a binding left behind by a dropped role of that name.
    DELETE FROM outbox._tenant_bindings b
     WHERE b.tenant = unbind_tenant.tenant
       AND (b.role = (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = unbind_tenant.role)
            OR (b.role_name = unbind_tenant.role
                AND NOT EXISTS (SELECT FROM pg_catalog.pg_roles r WHERE r.oid = b.role)));
    IF FOUND THEN
        INSERT INTO outbox._operator_log (action, tenant, detail)
        VALUES ('unbind_tenant', unbind_tenant.tenant, jsonb_build_object('role', unbind_tenant.role::text));
    ELSE
        RAISE NOTICE 'role "%" was not bound to tenant "%"', unbind_tenant.role, unbind_tenant.tenant;
    END IF;
END
$fn$;
COMMENT ON FUNCTION outbox.unbind_tenant(name, text) IS 'Removes a binding made by bind_tenant.';

-- Row-level security: readers see the rows of their tenants. Writers and operators have
-- SELECT only: every change goes through a function. The worker's role bypasses it; the
-- worker_rows policies let a role that merely belongs to outbox_worker (outbox.role set
-- to another role) work too, if more slowly.
ALTER TABLE outbox._messages ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox._attempts ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox._ledger ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox._operator_log ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox._tenant_bindings ENABLE ROW LEVEL SECURITY;

CREATE POLICY tenant_rows ON outbox._messages FOR SELECT
    USING (tenant = ANY ((SELECT outbox._visible_tenants())::text[]));
CREATE POLICY tenant_rows ON outbox._attempts FOR SELECT
    USING (tenant = ANY ((SELECT outbox._visible_tenants())::text[]));
CREATE POLICY tenant_rows ON outbox._ledger FOR SELECT
    USING (tenant = ANY ((SELECT outbox._visible_tenants())::text[]));
-- A row about a message or a binding is its tenant's; a row about a channel (no tenant) is
-- shown to the roles that may see the channel.
CREATE POLICY tenant_rows ON outbox._operator_log FOR SELECT
    USING (tenant = ANY ((SELECT outbox._visible_tenants())::text[])
           OR (tenant IS NULL AND channel IN (SELECT outbox._visible_channels())));

CREATE POLICY worker_rows ON outbox._messages TO outbox_worker USING (true) WITH CHECK (true);
CREATE POLICY worker_rows ON outbox._attempts TO outbox_worker USING (true) WITH CHECK (true);
CREATE POLICY worker_rows ON outbox._ledger TO outbox_worker USING (true) WITH CHECK (true);
CREATE POLICY worker_rows ON outbox._operator_log TO outbox_worker USING (true) WITH CHECK (true);
CREATE POLICY admin_rows ON outbox._tenant_bindings FOR SELECT TO outbox_admin USING (true);
