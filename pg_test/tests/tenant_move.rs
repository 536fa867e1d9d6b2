//! Moving a tenant between two clusters (`scripts/move_tenant.sh`, docs/scaling.md): two
//! clusters of the test's own, two tenants on the source, one of them moved with its
//! delivered and queued messages, its ledger and its bindings. On the target the effects
//! already delivered are never sent again (the ledger barrier, even when the application
//! enqueues their keys anew), the queued ones are delivered once, and the other tenant is
//! untouched on the source.
//!
//! The clusters live under `OUTBOX_MOVE_BASE` (`/tmp/outbox_move`) on `OUTBOX_MOVE_PGPORT`
//! (54884) and the port after it.
//!
//! Run: `cargo test -p outbox_e2e --release --test tenant_move -- --test-threads=1`.

use outbox_e2e::cluster::{poll, Cluster, OwnCluster};
use outbox_e2e::helpers::{count, create_channel, enqueue, session_as, try_enqueue};
use outbox_e2e::sim::Simulator;
use postgres::Client;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

const OPTIONS_ACME: &str = r#"{"idempotency_header": "Idempotency-Key", "tenants": ["acme"]}"#;
const OPTIONS_OTHER: &str = r#"{"idempotency_header": "Idempotency-Key", "tenants": ["other"]}"#;

fn own(name: &str, offset: u16) -> OwnCluster {
    let base = std::env::var("OUTBOX_MOVE_BASE").unwrap_or_else(|_| "/tmp/outbox_move".into());
    let port: u16 = outbox_e2e::cluster::env_port("OUTBOX_MOVE_PGPORT", 54884);
    OwnCluster::fresh(
        PathBuf::from(base).join(name),
        port + offset,
        "app",
        1,
        "outbox.poll_interval_ms = 100",
    )
}

/// The application roles (cluster-wide: made on each cluster).
fn roles(c: &mut Client) {
    c.batch_execute(
        "CREATE ROLE acme_app NOLOGIN IN ROLE outbox_writer;
         CREATE ROLE other_app NOLOGIN IN ROLE outbox_writer;",
    )
    .unwrap();
}

fn in_state(c: &mut Client, tenant: &str, state: &str) -> i64 {
    count(
        c,
        "SELECT count(*) FROM outbox.messages WHERE tenant = $1 AND state::text = $2",
        &[&tenant, &state],
    )
}

