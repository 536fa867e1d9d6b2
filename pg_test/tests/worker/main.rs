//! End-to-end tests of the delivery worker against the real cluster (`scripts/cluster.sh`,
//! located by `OUTBOX_BASE` / `OUTBOX_PGPORT`) and the provider simulator.
//!
//! Run: `cargo test -p outbox_e2e --release --test worker -- --test-threads=1`.
//!
//! Every test uses its own channel names and its own simulator, so messages never cross
//! between tests; every server-wide setting a test changes is reset by a guard, also when
//! the test fails.

use outbox_e2e::cluster::{poll, unique, wait_for_workers, Cluster};
use outbox_e2e::helpers::{
    arm_fault, attempts, cluster_and_sim, count, create_channel, enqueue_payload, enqueue_with,
    ledger_entries, one, reset_setting, set_setting, sim_channel, wait_for_count, Attempt,
    SettingsGuard, QUIET, SETTLE,
};
use outbox_e2e::sim::{Action, Received, Simulator};
use postgres::{Client, NoTls};
use std::collections::{HashMap, HashSet};
use std::time::Duration;

// The tests, by area (numbered as in the sections).
mod bad_rows;
mod claims;
mod concurrency;
mod crashes;
mod delivery;
mod flights;
mod key_holds;
mod leases;
mod retention;

// ---------------------------------------------------------------------------------------
// Helpers (local to this file)
// ---------------------------------------------------------------------------------------

fn effect_key(c: &mut Client, source: &str, op: &str) -> String {
    c.query_one(
        "SELECT outbox.effect_key($1::text, $2::text)",
        &[&source, &op],
    )
    .expect("effect_key")
    .get(0)
}

#[derive(Debug, Clone)]
#[allow(dead_code)]
struct Msg {
    id: i64,
    state: String,
    attempts: i32,
    effect_key: String,
    external_id: Option<String>,
    last_error_class: Option<String>,
    last_error: Option<String>,
    last_http_status: Option<i32>,
}

fn message(c: &mut Client, id: i64) -> Result<Option<Msg>, postgres::Error> {
    Ok(c.query_opt(
        "SELECT state::text, attempts, effect_key, external_id, last_error_class::text, last_error, last_http_status
           FROM outbox.messages WHERE id = $1",
        &[&id],
    )?
    .map(|r| Msg {
        id,
        state: r.get(0),
        attempts: r.get(1),
        effect_key: r.get(2),
        external_id: r.get(3),
        last_error_class: r.get(4),
        last_error: r.get(5),
        last_http_status: r.get(6),
    }))
}

/// Waits until message `id` satisfies `pred`; panics with the last state seen.
fn wait_msg(
    cluster: &Cluster,
    id: i64,
    timeout: Duration,
    what: &str,
    pred: impl Fn(&Msg) -> bool,
) -> Msg {
    let mut last = None;
    let found = poll(cluster, timeout, |c| {
        let m = message(c, id)?;
        last.clone_from(&m);
        Ok(m.filter(|m| pred(m)))
    });
    found.unwrap_or_else(|| {
        panic!(
            "message {id} did not become {what} within {timeout:?}; last seen: {last:?}; see {}",
            cluster.log_path().display()
        )
    })
}

/// Waits until message `id` is in `state` and returns it; panics with the last state seen.
fn wait_message(cluster: &Cluster, id: i64, state: &str) -> Msg {
    wait_msg(cluster, id, SETTLE, state, |m| m.state == state)
}

/// Sets `outbox.lease_ms` to its least (1 s) until the guard is dropped, and waits until
/// the workers have reloaded.
fn short_lease<'a>(cluster: &'a Cluster, c: &mut Client) -> SettingsGuard<'a> {
    let guard = SettingsGuard::new(cluster, &["outbox.lease_ms"]);
    set_setting(c, "outbox.lease_ms", "1000");
    std::thread::sleep(Duration::from_millis(700));
    guard
}

/// The cluster, once at least two workers run: tests of what one worker does while the
/// other works need both.
fn with_two_workers() -> Cluster {
    let cluster = Cluster::from_env();
    assert!(
        wait_for_workers(&cluster, &[]).len() >= 2,
        "needs two workers (OUTBOX_WORKERS=2, as scripts/test.sh sets)"
    );
    cluster
}

/// How many messages of `channel` are in each state.
fn states_of(c: &mut Client, channel: &str) -> HashMap<String, i64> {
    c.query(
        "SELECT state::text, count(*) FROM outbox.messages WHERE channel = $1 GROUP BY 1",
        &[&channel],
    )
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// Pauses `channel` and waits until none of its messages is in flight, so that the rest of
/// a backlog stays queued instead of going to a provider that is gone when the test ends.
fn pause_and_settle(cluster: &Cluster, c: &mut Client, channel: &str) {
    c.execute("SELECT outbox.pause_channel($1, 'test over')", &[&channel])
        .unwrap();
    assert!(
        no_message_left(cluster, channel, "state = 'sending'"),
        "the sends of {channel} did not settle"
    );
}

/// Waits (up to `SETTLE`) until no message of `channel` meets `condition` (on
/// `outbox.messages`); false if some still do.
fn no_message_left(cluster: &Cluster, channel: &str, condition: &str) -> bool {
    let sql = format!("SELECT count(*) FROM outbox.messages WHERE channel = $1 AND {condition}");
    poll(cluster, SETTLE, |c| {
        let n: i64 = c.query_one(sql.as_str(), &[&channel])?.get(0);
        Ok((n == 0).then_some(()))
    })
    .is_some()
}

/// A new channel whose every request the simulator answers after `delay`, with room for
/// `max_in_flight` messages in flight. It names an idempotency header, so that its bound
/// is `max_in_flight` (a channel that can neither dedupe nor be asked has the smaller
/// `max_unverifiable_in_flight`).
fn slow_channel(
    c: &mut Client,
    sim: &Simulator,
    prefix: &str,
    delay: Duration,
    max_in_flight: i64,
) -> String {
    let ch = unique(prefix);
    sim.set_default(&ch, Action::AcceptAfter(delay));
    let options =
        format!(r#"{{"max_in_flight": {max_in_flight}, "idempotency_header": "Idempotency-Key"}}"#);
    create_channel(c, &ch, &sim.send_url(&ch), &options);
    ch
}

/// Enqueues `n` messages on the channel in one statement.
fn enqueue_backlog(c: &mut Client, channel: &str, n: i64) {
    c.execute(
        "SELECT outbox.enqueue($1, jsonb_build_object('n', g), $2 || ':' || g)
           FROM generate_series(1, $3::int8) g",
        &[&channel, &channel, &n],
    )
    .unwrap();
}

fn body_json(r: &Received) -> serde_json::Value {
    serde_json::from_slice(&r.body)
        .unwrap_or_else(|e| panic!("body of request {} is not JSON ({e})", r.seq))
}

fn header<'r>(r: &'r Received, name: &str) -> Option<&'r str> {
    r.headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}
