// `#[pg_test]`s of tenants and roles: bindings and their refusals, which tenant a role acts
// for, row-level security on the views, operator actions on another tenant's message, and
// the limits on message headers. (sqlstate, count and channel come from sql_api.rs.)

fn role(name: &str, grant: &str) {
    Spi::run(&format!("CREATE ROLE {name} NOLOGIN; GRANT {grant} TO {name}")).expect("role");
}

/// Runs `sql` as `role` (SET ROLE, as an application would) and returns to the superuser.
fn as_role<R>(role: &str, f: impl FnOnce() -> R) -> R {
    Spi::run(&format!("SET LOCAL ROLE {role}")).expect("set role");
    let r = f();
    Spi::run("RESET ROLE").expect("reset role");
    r
}

/// The SQLSTATE of `sql` run as `role` (the helper function is created as the superuser).
fn sqlstate_as(role: &str, sql: &str) -> String {
    Spi::run(SQLSTATE_OF).expect("helper");
    as_role(role, || {
        Spi::get_one_with_args::<String>("SELECT pg_temp.sqlstate_of($1)", &[sql.into()])
            .expect("spi")
            .expect("sqlstate")
    })
}

fn enqueue_as(role: &str, channel: &str, key: &str) -> i64 {
    as_role(role, || {
        Spi::get_one::<i64>(&format!(
            "SELECT outbox.enqueue('{channel}', '{{\"n\": 1}}', '{key}')"
        ))
        .expect("enqueue")
        .expect("id")
    })
}

#[pg_test]
fn bind_tenant_refuses_bad_input_and_writes_nothing() {
    role("t_app", "outbox_writer");
    let before = count("SELECT count(*) FROM outbox._tenant_bindings");
    let log_before = count("SELECT count(*) FROM outbox._operator_log");
    for (sql, code) in [
        ("SELECT outbox.bind_tenant('t_nobody', 'acme')", "42704"),
        ("SELECT outbox.bind_tenant('t_app', '')", "22023"),
        ("SELECT outbox.bind_tenant('t_app', NULL)", "22023"),
        ("SELECT outbox.bind_tenant(NULL, 'acme')", "22023"),
        ("SELECT outbox.bind_tenant('t_app', E'ac\\nme')", "22023"),
        ("SELECT outbox.bind_tenant('t_app', repeat('x', 129))", "22023"),
        ("SELECT outbox.unbind_tenant('t_app', '')", "22023"),
    ] {
        assert_eq!(sqlstate(sql), code, "{sql}");
    }
    assert_eq!(count("SELECT count(*) FROM outbox._tenant_bindings"), before);
    assert_eq!(count("SELECT count(*) FROM outbox._operator_log"), log_before);
    Spi::run(
        "CREATE OR REPLACE FUNCTION pg_temp.hint_of(stmt text) RETURNS text LANGUAGE plpgsql AS $$
         DECLARE h text;
         BEGIN
             EXECUTE stmt;
             RETURN NULL;
         EXCEPTION WHEN OTHERS THEN
             GET STACKED DIAGNOSTICS h = PG_EXCEPTION_HINT;
             RETURN h;
         END $$",
    )
    .expect("helper");
    let hint = Spi::get_one::<String>("SELECT pg_temp.hint_of('SELECT outbox.bind_tenant(NULL, ''acme'')')")
        .expect("spi")
        .unwrap_or_default();
    assert!(hint.contains("bind_tenant('app_writer', 'acme')"), "{hint:?}");

    Spi::run("SELECT outbox.bind_tenant('t_app', 'acme'); SELECT outbox.bind_tenant('t_app', 'acme')")
        .expect("bind twice");
    assert_eq!(count("SELECT count(*) FROM outbox._tenant_bindings WHERE role_name = 't_app'"), 1);
    assert_eq!(count("SELECT count(*) FROM outbox._operator_log WHERE action = 'bind_tenant' AND tenant = 'acme'"), 1);
    Spi::run("SELECT outbox.unbind_tenant('t_app', 'acme'); SELECT outbox.unbind_tenant('t_app', 'acme')")
        .expect("unbind twice");
    assert_eq!(count("SELECT count(*) FROM outbox._tenant_bindings WHERE role_name = 't_app'"), 0);
}

