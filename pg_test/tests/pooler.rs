//! Applications behind PgBouncer in `pool_mode = transaction` (docs/pooling.md), against the
//! real cluster, the real workers and the provider simulator:
//!
//! 1. the two application examples (`examples/python`, psycopg 3; `examples/rust`,
//!    tokio-postgres) run as real processes, 8 clients for each of two tenants interleaved
//!    on 3 server connections: every order and its message commit together, every message
//!    lands in its own tenant, serialization failures (a hot stock row under SERIALIZABLE)
//!    are retried with the same effect key, and running every turn again makes no second
//!    message, order or send;
//! 2. a session-level `SET outbox.tenant` leaks to the next client of the same server
//!    connection; `SET LOCAL` does not;
//! 3. a named prepared statement made outside a transaction is gone on the next server
//!    connection (PgBouncer 1.18); an unnamed one (`query_typed`) works.
//!
//! Run: `cargo test -p outbox_e2e --release --test pooler -- --test-threads=1`. PgBouncer
//! listens on `OUTBOX_PGBOUNCER_PORT` (default 54850). The Rust example is built once into
//! the target directory (`target/tmp/examples`) and reused.

use outbox_e2e::cluster::{unique, wait_until, Cluster};
use outbox_e2e::helpers::{code_of, create_channel, describe, ident, serial, SETTLE};
use outbox_e2e::pooler::{PgBouncer, Pool};
use outbox_e2e::sim::Simulator;
use postgres::types::Type;
use postgres::{Client, NoTls};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Clients per example process, and turns per client: 4 processes (two examples, two
/// tenants) make 8 clients per tenant.
const CLIENTS: usize = 4;
const TURNS: usize = 15;
/// The server connections the 16 clients share.
const POOL_SIZE: u32 = 3;

/// The application's own tables (made once, shared by every run: rows carry their run's
/// request ids and tenants).
const SHOP_SCHEMA: &str = include_str!("../../examples/shop.sql");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A superuser connection to the cluster with the shop's tables, and the shop's login role.
fn shop_app(cluster: &Cluster) -> (Client, AppRole<'_>) {
    let mut su = cluster.connect();
    su.batch_execute(SHOP_SCHEMA).expect("the shop's tables");
    let app = AppRole::create(cluster, &mut su);
    (su, app)
}

/// PgBouncer in front of `cluster` with one pool, `alias`, of `pool_size` server
/// connections, for `app`.
fn one_pool(
    cluster: &Cluster,
    app: &AppRole<'_>,
    alias: &'static str,
    pool_size: u32,
) -> PgBouncer {
    PgBouncer::start(cluster, &[&app.name], &[Pool { alias, pool_size }])
}

/// A login role of the application: writes through outbox_writer, for any tenant it names
/// (`'*'`), and owns nothing. Its sessions write their errors to the server log (the
/// cluster's `log_min_messages = log` leaves them out). Dropped (binding first) when the
/// guard is.
struct AppRole<'a> {
    cluster: &'a Cluster,
    name: String,
}

impl<'a> AppRole<'a> {
    fn create(cluster: &'a Cluster, su: &mut Client) -> AppRole<'a> {
        let name = unique("shop_app");
        su.batch_execute(&format!(
            "CREATE ROLE {r} LOGIN; GRANT outbox_writer TO {r};
             ALTER ROLE {r} SET log_min_messages = 'error';
             GRANT USAGE ON SCHEMA shop TO {r};
             GRANT SELECT, INSERT, UPDATE ON shop.orders, shop.stock TO {r};",
            r = ident(&name)
        ))
        .unwrap_or_else(|e| panic!("create the application role {name}: {}", describe(&e)));
        su.execute("SELECT outbox.bind_tenant($1::text::name, '*')", &[&name])
            .unwrap_or_else(|e| panic!("bind {name} to '*': {}", describe(&e)));
        AppRole { cluster, name }
    }
}

impl Drop for AppRole<'_> {
    fn drop(&mut self) {
        let Ok(mut c) = Client::connect(&self.cluster.conninfo(), NoTls) else {
            return;
        };
        let _ = c.execute(
            "SELECT outbox.unbind_tenant($1::text::name, '*')",
            &[&self.name],
        );
        // Its server connections (PgBouncer's) are gone once PgBouncer stopped.
        let _ = c.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1",
            &[&self.name],
        );
        let r = ident(&self.name);
        let _ = c.batch_execute(&format!(
            "REVOKE ALL ON shop.orders, shop.stock FROM {r}; REVOKE USAGE ON SCHEMA shop FROM {r}"
        ));
        let _ = c.batch_execute(&format!("DROP ROLE IF EXISTS {r}"));
    }
}

