//! Section 3: what each role may call and read, by calling it and from the catalog.

use super::*;

// ---------------------------------------------------------------------------------------
// 3. privileges
// ---------------------------------------------------------------------------------------

/// The `_`-prefixed (private) tables and views of the schema.
fn private_relations(su: &mut Client) -> Vec<String> {
    su.query(
        "SELECT c.relname::text FROM pg_class c
          WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm')
            AND c.relname LIKE '\\_%' ORDER BY 1",
        &[],
    )
    .expect("private relations")
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// A channel whose headers carry a secret, paused (nothing is sent on it): returns the
/// secret and the channel's name.
fn secret_channel(fx: &Fixture<'_>, su: &mut Client) -> (String, String) {
    let secret = unique("s3cr3t");
    let secret_ch = unique("ten_secret");
    create_channel(
        su,
        &secret_ch,
        &fx.sim.send_url(&secret_ch),
        &format!(
            r#"{{"headers": {{"Authorization": "Bearer {secret}", "X-Api-Key": "{secret}"}}}}"#
        ),
    );
    su.execute(
        "SELECT outbox.pause_channel($1, 'tenants test: nothing to send')",
        &[&secret_ch],
    )
    .unwrap_or_else(|e| panic!("pause {secret_ch}: {}", describe(&e)));
    (secret, secret_ch)
}

/// Calls that need a privilege the role has not: 42501 for a writer, an operator and a role
/// without outbox grants; nothing they tried changes anything.
#[test]
fn writers_operators_and_roles_without_grants_are_refused_what_they_are_not_granted() {
    let (_serial, cluster, mut su) = start();
    let fx = Fixture::new(&cluster);
    let (_, secret_ch) = secret_channel(&fx, &mut su);
    // Any binding a refused call might have created is removed at the end.
    let new_channel = unique("ten_nope");
    let endpoint = fx.sim.send_url(&new_channel);
    let a_id = fx.a_failed;
    let mut problems = Vec::new();

    // Calls that need a privilege the role has not: (what, sql, params).
    type Call<'c> = (&'static str, &'static str, Vec<&'c (dyn ToSql + Sync)>);
    let admin_calls: Vec<Call<'_>> = vec![
        (
            "create_channel",
            "SELECT outbox.create_channel($1::text, $2::text, '{}'::jsonb)",
            vec![&new_channel, &endpoint],
        ),
        (
            "alter_channel",
            "SELECT outbox.alter_channel($1::text, '{\"max_in_flight\": 3}'::jsonb)",
            vec![&fx.ok_ch],
        ),
        (
            "pause_channel",
            "SELECT outbox.pause_channel($1::text, 'tenants test')",
            vec![&fx.ok_ch],
        ),
        (
            "resume_channel",
            "SELECT outbox.resume_channel($1::text)",
            vec![&secret_ch],
        ),
        (
            "bind_tenant",
            "SELECT outbox.bind_tenant($1::text::name, $2::text)",
            vec![&fx.writer_a, &fx.b],
        ),
        (
            "unbind_tenant",
            "SELECT outbox.unbind_tenant($1::text::name, $2::text)",
            vec![&fx.writer_b, &fx.b],
        ),
        ("prometheus", "SELECT outbox.prometheus()", vec![]),
        ("metrics", "SELECT count(*) FROM outbox.metrics", vec![]),
        ("alerts", "SELECT count(*) FROM outbox.alerts", vec![]),
    ];
    let operator_calls: Vec<Call<'_>> = vec![
        (
            "retry",
            "SELECT outbox.retry($1::int8, 'tenants test')",
            vec![&a_id],
        ),
        (
            "resolve",
            "SELECT outbox.resolve($1::int8, 'cancelled', 'tenants test')",
            vec![&a_id],
        ),
        (
            "cancel",
            "SELECT outbox.cancel($1::int8, 'tenants test')",
            vec![&a_id],
        ),
        (
            "assign",
            "SELECT outbox.assign($1::int8, 'writer')",
            vec![&a_id],
        ),
        (
            "reconcile(id)",
            "SELECT outbox.reconcile($1::int8)",
            vec![&a_id],
        ),
        ("reconcile()", "SELECT * FROM outbox.reconcile()", vec![]),
        (
            "worker_status",
            "SELECT * FROM outbox.worker_status()",
            vec![],
        ),
        (
            "work_queue",
            "SELECT count(*) FROM outbox.work_queue",
            vec![],
        ),
        (
            "operator_log",
            "SELECT count(*) FROM outbox.operator_log",
            vec![],
        ),
    ];
    let key = unique("ten_op_enqueue");
    let payload = "{}";
    let enqueue_call: Call<'_> = (
        "enqueue",
        "SELECT outbox.enqueue($1::text, $2::text::jsonb, $3::text)",
        vec![&fx.ok_ch, &payload, &key],
    );

    let mut expect_refused = |s: &mut Session, role_kind: &str, calls: &[Call<'_>]| {
        for (what, sql, params) in calls {
            if let Err(p) = check_code(
                s.c.execute(*sql, params),
                "42501",
                &format!("{role_kind} {} calling {what}", s.who),
            ) {
                problems.push(p);
            }
        }
    };
    let mut writer = fx.session(&fx.writer_a);
    expect_refused(&mut writer, "writer", &admin_calls);
    expect_refused(&mut writer, "writer", &operator_calls);
    let mut operator = fx.session(&fx.operator_a);
    expect_refused(&mut operator, "operator", &admin_calls);
    expect_refused(
        &mut operator,
        "operator",
        std::slice::from_ref(&enqueue_call),
    );
    let mut nogrant = fx.session(&fx.nogrant);
    expect_refused(&mut nogrant, "role without outbox grants", &admin_calls);
    expect_refused(&mut nogrant, "role without outbox grants", &operator_calls);
    expect_refused(
        &mut nogrant,
        "role without outbox grants",
        std::slice::from_ref(&enqueue_call),
    );
    let reader_calls: Vec<Call<'_>> = vec![
        ("status", "SELECT outbox.status($1::int8)", vec![&a_id]),
        (
            "effect_key",
            "SELECT outbox.effect_key('src', 'op')",
            vec![],
        ),
    ];
    expect_refused(&mut nogrant, "role without outbox grants", &reader_calls);

    // Undo what a wrongly accepted call may have changed.
    let _ = su.execute("SELECT outbox.resume_channel($1)", &[&fx.ok_ch]);
    let _ = unbind(&mut su, &fx.writer_a, &fx.b);
    let _ = bind(&mut su, &fx.writer_b, &fx.b);
    assert_no_problems(&problems, "role privileges: refused calls");
}

