//! The second security review (issue 68), tried as the hostile roles it names would try it,
//! and the checks that keep the next function, grant or script from opening the same holes:
//!
//! - every function of the extension pins its search path (or is listed here with why it
//!   need not), PUBLIC may execute only the functions listed here, and every script that
//!   runs SQL as a superuser pins its search path and qualifies what it calls;
//! - a function planted in `public` never runs from `outbox.prometheus()` (finding 3), an
//!   operator planted there never runs from `scripts/move_tenant.sh` (finding 4);
//! - a `sql` channel names its tenants (5); the key headers may not frame, route, authorize
//!   or sign a request (12); an option value refused for its shape is not quoted (10); a
//!   shared channel shows each tenant only itself (9); the metadata address in its IPv6
//!   spellings is refused (15); a cancel inside `reconcile()` shows no Rust backtrace (17).
//!
//! The clusters of the move live under `OUTBOX_MOVE_BASE` (`/tmp/outbox_move`) on
//! `OUTBOX_MOVE_PGPORT` (54884) and the port after it, as in tenant_move.rs; the cluster with
//! `RUST_BACKTRACE=1` under `OUTBOX_BACKTRACE_BASE` (`/tmp/outbox_backtrace`) on
//! `OUTBOX_BACKTRACE_PGPORT` (54886).
//!
//! Run: `cargo test -p outbox_e2e --release --test security_review -- --test-threads=1`.

use outbox_e2e::cluster::{env_port, unique, wait_until, Cluster, OwnCluster};
use outbox_e2e::helpers::{
    code_of, count, create_channel, describe, enqueue, ident, serial, session_as,
};
use postgres::{Client, NoTls};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// Functions of the extension that neither pin `search_path` nor are C functions, nor have
/// an SQL-standard body (`BEGIN ATOMIC`, whose names are resolved when it is created), and
/// why each may do without: what is not here must pin it.
const UNPINNED_WITH_REASON: &[(&str, &str)] = &[(
    "_ledger_entry(text, text)",
    "the claim inlines it as one index probe per message, which a SET clause would prevent; \
     its body names only outbox._ledger and pg_catalog's = (OPERATOR(pg_catalog.=))",
)];

/// C functions that run as their owner (SECURITY DEFINER) without a SET clause, and why:
/// what is not here must pin `search_path` with a SET clause (pgrx's #[search_path]).
const DEFINER_C_WITHOUT_SET: &[(&str, &str)] = &[(
    "enqueue(text, jsonb, text, text, timestamp with time zone, jsonb)",
    "plans and runs its statements (schema-qualified, operators included) under a search \
     path of pg_catalog alone that it pushes itself (src/spi/pinned.rs); a SET clause would \
     cost a configuration save and restore in every call",
)];

/// The functions PUBLIC may execute, and why.
const PUBLIC_EXECUTE: &[(&str, &str)] = &[
    (
        "_visible_tenants()",
        "row-level security of the message tables calls it for every reader; it answers \
         about the caller alone",
    ),
    (
        "_visible_channels()",
        "row-level security of the operator log calls it for every reader; it answers about \
         the caller alone",
    ),
];

/// A database of the suite's cluster with the extension, made for one test and dropped
/// after it (also when it fails): what a test plants there reaches no other test.
struct Scratch {
    cluster: Cluster,
    db: String,
    roles: Vec<String>,
}

impl Scratch {
    fn new(cluster: &Cluster, prefix: &str) -> Scratch {
        let db = unique(prefix);
        let mut su = cluster.connect();
        su.batch_execute(&format!("CREATE DATABASE {}", ident(&db)))
            .expect("create database");
        let mut c = cluster.connect_to(&db);
        c.batch_execute("SET client_min_messages = warning; CREATE EXTENSION outbox_delivery")
            .expect("create extension");
        Scratch {
            cluster: cluster.clone(),
            db,
            roles: Vec::new(),
        }
    }

    fn connect(&self) -> Client {
        self.cluster.connect_to(&self.db)
    }