/// The Rust example, built once (dev profile, its own lock file) into the target directory.
fn rust_example() -> PathBuf {
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("examples");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let started = Instant::now();
    let out = Command::new(cargo)
        .args(["build", "--locked", "--quiet", "--manifest-path"])
        .arg(repo().join("examples/rust/Cargo.toml"))
        .env("CARGO_TARGET_DIR", &target)
        .output()
        .expect("run cargo build for examples/rust");
    assert!(
        out.status.success(),
        "building examples/rust failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("examples/rust built in {:.1?}", started.elapsed());
    target.join("debug/shop_turns")
}

/// The Python example's interpreter, with psycopg where `scripts/setup.sh` put it.
fn python_example() -> Command {
    let mut c = Command::new("python3");
    c.arg(repo().join("examples/python/shop_turns.py"))
        .env("PYTHONPATH", repo().join("examples/python/.deps"));
    c
}

/// What one example process reported: its turns, retries and message id per request.
struct Report {
    label: String,
    tenant: String,
    turns: usize,
    retries: u64,
    ids: BTreeMap<String, i64>,
}

fn report(label: &str, out: Output) -> Report {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{label} failed ({}):\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{label}: its report is not JSON ({e}): {stdout}"));
    let ids = v["ids"]
        .as_object()
        .unwrap_or_else(|| panic!("{label}: no ids in {stdout}"))
        .iter()
        .map(|(k, id)| (k.clone(), id.as_i64().expect("a message id")))
        .collect();
    Report {
        label: label.to_string(),
        tenant: v["tenant"].as_str().unwrap_or_default().to_string(),
        turns: v["turns"].as_u64().unwrap_or_default() as usize,
        retries: v["retries"].as_u64().unwrap_or_default(),
        ids,
    }
}

/// Runs the four example processes at once (each example for each tenant) and waits for
/// them.
fn run_examples(
    rust: &Path,
    dsn: &str,
    channel: &str,
    run: &str,
    tenants: [&str; 2],
) -> Vec<Report> {
    let mut children = Vec::new();
    for tenant in tenants {
        let args = |c: &mut Command| {
            c.args([
                "--dsn",
                dsn,
                "--tenant",
                tenant,
                "--channel",
                channel,
                "--run",
                run,
            ])
            .args([
                "--clients",
                &CLIENTS.to_string(),
                "--turns",
                &TURNS.to_string(),
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        };
        let mut py = python_example();
        args(&mut py);
        children.push((
            format!("python, tenant {tenant}"),
            py.spawn().expect("start python3"),
        ));
        let mut rs = Command::new(rust);
        args(&mut rs);
        children.push((
            format!("rust, tenant {tenant}"),
            rs.spawn().expect("start the rust example"),
        ));
    }
    children
        .into_iter()
        .map(|(label, child)| {
            report(
                &label,
                child.wait_with_output().expect("wait for an example"),
            )
        })
        .collect()
}

/// Lines of the server log since `mark` that report a serialization failure of `app`
/// (its application_name, which PgBouncer sets on the server connection per client).
fn serialization_failures_logged(cluster: &Cluster, mark: u64, app: &str) -> u64 {
    cluster
        .log_since(mark)
        .lines()
        .filter(|l| {
            l.contains(app) && l.contains("ERROR:") && l.contains("could not serialize access")
        })
        .count() as u64
}

/// What the database holds for a run, as the superuser reads it.
struct Held {
    /// (tenant, request id of the payload, tenant of the payload, message id, key is the
    /// request's) per message of the run.
    messages: Vec<(String, String, String, i64, bool)>,
    orders_by_tenant: BTreeMap<String, i64>,
    sold_by_tenant: BTreeMap<String, i64>,
    /// Server connections that wrote orders, and those that wrote orders of both tenants.
    server_pids: usize,
    shared_pids: usize,
}

fn held(su: &mut Client, run: &str, tenants: [&str; 2]) -> Held {
    let like = format!("{run}-%");
    let messages = su
        .query(
            "SELECT tenant, payload->>'request_id', payload->>'tenant', id,
                    effect_key = outbox.effect_key(payload->>'request_id', 'order_confirmation')
               FROM outbox.messages WHERE payload->>'request_id' LIKE $1",
            &[&like],
        )
        .expect("the run's messages")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect();
    let mut by_tenant = |sql: &str| -> BTreeMap<String, i64> {
        su.query(sql, &[&tenants.to_vec()])
            .expect("per tenant")
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    };
    let orders_by_tenant =
        by_tenant("SELECT tenant, count(*) FROM shop.orders WHERE tenant = ANY($1) GROUP BY 1");
    let sold_by_tenant =
        by_tenant("SELECT tenant, sold::int8 FROM shop.stock WHERE tenant = ANY($1)");
    let pids = su
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE tenants = 2)
               FROM (SELECT server_pid, count(DISTINCT tenant) tenants FROM shop.orders
                      WHERE tenant = ANY($1) GROUP BY 1) p",
            &[&tenants.to_vec()],
        )
        .expect("server connections of the orders");
    Held {
        messages,
        orders_by_tenant,
        sold_by_tenant,
        server_pids: pids.get::<_, i64>(0) as usize,
        shared_pids: pids.get::<_, i64>(1) as usize,
    }
}

/// The checks of one run of the examples against what the database holds.
fn check_run(h: &Held, reports: &[Report], tenants: [&str; 2]) {
    let per_tenant = 2 * CLIENTS * TURNS;
    let mut reported: BTreeMap<String, i64> = BTreeMap::new();
    for r in reports {
        assert_eq!(r.turns, CLIENTS * TURNS, "{}: turns reported", r.label);
        for (request, id) in &r.ids {
            assert!(
                request.contains(&r.tenant),
                "{}: request {request} of another tenant",
                r.label
            );
            reported.insert(request.clone(), *id);
        }
    }
    assert_eq!(
        h.messages.len(),
        2 * per_tenant,
        "messages of the run: one per turn"
    );
    let cross: Vec<_> = h.messages.iter().filter(|m| m.0 != m.2).collect();
    assert!(
        cross.is_empty(),
        "messages written in another tenant than their turn's: {cross:?}"
    );
    let foreign: Vec<_> = h
        .messages
        .iter()
        .filter(|m| !tenants.contains(&m.0.as_str()) || !m.1.contains(&m.0))
        .collect();
    assert!(
        foreign.is_empty(),
        "messages of a tenant outside the run: {foreign:?}"
    );
    let bad_keys: Vec<_> = h.messages.iter().filter(|m| !m.4).collect();
    assert!(
        bad_keys.is_empty(),
        "messages whose key is not effect_key(request, 'order_confirmation'): {bad_keys:?}"
    );
    let requests: BTreeSet<&String> = h.messages.iter().map(|m| &m.1).collect();
    assert_eq!(
        requests.len(),
        h.messages.len(),
        "two messages for one request"
    );
    for m in &h.messages {
        assert_eq!(
            reported.get(&m.1),
            Some(&m.3),
            "the id reported for request {} is its message's",
            m.1
        );
    }
    for t in tenants {
        assert_eq!(
            h.orders_by_tenant.get(t),
            Some(&(per_tenant as i64)),
            "orders of tenant {t}"
        );
        assert_eq!(
            h.sold_by_tenant.get(t),
            Some(&(per_tenant as i64)),
            "stock sold of tenant {t}: one per order"
        );
    }
}

#[test]
fn two_applications_through_pgbouncer_write_each_message_once_in_its_own_tenant() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let (mut su, app) = shop_app(&cluster);
    let sim = Simulator::start();
    let channel = unique("shop_confirmations");
    create_channel(
        &mut su,
        &channel,
        &sim.send_url(&channel),
        r#"{"idempotency_header": "Idempotency-Key"}"#,
    );
    let run = unique("run");
    let tenants = [format!("{run}_acme"), format!("{run}_globex")];
    let tenants = [tenants[0].as_str(), tenants[1].as_str()];
    for t in tenants {
        su.execute(
            "INSERT INTO shop.stock (tenant, item) VALUES ($1, 'widget')",
            &[&t],
        )
        .expect("the tenant's stock row");
    }
    let rust = rust_example();
    let bouncer = one_pool(&cluster, &app, "shop", POOL_SIZE);
    let dsn = format!("{} application_name={run}", bouncer.dsn("shop", &app.name));

    let mark = cluster.log_mark();
    let started = Instant::now();
    let first = run_examples(&rust, &dsn, &channel, &run, tenants);
    eprintln!(
        "first run: {} turns in {:.1?}",
        4 * CLIENTS * TURNS,
        started.elapsed()
    );
    let h = held(&mut su, &run, tenants);
    check_run(&h, &first, tenants);
    assert!(
        h.server_pids <= POOL_SIZE as usize && h.shared_pids >= 1,
        "16 clients should share at most {POOL_SIZE} server connections, some of them serving both tenants: {} wrote orders, {} of them for both",
        h.server_pids,
        h.shared_pids
    );

    // The retry path ran: SERIALIZABLE turns on one stock row per tenant failed with
    // 40001, and each failure the server logged was retried by an example.
    let retries: u64 = first.iter().map(|r| r.retries).sum();
    let logged = serialization_failures_logged(&cluster, mark, &run);
    eprintln!(
        "retries after 40001: {retries} ({}); serialization failures in the server log: {logged}",
        first
            .iter()
            .map(|r| format!("{}: {}", r.label, r.retries))
            .collect::<Vec<_>>()
            .join(", ")
    );
    assert!(
        retries > 0,
        "no turn met a serialization failure: the retry path was not exercised"
    );
    assert_eq!(
        retries, logged,
        "every serialization failure the server logged is one retry reported"
    );

    // Every turn again, as after a crash that lost the answers: the same messages, no new
    // order, no new send.
    let again = run_examples(&rust, &dsn, &channel, &run, tenants);
    let h2 = held(&mut su, &run, tenants);
    check_run(&h2, &again, tenants);
    assert_eq!(
        h2.messages.len(),
        h.messages.len(),
        "running the turns again made new messages"
    );
    for (a, b) in first.iter().zip(&again) {
        assert_eq!(
            a.ids, b.ids,
            "{}: the turns run again returned other message ids",
            a.label
        );
    }

    let total = h.messages.len();
    let delivered = wait_until(SETTLE, || {
        su.query_one(
            "SELECT count(*) FROM outbox.messages WHERE payload->>'request_id' LIKE $1 AND state = 'delivered'",
            &[&format!("{run}-%")],
        )
        .map(|r| r.get::<_, i64>(0) as usize == total)
        .unwrap_or(false)
    });
    assert!(
        delivered,
        "the run's {total} messages were not all delivered within {SETTLE:?}"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(sim.send_count(&channel), total, "one send per message");
    drop(bouncer);
}

/// Enqueues on `c` without naming a tenant: the tenant of the message, or the SQLSTATE of
/// the refusal.
fn enqueue_unnamed(c: &mut Client, su: &mut Client, channel: &str) -> Result<String, String> {
    let key = unique("pool_unnamed");
    let id: i64 = c
        .query_one(
            "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text)",
            &[&channel, &key],
        )
        .map_err(|e| code_of(&e))?
        .get(0);
    Ok(su
        .query_one("SELECT tenant FROM outbox.messages WHERE id = $1", &[&id])
        .expect("tenant of the message")
        .get(0))
}

#[test]
fn a_session_set_of_the_tenant_leaks_to_the_next_client_and_set_local_does_not() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let (mut su, app) = shop_app(&cluster);
    let sim = Simulator::start();
    let channel = unique("pool_leak");
    create_channel(&mut su, &channel, &sim.send_url(&channel), "{}");
    let tenant = unique("pool_leak_t");
    // One server connection: every client's transaction runs on it in turn.
    let bouncer = one_pool(&cluster, &app, "one", 1);
    let mut first = bouncer.connect("one", &app.name);
    let mut next = bouncer.connect("one", &app.name);

    // Unsafe: a session-level SET stays on the server connection after the transaction.
    first
        .batch_execute(&format!("SET outbox.tenant = '{tenant}'"))
        .expect("SET outbox.tenant");
    assert_eq!(
        enqueue_unnamed(&mut next, &mut su, &channel),
        Ok(tenant.clone()),
        "a client that names no tenant, after another client's session-level SET on the same server connection, should act for that client's tenant (the leak docs/pooling.md warns of)"
    );
    let seen: i64 = next
        .query_one("SELECT count(*) FROM outbox.messages", &[])
        .expect("count")
        .get(0);
    assert!(
        seen > 0,
        "the leaked tenant should show its rows to the next client too"
    );
    first
        .batch_execute("RESET outbox.tenant")
        .expect("RESET outbox.tenant");

    // Safe: SET LOCAL ends with its transaction.
    let mut tx = first.transaction().expect("BEGIN");
    tx.batch_execute(&format!("SET LOCAL outbox.tenant = '{tenant}'"))
        .expect("SET LOCAL");
    let key = unique("pool_local");
    let id: i64 = tx
        .query_one(
            "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text)",
            &[&channel, &key],
        )
        .unwrap_or_else(|e| panic!("enqueue with SET LOCAL: {}", describe(&e)))
        .get(0);
    tx.commit().expect("COMMIT");
    let t: String = su
        .query_one("SELECT tenant FROM outbox.messages WHERE id = $1", &[&id])
        .expect("tenant")
        .get(0);
    assert_eq!(t, tenant, "the message enqueued under SET LOCAL");
    assert_eq!(
        enqueue_unnamed(&mut next, &mut su, &channel),
        Err("42501".to_string()),
        "after a SET LOCAL transaction of another client, a client that names no tenant must be refused (its role is bound to '*')"
    );
    let seen: i64 = next
        .query_one("SELECT count(*) FROM outbox.messages", &[])
        .expect("count")
        .get(0);
    assert_eq!(
        seen, 0,
        "after another client's SET LOCAL transaction, a client that names no tenant sees no rows"
    );
    drop(bouncer);
}

