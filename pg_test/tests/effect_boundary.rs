//! The boundary around a `sql` effect (docs/security.md): the function of a tenant's
//! channel runs in the worker's process, and must get nothing of the worker.
//!
//! 1. It acts as its `run_as` role for its message's tenant alone: row-level security shows
//!    it that tenant's rows, `enqueue` inside it writes into that tenant, and naming
//!    another tenant is refused with 42501.
//! 2. Settings it changes, even at session level (`set_config(…, false)`), do not outlive
//!    its call: a search path, `outbox.tenant` or a timeout it leaves behind is gone for the
//!    next effect and for the worker's own statements, so a function planted under a
//!    built-in's name (`now()`) never runs as the worker. `SET ROLE` is refused inside it.
//! 3. The worker's statements never resolve names in `public`: an operator planted there
//!    for `outbox.state` never runs, however often the worker plans its statements again.
//!
//! Run: `cargo test -p outbox_e2e --release --test effect_boundary`.

use outbox_e2e::cluster::{unique, wait_for_state, wait_for_workers, Cluster};
use outbox_e2e::helpers::{code_of, count, create_channel, one, serial};
use outbox_e2e::sim::Simulator;
use postgres::Client;
use std::time::Duration;

const T: Duration = Duration::from_secs(40);

/// An application schema `s` with a role `s_fx` that effects run as (a writer, bound to no
/// tenant), a table the effects write what they saw into, and a paused channel for the
/// messages they enqueue.
struct App {
    s: String,
    role: String,
    child_channel: String,
}

impl App {
    fn new(c: &mut Client) -> App {
        let s = unique("fxb");
        let role = format!("{s}_fx");
        c.batch_execute(&format!(
            r#"
            CREATE SCHEMA {s};
            CREATE ROLE {role} NOLOGIN IN ROLE outbox_writer;
            CREATE TABLE {s}.seen (key text, tenants text[], rows_seen int8, search_path text,
                                   tenant_setting text, caller text, plan_cache_mode text);
            GRANT USAGE ON SCHEMA {s} TO {role};
            GRANT INSERT ON {s}.seen TO {role};
            "#
        ))
        .expect("app schema");
        let child_channel = unique("fxb_child");
        create_channel(c, &child_channel, "http://127.0.0.1:9/child", "{}");
        c.execute(
            "SELECT outbox.pause_channel($1, 'effect boundary test: nothing is sent')",
            &[&child_channel],
        )
        .expect("pause");
        App {
            s,
            role,
            child_channel,
        }
    }

    /// A function `s.name(payload, key)` with `body` (PL/pgSQL), executable by the role.
    fn function(&self, c: &mut Client, name: &str, body: &str) -> String {
        let f = format!("{}.{name}", self.s);
        c.batch_execute(&format!(
            "CREATE FUNCTION {f}(payload jsonb, effect_key text) RETURNS text LANGUAGE plpgsql AS $fn$
             BEGIN {body} END $fn$;
             GRANT EXECUTE ON FUNCTION {f}(jsonb, text) TO {role};",
            role = self.role
        ))
        .expect("effect function");
        f
    }

    /// A sql channel calling `function` as the role.
    fn channel(&self, c: &mut Client, function: &str) -> String {
        let ch = unique("fxb_ch");
        let options = format!(
            r#"{{"kind": "sql", "function": "{function}", "run_as": "{}", "retry": {{"max_attempts": 1}}, "tenants": ["*"]}}"#,
            self.role
        );
        create_channel(c, &ch, "sql", &options);
        ch
    }

    /// What the effects recorded: (key, tenants, rows, search_path, outbox.tenant, caller).
    fn seen(&self, c: &mut Client) -> Vec<(String, Vec<String>, i64, String, String, String)> {
        c.query(
            &format!(
                "SELECT key, tenants, rows_seen, search_path, coalesce(tenant_setting, ''), caller
                   FROM {}.seen ORDER BY key",
                self.s
            ),
            &[],
        )
        .expect("seen")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
        .collect()
    }
}