    /// A role of the test's own (cluster-wide), dropped with the database.
    fn role(&mut self, prefix: &str, attributes: &str) -> String {
        let role = unique(prefix);
        self.connect()
            .batch_execute(&format!("CREATE ROLE {} {attributes}", ident(&role)))
            .expect("create role");
        self.roles.push(role.clone());
        role
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Ok(mut su) = Client::connect(&self.cluster.conninfo(), NoTls) {
            let _ = su.batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                ident(&self.db)
            ));
            for role in &self.roles {
                let _ = su.batch_execute(&format!("DROP ROLE IF EXISTS {}", ident(role)));
            }
        }
    }
}

fn is_superuser(c: &mut Client, role: &str) -> bool {
    c.query_one("SELECT rolsuper FROM pg_roles WHERE rolname = $1", &[&role])
        .expect("role")
        .get(0)
}

/// The body of a function planted by `role`: when it runs as a superuser it makes `role`
/// one (what the review did), and it always says it ran.
fn escalating_body(role: &str, result: &str) -> String {
    format!(
        "BEGIN
             IF (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user) THEN
                 EXECUTE 'ALTER ROLE {} SUPERUSER';
             END IF;
             RAISE WARNING 'planted function ran as %', current_user;
             RETURN {result};
         END",
        ident(role)
    )
}

// ---------------------------------------------------------------------------------------
// The systemic checks
// ---------------------------------------------------------------------------------------

#[test]
fn every_function_of_the_extension_pins_its_search_path_or_is_listed() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    // Every member function of the extension, whatever its schema, and the functions of
    // the operators in schema outbox.
    let rows = c
        .query(
            "WITH ext AS (
                 SELECT p.oid FROM pg_depend d JOIN pg_proc p ON p.oid = d.objid
                  WHERE d.classid = 'pg_proc'::regclass AND d.deptype = 'e'
                    AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'outbox_delivery')
                 UNION
                 SELECT o.oprcode FROM pg_operator o
                  WHERE o.oprnamespace = 'outbox'::regnamespace)
             SELECT p.proname || '(' || oidvectortypes(p.proargtypes) || ')',
                    l.lanname, p.prosecdef, p.prosqlbody IS NOT NULL,
                    coalesce(EXISTS (SELECT 1 FROM unnest(p.proconfig) s
                                      WHERE s LIKE 'search\\_path=%'
                                        AND s ~ '^search_path=\"?pg_catalog\"?(, ?\"?pg_temp\"?)?$'), false)
               FROM ext JOIN pg_proc p ON p.oid = ext.oid JOIN pg_language l ON l.oid = p.prolang
              ORDER BY 1",
            &[],
        )
        .expect("the extension's functions");
    assert!(rows.len() > 50, "only {} functions found", rows.len());
    let mut offenders = Vec::new();
    let mut listed_seen = BTreeSet::new();
    for r in &rows {
        let (name, lang, definer, atomic, pinned): (String, String, bool, bool, bool) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
        let why = if pinned {
            continue;
        } else if lang == "c" || lang == "internal" {
            if !definer {
                continue; // runs with the caller's rights: nothing to gain by planting
            }
            DEFINER_C_WITHOUT_SET.iter().find(|(n, _)| *n == name)
        } else if atomic {
            continue; // BEGIN ATOMIC: resolved when created, under CREATE EXTENSION's path
        } else {
            UNPINNED_WITH_REASON.iter().find(|(n, _)| *n == name)
        };
        match why {
            Some((n, _)) => {
                listed_seen.insert(*n);
            }
            None => offenders.push(format!(
                "{name} ({lang}{})",
                if definer { ", SECURITY DEFINER" } else { "" }
            )),
        }
    }
    assert!(
        offenders.is_empty(),
        "these functions resolve names under their caller's search_path: add \
         SET search_path = pg_catalog, pg_temp (sql/*.sql and the upgrade script), or list \
         them here with the reason: {offenders:#?}"
    );
    // A listed function that no longer needs its place is taken off the list.
    for (n, _) in UNPINNED_WITH_REASON.iter().chain(DEFINER_C_WITHOUT_SET) {
        assert!(
            listed_seen.contains(n),
            "{n} is listed but pins its path or is gone"
        );
    }
}