/// Private tables and views: 42501 for writer, operator and the role without grants,
/// except the tables under the views a role reads; every view for the role without grants.
#[test]
fn private_relations_are_refused_except_under_the_views_a_role_reads() {
    let (_serial, cluster, mut su) = start();
    let fx = Fixture::new(&cluster);
    let mut problems = Vec::new();
    let mut writer = fx.session(&fx.writer_a);
    let mut operator = fx.session(&fx.operator_a);
    let mut nogrant = fx.session(&fx.nogrant);

    // Private tables and views: 42501 for writer, operator and the role without grants.
    let private = private_relations(&mut su);
    for must in [
        "_channels",
        "_messages",
        "_attempts",
        "_ledger",
        "_operator_log",
    ] {
        assert!(
            private.iter().any(|p| p == must),
            "outbox.{must} should exist (private tables found: {private:?})"
        );
    }
    // The tables under the views are readable by the roles that read the views, because the
    // views run with the caller's rights (security_invoker): row-level security filters
    // them, which the isolation test checks, and outbox._under_way (the messages in flight)
    // filters itself the same way. Every other private relation is refused.
    let under_views = |who: &str, rel: &str| {
        let writer_tables = ["_messages", "_under_way", "_attempts", "_ledger"];
        (who.contains("writer") && writer_tables.contains(&rel))
            || (who.contains("operator")
                && (writer_tables.contains(&rel) || rel == "_operator_log"))
    };
    for s in [&mut writer, &mut operator, &mut nogrant] {
        for rel in &private {
            if under_views(&s.who, rel) {
                continue;
            }
            if let Err(p) = check_code(
                s.c.query(&format!("SELECT 1 FROM outbox.{} LIMIT 1", ident(rel)), &[]),
                "42501",
                &format!("{} reading the private outbox.{rel}", s.who),
            ) {
                problems.push(p);
            }
        }
    }
    // Every view of the schema: 42501 for the role without grants.
    let views: Vec<String> = su
        .query(
            "SELECT relname::text FROM pg_class WHERE relnamespace = 'outbox'::regnamespace AND relkind IN ('v', 'm') ORDER BY 1",
            &[],
        )
        .expect("views")
        .iter()
        .map(|r| r.get(0))
        .collect();
    for v in &views {
        if let Err(p) = check_code(
            nogrant
                .c
                .query(&format!("SELECT 1 FROM outbox.{} LIMIT 1", ident(v)), &[]),
            "42501",
            &format!("role without outbox grants reading outbox.{v}"),
        ) {
            problems.push(p);
        }
    }
    assert_no_problems(&problems, "role privileges: private relations");
}