/// The body of an effect that records what it sees: the tenants of the messages row-level
/// security shows it, the search path, `outbox.tenant`, the calling role and the plan cache
/// mode.
fn recorder(s: &str) -> String {
    format!(
        "INSERT INTO {s}.seen
         SELECT $2, array_agg(DISTINCT m.tenant ORDER BY m.tenant), count(*),
                current_setting('search_path'), current_setting('outbox.tenant', true), current_user::text,
                current_setting('plan_cache_mode')
           FROM outbox.messages m;
         RETURN 'seen';"
    )
}

/// Enqueues on `channel` for `tenant` (as the superuser naming it); returns the id.
fn enqueue_for(c: &mut Client, tenant: &str, channel: &str, payload: &str) -> i64 {
    let mut tx = c.transaction().expect("tx");
    tx.execute("SELECT set_config('outbox.tenant', $1, true)", &[&tenant])
        .expect("tenant");
    let id: i64 = one(
        &mut tx,
        "SELECT outbox.enqueue($1, $2::text::jsonb, $3)",
        &[&channel, &payload, &unique("fxb_key")],
    );
    tx.commit().expect("commit");
    id
}

/// Five messages delivered over HTTP through every phase of the worker; returns the
/// simulator that received them.
fn deliver_five_over_http(cluster: &Cluster, c: &mut Client) -> Simulator {
    let sim = Simulator::start();
    let http = unique("fxb_http");
    create_channel(
        c,
        &http,
        &sim.send_url(&http),
        r#"{"retry": {"base_ms": 100}}"#,
    );
    let ids: Vec<i64> = (0..5)
        .map(|_| enqueue_for(c, "default", &http, "{}"))
        .collect();
    for id in ids {
        assert!(
            wait_for_state(cluster, id, "delivered", T),
            "{}",
            last_error(c, id)
        );
    }
    sim
}

fn last_error(c: &mut Client, id: i64) -> String {
    c.query_one(
        "SELECT coalesce(last_error, '') FROM outbox.messages WHERE id = $1",
        &[&id],
    )
    .expect("last_error")
    .get(0)
}

#[test]
fn an_effect_sees_and_enqueues_for_its_message_tenant_alone() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let app = App::new(&mut c);
    let (a, b) = (unique("ta"), unique("tb"));
    // Tenant b has messages too: an effect of tenant a must not see them.
    enqueue_for(&mut c, &b, &app.child_channel, "{}");

    let body = recorder(&app.s).replace(
        "RETURN 'seen';",
        &format!(
            "PERFORM outbox.enqueue('{}', '{{}}'::jsonb, effect_key || '-child'); RETURN 'seen';",
            app.child_channel
        ),
    );
    let f = app.function(&mut c, "probe", &body);
    let ch = app.channel(&mut c, &f);
    let id = enqueue_for(&mut c, &a, &ch, "{}");
    assert!(
        wait_for_state(&cluster, id, "delivered", T),
        "the probe was not delivered: {}",
        last_error(&mut c, id)
    );

    let seen = app.seen(&mut c);
    assert_eq!(seen.len(), 1, "{seen:?}");
    let (_, tenants, rows, _, _, caller) = &seen[0];
    assert_eq!(
        tenants,
        &vec![a.clone()],
        "row-level security showed the effect these tenants"
    );
    assert!(*rows >= 1, "the effect saw its own message");
    assert_eq!(caller, &app.role, "the effect runs as its run_as role");
    let children =
        "SELECT count(*) FROM outbox._messages WHERE tenant = $1 AND effect_key LIKE '%-child'";
    assert_eq!(
        count(&mut c, children, &[&a]),
        1,
        "the enqueue inside the effect wrote into tenant {a}"
    );
    assert_eq!(
        count(&mut c, children, &[&"default"]),
        0,
        "nothing was written into tenant default"
    );
}