#[test]
fn public_may_execute_only_the_listed_functions() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    // A function without an ACL has the default one, which grants EXECUTE to PUBLIC.
    let granted: BTreeSet<String> = c
        .query(
            "SELECT p.proname || '(' || oidvectortypes(p.proargtypes) || ')'
               FROM pg_depend d JOIN pg_proc p ON p.oid = d.objid
              CROSS JOIN LATERAL aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
              WHERE d.classid = 'pg_proc'::regclass AND d.deptype = 'e'
                AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'outbox_delivery')
                AND a.grantee = 0 AND a.privilege_type = 'EXECUTE'",
            &[],
        )
        .expect("grants")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let listed: BTreeSet<String> = PUBLIC_EXECUTE.iter().map(|(n, _)| n.to_string()).collect();
    assert_eq!(
        granted, listed,
        "EXECUTE granted to PUBLIC differs from the list (sql/privileges.sql revokes it from \
         every function; grant a function to PUBLIC only with its reason here)"
    );
}

// ---------------------------------------------------------------------------------------
// Finding 3: outbox.prometheus() and a function planted in public
// ---------------------------------------------------------------------------------------

#[test]
fn prometheus_never_runs_a_function_planted_in_public() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut scratch = Scratch::new(&cluster, "sec_prom");
    let planter = scratch.role("sec_planter", "NOLOGIN");
    let monitor = scratch.role("sec_monitor", "NOLOGIN IN ROLE pg_monitor");
    let mut su = scratch.connect();
    su.batch_execute(&format!(
        "GRANT CREATE ON SCHEMA public TO {p};
         SET ROLE {p};",
        p = ident(&planter)
    ))
    .expect("the planter may create in public");
    // Overloads of format that match the calls of prometheus() better than pg_catalog's
    // format(text, VARIADIC "any"): they win under the default search path.
    for args in [
        "text, bigint",
        "text, text",
        "text, text, text",
        "text, text, bigint",
        "text, text, numeric",
        "text, text, text, bigint",
        "text, text, text, text",
    ] {
        su.batch_execute(&format!(
            "CREATE FUNCTION public.format({args}) RETURNS text LANGUAGE plpgsql AS $b${}$b$",
            escalating_body(&planter, "'planted'")
        ))
        .unwrap_or_else(|e| panic!("plant format({args}): {e}"));
    }
    su.batch_execute("RESET ROLE").expect("reset");
    create_channel(
        &mut su,
        "prom",
        "http://127.0.0.1:9/hook",
        r#"{"idempotency_header": "Idempotency-Key"}"#,
    );

    // A superuser reads the exposition under the database's default search path.
    su.batch_execute("SET search_path = \"$user\", public")
        .unwrap();
    let text: String = su
        .query_one("SELECT outbox.prometheus()", &[])
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("prometheus() as a superuser: {}", describe(&e)));
    assert!(!text.contains("planted"), "{text}");
    assert!(text.contains("outbox_messages{channel=\"prom\""), "{text}");
    assert!(
        !is_superuser(&mut su, &planter),
        "the planter became a superuser"
    );

    // And so does the scrape's role, pg_monitor.
    su.batch_execute(&format!("SET ROLE {}", ident(&monitor)))
        .unwrap();
    let text: String = su
        .query_one("SELECT outbox.prometheus()", &[])
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("prometheus() as pg_monitor: {}", describe(&e)));
    assert!(!text.contains("planted"), "{text}");
    su.batch_execute("RESET ROLE").unwrap();
    assert!(
        !is_superuser(&mut su, &planter),
        "the planter became a superuser"
    );
}

// ---------------------------------------------------------------------------------------
// Finding 4: scripts/move_tenant.sh and an operator planted in public
// ---------------------------------------------------------------------------------------