fn wait_state(cluster: &Cluster, tenant: &str, state: &str, n: i64) {
    let ok = poll(cluster, Duration::from_secs(30), |c| {
        Ok((in_state(c, tenant, state) == n).then_some(()))
    });
    let mut c = cluster.connect();
    let states: Vec<(String, i64)> = c
        .query(
            "SELECT state::text, count(*) FROM outbox.messages WHERE tenant = $1 GROUP BY 1 ORDER BY 1",
            &[&tenant],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(
        ok.is_some(),
        "{n} messages of {tenant} {state} on {}; states: {states:?}",
        cluster.base.display()
    );
}

fn ledger_of(c: &mut Client, tenant: &str) -> Vec<(String, Option<String>)> {
    c.query(
        "SELECT effect_key, external_id FROM outbox._ledger WHERE tenant = $1 ORDER BY effect_key",
        &[&tenant],
    )
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

fn enqueue_as(cluster: &Cluster, role: &str, channel: &str, keys: &[&str]) {
    let mut c = session_as(cluster, role);
    for k in keys {
        enqueue(&mut c, channel, k);
    }
}

/// Runs the move; returns its output.
fn move_tenant(source: &Cluster, target: &Cluster, tenant: &str) -> String {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/move_tenant.sh");
    let out = Command::new("bash")
        .arg(script)
        .args([&source.conninfo(), &target.conninfo(), tenant])
        .output()
        .expect("run scripts/move_tenant.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "move_tenant.sh failed: {text}");
    text
}

#[test]
fn a_moved_tenant_sends_nothing_twice_and_the_other_is_untouched() {
    let sim = Simulator::start();
    let source = own("source", 0);
    let target = own("target", 1);
    let mut s = source.connect();
    let mut t = target.connect();
    roles(&mut s);
    roles(&mut t);
    s.batch_execute(
        "SELECT outbox.bind_tenant('acme_app', 'acme'); SELECT outbox.bind_tenant('other_app', 'other');",
    )
    .unwrap();
    create_channel(
        &mut s,
        "acme_orders",
        &sim.send_url("acme_orders"),
        OPTIONS_ACME,
    );
    create_channel(
        &mut s,
        "other_orders",
        &sim.send_url("other_orders"),
        OPTIONS_OTHER,
    );

    // Delivered on the source, then queued there (the channel paused).
    let delivered = ["d1", "d2", "d3", "d4"];
    let queued = ["q1", "q2", "q3"];
    enqueue_as(&source, "acme_app", "acme_orders", &delivered);
    enqueue_as(&source, "other_app", "other_orders", &["o1", "o2", "o3"]);
    wait_state(&source, "acme", "delivered", 4);
    wait_state(&source, "other", "delivered", 3);
    s.execute(
        "SELECT outbox.pause_channel('acme_orders', 'provider maintenance')",
        &[],
    )
    .unwrap();
    enqueue_as(&source, "acme_app", "acme_orders", &queued);
    let source_ledger = ledger_of(&mut s, "acme");
    assert_eq!(source_ledger.len(), 4);

    // The target: the tenant's channel under its name, paused.
    create_channel(
        &mut t,
        "acme_orders",
        &sim.send_url("acme_orders"),
        OPTIONS_ACME,
    );
    t.execute(
        "SELECT outbox.pause_channel('acme_orders', 'receiving a tenant')",
        &[],
    )
    .unwrap();

    let out = move_tenant(&source, &target, "acme");
    eprintln!("{out}");
    assert!(out.contains("(the same): committed"), "{out}");

    // On the target: its messages, ledger and binding; nothing of the other tenant.
    assert_eq!(in_state(&mut t, "acme", "delivered"), 4, "{out}");
    assert_eq!(in_state(&mut t, "acme", "queued"), 3, "{out}");
    assert_eq!(ledger_of(&mut t, "acme"), source_ledger);
    assert_eq!(
        count(
            &mut t,
            "SELECT count(*) FROM outbox._messages WHERE tenant = 'other'",
            &[]
        ),
        0
    );
    assert_eq!(
        count(
            &mut t,
            "SELECT count(*) FROM outbox._tenant_bindings WHERE tenant = 'acme'",
            &[]
        ),
        1
    );
    // On the source: the tenant's unfinished messages cancelled, its writers unbound.
    assert_eq!(in_state(&mut s, "acme", "cancelled"), 3);
    assert!(try_enqueue(&mut session_as(&source, "acme_app"), "acme_orders", "late").is_err());

    // The queued ones are delivered once by the target.
    t.execute("SELECT outbox.resume_channel('acme_orders')", &[])
        .unwrap();
    wait_state(&target, "acme", "delivered", 7);

    // The application enqueues the delivered keys again: each names its delivered message,
    // which moved with its ledger entry, and nothing new is queued.
    enqueue_as(&target, "acme_app", "acme_orders", &delivered);
    wait_state(&target, "acme", "delivered", 7);
    assert_eq!(
        count(
            &mut t,
            "SELECT count(*) FROM outbox._messages WHERE tenant = 'acme'",
            &[]
        ),
        0,
        "every message of acme is delivered: none is left in the queue table"
    );
    // The barrier: queue rows for those keys (a restore without the ledger's messages, say)
    // are stopped by the ledger before a send.
    t.batch_execute(
        "INSERT INTO outbox._messages (tenant, channel_id, effect_key, payload, next_attempt_at)
         SELECT l.tenant, l.channel_id, l.effect_key, l.payload, now()
           FROM outbox._ledger l WHERE l.tenant = 'acme' AND l.effect_key LIKE 'd%'",
    )
    .unwrap();
    wait_state(&target, "acme", "delivered", 11);
    let sent = sim.header_values("acme_orders", "Idempotency-Key");
    let mut copies: HashMap<&str, usize> = HashMap::new();
    for k in &sent {
        *copies.entry(k.as_str()).or_default() += 1;
    }
    let expected: Vec<String> = delivered
        .iter()
        .chain(queued.iter())
        .map(|k| format!("4:acme:{k}"))
        .collect();
    for k in &expected {
        assert_eq!(
            copies.get(k.as_str()),
            Some(&1),
            "{k} sent once; sends: {sent:?}"
        );
    }
    assert_eq!(sent.len(), expected.len(), "sends: {sent:?}");

    // The other tenant, on the source, goes on as before.
    enqueue_as(&source, "other_app", "other_orders", &["o4"]);
    wait_state(&source, "other", "delivered", 4);
    assert_eq!(sim.send_count("other_orders"), 4);
    assert!(one_bool(
        &mut s,
        "SELECT NOT paused FROM outbox._channels WHERE name = 'other_orders'"
    ));
}

fn one_bool(c: &mut Client, sql: &str) -> bool {
    c.query_one(sql, &[]).unwrap().get(0)
}