#[pg_test]
fn the_acting_tenant_follows_the_bindings() {
    channel("tn");
    role("t_one", "outbox_writer");
    role("t_two", "outbox_writer");
    role("t_star", "outbox_writer");
    role("t_none", "outbox_writer");
    role("t_group", "outbox_writer");
    role("t_member", "t_group");
    Spi::run(
        "SELECT outbox.bind_tenant('t_one', 'a');
         SELECT outbox.bind_tenant('t_two', 'a'); SELECT outbox.bind_tenant('t_two', 'b');
         SELECT outbox.bind_tenant('t_star', '*');
         SELECT outbox.bind_tenant('t_group', 'g')",
    )
    .expect("bind");
    let tenant_of = |id: i64| {
        Spi::get_one::<String>(&format!("SELECT tenant FROM outbox._messages WHERE id = {id}"))
            .unwrap()
            .unwrap()
    };
    assert_eq!(tenant_of(enqueue_as("t_one", "tn", "k1")), "a");
    assert_eq!(tenant_of(enqueue_as("t_member", "tn", "k2")), "g", "bound through membership");
    let superuser = Spi::get_one::<i64>("SELECT outbox.enqueue('tn', '{}', 'k3')").unwrap().unwrap();
    assert_eq!(tenant_of(superuser), "default");

    let enqueue = "SELECT outbox.enqueue('tn', '{}', 'k4')";
    assert_eq!(sqlstate_as("t_two", enqueue), "42501", "several tenants, none named");
    assert_eq!(sqlstate_as("t_star", enqueue), "42501", "'*' without outbox.tenant");
    assert_eq!(sqlstate_as("t_none", enqueue), "42501", "bound to nothing");
    Spi::run("SET LOCAL outbox.tenant = 'b'").unwrap();
    assert_eq!(tenant_of(enqueue_as("t_two", "tn", "k5")), "b");
    assert_eq!(tenant_of(enqueue_as("t_star", "tn", "k6")), "b");
    assert_eq!(sqlstate_as("t_one", enqueue), "42501", "t_one is not bound to b");
    Spi::run("SET LOCAL outbox.tenant = '*'").unwrap();
    assert_eq!(sqlstate_as("t_star", enqueue), "22023", "'*' is not a tenant");
    Spi::run("SET LOCAL outbox.tenant = ''").unwrap();

    // The same effect key in two tenants: two messages.
    Spi::run("SELECT outbox.bind_tenant('t_none', 'c')").unwrap();
    let a = enqueue_as("t_one", "tn", "shared-key");
    let c = enqueue_as("t_none", "tn", "shared-key");
    assert_ne!(a, c);
}

#[pg_test]
fn row_level_security_shows_a_role_its_own_tenant() {
    channel("rls");
    role("t_wa", "outbox_writer");
    role("t_wb", "outbox_writer");
    role("t_oa", "outbox_operator");
    Spi::run(
        "SELECT outbox.bind_tenant('t_wa', 'a'); SELECT outbox.bind_tenant('t_oa', 'a');
         SELECT outbox.bind_tenant('t_wb', 'b')",
    )
    .unwrap();
    let a = enqueue_as("t_wa", "rls", "ka");
    let b = enqueue_as("t_wb", "rls", "kb");
    Spi::run(&format!("UPDATE outbox._messages SET state = 'failed' WHERE id IN ({a}, {b})")).unwrap();

    let seen = |role: &str, sql: &str| as_role(role, || count(sql));
    assert_eq!(seen("t_wa", "SELECT count(*) FROM outbox.messages"), 1);
    assert_eq!(seen("t_wa", &format!("SELECT count(*) FROM outbox.messages WHERE id = {b}")), 0);
    assert_eq!(seen("t_wa", &format!("SELECT count(*) FROM outbox._messages WHERE id = {b}")), 0);
    assert_eq!(seen("t_oa", "SELECT count(*) FROM outbox.work_queue"), 1);
    assert_eq!(seen("t_oa", &format!("SELECT count(*) FROM outbox.work_queue WHERE id = {a}")), 1);
    assert_eq!(
        as_role("t_wa", || Spi::get_one::<String>(&format!("SELECT outbox.status({b})::text")).unwrap()),
        None,
        "another tenant's message is unknown"
    );
    for sql in [
        format!("SELECT outbox.retry({b}, 'r')"),
        format!("SELECT outbox.resolve({b}, 'delivered', 'r')"),
        format!("SELECT outbox.cancel({b}, 'r')"),
        format!("SELECT outbox.assign({b}, 'me')"),
        format!("SELECT outbox.reconcile({b})"),
    ] {
        assert_eq!(sqlstate_as("t_oa", &sql), "02000", "{sql}");
    }
    assert_eq!(sqlstate_as("t_oa", &format!("SELECT outbox.cancel({a}, 'r')")), "00000");
    assert_eq!(
        Spi::get_one::<String>(&format!("SELECT state::text FROM outbox._messages WHERE id = {b}")).unwrap().as_deref(),
        Some("failed")
    );
    // Writers neither act nor read secrets or figures.
    for sql in [
        format!("SELECT outbox.cancel({a}, 'r')"),
        "SELECT * FROM outbox._channels".to_string(),
        "SELECT * FROM outbox.metrics".to_string(),
        "SELECT outbox.create_channel('x', 'http://127.0.0.1:9/', '{}')".to_string(),
        "SELECT outbox.bind_tenant('t_wa', 'b')".to_string(),
        format!("UPDATE outbox._messages SET state = 'delivered' WHERE id = {a}"),
    ] {
        assert_eq!(sqlstate_as("t_wa", &sql), "42501", "{sql}");
    }
    let masked = as_role("t_oa", || {
        Spi::get_one::<String>("SELECT options::text FROM outbox.channels WHERE name = 'rls'").unwrap().unwrap()
    });
    assert!(!masked.contains("s3cret"), "{masked}");
}

