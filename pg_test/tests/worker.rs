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
    arm_fault, count, create_channel, enqueue_payload, enqueue_with, reset_setting, set_setting,
    SettingsGuard, QUIET, SETTLE,
};
use outbox_e2e::sim::{Action, Received, Simulator};
use postgres::{Client, NoTls};
use std::collections::{HashMap, HashSet};
use std::time::Duration;

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

#[derive(Debug, Clone)]
#[allow(dead_code)]
struct Attempt {
    attempt: i32,
    kind: String,
    outcome: Option<String>,
    error_class: Option<String>,
    http_status: Option<i32>,
    error: Option<String>,
    external_id: Option<String>,
    effect_key_sent: Option<String>,
    worker_pid: Option<i32>,
    started_at_us: i64,
}

fn attempts(c: &mut Client, id: i64) -> Vec<Attempt> {
    c.query(
        "SELECT attempt, kind, outcome, error_class::text, http_status, error, external_id,
                effect_key_sent, worker_pid, (extract(epoch FROM started_at) * 1000000)::int8
           FROM outbox.attempts WHERE message_id = $1 ORDER BY attempt_id",
        &[&id],
    )
    .expect("attempts")
    .iter()
    .map(|r| Attempt {
        attempt: r.get(0),
        kind: r.get(1),
        outcome: r.get(2),
        error_class: r.get(3),
        http_status: r.get(4),
        error: r.get(5),
        external_id: r.get(6),
        effect_key_sent: r.get(7),
        worker_pid: r.get(8),
        started_at_us: r.get(9),
    })
    .collect()
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
/// `max_in_flight` messages in flight.
fn slow_channel(
    c: &mut Client,
    sim: &Simulator,
    prefix: &str,
    delay: Duration,
    max_in_flight: i64,
) -> String {
    let ch = unique(prefix);
    sim.set_default(&ch, Action::AcceptAfter(delay));
    let options = format!(r#"{{"max_in_flight": {max_in_flight}}}"#);
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

// ---------------------------------------------------------------------------------------
// 1. Commit → delivered
// ---------------------------------------------------------------------------------------

#[test]
fn commit_is_delivered_with_ledger_attempt_and_headers() {
    let cluster = Cluster::from_env();
    cluster.wait_for_worker();
    let sim = Simulator::start();
    let ch = unique("w_deliver");
    let mut c = cluster.connect();
    create_channel(
        &mut c,
        &ch,
        &sim.send_url(&ch),
        r#"{"idempotency_header": "Idempotency-Key", "external_id": "/id",
            "headers": {"Authorization": "Bearer t0ken-1", "X-Static": "static-1"}}"#,
    );
    let key = effect_key(&mut c, &unique("turn"), "send_reply");
    let payload = r#"{"to": "user-7", "text": "Your order shipped", "n": [1, 2, 3]}"#;
    let id = {
        let mut tx = c.transaction().unwrap();
        let id = enqueue_with(
            &mut tx,
            &ch,
            payload,
            &key,
            None,
            Some(r#"{"X-Request-Id": "req-42", "X-Tenant-Hint": "acme"}"#),
        );
        tx.commit().unwrap();
        id
    };

    let m = wait_message(&cluster, id, "delivered");
    assert!(sim.wait_for_stored(&ch, 1, Duration::from_secs(5)));
    let stored = sim.stored(&ch);
    assert_eq!(stored.len(), 1, "the provider stored exactly one message");
    assert_eq!(sim.send_count(&ch), 1, "exactly one request was sent");
    let ext = stored[0].external_id.clone();
    assert_eq!(m.external_id.as_deref(), Some(ext.as_str()));
    assert_eq!(m.effect_key, key);
    assert_eq!(m.attempts, 1);
    assert_eq!(m.last_http_status, Some(200));

    // The ledger: one entry, recorded by the worker, with the provider's id.
    let ledger = c
        .query(
            "SELECT message_id, external_id, recorded_by FROM outbox.ledger WHERE effect_key = $1",
            &[&key],
        )
        .unwrap();
    assert_eq!(ledger.len(), 1, "one ledger entry for the effect");
    assert_eq!(ledger[0].get::<_, i64>(0), id);
    assert_eq!(
        ledger[0].get::<_, Option<String>>(1).as_deref(),
        Some(ext.as_str())
    );
    assert_eq!(ledger[0].get::<_, String>(2), "worker");

    // One attempt row: a send, delivered, HTTP 200, with the key and the external id.
    let a = attempts(&mut c, id);
    assert_eq!(a.len(), 1, "one attempt row: {a:?}");
    assert_eq!(a[0].kind, "send");
    assert_eq!(a[0].attempt, 1);
    assert_eq!(a[0].outcome.as_deref(), Some("delivered"));
    assert_eq!(a[0].http_status, Some(200));
    assert_eq!(a[0].error_class, None);
    assert_eq!(a[0].external_id.as_deref(), Some(ext.as_str()));
    assert_eq!(a[0].effect_key_sent.as_deref(), Some(key.as_str()));
    let pids = cluster.worker_pids(&mut c);
    assert!(
        a[0].worker_pid.is_some_and(|p| pids.contains(&p)),
        "attempt made by a running worker: {:?} not in {pids:?}",
        a[0].worker_pid
    );

    // What the provider received.
    let sends = sim.sends(&ch);
    assert_eq!(sends.len(), 1);
    let r = &sends[0];
    assert_eq!(r.method, "POST");
    assert_eq!(r.status, Some(200));
    assert_eq!(header(r, "Idempotency-Key"), Some(key.as_str()));
    assert_eq!(r.key.as_deref(), Some(key.as_str()));
    assert_eq!(
        body_json(r),
        serde_json::from_str::<serde_json::Value>(payload).unwrap(),
        "the body is the payload"
    );
    assert_eq!(header(r, "Authorization"), Some("Bearer t0ken-1"));
    assert_eq!(header(r, "X-Static"), Some("static-1"));
    assert_eq!(header(r, "X-Request-Id"), Some("req-42"));
    assert_eq!(header(r, "X-Tenant-Hint"), Some("acme"));
    assert_eq!(header(r, "Content-Type"), Some("application/json"));
    assert_eq!(sim.header_values(&ch, "Idempotency-Key"), vec![key.clone()]);
}

// ---------------------------------------------------------------------------------------
// 2. Re-enqueue of a delivered key; the ledger barrier after retention-like deletion
// ---------------------------------------------------------------------------------------

#[test]
fn reenqueue_returns_same_id_and_ledger_blocks_resend_after_row_deleted() {
    let cluster = Cluster::from_env();
    cluster.wait_for_worker();
    let sim = Simulator::start();
    let ch = unique("w_ledger");
    let mut c = cluster.connect();
    create_channel(
        &mut c,
        &ch,
        &sim.send_url(&ch),
        r#"{"idempotency_header": "Idempotency-Key", "external_id": "/id"}"#,
    );
    let key = effect_key(&mut c, &unique("turn"), "send_reply");
    let payload = r#"{"text": "once"}"#;
    let id = enqueue_payload(&mut c, &ch, payload, &key);
    wait_message(&cluster, id, "delivered");
    assert_eq!(sim.send_count(&ch), 1);
    let ext = sim.stored(&ch)[0].external_id.clone();

    // The same effect again: the same message, nothing new.
    let again = enqueue_payload(&mut c, &ch, payload, &key);
    assert_eq!(again, id, "re-enqueue of a delivered effect returns its id");
    let n: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.messages WHERE effect_key = $1",
            &[&key],
        )
        .unwrap()
        .get(0);
    assert_eq!(n, 1, "still one message for the key");
    std::thread::sleep(QUIET);
    assert_eq!(sim.send_count(&ch), 1, "no second request");
    assert_eq!(attempts(&mut c, id).len(), 1, "no second attempt");

    // Simulate retention: the message and its attempts are gone, the ledger stays.
    c.execute("DELETE FROM outbox._attempts WHERE message_id = $1", &[&id])
        .unwrap();
    let deleted = c
        .execute("DELETE FROM outbox._messages WHERE id = $1", &[&id])
        .unwrap();
    assert_eq!(deleted, 1);
    assert_eq!(
        cluster_status(&mut c, id).as_deref(),
        Some("delivered"),
        "status() of a removed message whose effect is in the ledger"
    );

    let new_id = enqueue_payload(&mut c, &ch, payload, &key);
    assert_ne!(new_id, id, "the removed message is not found: a new row");
    let m = wait_message(&cluster, new_id, "delivered");
    std::thread::sleep(QUIET);
    assert_eq!(
        sim.send_count(&ch),
        1,
        "the barrier: an effect in the ledger is never sent again"
    );
    assert_eq!(sim.stored(&ch).len(), 1);
    assert_eq!(
        m.external_id.as_deref(),
        Some(ext.as_str()),
        "the new row carries the recorded external id"
    );
    let a = attempts(&mut c, new_id);
    assert_eq!(a.len(), 1, "{a:?}");
    assert_eq!(a[0].kind, "send");
    assert_eq!(a[0].http_status, None, "nothing was sent: no HTTP status");
    let outcome = a[0].outcome.clone().unwrap_or_default();
    assert!(
        outcome.contains("not sent") && outcome.contains("ledger"),
        "the attempt says it was not sent because of the ledger: {outcome:?}"
    );
    // The ledger still names the first message, once.
    let ledger = c
        .query(
            "SELECT message_id, external_id FROM outbox.ledger WHERE effect_key = $1",
            &[&key],
        )
        .unwrap();
    assert_eq!(ledger.len(), 1);
    assert_eq!(ledger[0].get::<_, i64>(0), id);
    assert_eq!(
        ledger[0].get::<_, Option<String>>(1).as_deref(),
        Some(ext.as_str())
    );
}

fn cluster_status(c: &mut Client, id: i64) -> Option<String> {
    c.query_one("SELECT outbox.status($1)::text", &[&id])
        .unwrap()
        .get(0)
}

// ---------------------------------------------------------------------------------------
// 3. Ordering key while the first message keeps failing
// ---------------------------------------------------------------------------------------

#[test]
fn ordering_key_waits_for_a_failing_first_message() {
    let cluster = Cluster::from_env();
    cluster.wait_for_worker();
    let sim = Simulator::start();
    let ch = unique("w_order");
    sim.set_plan(&ch, vec![Action::Status(503), Action::Status(503)]);
    let mut c = cluster.connect();
    create_channel(
        &mut c,
        &ch,
        &sim.send_url(&ch),
        r#"{"idempotency_header": "Idempotency-Key",
            "retry": {"base_ms": 200, "max_ms": 400, "jitter": "none", "max_attempts": 4}}"#,
    );
    let okey = unique("conversation");
    let keys: Vec<String> = (0..3).map(|i| unique(&format!("ord{i}"))).collect();
    let ids: Vec<i64> = {
        let mut tx = c.transaction().unwrap();
        let ids = keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                enqueue_with(
                    &mut tx,
                    &ch,
                    &format!(r#"{{"seq": {i}}}"#),
                    k,
                    Some(&okey),
                    None,
                )
            })
            .collect();
        tx.commit().unwrap();
        ids
    };
    assert!(ids.windows(2).all(|w| w[0] < w[1]));

    // While the first one is still failing, the others have not been tried.
    assert!(
        sim.wait_for_sends(&ch, 1, SETTLE),
        "first attempt never came"
    );
    let waiting: Vec<i32> = ids[1..]
        .iter()
        .map(|id| message(&mut c, *id).unwrap().unwrap().attempts)
        .collect();
    if sim.send_count(&ch) < 3 {
        assert_eq!(
            waiting,
            vec![0, 0],
            "later messages of the ordering key were claimed while the first was failing"
        );
    }

    for id in &ids {
        wait_message(&cluster, *id, "delivered");
    }
    let m1 = message(&mut c, ids[0]).unwrap().unwrap();
    assert_eq!(m1.attempts, 3, "503, 503, then accepted");

    let stored: Vec<Option<String>> = sim.stored(&ch).into_iter().map(|s| s.key).collect();
    assert_eq!(
        stored,
        keys.iter().cloned().map(Some).collect::<Vec<_>>(),
        "the provider stored them in enqueue order"
    );
    let sends = sim.sends(&ch);
    let summary: Vec<(Option<String>, String)> = sends
        .iter()
        .map(|r| (r.key.clone(), r.outcome.clone()))
        .collect();
    assert_eq!(
        sends.len(),
        5,
        "3 sends of the first, 1 of each other: {summary:?}"
    );
    let first_accepted = sends
        .iter()
        .find(|r| r.key.as_deref() == Some(keys[0].as_str()) && r.status == Some(200))
        .expect("first message accepted")
        .seq;
    let first_key_sends: Vec<&str> = sends
        .iter()
        .filter(|r| r.key.as_deref() == Some(keys[0].as_str()))
        .map(|r| r.outcome.as_str())
        .collect();
    assert_eq!(
        first_key_sends,
        vec!["status:503", "status:503", "accepted"]
    );
    for (i, k) in keys.iter().enumerate().skip(1) {
        let seqs: Vec<u64> = sends
            .iter()
            .filter(|r| r.key.as_deref() == Some(k.as_str()))
            .map(|r| r.seq)
            .collect();
        assert_eq!(seqs.len(), 1, "message {i} sent once: {summary:?}");
        assert!(
            seqs[0] > first_accepted,
            "message {i} was requested (seq {}) before the first was delivered (seq {first_accepted}): {summary:?}",
            seqs[0]
        );
    }
    // The third waited for the second too.
    let seq_of = |k: &str| {
        sends
            .iter()
            .find(|r| r.key.as_deref() == Some(k))
            .map(|r| r.seq)
            .unwrap()
    };
    assert!(seq_of(&keys[2]) > seq_of(&keys[1]));
}