/// Notes a call that `who` may make and that failed.
fn may_call<T>(problems: &mut Vec<String>, who: &str, what: &str, r: Result<T, postgres::Error>) {
    if let Err(e) = r {
        problems.push(format!("{who} may call {what}: {}", describe(&e)));
    }
}

/// What they may do: writer enqueues, reads status and effect keys; operator assigns,
/// reads worker_status.
#[test]
fn writers_and_operators_may_call_what_the_table_grants() {
    let (_serial, cluster, _) = start();
    let fx = Fixture::new(&cluster);
    let mut problems = Vec::new();
    let mut writer = fx.session(&fx.writer_a);
    let mut operator = fx.session(&fx.operator_a);

    // What they may do: writer enqueues, reads status and effect keys; operator assigns,
    // reads worker_status.
    if let Err(e) = writer.try_enqueue(&fx.ok_ch, &unique("ten_priv_ok")) {
        problems.push(format!(
            "writer {} could not enqueue into its tenant: {}",
            writer.who,
            describe(&e)
        ));
    }
    for (who, what, sql) in [
        ("writer", "status", "SELECT outbox.status(1)::text"),
        (
            "writer",
            "effect_key",
            "SELECT outbox.effect_key('src', 'op')",
        ),
        (
            "operator",
            "worker_status",
            "SELECT * FROM outbox.worker_status()",
        ),
        ("operator", "status", "SELECT outbox.status(1)::text"),
    ] {
        let s = if who == "writer" {
            &mut writer
        } else {
            &mut operator
        };
        may_call(&mut problems, who, what, s.c.query(sql, &[]));
    }
    assert_no_problems(&problems, "role privileges: granted calls");
}