#[pg_test]
fn message_headers_are_limited() {
    channel("hl");
    let many: Vec<String> = (0..33).map(|i| format!("\"X-H{i}\": \"v\"")).collect();
    for headers in [
        format!("{{{}}}", many.join(", ")),
        "{\"X-A\": \"line\\r\\nX-Injected: 1\"}".to_string(),
        format!("{{\"X-A\": \"{}\"}}", "v".repeat(8193)),
        format!("{{\"{}\": \"v\"}}", "X".repeat(257)),
        format!("{{\"X-A\": \"{0}\", \"X-B\": \"{0}\", \"X-C\": \"{0}\"}}", "v".repeat(6000)),
    ] {
        let sql = format!("SELECT outbox.enqueue('hl', '{{}}', 'k', headers => $h${headers}$h$::jsonb)");
        assert_eq!(sqlstate(&sql), "22023", "{}", &headers[..headers.len().min(80)]);
    }
    assert_eq!(count("SELECT count(*) FROM outbox._messages"), 0);
    assert_eq!(
        sqlstate("SELECT outbox.enqueue('hl', '{}', 'k', headers => '{\"X-A\": \"tab\\tok\"}')"),
        "00000"
    );
}

#[pg_test]
fn providers_receive_keys_qualified_by_tenant() {
    let key = |t: &str, k: &str| {
        Spi::get_one_with_args::<String>("SELECT outbox._provider_key($1, $2)", &[t.into(), k.into()])
            .unwrap()
            .unwrap()
    };
    assert_eq!(key("default", "order-17:reply"), "order-17:reply");
    assert_eq!(key("acme", "order-17:reply"), "4:acme:order-17:reply");
    assert_eq!(key("ü", "k"), "2:ü:k", "the length is in bytes");
    // No two (tenant, key) pairs meet: the tenant's length is part of the key.
    assert_ne!(key("a", "b:c"), key("a:b", "c"));
    assert_eq!(key("default", "4:acme:x"), "7:default:4:acme:x");
    assert_ne!(key("default", "4:acme:x"), key("acme", "x"));
    // NULL in, NULL out, as for a STRICT function.
    for (t, k) in [(None, Some("k")), (Some("default"), None), (Some("acme"), None)] {
        let got = Spi::get_one_with_args::<String>(
            "SELECT outbox._provider_key($1, $2)",
            &[t.into(), k.into()],
        )
        .unwrap();
        assert_eq!(got, None, "{t:?}, {k:?}");
    }
    // The worker's claim calls it once per message it takes: a function of the library,
    // not SQL with a regular expression (src/effect_key.rs).
    let (language, volatile, strict) = Spi::get_three::<String, String, bool>(
        "SELECT l.lanname::text, p.provolatile::text, p.proisstrict
           FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
          WHERE p.oid = 'outbox._provider_key(text, text)'::regprocedure",
    )
    .unwrap();
    assert_eq!(
        (language.as_deref(), volatile.as_deref(), strict),
        (Some("c"), Some("i"), Some(true))
    );
}