/// Scripts that run SQL only against a cluster they started themselves (scripts/cluster.sh,
/// a throwaway data directory in which no other role exists), and so need not pin their
/// search path: the benchmarks, the profiles, the demo and the cluster script.
const THROWAWAY_CLUSTER_SCRIPTS: &[&str] = &[
    "bench.sh",
    "bench_anchors.sh",
    "bench_claim_statement.sh",
    "bench_drain_end.sh",
    "bench_drain_start.sh",
    "bench_enqueue_parts.sh",
    "bench_large_answers.sh",
    "bench_many_channels.sh",
    "bench_latency_prefixes.sh",
    "bench_ordering_backlog.sh",
    "bench_payload_compression.sh",
    "bench_prefixes.sh",
    "bench_record_statement.sh",
    "bench_shared_channel.sh",
    "bench_sql_effects.sh",
    "bench_successive_drains.sh",
    "bench_write_paths.sh",
    "cluster.sh",
    "demo.sh",
    "lib.sh",
    "profile_delivery.sh",
    "profile_enqueue.sh",
    "profile_idle_path.sh",
    "profile_signing.sh",
    "profile_worker_memory.sh",
];

/// Scripts that run SQL as a superuser in a database they are given: each of their
/// sessions sets `search_path = pg_catalog, pg_temp` first and their SQL qualifies every
/// function it calls.
const PINNED_SCRIPTS: &[&str] = &["move_tenant.sh"];

fn scripts_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts")
}

#[test]
fn every_script_that_runs_sql_as_a_superuser_pins_its_search_path() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    // Every function name pg_catalog has: an unqualified call of one of them in a pinned
    // script's SQL is looked up by name, and is written pg_catalog.name( instead.
    let catalog: BTreeSet<String> = c
        .query(
            "SELECT DISTINCT proname::text FROM pg_proc WHERE pronamespace = 'pg_catalog'::regnamespace",
            &[],
        )
        .expect("pg_catalog's functions")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut unlisted = Vec::new();
    for entry in std::fs::read_dir(scripts_dir()).expect("scripts/") {
        let path = entry.expect("entry").path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let runs_sql = text.contains("psql") || text.contains("PSQL");
        if !runs_sql || THROWAWAY_CLUSTER_SCRIPTS.contains(&name.as_str()) {
            continue;
        }
        if !PINNED_SCRIPTS.contains(&name.as_str()) {
            unlisted.push(name);
            continue;
        }
        assert!(
            text.contains("SET search_path = pg_catalog, pg_temp"),
            "{name} does not set search_path = pg_catalog, pg_temp"
        );
        // Every psql it runs goes through the one function that sets the path first.
        let direct: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("\"$PSQL\"") && !l.contains("$PIN_SEARCH_PATH"))
            .collect();
        assert!(
            direct.is_empty(),
            "{name} runs psql without the SET: {direct:#?}"
        );
        let mut unqualified = BTreeSet::new();
        for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
            let bytes = line.as_bytes();
            let mut i = 0;
            while i < bytes.len() {
                if bytes[i].is_ascii_alphabetic() || bytes[i] == b'_' {
                    let start = i;
                    while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_')
                    {
                        i += 1;
                    }
                    let word = &line[start..i];
                    let before = if start > 0 { bytes[start - 1] } else { b' ' };
                    let is_call = bytes.get(i) == Some(&b'(') && bytes.get(i + 1) != Some(&b')');
                    if is_call && before != b'.' && before != b'$' && catalog.contains(word) {
                        unqualified.insert(word.to_string());
                    }
                } else {
                    i += 1;
                }
            }
        }
        assert!(
            unqualified.is_empty(),
            "{name} calls pg_catalog functions unqualified: {unqualified:?}"
        );
    }
    assert!(
        unlisted.is_empty(),
        "scripts that run SQL, in neither list of this test: {unlisted:?}; a script given \
         a database pins its search path (PINNED_SCRIPTS), one that runs only against its \
         own throwaway cluster is listed in THROWAWAY_CLUSTER_SCRIPTS"
    );
}

fn move_cluster(name: &str, offset: u16) -> OwnCluster {
    let base = std::env::var("OUTBOX_MOVE_BASE").unwrap_or_else(|_| "/tmp/outbox_move".into());
    let port = env_port("OUTBOX_MOVE_PGPORT", 54884);
    OwnCluster::fresh(
        PathBuf::from(base).join(name),
        port + offset,
        "app",
        1,
        "outbox.poll_interval_ms = 100",
    )
}