// ---------------------------------------------------------------------------------------
// 4. kill -9 of a worker mid-batch on a deduping channel
// ---------------------------------------------------------------------------------------

#[test]
fn kill_9_mid_batch_on_deduping_channel_stores_each_effect_once() {
    let cluster = Cluster::from_env();
    let pids_before = wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let ch = unique("w_kill");
    sim.set_dedupe(&ch, "Idempotency-Key");
    sim.set_default(&ch, Action::Hang { store: true });
    let mut c = cluster.connect();
    create_channel(
        &mut c,
        &ch,
        &sim.send_url(&ch),
        r#"{"idempotency_header": "Idempotency-Key", "external_id": "/id",
            "retry": {"base_ms": 200, "max_ms": 1000, "jitter": "none"}}"#,
    );
    let keys: Vec<String> = (0..5).map(|i| unique(&format!("k9_{i}"))).collect();
    let ids: Vec<i64> = {
        let mut tx = c.transaction().unwrap();
        let ids = keys
            .iter()
            .enumerate()
            .map(|(i, k)| enqueue_payload(&mut tx, &ch, &format!(r#"{{"n": {i}}}"#), k))
            .collect();
        tx.commit().unwrap();
        ids
    };
    assert!(
        sim.wait_for_stored(&ch, 5, SETTLE),
        "the provider did not get the batch: {} stored",
        sim.stored(&ch).len()
    );
    let states: Vec<String> = ids
        .iter()
        .map(|id| message(&mut c, *id).unwrap().unwrap().state)
        .collect();
    assert!(
        states.iter().all(|s| s == "sending"),
        "all in flight: {states:?}"
    );
    let in_flight_pids: Vec<i32> = c
        .query(
            "SELECT DISTINCT worker_pid FROM outbox.attempts WHERE message_id = ANY($1) AND kind = 'send'",
            &[&ids],
        )
        .unwrap()
        .iter()
        .filter_map(|r| r.get::<_, Option<i32>>(0))
        .collect();
    let victim = *in_flight_pids.first().expect("a worker has them in flight");
    assert!(
        pids_before.contains(&victim),
        "{victim} is a worker: {pids_before:?}"
    );
    drop(c);

    cluster.kill_worker(victim);
    sim.set_default(&ch, Action::Accept);

    // The postmaster crash-restarts the server and starts new workers.
    let pids_after = poll(&cluster, Duration::from_secs(60), |c| {
        let p = cluster.worker_pids(c);
        Ok((p.len() == 2 && p.iter().all(|p| !pids_before.contains(p))).then_some(p))
    })
    .unwrap_or_else(|| {
        panic!(
            "the workers were not restarted after kill -9 of {victim}; see {}",
            cluster.log_path().display()
        )
    });
    assert!(!pids_after.contains(&victim));

    for id in &ids {
        wait_msg(&cluster, *id, Duration::from_secs(60), "delivered", |m| {
            m.state == "delivered"
        });
    }

    // The provider stored each effect exactly once.
    let stored = sim.stored(&ch);
    let stored_keys: Vec<String> = stored.iter().filter_map(|s| s.key.clone()).collect();
    assert_eq!(stored.len(), 5, "stored: {stored_keys:?}");
    assert_eq!(
        stored_keys.iter().collect::<HashSet<_>>(),
        keys.iter().collect::<HashSet<_>>(),
        "each effect key stored exactly once"
    );
    let mut per_key: HashMap<String, Vec<String>> = HashMap::new();
    for r in sim.sends(&ch) {
        per_key
            .entry(r.key.clone().expect("every send carries the key"))
            .or_default()
            .push(r.outcome.clone());
    }
    for k in &keys {
        assert_eq!(
            per_key.get(k).map(Vec::as_slice),
            Some(&["hang".to_string(), "deduped".to_string()][..]),
            "key {k}: one hung send, then one same-key resend answered from the dedupe store"
        );
    }

    let mut c = cluster.connect();
    for (id, key) in ids.iter().zip(&keys) {
        let m = message(&mut c, *id).unwrap().unwrap();
        let ext = stored
            .iter()
            .find(|s| s.key.as_deref() == Some(key.as_str()))
            .map(|s| s.external_id.clone());
        assert_eq!(m.external_id, ext, "message {id} has the provider's id");
        let a = attempts(&mut c, *id);
        assert!(
            a.iter()
                .all(|a| a.effect_key_sent.as_deref() == Some(key.as_str())),
            "message {id}: the same key on every attempt: {a:?}"
        );
        assert_eq!(
            a.iter().filter(|a| a.kind == "send").count(),
            2,
            "message {id}: two send attempts: {a:?}"
        );
        assert!(
            a.iter().any(|a| a.kind == "recovery"),
            "message {id}: a recovery decision: {a:?}"
        );
        let ledger: i64 = c
            .query_one(
                "SELECT count(*) FROM outbox.ledger WHERE effect_key = $1 AND message_id = $2",
                &[key, id],
            )
            .unwrap()
            .get(0);
        assert_eq!(ledger, 1);
    }
}

// ---------------------------------------------------------------------------------------
// 5. Fault injection points
// ---------------------------------------------------------------------------------------

/// Enqueues one message with `point` armed and waits until the crash and its recovery
/// have happened (the fault is reset then); returns (simulator, channel, message id, the
/// server log written meanwhile) for the checks.
fn run_fault(point: &str, dedupe: bool) -> (Simulator, String, i64, String) {
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let ch = unique(&format!("w_{point}"));
    let mut c = cluster.connect();
    let options = if dedupe {
        sim.set_dedupe(&ch, "Idempotency-Key");
        r#"{"idempotency_header": "Idempotency-Key", "external_id": "/id",
            "retry": {"base_ms": 200, "max_ms": 1000, "jitter": "none"}}"#
    } else {
        r#"{"external_id": "/id", "retry": {"base_ms": 200, "max_ms": 1000, "jitter": "none"}}"#
    };
    create_channel(&mut c, &ch, &sim.send_url(&ch), options);

    let mark = cluster.log_mark();
    let guard = arm_fault(&cluster, point);
    let id = enqueue_payload(&mut c, &ch, r#"{"text": "fault"}"#, &unique("fault"));
    drop(c);
    // Claimed (attempt 1), the worker died, and the restarted worker recovered it.
    wait_msg(&cluster, id, SETTLE, "recovered (not sending)", |m| {
        m.attempts >= 1 && m.state != "sending"
    });
    drop(guard);

    let log = cluster.log_since(mark);
    // "... fault injection POINT: worker dies with messages [ID, ...] in flight" (the log
    // line prefix holds "[pid]" too: read the last bracket).
    let needle = format!("fault injection {point}:");
    let in_flight = |l: &str| -> Vec<i64> {
        l.rsplit_once('[')
            .and_then(|(_, rest)| rest.split_once(']'))
            .map(|(list, _)| {
                list.split(',')
                    .filter_map(|x| x.trim().parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    };
    let fired = log
        .lines()
        .any(|l| l.contains(&needle) && in_flight(l).contains(&id));
    assert!(
        fired,
        "the fault {point} did not fire with message {id} in flight; log:\n{log}"
    );
    assert!(
        log.contains("whose attempt was interrupted"),
        "a worker recovered the interrupted attempt; log:\n{log}"
    );
    (sim, ch, id, log)
}

fn assert_recovered_and_delivered_once(point: &str, expected_sends: usize) {
    let cluster = Cluster::from_env();
    let (sim, ch, id, _log) = run_fault(point, true);
    let m = wait_message(&cluster, id, "delivered");
    let stored = sim.stored(&ch);
    assert_eq!(stored.len(), 1, "{point}: stored exactly once");
    assert_eq!(
        m.external_id.as_deref(),
        Some(stored[0].external_id.as_str())
    );
    assert_eq!(stored[0].key.as_deref(), Some(m.effect_key.as_str()));
    let outcomes: Vec<String> = sim.sends(&ch).iter().map(|r| r.outcome.clone()).collect();
    assert_eq!(
        outcomes.len(),
        expected_sends,
        "{point}: sends {outcomes:?}"
    );
    if expected_sends == 2 {
        assert_eq!(outcomes, vec!["accepted", "deduped"], "{point}");
    }
    let mut c = cluster.connect();
    let a = attempts(&mut c, id);
    let recovery: Vec<&Attempt> = a.iter().filter(|a| a.kind == "recovery").collect();
    assert_eq!(recovery.len(), 1, "{point}: one recovery decision: {a:?}");
    assert_eq!(
        recovery[0].outcome.as_deref(),
        Some("recovered: queued"),
        "{point}: deduping channel → same-key retry: {a:?}"
    );
    assert_eq!(recovery[0].error_class.as_deref(), Some("ambiguous"));
    assert!(
        a.iter()
            .all(|a| a.effect_key_sent.as_deref() == Some(m.effect_key.as_str())),
        "{point}: the same key on every attempt: {a:?}"
    );
    let last_send = a.iter().rfind(|a| a.kind == "send").unwrap();
    assert_eq!(last_send.outcome.as_deref(), Some("delivered"));
    assert_eq!(last_send.http_status, Some(200));
    let ledger: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.ledger WHERE message_id = $1",
            &[&id],
        )
        .unwrap()
        .get(0);
    assert_eq!(ledger, 1, "{point}: one ledger entry");
}

#[test]
fn fault_crash_after_claim_on_deduping_channel_is_delivered_once() {
    assert_recovered_and_delivered_once("crash_after_claim", 1);
}

#[test]
fn fault_crash_after_send_on_deduping_channel_is_delivered_once() {
    assert_recovered_and_delivered_once("crash_after_send", 2);
}

#[test]
fn fault_crash_after_response_on_deduping_channel_is_delivered_once() {
    assert_recovered_and_delivered_once("crash_after_response", 2);
}

#[test]
fn fault_crash_before_commit_on_deduping_channel_is_delivered_once() {
    assert_recovered_and_delivered_once("crash_before_commit", 2);
}

fn assert_uncertain_never_resent(point: &str, sends_left_by_crash: usize) {
    let cluster = Cluster::from_env();
    let (sim, ch, id, _log) = run_fault(point, false);
    let m = wait_message(&cluster, id, "uncertain");
    assert_eq!(m.last_error_class.as_deref(), Some("ambiguous"));
    assert_eq!(
        sim.send_count(&ch),
        sends_left_by_crash,
        "{point}: what the crash left"
    );
    std::thread::sleep(QUIET);
    assert_eq!(
        sim.send_count(&ch),
        sends_left_by_crash,
        "{point}: never blindly resent"
    );
    assert_eq!(sim.stored(&ch).len(), sends_left_by_crash);
    let mut c = cluster.connect();
    let m = message(&mut c, id).unwrap().unwrap();
    assert_eq!(m.state, "uncertain", "{point}: stays uncertain");
    assert_eq!(m.attempts, 1);
    let a = attempts(&mut c, id);
    let recovery: Vec<&Attempt> = a.iter().filter(|a| a.kind == "recovery").collect();
    assert_eq!(recovery.len(), 1, "{point}: one recovery decision: {a:?}");
    assert_eq!(recovery[0].outcome.as_deref(), Some("recovered: uncertain"));
    assert_eq!(a.iter().filter(|a| a.kind == "send").count(), 1, "{a:?}");
    let ledger: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.ledger WHERE message_id = $1",
            &[&id],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        ledger, 0,
        "{point}: no ledger entry for an unconfirmed effect"
    );
}

#[test]
fn fault_crash_after_claim_without_dedupe_is_uncertain_and_not_sent() {
    assert_uncertain_never_resent("crash_after_claim", 0);
}

#[test]
fn fault_crash_after_send_without_dedupe_is_uncertain_and_not_resent() {
    assert_uncertain_never_resent("crash_after_send", 1);
}

// ---------------------------------------------------------------------------------------
// 6. SIGHUP changes batch_size without a restart
// ---------------------------------------------------------------------------------------

fn settings_lines_with(log: &str, needle: &str) -> HashSet<String> {
    log.lines()
        .filter(|l| l.contains(" settings: ") && l.contains(needle))
        .filter_map(|l| {
            let rest = &l[l.find("outbox_delivery worker ")? + "outbox_delivery worker ".len()..];
            Some(rest.split_whitespace().next()?.to_string())
        })
        .collect()
}

#[test]
fn sighup_changes_batch_size_without_restart() {
    let cluster = Cluster::from_env();
    let pids_before = wait_for_workers(&cluster, &[]);
    let mut c = cluster.connect();
    let guard = SettingsGuard::new(&cluster, &["outbox.batch_size"]);
    let mark = cluster.log_mark();
    set_setting(&mut c, "outbox.batch_size", "3");

    // Both workers log their new settings.
    let ok = outbox_e2e::cluster::wait_until(SETTLE, || {
        settings_lines_with(&cluster.log_since(mark), "batch_size=3").len() == 2
    });
    assert!(
        ok,
        "no settings line with batch_size=3 from both workers; log:\n{}",
        cluster.log_since(mark)
    );
    let show: String = cluster
        .connect()
        .query_one("SHOW outbox.batch_size", &[])
        .unwrap()
        .get(0);
    assert_eq!(show, "3");

    // The new size is in force: claims take at most 3 messages.
    let sim = Simulator::start();
    let ch = unique("w_batch");
    sim.set_default(&ch, Action::AcceptAfter(Duration::from_millis(20)));
    create_channel(&mut c, &ch, &sim.send_url(&ch), "{}");
    let ids: Vec<i64> = {
        let mut tx = c.transaction().unwrap();
        let ids = (0..9)
            .map(|i| enqueue_payload(&mut tx, &ch, &format!(r#"{{"n": {i}}}"#), &unique("batch")))
            .collect();
        tx.commit().unwrap();
        ids
    };
    for id in &ids {
        wait_message(&cluster, *id, "delivered");
    }
    assert_eq!(sim.stored(&ch).len(), 9);
    let mut claims: HashMap<(Option<i32>, i64), usize> = HashMap::new();
    for id in &ids {
        for a in attempts(&mut c, *id) {
            *claims.entry((a.worker_pid, a.started_at_us)).or_default() += 1;
        }
    }
    let largest = claims.values().copied().max().unwrap_or(0);
    assert!(
        largest <= 3,
        "a claim took {largest} messages with batch_size = 3: {claims:?}"
    );
    assert!(claims.len() >= 3, "9 messages in claims of at most 3");

    let pids_after = cluster.worker_pids(&mut c);
    assert_eq!(pids_after, pids_before, "no worker restarted");

    // Reset and see it applied.
    let mark = cluster.log_mark();
    reset_setting(&cluster, "outbox.batch_size").unwrap();
    let ok = outbox_e2e::cluster::wait_until(SETTLE, || {
        settings_lines_with(&cluster.log_since(mark), "batch_size=200").len() == 2
    });
    assert!(
        ok,
        "batch_size not back to 200; log:\n{}",
        cluster.log_since(mark)
    );
    drop(guard);
    assert_eq!(cluster.worker_pids(&mut c), pids_before);
}

// ---------------------------------------------------------------------------------------
// 7. Two workers never send the same message
// ---------------------------------------------------------------------------------------

#[test]
fn two_workers_never_send_the_same_message() {
    const N: usize = 500;
    let cluster = Cluster::from_env();
    let pids = wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let ch = unique("w_load");
    sim.set_default(&ch, Action::AcceptAfter(Duration::from_millis(5)));
    let mut c = cluster.connect();
    // No idempotency header: the provider cannot dedupe, every duplicate send would show.
    create_channel(&mut c, &ch, &sim.send_url(&ch), "{}");
    let keys: Vec<String> = (0..N).map(|i| format!("{}-{i}", unique("load"))).collect();
    // Several commits, so that both workers are woken while work is pending.
    let mut ids = Vec::with_capacity(N);
    for chunk in keys.chunks(50) {
        let mut tx = c.transaction().unwrap();
        for k in chunk {
            let headers = format!(r#"{{"X-Effect-Key": "{k}"}}"#);
            ids.push(enqueue_with(
                &mut tx,
                &ch,
                &format!(r#"{{"key": "{k}"}}"#),
                k,
                None,
                Some(&headers),
            ));
        }
        tx.commit().unwrap();
    }

    let done = poll(&cluster, Duration::from_secs(120), |c| {
        let n: i64 = c
            .query_one(
                "SELECT count(*) FROM outbox.messages WHERE channel = $1 AND state = 'delivered'",
                &[&ch],
            )?
            .get(0);
        Ok((n as usize == N).then_some(()))
    });
    let states = states_of(&mut c, &ch);
    assert!(done.is_some(), "not all delivered: {states:?}");

    let sends = sim.sends(&ch);
    let mut seen: HashMap<String, usize> = HashMap::new();
    for r in &sends {
        let k = r.key.clone().expect("X-Effect-Key on every send");
        assert_eq!(
            body_json(r)["key"].as_str(),
            Some(k.as_str()),
            "body and key header belong to the same message"
        );
        *seen.entry(k).or_default() += 1;
    }
    let dups: Vec<(&String, &usize)> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(dups.is_empty(), "keys received more than once: {dups:?}");
    assert_eq!(sends.len(), N, "every message sent exactly once");
    assert_eq!(
        seen.keys().collect::<HashSet<_>>(),
        keys.iter().collect::<HashSet<_>>()
    );
    assert_eq!(sim.stored(&ch).len(), N);

    let per_message: Vec<(i64, i64)> = c
        .query(
            "SELECT message_id, count(*) FROM outbox.attempts WHERE message_id = ANY($1) GROUP BY 1 HAVING count(*) <> 1",
            &[&ids],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(
        per_message.is_empty(),
        "messages with other than one attempt: {per_message:?}"
    );

    let used: HashSet<i32> = c
        .query(
            "SELECT DISTINCT worker_pid FROM outbox.attempts WHERE message_id = ANY($1)",
            &[&ids],
        )
        .unwrap()
        .iter()
        .filter_map(|r| r.get::<_, Option<i32>>(0))
        .collect();
    assert!(
        used.iter().all(|p| pids.contains(p)),
        "attempts by unknown pids {used:?} (workers {pids:?})"
    );
    if used.len() == 2 {
        assert_eq!(used, pids.iter().copied().collect::<HashSet<_>>());
    } else {
        eprintln!(
            "note: the load of {N} messages did not spread over both workers (used {used:?} of {pids:?}); \
             the no-duplicate checks above still hold"
        );
    }
}

/// A channel with a deep backlog does not hold back another channel: the batch is shared
/// among the channels with due messages, so a single message on another channel is
/// delivered while most of the first channel's backlog is still queued. Two quiet channels,
/// one created before the busy one and one after it, so that one of them comes after the
/// busy channel in whatever order the channel table is read.
#[test]
fn a_deep_backlog_on_one_channel_does_not_starve_another() {
    const BACKLOG: i64 = 6000;
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let quiet = [unique("w_quiet_before"), unique("w_quiet_after")];
    let mut c = cluster.connect();
    create_channel(&mut c, &quiet[0], &sim.send_url(&quiet[0]), "{}");
    // Every request of the busy channel takes 50 ms, and its max_in_flight is above the
    // batch size, so that it could fill every batch alone: its backlog needs dozens.
    let busy = slow_channel(&mut c, &sim, "w_busy", Duration::from_millis(50), 1000);
    c.execute(
        "SELECT outbox.pause_channel($1, 'loading a backlog')",
        &[&busy],
    )
    .unwrap();
    enqueue_backlog(&mut c, &busy, BACKLOG);
    c.execute("SELECT outbox.resume_channel($1)", &[&busy])
        .unwrap();
    create_channel(&mut c, &quiet[1], &sim.send_url(&quiet[1]), "{}");
    assert!(
        sim.wait_for_sends(&busy, 200, SETTLE),
        "the busy channel's backlog did not start"
    );
    let ids: Vec<i64> = quiet
        .iter()
        .map(|q| enqueue_payload(&mut c, q, r#"{"n": "alone"}"#, &unique("w_quiet_k")))
        .collect();
    let delivered = poll(&cluster, SETTLE, |c| {
        let done: i64 = c
            .query_one(
                "SELECT count(*) FROM outbox.messages WHERE id = ANY($1) AND state = 'delivered'",
                &[&ids],
            )?
            .get(0);
        Ok((done == 2).then_some(()))
    });
    assert!(
        delivered.is_some(),
        "the quiet channels' messages were not delivered"
    );
    pause_and_settle(&cluster, &mut c, &busy);
    // How far the backlog had gone when the later quiet message was delivered, from the
    // worker's own records (not from when this test happened to look): the busy messages
    // whose first attempt had not started by then.
    let unclaimed: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.messages b
              WHERE b.channel = $2
                AND NOT EXISTS (SELECT 1 FROM outbox.attempts a
                                 WHERE a.message_id = b.id
                                   AND a.started_at <= (SELECT max(delivered_at) FROM outbox.messages
                                                         WHERE id = ANY($1)))",
            &[&ids, &busy],
        )
        .unwrap()
        .get(0);
    assert!(
        unclaimed >= BACKLOG / 3,
        "the quiet channels' messages were delivered only when {unclaimed} of the busy channel's \
         {BACKLOG} messages had not been claimed yet: one waited behind the backlog"
    );
    for q in &quiet {
        assert_eq!(sim.send_count(q), 1, "sends to {q}");
    }
}

/// While a worker drains a backlog in full batches, its claims of a channel resume where the
/// last one began instead of at the head of the due index. A message that commits late
/// with a due time older than the whole backlog sits behind those positions; a claim from
/// the head at least every second must still find it while the backlog drains.
#[test]
fn a_message_committed_late_with_an_older_due_time_is_claimed_during_a_backlog() {
    const BACKLOG: i64 = 12_000;
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let mut c = cluster.connect();
    // 100 ms a request: a batch lasts at least that long, and the backlog some seconds.
    let busy = slow_channel(&mut c, &sim, "w_late", Duration::from_millis(100), 5000);
    c.execute(
        "SELECT outbox.pause_channel($1, 'loading a backlog')",
        &[&busy],
    )
    .unwrap();
    // The late message's transaction begins first: its due time is its transaction's start.
    let mut late_conn = cluster.connect();
    let mut late_tx = late_conn.transaction().unwrap();
    let late_key = unique("w_late_k");
    let late = enqueue_payload(&mut late_tx, &busy, r#"{"n": "late"}"#, &late_key);
    std::thread::sleep(Duration::from_millis(20));
    enqueue_backlog(&mut c, &busy, BACKLOG);
    c.execute("SELECT outbox.resume_channel($1)", &[&busy])
        .unwrap();
    assert!(
        sim.wait_for_sends(&busy, 600, SETTLE),
        "the backlog did not start"
    );
    late_tx.commit().unwrap();
    let older: bool = c
        .query_one(
            "SELECT (SELECT next_attempt_at FROM outbox._messages WHERE id = $1)
                  < (SELECT min(next_attempt_at) FROM outbox._messages m JOIN outbox._channels ch
                        ON ch.id = m.channel_id WHERE ch.name = $2 AND m.id <> $1)",
            &[&late, &busy],
        )
        .unwrap()
        .get(0);
    assert!(older, "the late message is not due before the backlog");
    let delivered = poll(&cluster, SETTLE, |c| {
        let r = c.query_one(
            "SELECT (SELECT state::text FROM outbox._messages WHERE id = $1),
                    (SELECT count(*) FROM outbox.messages WHERE channel = $2 AND state = 'queued')",
            &[&late, &busy],
        )?;
        let (state, queued): (String, i64) = (r.get(0), r.get(1));
        Ok((state == "delivered").then_some(queued))
    });
    let queued = delivered.expect("the late message was not delivered");
    assert!(
        queued >= BACKLOG / 4,
        "the late message was delivered only when {queued} of {BACKLOG} messages were still \
         queued: the claims passed over it"
    );
    pause_and_settle(&cluster, &mut c, &busy);
}

// ---------------------------------------------------------------------------------------
// 8. Retention
// ---------------------------------------------------------------------------------------

#[test]
fn retention_purges_old_delivered_and_keeps_everything_else() {
    let cluster = Cluster::from_env();
    cluster.wait_for_worker();
    let sim = Simulator::start();
    let ok_ch = unique("w_ret_ok");
    let fail_ch = unique("w_ret_fail");
    let held_ch = unique("w_ret_held");
    sim.set_default(&fail_ch, Action::Status(401));
    let mut c = cluster.connect();
    create_channel(
        &mut c,
        &ok_ch,
        &sim.send_url(&ok_ch),
        r#"{"external_id": "/id"}"#,
    );
    create_channel(&mut c, &fail_ch, &sim.send_url(&fail_ch), "{}");
    // A retry horizon as long as a channel may declare: the ledger is kept at least that
    // long, capped at a century, and the purge must not leave the range of timestamps.
    create_channel(
        &mut c,
        &held_ch,
        &sim.send_url(&held_ch),
        r#"{"retry": {"max_age_ms": 9223372036854775807}}"#,
    );
    c.execute(
        "SELECT outbox.pause_channel($1::text, 'retention test')",
        &[&held_ch],
    )
    .unwrap();

    let ok_key = unique("ret_ok");
    let delivered = enqueue_payload(&mut c, &ok_ch, r#"{"r": 1}"#, &ok_key);
    let failed = enqueue_payload(&mut c, &fail_ch, r#"{"r": 2}"#, &unique("ret_fail"));
    let held = enqueue_payload(&mut c, &held_ch, r#"{"r": 3}"#, &unique("ret_held"));
    let dm = wait_message(&cluster, delivered, "delivered");
    let fm = wait_message(&cluster, failed, "failed");
    assert_eq!(fm.last_http_status, Some(401));
    assert_eq!(fm.last_error_class.as_deref(), Some("permanent"));
    assert_eq!(attempts(&mut c, delivered).len(), 1);
    assert_eq!(attempts(&mut c, failed).len(), 1);

    let _guard = SettingsGuard::new(&cluster, &["outbox.retention"]);
    set_setting(&mut c, "outbox.retention", "1");

    let gone = poll(&cluster, Duration::from_secs(40), |c| {
        let n: i64 = c
            .query_one(
                "SELECT count(*) FROM outbox._messages WHERE id = $1",
                &[&delivered],
            )?
            .get(0);
        Ok((n == 0).then_some(()))
    });
    assert!(
        gone.is_some(),
        "the delivered message was not purged within 40 s with outbox.retention = 1"
    );

    assert_eq!(
        attempts(&mut c, delivered).len(),
        0,
        "its attempts are purged with it"
    );
    let ledger = c
        .query(
            "SELECT message_id, external_id FROM outbox.ledger WHERE effect_key = $1",
            &[&ok_key],
        )
        .unwrap();
    assert_eq!(ledger.len(), 1, "the ledger entry stays");
    assert_eq!(ledger[0].get::<_, i64>(0), delivered);
    assert_eq!(ledger[0].get::<_, Option<String>>(1), dm.external_id);
    assert_eq!(
        cluster_status(&mut c, delivered).as_deref(),
        Some("delivered"),
        "status() still says delivered"
    );

    let f = message(&mut c, failed)
        .unwrap()
        .expect("failed message kept");
    assert_eq!(f.state, "failed");
    assert_eq!(attempts(&mut c, failed).len(), 1, "its attempts kept");
    let h = message(&mut c, held).unwrap().expect("queued message kept");
    assert_eq!(h.state, "queued");
    assert_eq!(h.attempts, 0);
    assert_eq!(
        sim.send_count(&held_ch),
        0,
        "a paused channel sends nothing"
    );
    // Unknown ids stay unknown.
    assert_eq!(cluster_status(&mut c, -1), None);
}

// ---------------------------------------------------------------------------------------
// 9. Bad rows never stop the worker
// ---------------------------------------------------------------------------------------

#[test]
fn bad_rows_never_stop_the_worker() {
    let cluster = Cluster::from_env();
    let pids_before = wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let bad_hdr_ch = unique("w_badhdr");
    let dns_ch = unique("w_dns");
    let good_ch = unique("w_good");
    let mut c = cluster.connect();
    create_channel(&mut c, &bad_hdr_ch, &sim.send_url(&bad_hdr_ch), "{}");
    create_channel(
        &mut c,
        &dns_ch,
        "http://nonexistent.invalid/x",
        r#"{"retry": {"base_ms": 60000, "max_ms": 60000, "jitter": "none"}}"#,
    );
    create_channel(
        &mut c,
        &good_ch,
        &sim.send_url(&good_ch),
        r#"{"external_id": "/id"}"#,
    );

    // A header value HTTP cannot carry (a control character): enqueue refuses it, so the
    // bad row is written by hand, as an older version or a careless UPDATE could have.
    let refused = c
        .query_one(
            "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text, headers => $3::text::jsonb)",
            &[&bad_hdr_ch, &unique("badhdr"), &r#"{"X-Bad": "a\u0001b"}"#],
        )
        .expect_err("a control character in a header value is refused");
    assert_eq!(
        refused.as_db_error().map(|d| d.code().code()),
        Some("22023"),
        "{refused:?}"
    );
    let bad = {
        let mut t = c.transaction().expect("begin");
        let id = enqueue_with(
            &mut t,
            &bad_hdr_ch,
            r#"{"x": 1}"#,
            &unique("badhdr"),
            None,
            None,
        );
        t.execute(
            r#"UPDATE outbox._messages SET headers = '{"X-Bad": "a\u0001b"}' WHERE id = $1"#,
            &[&id],
        )
        .expect("write the bad header");
        t.commit().expect("commit");
        id
    };
    let dns = enqueue_payload(&mut c, &dns_ch, r#"{"x": 2}"#, &unique("dns"));

    let m = wait_message(&cluster, bad, "failed");
    assert_eq!(m.last_error_class.as_deref(), Some("permanent"));
    let err = m.last_error.clone().unwrap_or_default();
    assert!(
        err.contains("X-Bad") && err.contains("not sent"),
        "a readable error naming the header: {err:?}"
    );
    assert_eq!(sim.send_count(&bad_hdr_ch), 0, "nothing was sent");

    let d = wait_msg(&cluster, dns, SETTLE, "a transient DNS failure", |m| {
        m.attempts >= 1 && m.last_error_class.is_some()
    });
    // Stop its retries (every 60 s) before checking, so the shared cluster stays quiet.
    c.execute(
        "SELECT outbox.pause_channel($1::text, 'end of test')",
        &[&dns_ch],
    )
    .unwrap();
    assert_eq!(d.last_error_class.as_deref(), Some("transient"), "{d:?}");
    assert_eq!(d.state, "queued", "a transient error is retried: {d:?}");
    let err = d.last_error.clone().unwrap_or_default();
    assert!(err.contains("DNS"), "phase DNS in last_error: {err:?}");
    let a = attempts(&mut c, dns);
    assert_eq!(a[0].error_class.as_deref(), Some("transient"));
    assert!(a[0].error.as_deref().unwrap_or("").contains("DNS"), "{a:?}");

    // A due time and a creation time of -infinity, written by hand: the worker reads times
    // as numbers, and these have none. It is delivered like any other.
    let timeless = {
        let mut tx = c.transaction().unwrap();
        let id = enqueue_payload(&mut tx, &good_ch, r#"{"x": 5}"#, &unique("timeless"));
        tx.execute(
            "UPDATE outbox._messages SET next_attempt_at = '-infinity', created_at = '-infinity'
              WHERE id = $1",
            &[&id],
        )
        .expect("write the due time");
        tx.commit().unwrap();
        id
    };
    wait_message(&cluster, timeless, "delivered");

    // Counters at the ends of their range, a lease without an end, headers that are not an
    // object, and a channel whose options were changed by hand, all written in one
    // transaction. Before the worker saturated its counters, the first of these failed every
    // claim with 'integer out of range' and both workers restarted every second.
    let (at_max, base_min, no_lease, hdr_array, bad_opts) = {
        let mut tx = c.transaction().unwrap();
        let at_max = enqueue_payload(&mut tx, &good_ch, r#"{"x": 6}"#, &unique("at_max"));
        let base_min = enqueue_payload(&mut tx, &good_ch, r#"{"x": 7}"#, &unique("base_min"));
        let no_lease = enqueue_payload(&mut tx, &good_ch, r#"{"x": 8}"#, &unique("no_lease"));
        let hdr_array = enqueue_payload(&mut tx, &good_ch, r#"{"x": 9}"#, &unique("hdr_array"));
        let bad_opts = enqueue_payload(&mut tx, &dns_ch, r#"{"x": 10}"#, &unique("bad_opts"));
        for (sql, id) in [
            ("UPDATE outbox._messages SET attempts = 2147483647 WHERE id = $1", at_max),
            ("UPDATE outbox._messages SET attempts = 5, budget_base = -2147483648 WHERE id = $1", base_min),
            ("UPDATE outbox._messages SET state = 'sending', lease_until = NULL, lease_owner = NULL WHERE id = $1", no_lease),
            ("UPDATE outbox._messages SET headers = '[1, 2]' WHERE id = $1", hdr_array),
        ] {
            tx.execute(sql, &[&id]).expect(sql);
        }
        tx.execute(
            r#"UPDATE outbox._channels SET options = jsonb_set(options, '{max_in_flight}', '"many"'),
                                           paused = false
                WHERE name = $1"#,
            &[&dns_ch],
        )
        .expect("write the bad option");
        tx.commit().unwrap();
        (at_max, base_min, no_lease, hdr_array, bad_opts)
    };
    let m = wait_message(&cluster, at_max, "delivered");
    assert_eq!(
        m.attempts,
        i32::MAX,
        "the counter stays at its limit: {m:?}"
    );
    wait_message(&cluster, base_min, "delivered");
    // In flight with no end to its lease: taken back as an interrupted attempt, not resent.
    let m = wait_message(&cluster, no_lease, "uncertain");
    assert_eq!(m.last_error_class.as_deref(), Some("ambiguous"), "{m:?}");
    let m = wait_message(&cluster, hdr_array, "failed");
    assert!(
        m.last_error
            .as_deref()
            .unwrap_or("")
            .contains("must be a JSON object"),
        "{m:?}"
    );
    let m = wait_message(&cluster, bad_opts, "failed");
    assert!(
        m.last_error
            .as_deref()
            .unwrap_or("")
            .contains("max_in_flight"),
        "the channel's bad option is named: {m:?}"
    );
    assert_eq!(
        sim.stored(&good_ch).len(),
        3,
        "the two messages at the counters' ends were sent, the others not"
    );
    // The views read the bad option as unknown instead of failing.
    let max_attempts: Option<i32> = c
        .query_one(
            "SELECT max_attempts FROM outbox.messages WHERE id = $1",
            &[&bad_opts],
        )
        .expect("outbox.messages with a channel's option changed by hand")
        .get(0);
    assert_eq!(max_attempts, Some(8));
    c.execute(
        "SELECT outbox.pause_channel($1::text, 'end of test')",
        &[&dns_ch],
    )
    .unwrap();
    c.execute("SELECT outbox.cancel($1, 'end of test')", &[&no_lease])
        .unwrap();

    // After those, normal work goes on, on another channel and on the bad header's channel.
    let good = enqueue_payload(&mut c, &good_ch, r#"{"x": 3}"#, &unique("good"));
    let also = enqueue_payload(&mut c, &bad_hdr_ch, r#"{"x": 4}"#, &unique("good2"));
    let g = wait_message(&cluster, good, "delivered");
    wait_message(&cluster, also, "delivered");
    assert_eq!(sim.stored(&good_ch).len(), 4);
    assert!(
        sim.stored(&good_ch)
            .iter()
            .any(|s| g.external_id.as_deref() == Some(s.external_id.as_str())),
        "{g:?}"
    );
    assert_eq!(sim.stored(&bad_hdr_ch).len(), 1);
    assert_eq!(
        cluster.worker_pids(&mut c),
        pids_before,
        "no worker crashed or restarted"
    );
}

/// The soft open-files limit of a process, and its hard limit (`/proc/<pid>/limits`).
fn open_files_limits(pid: i32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("read limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a line for open files");
    let fields: Vec<&str> = line.split_whitespace().collect();
    (fields[3].to_string(), fields[4].to_string())
}

/// Busy channels one after another: each leaves a batch's worth of idle connections in
/// each worker. Under the usual soft limit of 1,024 open files, which PostgreSQL sizes its
/// own file cache from, those sockets took the descriptors PostgreSQL counted on: its file
/// opens failed with "Too many open files; release and retry" and the drains slowed by a
/// third (seen in the benchmark). The workers raise their soft limit to the hard one at
/// start, and keep at most a batch of idle connections per channel.
#[test]
fn idle_connections_of_many_channels_leave_postgres_its_file_descriptors() {
    const CHANNELS: usize = 8;
    const PER_CHANNEL: i64 = 400;
    let cluster = Cluster::from_env();
    let pids = wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    sim.set_record_bodies(false);
    let mut c = cluster.connect();
    for pid in cluster.worker_pids(&mut c) {
        let (soft, hard) = open_files_limits(pid);
        assert_eq!(
            soft, hard,
            "worker {pid}: the soft open-files limit is raised to the hard one"
        );
    }
    let mark = cluster.log_mark();
    let mut channels = Vec::new();
    for _ in 0..CHANNELS {
        // 20 ms per answer: the requests of a batch overlap, each on a connection of its own.
        let ch = slow_channel(&mut c, &sim, "w_fds", Duration::from_millis(20), 1000);
        enqueue_backlog(&mut c, &ch, PER_CHANNEL);
        assert!(
            no_message_left(&cluster, &ch, "state <> 'delivered'"),
            "{ch} was not delivered: {:?}",
            states_of(&mut c, &ch)
        );
        channels.push(ch);
    }
    let retried: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.messages WHERE channel = ANY($1) AND attempts <> 1",
            &[&channels],
        )
        .unwrap()
        .get(0);
    assert_eq!(retried, 0, "every message went out on its first attempt");
    let log = cluster.log_since(mark);
    let starved: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("Too many open files"))
        .take(3)
        .collect();
    assert!(
        starved.is_empty(),
        "the server ran out of file descriptors: {starved:?}"
    );
    assert_eq!(cluster.worker_pids(&mut c), pids, "no worker restarted");
}

// ---------------------------------------------------------------------------------------
// 10. A fast shutdown while the workers are busy
// ---------------------------------------------------------------------------------------

/// `pg_ctl stop -m fast` while the workers deliver a backlog: each worker finishes the batch
/// it has in flight, records it and exits, so the server stops within seconds and nothing
/// is left in `sending` or `uncertain`. Before the worker kept its own stop flag, a SIGTERM
/// that arrived during a busy cycle was lost and the server never stopped.
#[test]
fn fast_shutdown_under_load_stops_promptly_and_leaves_no_attempt_open() {
    const BACKLOG: i64 = 20_000;
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let mut c = cluster.connect();
    // 200 ms per request: the backlog keeps both workers busy for several seconds.
    let ch = slow_channel(&mut c, &sim, "w_shutdown", Duration::from_millis(200), 1000);
    enqueue_backlog(&mut c, &ch, BACKLOG);
    assert!(
        sim.wait_for_sends(&ch, 400, SETTLE),
        "the backlog did not start"
    );
    drop(c);

    let started = std::time::Instant::now();
    cluster.script(&["stop", "fast"]);
    let took = started.elapsed();
    cluster.script(&["start"]);
    wait_for_workers(&cluster, &[]);
    let mut c = cluster.connect();
    // The restarted workers may have claimed a batch before the pause: it settles first.
    pause_and_settle(&cluster, &mut c, &ch);
    assert!(
        took < Duration::from_secs(20),
        "pg_ctl stop -m fast took {took:?} with the workers busy"
    );

    let states = states_of(&mut c, &ch);
    let delivered = states.get("delivered").copied().unwrap_or(0);
    assert!(
        delivered < BACKLOG,
        "the whole backlog was delivered before the shutdown: the test proves nothing ({states:?})"
    );
    assert_eq!(
        states.get("queued").copied().unwrap_or(0) + delivered,
        BACKLOG,
        "after a fast shutdown every message is queued or delivered (none uncertain): {states:?}"
    );
    // Every request the provider got belongs to a delivered message, once.
    assert_eq!(
        sim.send_count(&ch) as i64,
        delivered,
        "sends vs delivered messages: {states:?}"
    );
}

/// A request allowed to take longer than `outbox.lease_ms` (the channel's `timeout_ms`)
/// keeps its message leased until it is answered: the other worker, idle and sweeping for
/// lost leases meanwhile, does not take it back and send it again.
#[test]
fn a_request_slower_than_the_lease_but_within_its_timeout_keeps_its_lease() {
    // The other worker is the one that would take the message back.
    let cluster = with_two_workers();
    let sim = Simulator::start();
    let mut c = cluster.connect();
    let ch = unique("slow_lease");
    sim.set_dedupe(&ch, "Idempotency-Key");
    sim.set_default(&ch, Action::AcceptAfter(Duration::from_millis(3000)));
    create_channel(
        &mut c,
        &ch,
        &sim.send_url(&ch),
        r#"{"idempotency_header": "Idempotency-Key", "timeout_ms": 6000}"#,
    );
    let _lease = short_lease(&cluster, &mut c);

    let id = enqueue_payload(&mut c, &ch, r#"{"to": "slow"}"#, &unique("k"));
    let m = wait_msg(&cluster, id, SETTLE, "delivered", |m| {
        m.state == "delivered"
    });
    // Two seconds past the setting's lease, the answer came; a message taken back would
    // have been sent again with the same key (this channel dedupes), or stopped uncertain.
    let kinds: Vec<String> = attempts(&mut c, id).into_iter().map(|a| a.kind).collect();
    assert_eq!((m.attempts, kinds), (1, vec!["send".to_string()]));
    assert_eq!(sim.send_count(&ch), 1, "requests at the provider");
}

/// The effects of a `sql` channel run one after another in the record transaction, which
/// can outlast any lease. Their messages are locked while it runs: the other worker does
/// not take them back as interrupted (which for a `sql` channel would run each effect a
/// second time), and each effect happens once.
#[test]
fn sql_effects_longer_than_the_lease_are_not_taken_back_and_run_once() {
    let cluster = with_two_workers();
    let mut c = cluster.connect();
    let s = unique("slow_fx");
    let role = format!("{s}_effects");
    c.batch_execute(&format!(
        r#"
        CREATE SCHEMA {s};
        CREATE TABLE {s}.done (effect_key text NOT NULL);
        CREATE ROLE {role} NOLOGIN;
        GRANT USAGE ON SCHEMA {s} TO {role};
        GRANT INSERT ON {s}.done TO {role};
        CREATE FUNCTION {s}.slow(payload jsonb, effect_key text) RETURNS text LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_sleep(0.4);
            INSERT INTO {s}.done VALUES (effect_key);
            RETURN 'done';
        END $$;
        GRANT EXECUTE ON FUNCTION {s}.slow(jsonb, text) TO {role};
        "#
    ))
    .expect("effect schema");
    let ch = unique("slow_fx");
    // A lease of 1000 ms becomes 6000 (timeout 1000 + 5000); 40 effects of 0.4 s take 16 s,
    // and at least 8 s in one transaction however the two workers share the batch.
    create_channel(
        &mut c,
        &ch,
        "sql",
        &format!(
            r#"{{"kind": "sql", "function": "{s}.slow", "run_as": "{role}", "timeout_ms": 1000, "connect_timeout_ms": 500}}"#
        ),
    );
    let _lease = short_lease(&cluster, &mut c);

    // Held while enqueued, so that they are claimed together.
    c.execute("SELECT outbox.pause_channel($1, 'enqueue a batch')", &[&ch])
        .unwrap();
    enqueue_backlog(&mut c, &ch, 40);
    c.execute("SELECT outbox.resume_channel($1)", &[&ch])
        .unwrap();
    assert!(
        no_message_left(&cluster, &ch, "state <> 'delivered'"),
        "not all delivered: {:?}",
        states_of(&mut c, &ch)
    );
    let (runs, keys): (i64, i64) = {
        let r = c
            .query_one(
                &format!("SELECT count(*), count(DISTINCT effect_key) FROM {s}.done"),
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!((runs, keys), (40, 40), "effects run, distinct effects");
    let recovered = count(
        &mut c,
        "SELECT count(*) FROM outbox.attempts a JOIN outbox.messages m ON m.id = a.message_id
          WHERE m.channel = $1 AND a.kind = 'recovery'",
        &[&ch],
    );
    assert_eq!(recovered, 0, "messages taken back while their effects ran");
}

/// A message whose earlier sibling on the same ordering key is `uncertain` waits: the
/// provider may hold the earlier one, and the later one must not overtake it. It goes once
/// an operator has decided the earlier one.
#[test]
fn an_ordering_key_waits_while_an_earlier_message_is_uncertain() {
    let cluster = Cluster::from_env();
    cluster.wait_for_worker();
    let sim = Simulator::start();
    let ch = unique("w_order_u");
    // The first send is read and stored, and its answer lost: no key, no lookup, so the
    // message stops in uncertain.
    sim.set_plan(&ch, vec![Action::DropAfterRead { store: true }]);
    let mut c = cluster.connect();
    create_channel(&mut c, &ch, &sim.send_url(&ch), r#"{}"#);
    let okey = unique("conversation");
    let (first, second) = {
        let mut tx = c.transaction().unwrap();
        let first = enqueue_with(
            &mut tx,
            &ch,
            r#"{"seq": 1}"#,
            &unique("u1"),
            Some(&okey),
            None,
        );
        let second = enqueue_with(
            &mut tx,
            &ch,
            r#"{"seq": 2}"#,
            &unique("u2"),
            Some(&okey),
            None,
        );
        tx.commit().unwrap();
        (first, second)
    };
    wait_message(&cluster, first, "uncertain");
    std::thread::sleep(QUIET);
    let waiting = message(&mut c, second).unwrap().unwrap();
    assert_eq!(
        (
            waiting.state.as_str(),
            waiting.attempts,
            sim.send_count(&ch)
        ),
        ("queued", 0, 1),
        "the later message was tried while the earlier one was uncertain"
    );

    c.execute(
        "SELECT outbox.resolve($1, 'delivered', 'the provider shows it')",
        &[&first],
    )
    .unwrap();
    wait_message(&cluster, second, "delivered");
    let seqs: Vec<i64> = sim
        .stored(&ch)
        .iter()
        .map(|s| {
            serde_json::from_slice::<serde_json::Value>(&s.body)
                .map_or(-1, |b| b["seq"].as_i64().unwrap_or(-1))
        })
        .collect();
    assert_eq!(seqs, vec![1, 2], "order at the provider");
}

/// `not_before` holds a message until its time: nothing is sent earlier, and it is sent
/// after.
#[test]
fn not_before_holds_a_message_until_its_time() {
    let cluster = Cluster::from_env();
    cluster.wait_for_worker();
    let sim = Simulator::start();
    let ch = unique("w_later");
    let mut c = cluster.connect();
    create_channel(&mut c, &ch, &sim.send_url(&ch), r#"{}"#);
    let id: i64 = c
        .query_one(
            "SELECT outbox.enqueue($1, '{\"to\": \"later\"}'::jsonb, $2, NULL, clock_timestamp() + interval '2 seconds')",
            &[&ch, &unique("later")],
        )
        .unwrap()
        .get(0);
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(sim.send_count(&ch), 0, "sent before not_before");
    assert_eq!(message(&mut c, id).unwrap().unwrap().state, "queued");
    wait_message(&cluster, id, "delivered");
    let on_time: bool = c
        .query_one(
            "SELECT a.started_at >= m.not_before FROM outbox._messages m
               JOIN outbox._attempts a ON a.message_id = m.id WHERE m.id = $1",
            &[&id],
        )
        .unwrap()
        .get(0);
    assert!(on_time, "the attempt started before not_before");
    assert_eq!(sim.send_count(&ch), 1);
}

/// The same effect key with another payload is never a second message: enqueue returns
/// the first message's id and warns, naming both payloads' hashes; the same payload again
/// returns the id without a warning.
#[test]
fn an_effect_key_reused_with_another_payload_warns_and_returns_the_first_message() {
    use std::sync::{Arc, Mutex};
    let cluster = Cluster::from_env();
    let warnings: Arc<Mutex<Vec<(String, String, String)>>> = Arc::default();
    let seen = warnings.clone();
    let mut config: postgres::Config = cluster.conninfo().parse().unwrap();
    config.notice_callback(move |n| {
        seen.lock().unwrap().push((
            n.severity().to_string(),
            n.message().to_string(),
            n.detail().unwrap_or_default().to_string(),
        ))
    });
    let mut c = config.connect(NoTls).unwrap();
    let ch = unique("w_reuse");
    create_channel(&mut c, &ch, "http://127.0.0.1:9/reuse", r#"{}"#);
    c.execute("SELECT outbox.pause_channel($1, 'nothing is sent')", &[&ch])
        .unwrap();
    let key = unique("reuse");
    let first = enqueue_payload(&mut c, &ch, r#"{"amount": 10}"#, &key);
    assert_eq!(
        enqueue_payload(&mut c, &ch, r#"{"amount": 10}"#, &key),
        first
    );
    assert!(
        warnings.lock().unwrap().is_empty(),
        "{:?}",
        warnings.lock().unwrap()
    );

    assert_eq!(
        enqueue_payload(&mut c, &ch, r#"{"amount": 20}"#, &key),
        first
    );
    let got = warnings.lock().unwrap().clone();
    assert_eq!(got.len(), 1, "{got:?}");
    let (severity, text, detail) = &got[0];
    assert_eq!(severity, "WARNING");
    assert!(
        text.contains(&format!("already belongs to message {first}")),
        "{text}"
    );
    let mut sha = |payload: &str| -> String {
        c.query_one(
            "SELECT encode(sha256(convert_to($1::text::jsonb::text, 'UTF8')), 'hex')",
            &[&payload],
        )
        .unwrap()
        .get(0)
    };
    for payload in [r#"{"amount": 10}"#, r#"{"amount": 20}"#] {
        let hash = sha(payload);
        assert!(detail.contains(&hash), "{detail} lacks {hash}");
    }
    let n = count(
        &mut c,
        "SELECT count(*) FROM outbox._messages WHERE effect_key = $1",
        &[&key],
    );
    assert_eq!(n, 1, "messages with the key");
}

/// `max_in_flight` bounds the attempts open at once on a channel, across both workers and
/// across claims: read from the attempts' own start and end times.
#[test]
fn max_in_flight_bounds_the_attempts_open_at_once() {
    let cluster = with_two_workers();
    let sim = Simulator::start();
    let mut c = cluster.connect();
    let ch = slow_channel(&mut c, &sim, "w_inflight", Duration::from_millis(400), 3);
    enqueue_backlog(&mut c, &ch, 15);
    assert!(
        no_message_left(&cluster, &ch, "state <> 'delivered'"),
        "not all delivered: {:?}",
        states_of(&mut c, &ch)
    );
    // For each attempt's start, how many attempts of the channel were open at that moment.
    let peak: i64 = c
        .query_one(
            "SELECT max(n) FROM (
                 SELECT (SELECT count(*) FROM outbox.attempts b JOIN outbox.messages mb ON mb.id = b.message_id
                          WHERE mb.channel = $1 AND b.kind = 'send'
                            AND b.started_at <= a.started_at AND b.finished_at > a.started_at) AS n
                   FROM outbox.attempts a JOIN outbox.messages m ON m.id = a.message_id
                  WHERE m.channel = $1 AND a.kind = 'send') s",
            &[&ch],
        )
        .unwrap()
        .get(0);
    assert!((1..=3).contains(&peak), "attempts open at once: {peak}");
    assert_eq!(sim.send_count(&ch), 15);
}