#[pg_test]
fn enqueue_ignores_the_callers_search_path() {
    // enqueue runs as its owner without a SET search_path clause: a caller whose search
    // path puts its own `=` operator and `now()` first must not get them called there.
    channel("sp");
    role("t_sp", "outbox_writer");
    Spi::run(
        "SELECT outbox.bind_tenant('t_sp', 'default');
         CREATE SCHEMA hostile;
         GRANT USAGE, CREATE ON SCHEMA hostile TO PUBLIC;
         CREATE TABLE hostile.calls (what text);
         GRANT INSERT ON hostile.calls TO PUBLIC;
         CREATE FUNCTION hostile.text_eq(text, text) RETURNS boolean LANGUAGE sql
             AS $$ INSERT INTO hostile.calls VALUES ('=') RETURNING $1 OPERATOR(pg_catalog.=) $2 $$;
         CREATE OPERATOR hostile.= (LEFTARG = text, RIGHTARG = text, FUNCTION = hostile.text_eq);
         CREATE FUNCTION hostile.now() RETURNS timestamptz LANGUAGE sql
             AS $$ INSERT INTO hostile.calls VALUES ('now') RETURNING pg_catalog.now() $$;
         CREATE FUNCTION hostile.array_agg(text) RETURNS text[] LANGUAGE sql
             AS $$ INSERT INTO hostile.calls VALUES ('array_agg') RETURNING ARRAY[$1] $$;",
    )
    .expect("hostile schema");
    Spi::run("SET LOCAL search_path = hostile, pg_catalog, public").unwrap();
    let as_writer = enqueue_as("t_sp", "sp", "k-hostile-1");
    let as_superuser = Spi::get_one::<i64>("SELECT outbox.enqueue('sp', '{}', 'k-hostile-2')")
        .unwrap()
        .unwrap();
    let again = enqueue_as("t_sp", "sp", "k-hostile-1");
    Spi::run("RESET search_path").unwrap();
    assert_eq!(again, as_writer, "the same effect key, the same message");
    assert_eq!(
        count(&format!(
            "SELECT count(*) FROM outbox._messages WHERE id IN ({as_writer}, {as_superuser}) AND tenant = 'default'"
        )),
        2
    );
    assert_eq!(count("SELECT count(*) FROM hostile.calls"), 0, "no function of the caller's schema ran");
    // The operator works where the caller's own statements use it: the test would see it.
    Spi::run("SET LOCAL search_path = hostile, pg_catalog").unwrap();
    Spi::run("SELECT 'a'::text = 'a'::text").unwrap();
    Spi::run("RESET search_path").unwrap();
    assert_eq!(count("SELECT count(*) FROM hostile.calls"), 1);
}

#[pg_test]
fn enqueue_sees_bindings_memberships_and_channels_changed_in_its_transaction() {
    // enqueue caches bindings and channels for the session; a change made earlier in the
    // same transaction is seen by the next call.
    channel("cc");
    role("t_cache", "outbox_writer");
    role("t_cache_group", "outbox_writer");
    Spi::run("SELECT outbox.bind_tenant('t_cache', 'a'); SELECT outbox.bind_tenant('t_cache_group', 'g')").unwrap();
    let tenant_of = |id: i64| {
        Spi::get_one::<String>(&format!("SELECT tenant FROM outbox._messages WHERE id = {id}"))
            .unwrap()
            .unwrap()
    };
    assert_eq!(tenant_of(enqueue_as("t_cache", "cc", "c1")), "a");
    Spi::run("SELECT outbox.unbind_tenant('t_cache', 'a'); SELECT outbox.bind_tenant('t_cache', 'b')").unwrap();
    assert_eq!(tenant_of(enqueue_as("t_cache", "cc", "c2")), "b", "a new binding");
    Spi::run("SELECT outbox.unbind_tenant('t_cache', 'b')").unwrap();
    assert_eq!(sqlstate_as("t_cache", "SELECT outbox.enqueue('cc', '{}', 'c3')"), "42501", "no binding left");
    Spi::run("GRANT t_cache_group TO t_cache").unwrap();
    assert_eq!(tenant_of(enqueue_as("t_cache", "cc", "c4")), "g", "a new membership");
    Spi::run("REVOKE t_cache_group FROM t_cache").unwrap();
    assert_eq!(sqlstate_as("t_cache", "SELECT outbox.enqueue('cc', '{}', 'c5')"), "42501", "membership revoked");

    // A channel that does not exist yet is not remembered as missing.
    assert_eq!(sqlstate("SELECT outbox.enqueue('cc_late', '{}', 'c6')"), "42704");
    channel("cc_late");
    assert_eq!(sqlstate("SELECT outbox.enqueue('cc_late', '{}', 'c6')"), "00000");
    assert_eq!(count("SELECT count(*) FROM outbox._messages m JOIN outbox._channels c ON c.id = m.channel_id WHERE c.name = 'cc_late'"), 1);
}