/// `public.||(bigint, text)` (and `(text, bigint)`), planted by a role that may create in
/// public: a closer match than pg_catalog's `anynonarray || text` for `count(*) || '…'`.
fn plant_concatenation(c: &mut Client, planter: &str) {
    c.batch_execute(&format!(
        "CREATE ROLE {p} NOLOGIN;
         GRANT CREATE ON SCHEMA public TO {p};
         SET ROLE {p};
         CREATE FUNCTION public.cat(bigint, text) RETURNS text LANGUAGE plpgsql AS $b${}$b$;
         CREATE OPERATOR public.|| (LEFTARG = bigint, RIGHTARG = text, FUNCTION = public.cat);
         CREATE FUNCTION public.cat(text, bigint) RETURNS text LANGUAGE plpgsql AS $b${}$b$;
         CREATE OPERATOR public.|| (LEFTARG = text, RIGHTARG = bigint, FUNCTION = public.cat);
         RESET ROLE;",
        escalating_body(planter, "$1::text || $2"),
        escalating_body(planter, "$1 || $2::text"),
        p = ident(planter)
    ))
    .expect("plant ||");
}

#[test]
fn move_tenant_never_runs_an_operator_planted_in_public() {
    let _serial = serial();
    let source = move_cluster("sec_source", 0);
    let target = move_cluster("sec_target", 1);
    let planter = "sec_move_planter";
    for cluster in [&source, &target] {
        let mut c = cluster.connect();
        c.batch_execute(
            "CREATE ROLE acme_app NOLOGIN IN ROLE outbox_writer;
             SET client_min_messages = warning;",
        )
        .unwrap();
        create_channel(
            &mut c,
            "ch",
            "http://127.0.0.1:9/hook",
            r#"{"idempotency_header": "Idempotency-Key", "tenants": ["acme"]}"#,
        );
        c.batch_execute("SELECT outbox.pause_channel('ch', 'the move test sends nothing')")
            .unwrap();
        plant_concatenation(&mut c, planter);
    }
    let mut s = source.connect();
    s.batch_execute("SELECT outbox.bind_tenant('acme_app', 'acme')")
        .unwrap();
    {
        let mut app = session_as(&source, "acme_app");
        enqueue(&mut app, "ch", "k1");
        enqueue(&mut app, "ch", "k2");
    }

    let script = scripts_dir().join("move_tenant.sh");
    let out = Command::new("bash")
        .arg(script)
        .args([&source.conninfo(), &target.conninfo(), "acme"])
        .output()
        .expect("run scripts/move_tenant.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "move_tenant.sh failed: {text}");
    assert!(!text.contains("planted function ran"), "{text}");
    for (what, cluster) in [("source", &source), ("target", &target)] {
        let mut c = cluster.connect();
        assert!(
            !is_superuser(&mut c, planter),
            "the planter became a superuser on the {what}: {text}"
        );
    }
    let mut t = target.connect();
    assert_eq!(
        count(
            &mut t,
            "SELECT count(*) FROM outbox._messages WHERE tenant = 'acme' AND state = 'queued'",
            &[]
        ),
        2,
        "{text}"
    );
}

// ---------------------------------------------------------------------------------------
// Finding 5: a sql channel names its tenants
// ---------------------------------------------------------------------------------------

#[test]
fn a_sql_channel_without_tenants_is_refused_with_a_hint() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let schema = unique("sec_fx");
    let role = unique("sec_fx_role");
    c.batch_execute(&format!(
        "CREATE SCHEMA {s};
         CREATE FUNCTION {s}.f(payload jsonb, effect_key text) RETURNS text LANGUAGE sql AS $$ SELECT NULL::text $$;
         CREATE ROLE {r} NOLOGIN;",
        s = ident(&schema),
        r = ident(&role)
    ))
    .unwrap();
    let function = format!("{schema}.f");
    let options = |tenants: &str| {
        format!(r#"{{"kind": "sql", "function": "{function}", "run_as": "{role}"{tenants}}}"#)
    };
    let create = |c: &mut Client, name: &str, options: &str| {
        c.execute(
            "SELECT outbox.create_channel($1::text, 'sql', $2::text::jsonb)",
            &[&name, &options],
        )
    };
    for without in [options(""), options(r#", "tenants": null"#)] {
        let e = create(&mut c, &unique("sec_sql"), &without).expect_err("no tenants");
        assert_eq!(code_of(&e), "22023", "{}", describe(&e));
        let db = e.as_db_error().unwrap();
        assert!(db.message().contains("\"tenants\""), "{}", describe(&e));
        assert!(
            db.hint().is_some_and(|h| h.contains("[\"*\"]")),
            "{}",
            describe(&e)
        );
    }
    let every = unique("sec_sql");
    create(&mut c, &every, &options(r#", "tenants": ["*"]"#)).expect("[\"*\"] written out");
    create(
        &mut c,
        &unique("sec_sql"),
        &options(r#", "tenants": ["acme"]"#),
    )
    .expect("one tenant");
    // alter_channel may not take the list away again.
    let e = c
        .execute(
            "SELECT outbox.alter_channel($1, '{\"tenants\": null}'::jsonb)",
            &[&every],
        )
        .expect_err("tenants removed");
    assert_eq!(code_of(&e), "22023", "{}", describe(&e));
}

// ---------------------------------------------------------------------------------------
// Finding 12: the key headers
// ---------------------------------------------------------------------------------------

#[test]
fn the_key_headers_may_not_frame_route_authorize_or_sign() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    for option in ["idempotency_header", "reference_header"] {
        for header in [
            "Host",
            "Content-Length",
            "Transfer-Encoding",
            "Connection",
            "Upgrade",
            "TE",
            "Trailer",
            "Proxy-Authorization",
            "Forwarded",
            "X-Forwarded-For",
            "Authorization",
            "Cookie",
            "webhook-id",
            "webhook-timestamp",
            "webhook-signature",
        ] {
            let options = serde_json::json!({ option: header }).to_string();
            let e = c
                .execute(
                    "SELECT outbox.create_channel($1::text, 'http://127.0.0.1:9/hook', $2::text::jsonb)",
                    &[&unique("sec_key"), &options],
                )
                .expect_err(header);
            assert_eq!(code_of(&e), "22023", "{option} {header}: {}", describe(&e));
            assert!(
                e.as_db_error().unwrap().message().contains(option),
                "{}",
                describe(&e)
            );
        }
        let options = serde_json::json!({ option: "X-Outbox-Key" }).to_string();
        c.execute(
            "SELECT outbox.create_channel($1::text, 'http://127.0.0.1:9/hook', $2::text::jsonb)",
            &[&unique("sec_key"), &options],
        )
        .unwrap_or_else(|e| panic!("{option} X-Outbox-Key: {}", describe(&e)));
    }
}

// ---------------------------------------------------------------------------------------
// Finding 10: option values refused for their shape
// ---------------------------------------------------------------------------------------

#[test]
fn values_refused_for_their_shape_reach_neither_the_client_nor_the_log() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let secret = unique("SECRET_token");
    // The server logs the errors of this session (log_min_messages = log keeps them out).
    c.batch_execute("SET log_min_messages = error").unwrap();
    let mark = cluster.log_mark();
    // Passed as a parameter, as an application passes it: the statement's text in the log
    // holds $3, not the value.
    for (endpoint, options) in [
        (
            "http://127.0.0.1:9/hook",
            serde_json::json!({"headers": [format!("Authorization: Bearer {secret}")]}),
        ),
        (
            "http://127.0.0.1:9/hook",
            serde_json::json!({"headers": {"Authorization": [format!("Bearer {secret}")]}}),
        ),
        (
            "nats://127.0.0.1:4222",
            serde_json::json!({"kind": "nats", "subject": "s", "stream": "S", "auth": secret}),
        ),
        (
            "http://127.0.0.1:9/hook",
            serde_json::json!({"reconcile": format!("http://127.0.0.1:9/m/{{effect_key}}?token={secret}")}),
        ),
    ] {
        let text = options.to_string();
        let e = c
            .execute(
                "SELECT outbox.create_channel($1::text, $2::text, $3::text::jsonb)",
                &[&unique("sec_shape"), &endpoint, &text],
            )
            .expect_err("a value of the wrong shape");
        assert_eq!(code_of(&e), "22023", "{}", describe(&e));
        let db = e.as_db_error().unwrap();
        let shown = format!("{} {:?} {:?}", db.message(), db.detail(), db.hint());
        assert!(!shown.contains(&secret), "{options}: {shown}");
    }
    // The log is written by the server as it reports; give it a moment.
    std::thread::sleep(Duration::from_millis(200));
    let log = cluster.log_since(mark);
    assert!(
        log.contains("sec_shape") || log.contains("channel option"),
        "no error logged"
    );
    assert!(
        !log.contains(&secret),
        "the server log holds the secret:\n{log}"
    );
}

// ---------------------------------------------------------------------------------------
// Finding 9: a shared channel shows each tenant only itself
// ---------------------------------------------------------------------------------------

#[test]
fn a_shared_channel_shows_each_tenant_only_itself() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut scratch = Scratch::new(&cluster, "sec_shared");
    let a_app = scratch.role("sec_a_app", "NOLOGIN IN ROLE outbox_writer");
    let b_ops = scratch.role("sec_b_ops", "NOLOGIN IN ROLE outbox_operator");
    let admin = scratch.role("sec_admin", "NOLOGIN IN ROLE outbox_admin");
    let mut su = scratch.connect();
    su.execute("SELECT outbox.bind_tenant($1, 'tenant_a')", &[&a_app])
        .unwrap();
    su.execute("SELECT outbox.bind_tenant($1, 'tenant_b')", &[&b_ops])
        .unwrap();
    create_channel(
        &mut su,
        "shared",
        "http://127.0.0.1:9/hook",
        r#"{"idempotency_header": "Idempotency-Key", "tenants": ["tenant_a", "tenant_b", "tenant_c"]}"#,
    );
    let tenants_shown = |c: &mut Client| -> serde_json::Value {
        let v: String = c
            .query_one(
                "SELECT (options -> 'tenants')::text FROM outbox.channels WHERE name = 'shared'",
                &[],
            )
            .expect("the channel is shown")
            .get(0);
        serde_json::from_str(&v).expect("json")
    };
    let logged = |c: &mut Client| -> Vec<serde_json::Value> {
        c.query(
            "SELECT (detail #> '{options,tenants}')::text FROM outbox.operator_log
              WHERE channel = 'shared' AND detail #> '{options,tenants}' IS NOT NULL",
            &[],
        )
        .expect("the operator log")
        .iter()
        .map(|r| serde_json::from_str(r.get::<_, &str>(0)).expect("json"))
        .collect()
    };
    let mut c = scratch.connect();
    c.batch_execute(&format!("SET ROLE {}", ident(&a_app)))
        .unwrap();
    assert_eq!(tenants_shown(&mut c), serde_json::json!(["tenant_a"]));
    c.batch_execute(&format!("RESET ROLE; SET ROLE {}", ident(&b_ops)))
        .unwrap();
    assert_eq!(tenants_shown(&mut c), serde_json::json!(["tenant_b"]));
    let rows = logged(&mut c);
    assert!(!rows.is_empty(), "the operator sees the channel's creation");
    assert!(
        rows.iter().all(|t| *t == serde_json::json!(["tenant_b"])),
        "{rows:?}"
    );
    c.batch_execute(&format!("RESET ROLE; SET ROLE {}", ident(&admin)))
        .unwrap();
    let all = serde_json::json!(["tenant_a", "tenant_b", "tenant_c"]);
    assert_eq!(tenants_shown(&mut c), all);
    c.batch_execute("RESET ROLE").unwrap();
    assert_eq!(tenants_shown(&mut c), all);
    let rows = logged(&mut c);
    assert!(
        !rows.is_empty() && rows.iter().all(|t| *t == all),
        "{rows:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Finding 15: the metadata address in its IPv6 spellings
// ---------------------------------------------------------------------------------------

#[test]
fn the_metadata_address_in_ipv6_spellings_is_refused() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    // outbox.allowed_hosts is '*' on the suite's cluster: every host, no sensitive address.
    for host in [
        "[::ffff:0:a9fe:a9fe]",
        "[2002:a9fe:a9fe::]",
        "[2002:a9fe:a9fe:1::1]",
        "[2001:0:a9fe:a9fe::1]",
        "[2001:0:4136:e378:8000:63bf:5601:5601]",
    ] {
        let endpoint = format!("http://{host}/latest/meta-data/");
        let e = c
            .execute(
                "SELECT outbox.create_channel($1::text, $2::text, '{}'::jsonb)",
                &[&unique("sec_meta"), &endpoint],
            )
            .expect_err(host);
        assert_eq!(code_of(&e), "42501", "{host}: {}", describe(&e));
        let detail = e
            .as_db_error()
            .unwrap()
            .detail()
            .unwrap_or_default()
            .to_string();
        assert!(detail.contains("169.254.169.254"), "{host}: {detail}");
    }
}

// ---------------------------------------------------------------------------------------
// Finding 17: no Rust backtrace in an error's DETAIL
// ---------------------------------------------------------------------------------------

#[test]
fn a_cancel_inside_reconcile_shows_no_backtrace() {
    let _serial = serial();
    // The server's environment has RUST_BACKTRACE=1 (inherited from this process).
    std::env::set_var("RUST_BACKTRACE", "1");
    let base =
        std::env::var("OUTBOX_BACKTRACE_BASE").unwrap_or_else(|_| "/tmp/outbox_backtrace".into());
    let cluster = OwnCluster::fresh(
        PathBuf::from(base),
        env_port("OUTBOX_BACKTRACE_PGPORT", 54886),
        "outbox",
        1,
        "",
    );
    let mut su = cluster.connect();
    create_channel(
        &mut su,
        "lookups",
        "http://127.0.0.1:9/hook",
        r#"{"reconcile": {"url": "http://127.0.0.1:9/m/{effect_key}"}}"#,
    );
    su.batch_execute("SELECT outbox.pause_channel('lookups', 'nothing is sent in this test')")
        .unwrap();
    let id = enqueue(&mut su, "lookups", "bt-1");

    // One session holds the message's row; reconcile() waits for it and is cancelled.
    let mut holder = cluster.connect();
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM outbox._messages WHERE id = {id} FOR UPDATE"
        ))
        .unwrap();
    let conninfo = cluster.conninfo();
    let waiter = std::thread::spawn(move || {
        let mut c = Client::connect(&conninfo, NoTls).expect("connect");
        c.batch_execute("SET application_name = 'sec_reconcile'")
            .unwrap();
        c.query_one("SELECT outbox.reconcile($1)", &[&id])
    });
    let mut watcher = cluster.connect();
    assert!(
        wait_until(Duration::from_secs(10), || {
            watcher
                .query_one(
                    "SELECT count(*) > 0 FROM pg_stat_activity
                      WHERE application_name = 'sec_reconcile' AND wait_event_type = 'Lock'",
                    &[],
                )
                .map(|r| r.get::<_, bool>(0))
                .unwrap_or(false)
                && watcher
                    .batch_execute("SELECT pg_stat_clear_snapshot()")
                    .is_ok()
        }),
        "reconcile() never waited for the row"
    );
    watcher
        .batch_execute(
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE application_name = 'sec_reconcile'",
        )
        .unwrap();
    let e = waiter.join().unwrap().expect_err("cancelled");
    holder.batch_execute("ROLLBACK").unwrap();
    assert_eq!(code_of(&e), "57014", "{}", describe(&e));
    let detail = e
        .as_db_error()
        .unwrap()
        .detail()
        .unwrap_or_default()
        .to_string();
    for frame in ["backtrace", "pgrx", "outbox_delivery::", "rust_", "   0: "] {
        assert!(
            !detail.contains(frame),
            "DETAIL shows a backtrace:\n{detail}"
        );
    }
}