#[test]
fn an_effect_that_names_another_tenant_is_refused() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let app = App::new(&mut c);
    let (a, b) = (unique("ta"), unique("tb"));
    let body = format!(
        "PERFORM set_config('outbox.tenant', '{b}', true);
         PERFORM outbox.enqueue('{}', '{{}}'::jsonb, effect_key || '-escape');
         RETURN 'escaped';",
        app.child_channel
    );
    let f = app.function(&mut c, "escape", &body);
    let ch = app.channel(&mut c, &f);
    let id = enqueue_for(&mut c, &a, &ch, "{}");
    assert!(
        wait_for_state(&cluster, id, "failed", T),
        "state: {:?}",
        outbox_e2e::cluster::state_of(&cluster, id)
    );
    let error = last_error(&mut c, id);
    assert!(
        error.contains("42501") && error.contains(&format!("may not act for tenant \"{b}\"")),
        "{error}"
    );
    let escaped =
        "SELECT count(*) FROM outbox._messages WHERE tenant = $1 AND effect_key LIKE '%-escape'";
    assert_eq!(
        count(&mut c, escaped, &[&b]),
        0,
        "nothing was written into tenant {b}"
    );
}

#[test]
fn settings_an_effect_changes_do_not_outlive_its_call() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let app = App::new(&mut c);
    let eve = unique("eve");
    // What the effect plants: a now() that reports who calls it.
    c.batch_execute(&format!(
        "CREATE SCHEMA {eve};
         CREATE TABLE {eve}.calls (who text, at timestamptz DEFAULT clock_timestamp());
         GRANT USAGE ON SCHEMA {eve} TO PUBLIC;
         GRANT INSERT ON {eve}.calls TO PUBLIC;
         CREATE FUNCTION {eve}.now() RETURNS timestamptz LANGUAGE plpgsql VOLATILE AS $fn$
         BEGIN INSERT INTO {eve}.calls (who) VALUES (current_user); RETURN pg_catalog.now(); END $fn$;
         GRANT EXECUTE ON FUNCTION {eve}.now() TO PUBLIC;"
    ))
    .expect("plant");
    let setter = app.function(
        &mut c,
        "setter",
        &format!(
            "PERFORM set_config('search_path', '{eve}, pg_catalog', false);
             PERFORM set_config('outbox.tenant', 'elsewhere', false);
             PERFORM set_config('statement_timeout', '1', false);
             PERFORM set_config('enable_indexscan', 'off', false);
             PERFORM set_config('plan_cache_mode', 'force_custom_plan', false);
             RETURN 'set';"
        ),
    );
    let setter_ch = app.channel(&mut c, &setter);
    let recorder_f = app.function(&mut c, "recorder", &recorder(&app.s));
    let recorder_ch = app.channel(&mut c, &recorder_f);
    let role_ch = {
        let f = app.function(&mut c, "become", "SET ROLE postgres; RETURN 'became';");
        app.channel(&mut c, &f)
    };
    let default_path: String = one(
        &mut c,
        "SELECT reset_val FROM pg_settings WHERE name = 'search_path'",
        &[],
    );

    let set = enqueue_for(&mut c, "default", &setter_ch, "{}");
    assert!(
        wait_for_state(&cluster, set, "delivered", T),
        "{}",
        last_error(&mut c, set)
    );
    let became = enqueue_for(&mut c, "default", &role_ch, "{}");
    assert!(
        wait_for_state(&cluster, became, "failed", T),
        "{}",
        last_error(&mut c, became)
    );
    assert!(
        last_error(&mut c, became).contains("42501"),
        "SET ROLE inside an effect: {}",
        last_error(&mut c, became)
    );
    // The worker's kept statements are analysed again after an invalidation: ANALYZE of the
    // message table makes one. Then more deliveries run through every phase.
    c.batch_execute("ANALYZE outbox._messages; ANALYZE outbox._attempts; ANALYZE outbox._ledger")
        .expect("analyze");
    let sim = deliver_five_over_http(&cluster, &mut c);
    let rec = enqueue_for(&mut c, "default", &recorder_ch, "{}");
    assert!(
        wait_for_state(&cluster, rec, "delivered", T),
        "{}",
        last_error(&mut c, rec)
    );

    let calls: i64 = c
        .query_one(&format!("SELECT count(*) FROM {eve}.calls"), &[])
        .expect("calls")
        .get(0);
    assert_eq!(
        calls, 0,
        "the planted now() ran in the worker {calls} times"
    );
    let seen = app.seen(&mut c);
    let (_, _, _, path, tenant, caller) = &seen[0];
    assert_eq!(
        path, &default_path,
        "the next effect ran under the database's search path"
    );
    assert_eq!(tenant, "", "outbox.tenant was left behind");
    assert_eq!(caller, &app.role);
    // The worker's session plans its own statements once, whatever the effects set; the
    // effects plan under the database's mode.
    let default_mode: String = one(
        &mut c,
        "SELECT reset_val FROM pg_settings WHERE name = 'plan_cache_mode'",
        &[],
    );
    let mode: String = one(
        &mut c,
        &format!("SELECT plan_cache_mode FROM {}.seen", app.s),
        &[],
    );
    assert_eq!(
        mode, default_mode,
        "the next effect ran under the database's plan cache mode"
    );
    sim.shutdown();
}