/// Channel secrets: masked for writer and operator in every view they read.
#[test]
fn channel_secrets_are_masked_for_writers_and_operators_everywhere_they_read() {
    let (_serial, cluster, mut su) = start();
    let fx = Fixture::new(&cluster);
    let (secret, secret_ch) = secret_channel(&fx, &mut su);
    let mut problems = Vec::new();
    let mut writer = fx.session(&fx.writer_a);
    let mut operator = fx.session(&fx.operator_a);

    // Channel secrets: masked for writer and operator, everywhere they can read.
    for s in [&mut writer, &mut operator] {
        match s.c.query_one(
            "SELECT count(*), coalesce(string_agg(c::text, E'\\n'), ''),
                    bool_and(c.options -> 'headers' ? 'Authorization')
               FROM outbox.channels c WHERE c.name = $1",
            &[&secret_ch],
        ) {
            Ok(row) => {
                let (n, text, has_name): (i64, String, Option<bool>) =
                    (row.get(0), row.get(1), row.get(2));
                if n != 1 {
                    problems.push(format!(
                        "{} sees {n} rows of channel {secret_ch} in outbox.channels; expected 1 (channels are not tenant data)",
                        s.who
                    ));
                }
                if text.contains(&secret) {
                    problems.push(format!(
                        "{} reads the channel secret in outbox.channels: {text}",
                        s.who
                    ));
                }
                if has_name != Some(true) {
                    problems.push(format!(
                        "{}: outbox.channels should show the header name Authorization with its value masked; row: {text}",
                        s.who
                    ));
                }
            }
            Err(e) => problems.push(format!(
                "{} could not read outbox.channels: {}",
                s.who,
                describe(&e)
            )),
        }
        let all = s.c.query_one(
            "SELECT coalesce(string_agg(c::text, E'\\n'), '') FROM outbox.channels c",
            &[],
        );
        if let Ok(row) = all {
            let text: String = row.get(0);
            if text.contains(&secret) {
                problems.push(format!(
                    "{} finds the channel secret somewhere in outbox.channels",
                    s.who
                ));
            }
        }
    }
    match operator.c.query_one(
        "SELECT count(*) FROM outbox.operator_log o WHERE strpos(o::text, $1) > 0",
        &[&secret],
    ) {
        Ok(row) if row.get::<_, i64>(0) == 0 => {}
        Ok(row) => problems.push(format!(
            "operator reads the channel secret in {} outbox.operator_log rows",
            row.get::<_, i64>(0)
        )),
        Err(e) => problems.push(format!(
            "operator could not read outbox.operator_log: {}",
            describe(&e)
        )),
    }
    assert_no_problems(&problems, "role privileges: masked secrets");
}

/// The admin reads the secret in outbox._channels and administers channels.
#[test]
fn the_admin_reads_channel_secrets_and_administers_channels() {
    let (_serial, cluster, mut su) = start();
    let fx = Fixture::new(&cluster);
    let (secret, secret_ch) = secret_channel(&fx, &mut su);
    let mut problems = Vec::new();

    // The admin reads the secret in outbox._channels and administers channels.
    let mut admin = fx.session(&fx.admin);
    match admin.c.query_one(
        "SELECT options::text FROM outbox._channels WHERE name = $1",
        &[&secret_ch],
    ) {
        Ok(row) => {
            let options: String = row.get(0);
            if !options.contains(&secret) {
                problems.push(format!(
                    "admin reads outbox._channels but the secret is not in the options: {options}"
                ));
            }
        }
        Err(e) => problems.push(format!(
            "admin {} could not read outbox._channels: {}",
            fx.admin,
            describe(&e)
        )),
    }
    let admin_ch = unique("ten_admin");
    for (what, r) in [
        (
            "create_channel",
            admin.c.execute(
                "SELECT outbox.create_channel($1::text, $2::text, '{}'::jsonb)",
                &[&admin_ch, &fx.sim.send_url(&admin_ch)],
            ),
        ),
        (
            "pause_channel",
            admin.c.execute(
                "SELECT outbox.pause_channel($1::text, 'tenants test')",
                &[&admin_ch],
            ),
        ),
        (
            "alter_channel",
            admin.c.execute(
                "SELECT outbox.alter_channel($1::text, '{\"max_in_flight\": 2}'::jsonb)",
                &[&admin_ch],
            ),
        ),
        (
            "resume_channel",
            admin
                .c
                .execute("SELECT outbox.resume_channel($1::text)", &[&admin_ch]),
        ),
        (
            "prometheus",
            admin.c.execute("SELECT outbox.prometheus()", &[]),
        ),
        (
            "metrics",
            admin.c.execute("SELECT count(*) FROM outbox.metrics", &[]),
        ),
        (
            "alerts",
            admin.c.execute("SELECT count(*) FROM outbox.alerts", &[]),
        ),
        (
            "worker_status",
            admin.c.execute("SELECT * FROM outbox.worker_status()", &[]),
        ),
    ] {
        may_call(&mut problems, "admin", what, r);
    }
    assert_no_problems(&problems, "role privileges: admin");
}