#[test]
fn a_named_prepared_statement_is_lost_on_the_next_server_connection_and_an_unnamed_one_is_not() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let (_su, app) = shop_app(&cluster);
    // Two server connections, none open yet.
    let bouncer = one_pool(&cluster, &app, "two", 2);
    let mut prepares = bouncer.connect("two", &app.name);
    let mut holds = bouncer.connect("two", &app.name);

    // Prepared (named) on the first server connection, which is free again afterwards.
    let statement = prepares
        .prepare("SELECT outbox.effect_key($1::text, 'op')")
        .unwrap_or_else(|e| panic!("prepare through PgBouncer: {}", describe(&e)));
    // Another client's transaction takes that connection; the statement runs on a new one.
    let mut tx = holds.transaction().expect("BEGIN");
    tx.batch_execute("SELECT 1")
        .expect("the other client's transaction");
    let lost = prepares.query(&statement, &[&"request-1"]);
    match &lost {
        Err(e) => assert_eq!(
            code_of(e),
            "26000",
            "expected 'prepared statement does not exist', got {}",
            describe(e)
        ),
        Ok(_) => panic!("the named statement ran on a server connection it was not prepared on"),
    }
    // Unnamed, parsed and run in one round trip: whichever connection it lands on.
    let row = prepares
        .query_typed_one(
            "SELECT outbox.effect_key($1, 'op')",
            &[(&"request-1", Type::TEXT)],
        )
        .unwrap_or_else(|e| panic!("query_typed through PgBouncer: {}", describe(&e)));
    let key: String = row.get(0);
    assert_eq!(key.len(), 64, "an effect key");
    tx.commit().expect("COMMIT");
    drop(bouncer);
}