/// Drops the planted operator when the test ends, also when it fails: every session of the
/// database that compares states unqualified would call it.
struct Planted<'a>(&'a Cluster);

impl Drop for Planted<'_> {
    fn drop(&mut self) {
        let mut c = self.0.connect();
        let _ = c.batch_execute(
            "DROP OPERATOR IF EXISTS public.= (outbox.state, outbox.state);
             DROP FUNCTION IF EXISTS public.planted_state_eq(outbox.state, outbox.state);
             DROP TABLE IF EXISTS public.planted_calls;",
        );
    }
}

#[test]
fn an_operator_planted_in_public_never_runs_in_the_worker() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let planted = Planted(&cluster);
    // What a role that may CREATE in public (the database's owner) can plant: an exact
    // match for outbox.state, which the planner prefers to pg_catalog's anyenum operator.
    c.batch_execute(
        "CREATE TABLE public.planted_calls (who text);
         GRANT INSERT ON public.planted_calls TO PUBLIC;
         CREATE FUNCTION public.planted_state_eq(x outbox.state, y outbox.state) RETURNS boolean
         LANGUAGE plpgsql VOLATILE AS $fn$
         BEGIN INSERT INTO public.planted_calls VALUES (current_user); RETURN x::text = y::text; END $fn$;
         GRANT EXECUTE ON FUNCTION public.planted_state_eq(outbox.state, outbox.state) TO PUBLIC;
         CREATE OPERATOR public.= (leftarg = outbox.state, rightarg = outbox.state,
                                   function = public.planted_state_eq);",
    )
    .expect("plant the operator");
    // New workers prepare every statement again, as after any restart.
    let old = cluster.worker_pids(&mut c);
    c.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE backend_type = 'outbox_delivery worker'",
        &[],
    )
    .expect("terminate workers");
    wait_for_workers(&cluster, &old);

    let sim = deliver_five_over_http(&cluster, &mut c);
    let by_worker = count(
        &mut c,
        "SELECT count(*) FROM public.planted_calls WHERE who = current_setting('outbox.role')",
        &[],
    );
    assert_eq!(
        by_worker, 0,
        "the planted operator ran as the worker's role"
    );
    let errors: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.worker_status() WHERE state = 'stopped'",
            &[],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("worker_status: {}", code_of(&e)));
    assert_eq!(errors, 0, "a worker stopped");
    drop(planted);
    sim.shutdown();
}