/// The catalog says the same: function privileges per role.
#[test]
fn the_catalog_grants_each_role_the_functions_the_table_says() {
    let (_serial, cluster, mut su) = start();
    let fx = Fixture::new(&cluster);
    assert_no_problems(
        &function_privileges(&mut su, &fx),
        "role privileges: catalog, functions",
    );
}

/// The catalog says the same: table and view privileges per role.
#[test]
fn the_catalog_grants_each_role_the_tables_and_views_the_table_says() {
    let (_serial, cluster, mut su) = start();
    let fx = Fixture::new(&cluster);
    assert_no_problems(
        &relation_privileges(&mut su, &fx),
        "role privileges: catalog, relations",
    );
}

/// Function privileges of the fixture's roles, from the catalog.
fn function_privileges(su: &mut Client, fx: &Fixture<'_>) -> Vec<String> {
    let mut problems = Vec::new();
    let functions: Vec<(String, String, String)> = su
        .query(
            "SELECT p.proname::text, p.oid::regprocedure::text, p.oid::text FROM pg_proc p
              WHERE p.pronamespace = 'outbox'::regnamespace ORDER BY 2",
            &[],
        )
        .expect("functions of the schema")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let may_execute = |su: &mut Client, role: &str, oid: &str| -> bool {
        su.query_one(
            "SELECT has_function_privilege($1::text, $2::text::oid, 'EXECUTE')",
            &[&role, &oid],
        )
        .unwrap_or_else(|e| panic!("has_function_privilege({role}, {oid}): {}", describe(&e)))
        .get(0)
    };
    // The public functions of the contract; functions added later are only checked for
    // PUBLIC.
    const CONTRACT: [&str; 16] = [
        "effect_key",
        "create_channel",
        "alter_channel",
        "pause_channel",
        "resume_channel",
        "enqueue",
        "status",
        "reconcile",
        "retry",
        "resolve",
        "cancel",
        "assign",
        "bind_tenant",
        "unbind_tenant",
        "prometheus",
        "worker_status",
    ];
    const WRITER_MAY: [&str; 3] = ["enqueue", "status", "effect_key"];
    // What row-level security calls for every reader of a table: PUBLIC's.
    const ROW_SECURITY: [&str; 2] = ["_visible_tenants", "_visible_channels"];
    const OPERATOR_MAY: [&str; 7] = [
        "status",
        "reconcile",
        "retry",
        "resolve",
        "cancel",
        "assign",
        "worker_status",
    ];
    let operator_may_not =
        |name: &str| ["enqueue", "prometheus"].contains(&name) || ADMINISTRATION.contains(&name);
    let admin_may = |name: &str| {
        ["prometheus", "worker_status"].contains(&name) || ADMINISTRATION.contains(&name)
    };
    for (name, signature, oid) in &functions {
        let name = name.as_str();
        if CONTRACT.contains(&name) {
            let w = may_execute(su, &fx.writer_a, oid);
            let expected = WRITER_MAY.contains(&name);
            if w != expected {
                problems.push(format!(
                    "catalog: outbox_writer {} EXECUTE on {signature}; expected {}",
                    if w { "has" } else { "lacks" },
                    if expected { "to have it" } else { "it not to" }
                ));
            }
            let o = may_execute(su, &fx.operator_a, oid);
            if OPERATOR_MAY.contains(&name) && !o {
                problems.push(format!(
                    "catalog: outbox_operator lacks EXECUTE on {signature}"
                ));
            }
            if operator_may_not(name) && o {
                problems.push(format!(
                    "catalog: outbox_operator has EXECUTE on {signature}; it must not"
                ));
            }
            if admin_may(name) && !may_execute(su, &fx.admin, oid) {
                problems.push(format!(
                    "catalog: outbox_admin lacks EXECUTE on {signature}"
                ));
            }
        }
        if !ROW_SECURITY.contains(&name) && may_execute(su, &fx.nogrant, oid) {
            problems.push(format!(
                "catalog: a role without outbox grants (PUBLIC) has EXECUTE on {signature}; only the functions row-level security calls ({ROW_SECURITY:?}) are PUBLIC"
            ));
        }
    }
    problems
}

/// Relation privileges of the fixture's roles, from the catalog.
fn relation_privileges(su: &mut Client, fx: &Fixture<'_>) -> Vec<String> {
    let mut problems = Vec::new();
    let relations: Vec<(String, String, String)> = su
        .query(
            "SELECT c.relname::text, c.relkind::text, c.oid::text FROM pg_class c
              WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
              ORDER BY 1",
            &[],
        )
        .expect("relations of the schema")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let has = |su: &mut Client, role: &str, oid: &str, kind: &str, privilege: &str| -> bool {
        let f = if kind == "S" {
            "has_sequence_privilege"
        } else {
            "has_table_privilege"
        };
        su.query_one(
            &format!("SELECT {f}($1::text, $2::text::oid, $3::text)"),
            &[&role, &oid, &privilege],
        )
        .unwrap_or_else(|e| panic!("{f}({role}, {oid}, {privilege}): {}", describe(&e)))
        .get(0)
    };
    const WRITER_READS: [&str; 4] = ["messages", "attempts", "ledger", "channels"];
    const OPERATOR_READS: [&str; 6] = [
        "messages",
        "attempts",
        "ledger",
        "channels",
        "work_queue",
        "operator_log",
    ];
    const ADMIN_READS: [&str; 4] = ["_channels", "metrics", "alerts", "channels"];
    for (name, kind, oid) in &relations {
        let writes = if kind == "S" {
            "USAGE, UPDATE"
        } else {
            "INSERT, UPDATE, DELETE, TRUNCATE"
        };
        for (role, label) in [
            (&fx.writer_a, "outbox_writer"),
            (&fx.operator_a, "outbox_operator"),
            (&fx.nogrant, "a role without outbox grants"),
        ] {
            if has(su, role, oid, kind, writes) {
                problems.push(format!(
                    "catalog: {label} has one of {writes} on outbox.{name}; every change goes through a function"
                ));
            }
        }
        if kind == "S" {
            continue;
        }
        // Counted across tenants or private: no tenant role reads them (but the tables
        // under the security_invoker views, which row-level security filters).
        let under_view = [
            "_messages",
            "_under_way",
            "_attempts",
            "_ledger",
            "_operator_log",
        ]
        .contains(&name.as_str());
        let not_for_tenants =
            (name.starts_with('_') && !under_view) || name == "metrics" || name == "alerts";
        let w = has(su, &fx.writer_a, oid, kind, "SELECT");
        if WRITER_READS.contains(&name.as_str()) && !w {
            problems.push(format!(
                "catalog: outbox_writer lacks SELECT on outbox.{name}"
            ));
        }
        if (not_for_tenants
            || name == "work_queue"
            || name == "operator_log"
            || name == "_operator_log")
            && w
        {
            problems.push(format!(
                "catalog: outbox_writer has SELECT on outbox.{name}; it must not"
            ));
        }
        let o = has(su, &fx.operator_a, oid, kind, "SELECT");
        if OPERATOR_READS.contains(&name.as_str()) && !o {
            problems.push(format!(
                "catalog: outbox_operator lacks SELECT on outbox.{name}"
            ));
        }
        if not_for_tenants && o {
            problems.push(format!(
                "catalog: outbox_operator has SELECT on outbox.{name}; it must not"
            ));
        }
        if ADMIN_READS.contains(&name.as_str()) && !has(su, &fx.admin, oid, kind, "SELECT") {
            problems.push(format!(
                "catalog: outbox_admin lacks SELECT on outbox.{name}"
            ));
        }
        if has(su, &fx.nogrant, oid, kind, "SELECT") {
            problems.push(format!(
                "catalog: a role without outbox grants (PUBLIC) has SELECT on outbox.{name}"
            ));
        }
    }
    problems
}
