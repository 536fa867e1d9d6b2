//! End-to-end tests of the retry policy and the error classification, against the real
//! cluster (`scripts/cluster.sh`, settings from `OUTBOX_BASE` / `OUTBOX_PGPORT`) and the
//! provider simulator: backoff growth, `Retry-After`, permanent errors, exhaustion,
//! per-channel `classify` overrides, policy changes of queued messages, a server crash
//! during backoff, jitter spread, a garbage `Retry-After`, and a refused connection.
//!
//! Run: `cargo test -p outbox_e2e --release --test retry -- --test-threads=1`.

use outbox_e2e::cluster::{unique, wait_for_state, wait_until, Cluster};
use outbox_e2e::helpers::{
    attempts, cluster_and_sim, count, create_channel, enqueue, ledger_entries, one, sim_channel,
    Attempt,
};
use outbox_e2e::sim::{Action, Received};
use postgres::Client;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const LONG: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------
// helpers (local to this file)
// ---------------------------------------------------------------------------------------

/// An answer with HTTP `status` and a `Retry-After: value` header.
fn retry_after(status: u16, value: &str) -> Action {
    Action::StatusWithHeaders(status, vec![("Retry-After".into(), value.into())])
}

/// A message as `outbox.messages` shows it, plus the stored `next_attempt_at` (the view
/// shows it only while queued; the table keeps it after the message moved on, up to its
/// delivery, which moves it into its ledger entry: NaN then).
#[derive(Debug, Clone)]
struct MessageRow {
    state: String,
    attempts: i32,
    max_attempts: Option<i32>,
    last_error_class: Option<String>,
    last_error: Option<String>,
    last_http_status: Option<i32>,
    next_attempt_ms: f64,
    effect_key: String,
}

fn message(c: &mut Client, id: i64) -> MessageRow {
    let r = c
        .query_one(
            "SELECT v.state::text, v.attempts, v.max_attempts, v.last_error_class::text,
                    v.last_error, v.last_http_status,
                    coalesce((extract(epoch FROM m.next_attempt_at) * 1000)::float8, 'NaN'), v.effect_key
               FROM outbox.messages v LEFT JOIN outbox._messages m ON m.id = v.id
              WHERE v.id = $1",
            &[&id],
        )
        .unwrap_or_else(|e| panic!("message {id} not found: {e}"));
    MessageRow {
        state: r.get(0),
        attempts: r.get(1),
        max_attempts: r.get(2),
        last_error_class: r.get(3),
        last_error: r.get(4),
        last_http_status: r.get(5),
        next_attempt_ms: r.get(6),
        effect_key: r.get(7),
    }
}

fn db_now_ms(c: &mut Client) -> f64 {
    c.query_one(
        "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::float8",
        &[],
    )
    .expect("clock_timestamp")
    .get(0)
}

fn ms(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .expect("time after 1970")
        .as_secs_f64()
        * 1000.0
}

fn received_ms(sends: &[Received]) -> Vec<f64> {
    sends.iter().map(|r| ms(r.received_at)).collect()
}

fn gaps(times: &[f64]) -> Vec<f64> {
    times.windows(2).map(|w| w[1] - w[0]).collect()
}

/// Waits until message `id` is in `state`, with a readable failure.
fn expect_state(cluster: &Cluster, c: &mut Client, id: i64, state: &str) {
    if !wait_for_state(cluster, id, state, LONG) {
        panic!(
            "message {id} did not reach {state} within {LONG:?}: {:?}\nattempts: {:#?}",
            message(c, id),
            attempts(c, id)
        );
    }
}

/// Waits until the message has made `n` attempts and the n-th one is recorded with the
/// message back in `queued` (i.e. it waits in backoff).
fn wait_in_backoff(c: &mut Client, id: i64, n: i32) -> MessageRow {
    let ok = wait_until(LONG, || {
        let m = message(c, id);
        m.state == "queued" && m.attempts == n
    });
    let m = message(c, id);
    assert!(ok, "message {id} not in backoff after attempt {n}: {m:?}");
    m
}

fn send_attempts(rows: &[Attempt]) -> Vec<Attempt> {
    rows.iter().filter(|a| a.kind == "send").cloned().collect()
}

// ---------------------------------------------------------------------------------------
// 1. growing backoff
// ---------------------------------------------------------------------------------------

#[test]
fn transient_503_three_times_then_delivered_with_growing_gaps() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(
        &mut c,
        &sim,
        "rt_grow",
        r#"{"retry": {"base_ms": 200, "max_ms": 5000, "multiplier": 2.0, "jitter": "none"}}"#,
    );
    sim.set_plan(&ch, vec![Action::Status(503); 3]);
    let id = enqueue(&mut c, &ch, &unique("rt_grow_key"));
    expect_state(&cluster, &mut c, id, "delivered");

    let m = message(&mut c, id);
    assert_eq!(m.attempts, 4, "{m:?}");
    assert_eq!(m.last_http_status, Some(200), "{m:?}");
    assert_eq!(sim.send_count(&ch), 4);
    assert_eq!(sim.stored(&ch).len(), 1);

    // Provider side: the gaps between the requests grow with the policy.
    let sends = sim.sends(&ch);
    assert_eq!(
        sends.iter().map(|s| s.status).collect::<Vec<_>>(),
        vec![Some(503), Some(503), Some(503), Some(200)]
    );
    let policy = [200.0, 400.0, 800.0];
    let g = gaps(&received_ms(&sends));
    eprintln!("provider-side gaps between attempts: {g:?}");
    for (i, (gap, delay)) in g.iter().zip(policy).enumerate() {
        assert!(
            *gap >= delay,
            "gap {} is {gap:.1} ms, shorter than the policy delay {delay} ms (gaps {g:?})",
            i + 1
        );
        // ≈ the policy: a retry is due at its time, not at the worker's next poll.
        assert!(
            *gap < delay + 250.0,
            "gap {} is {gap:.1} ms, more than 250 ms beyond the policy delay {delay} ms (gaps {g:?})",
            i + 1
        );
    }
    assert!(
        g[0] < g[1] && g[1] < g[2],
        "gaps do not strictly increase: {g:?}"
    );

    // Local side: the attempt rows say the same.
    let rows = send_attempts(&attempts(&mut c, id));
    assert_eq!(
        rows.iter().map(|a| a.attempt).collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );
    for a in &rows[..3] {
        assert_eq!(a.error_class.as_deref(), Some("transient"), "{a:?}");
        assert_eq!(a.http_status, Some(503), "{a:?}");
        assert_eq!(a.outcome.as_deref(), Some("transient"), "{a:?}");
        let e = a.error.as_deref().unwrap_or_default();
        assert!(
            e.contains("HTTP 503"),
            "attempt error does not name HTTP 503: {a:?}"
        );
        assert!(a.finished_ms.is_some(), "{a:?}");
    }
    assert_eq!(
        rows[3].outcome.as_deref(),
        Some("delivered"),
        "{:?}",
        rows[3]
    );
    assert_eq!(rows[3].http_status, Some(200), "{:?}", rows[3]);
    assert_eq!(rows[3].error_class, None, "{:?}", rows[3]);
    let started: Vec<f64> = rows.iter().map(|a| a.started_ms).collect();
    let sg = gaps(&started);
    for (gap, delay) in sg.iter().zip(policy) {
        assert!(
            *gap >= delay,
            "started_at gaps {sg:?} below the policy {policy:?}"
        );
    }
    assert!(sg[0] < sg[1] && sg[1] < sg[2], "started_at gaps {sg:?}");
}

// ---------------------------------------------------------------------------------------
// 2. Retry-After honoured
// ---------------------------------------------------------------------------------------

#[test]
fn retry_after_429_delays_the_next_attempt() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(&mut c, &sim, "rt_429", r#"{"retry": {"base_ms": 100}}"#);
    sim.set_plan(&ch, vec![retry_after(429, "2")]);
    let id = enqueue(&mut c, &ch, &unique("rt_429_key"));
    expect_state(&cluster, &mut c, id, "delivered");

    let sends = sim.sends(&ch);
    assert_eq!(sends.len(), 2, "{sends:?}");
    assert_eq!(sends[0].status, Some(429));
    assert_eq!(sends[1].status, Some(200));
    let g = gaps(&received_ms(&sends));
    assert!(
        g[0] >= 2000.0,
        "second attempt {:.1} ms after the 429, earlier than Retry-After: 2",
        g[0]
    );
    assert!(g[0] < 6000.0, "second attempt came {:.1} ms late", g[0]);

    let rows = send_attempts(&attempts(&mut c, id));
    assert_eq!(rows.len(), 2, "{rows:#?}");
    assert_eq!(rows[0].http_status, Some(429), "{:?}", rows[0]);
    assert_eq!(
        rows[0].error_class.as_deref(),
        Some("transient"),
        "{:?}",
        rows[0]
    );
    assert_eq!(rows[0].retry_after_ms, Some(2000), "{:?}", rows[0]);
    assert!(
        rows[1].started_ms - rows[0].started_ms >= 2000.0,
        "attempt 2 started {:.1} ms after attempt 1",
        rows[1].started_ms - rows[0].started_ms
    );
    assert_eq!(rows[1].outcome.as_deref(), Some("delivered"));
    assert_eq!(message(&mut c, id).attempts, 2);
    assert_eq!(sim.stored(&ch).len(), 1);
}

// ---------------------------------------------------------------------------------------
// 3. permanent error
// ---------------------------------------------------------------------------------------

#[test]
fn permanent_401_fails_after_one_attempt() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(
        &mut c,
        &sim,
        "rt_401",
        r#"{"retry": {"base_ms": 100, "jitter": "none"}}"#,
    );
    sim.set_default(&ch, Action::Status(401));
    let id = enqueue(&mut c, &ch, &unique("rt_401_key"));
    expect_state(&cluster, &mut c, id, "failed");

    let m = message(&mut c, id);
    assert_eq!(m.attempts, 1, "{m:?}");
    assert_eq!(m.last_error_class.as_deref(), Some("permanent"), "{m:?}");
    assert_eq!(m.last_http_status, Some(401), "{m:?}");
    assert!(
        m.last_error
            .as_deref()
            .unwrap_or_default()
            .contains("HTTP 401"),
        "{m:?}"
    );
    // No retry follows: exactly one request, even 2 s later (base_ms is 100).
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(sim.send_count(&ch), 1);
    assert_eq!(sim.stored(&ch).len(), 0);
    let rows = attempts(&mut c, id);
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(rows[0].error_class.as_deref(), Some("permanent"));
    assert_eq!(rows[0].http_status, Some(401));
    assert_eq!(message(&mut c, id).state, "failed");
}

// ---------------------------------------------------------------------------------------
// 4. exhausted after max_attempts
// ---------------------------------------------------------------------------------------

#[test]
fn endless_503_ends_exhausted_after_max_attempts() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(
        &mut c,
        &sim,
        "rt_exh",
        r#"{"retry": {"max_attempts": 3, "base_ms": 100, "jitter": "none"}}"#,
    );
    sim.set_default(&ch, Action::Status(503));
    let id = enqueue(&mut c, &ch, &unique("rt_exh_key"));
    expect_state(&cluster, &mut c, id, "exhausted");

    // Nothing more is sent once the budget is spent.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(sim.send_count(&ch), 3);
    assert_eq!(sim.stored(&ch).len(), 0);

    let m = message(&mut c, id);
    assert_eq!(m.state, "exhausted", "{m:?}");
    assert_eq!(m.attempts, 3, "{m:?}");
    assert_eq!(m.max_attempts, Some(3), "{m:?}");
    assert_eq!(m.last_error_class.as_deref(), Some("transient"), "{m:?}");
    assert_eq!(m.last_http_status, Some(503), "{m:?}");
    let e = m.last_error.clone().unwrap_or_default();
    assert!(
        e.contains("HTTP 503"),
        "last_error lacks the last HTTP 503: {e}"
    );
    assert!(
        e.contains("retry budget spent") && e.contains("3 of 3 attempts"),
        "last_error does not mention the budget: {e}"
    );
    let rows = send_attempts(&attempts(&mut c, id));
    assert_eq!(
        rows.iter().map(|a| a.attempt).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert!(rows
        .iter()
        .all(|a| a.http_status == Some(503) && a.error_class.as_deref() == Some("transient")));
}

// ---------------------------------------------------------------------------------------
// 5. per-channel classify overrides
// ---------------------------------------------------------------------------------------

#[test]
fn classify_override_409_delivered() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(
        &mut c,
        &sim,
        "rt_409",
        r#"{"classify": {"409": "delivered"}, "retry": {"base_ms": 100}}"#,
    );
    sim.set_default(&ch, Action::Status(409));
    let key = unique("rt_409_key");
    let id = enqueue(&mut c, &ch, &key);
    expect_state(&cluster, &mut c, id, "delivered");

    let m = message(&mut c, id);
    assert_eq!(m.attempts, 1, "{m:?}");
    assert_eq!(m.last_http_status, Some(409), "{m:?}");
    let rows = attempts(&mut c, id);
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(rows[0].outcome.as_deref(), Some("delivered"));
    assert_eq!(rows[0].http_status, Some(409));
    let ledger = count(
        &mut c,
        "SELECT count(*) FROM outbox.ledger WHERE effect_key = $1 AND message_id = $2",
        &[&key, &id],
    );
    assert_eq!(ledger, 1, "a delivered message has its ledger entry");
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(sim.send_count(&ch), 1);
}

#[test]
fn classify_override_503_permanent() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(
        &mut c,
        &sim,
        "rt_503p",
        r#"{"classify": {"503": "permanent"}, "retry": {"base_ms": 100, "jitter": "none"}}"#,
    );
    sim.set_default(&ch, Action::Status(503));
    let id = enqueue(&mut c, &ch, &unique("rt_503p_key"));
    expect_state(&cluster, &mut c, id, "failed");

    let m = message(&mut c, id);
    assert_eq!(m.attempts, 1, "{m:?}");
    assert_eq!(m.last_error_class.as_deref(), Some("permanent"), "{m:?}");
    assert_eq!(m.last_http_status, Some(503), "{m:?}");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(sim.send_count(&ch), 1);
    let rows = attempts(&mut c, id);
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(rows[0].error_class.as_deref(), Some("permanent"));
    let ledger = ledger_entries(&mut c, id);
    assert_eq!(ledger, 0);
}

// ---------------------------------------------------------------------------------------
// 6. a policy change applies to messages already queued
// ---------------------------------------------------------------------------------------

#[test]
fn altered_policy_applies_to_a_message_in_backoff() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(
        &mut c,
        &sim,
        "rt_alter",
        r#"{"retry": {"max_attempts": 5, "base_ms": 60000, "jitter": "none"}}"#,
    );
    sim.set_default(&ch, Action::Status(503));
    let id = enqueue(&mut c, &ch, &unique("rt_alter_key"));
    let m = wait_in_backoff(&mut c, id, 1);
    assert_eq!(m.max_attempts, Some(5), "{m:?}");
    let now = db_now_ms(&mut c);
    assert!(
        m.next_attempt_ms > now + 50_000.0,
        "the message should wait about 60 s: due in {:.0} ms",
        m.next_attempt_ms - now
    );
    assert_eq!(sim.send_count(&ch), 1);

    c.execute(
        "SELECT outbox.alter_channel($1, $2::text::jsonb)",
        &[&ch, &r#"{"retry": {"max_attempts": 2}}"#],
    )
    .expect("alter_channel");
    let m = message(&mut c, id);
    assert_eq!(m.max_attempts, Some(2), "{m:?}");
    assert_eq!(m.state, "queued", "{m:?}");
    // The merge kept the other retry keys.
    let base: Option<i64> = one(
        &mut c,
        "SELECT (options -> 'retry' ->> 'base_ms')::int8 FROM outbox.channels WHERE name = $1",
        &[&ch],
    );
    assert_eq!(base, Some(60000));

    let n = c
        .execute(
            "UPDATE outbox._messages SET next_attempt_at = now() WHERE id = $1 AND state = 'queued'",
            &[&id],
        )
        .unwrap();
    assert_eq!(n, 1);
    expect_state(&cluster, &mut c, id, "exhausted");

    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(sim.send_count(&ch), 2);
    let m = message(&mut c, id);
    assert_eq!(m.state, "exhausted", "{m:?}");
    assert_eq!(m.attempts, 2, "{m:?}");
    assert_eq!(m.last_http_status, Some(503), "{m:?}");
    let e = m.last_error.clone().unwrap_or_default();
    assert!(e.contains("2 of 2 attempts"), "{e}");
    let rows = send_attempts(&attempts(&mut c, id));
    assert_eq!(rows.len(), 2, "{rows:#?}");
}

// ---------------------------------------------------------------------------------------
// 7. a server crash during backoff
// ---------------------------------------------------------------------------------------

#[test]
fn backoff_survives_a_server_crash_restart() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(
        &mut c,
        &sim,
        "rt_crash",
        r#"{"idempotency_header": "Idempotency-Key", "retry": {"base_ms": 3000, "jitter": "none"}}"#,
    );
    sim.set_plan(&ch, vec![Action::Status(503)]);
    let key = unique("rt_crash_key");
    let id = enqueue(&mut c, &ch, &key);
    let before = wait_in_backoff(&mut c, id, 1);
    assert_eq!(before.last_http_status, Some(503), "{before:?}");
    let rows_before = attempts(&mut c, id);
    assert_eq!(rows_before.len(), 1, "{rows_before:#?}");
    let first_started = rows_before[0].started_ms;
    // The backoff counts from the decision, read in whole milliseconds; the attempt's start
    // is in microseconds: an answer within the same millisecond may put the due time up to
    // 1 ms before start + 3000.
    assert!(
        before.next_attempt_ms >= first_started + 2999.0,
        "next attempt {:.1} ms after the first, expected >= 3000",
        before.next_attempt_ms - first_started
    );
    drop(c);

    cluster.crash_restart();
    let mut c = cluster.connect();
    let restarted_at = db_now_ms(&mut c);
    let after = message(&mut c, id);
    if after.state == "queued" {
        assert_eq!(
            after.next_attempt_ms, before.next_attempt_ms,
            "next_attempt_at changed across the restart"
        );
    } else {
        // A slow restart: a worker took the message again before it was read. A queued
        // message is taken only once due, so the due time must have passed by now.
        let read_at = db_now_ms(&mut c);
        assert!(
            read_at >= before.next_attempt_ms,
            "{} {:.1} ms before next_attempt_at: {after:?}",
            after.state,
            before.next_attempt_ms - read_at
        );
    }
    if restarted_at + 200.0 < before.next_attempt_ms {
        // Back before the due time: the restarted workers must leave it waiting.
        assert_eq!(after.state, "queued", "{after:?}");
        assert_eq!(after.attempts, 1, "{after:?}");
        assert_eq!(sim.send_count(&ch), 1, "retried before its time");
    } else {
        // A slow restart (busy machine) overran the 3 s backoff; the checks below (the
        // retry is not earlier than next_attempt_at, same key) still hold.
        eprintln!(
            "note: the restart finished {:.0} ms after the due time",
            restarted_at - before.next_attempt_ms
        );
    }
    cluster.wait_for_worker();

    expect_state(&cluster, &mut c, id, "delivered");
    let sends = sim.sends(&ch);
    assert_eq!(sends.len(), 2, "{sends:?}");
    let second = ms(sends[1].received_at);
    assert!(
        second + 1.0 >= before.next_attempt_ms,
        "retried {:.1} ms before next_attempt_at",
        before.next_attempt_ms - second
    );
    let ready = before.next_attempt_ms.max(restarted_at);
    assert!(
        second < ready + 5000.0,
        "retried {:.1} ms after it was due and the server was up",
        second - ready
    );
    let m = message(&mut c, id);
    assert_eq!(m.attempts, 2, "{m:?}");
    assert_eq!(m.effect_key, key);
    assert_eq!(
        sim.header_values(&ch, "Idempotency-Key"),
        vec![key.clone(), key.clone()],
        "both requests carry the same effect key"
    );
    // Two send rows and nothing else: a queued message is no lost lease to recover.
    let rows = attempts(&mut c, id);
    assert_eq!(
        rows.iter()
            .map(|a| (a.kind.as_str(), a.attempt))
            .collect::<Vec<_>>(),
        vec![("send", 1), ("send", 2)],
        "{rows:#?}"
    );
    assert!(rows
        .iter()
        .all(|a| a.effect_key_sent.as_deref() == Some(key.as_str())));
    assert_eq!(sim.stored(&ch).len(), 1);
}

// ---------------------------------------------------------------------------------------
// 8. jitter spreads a burst of failures
// ---------------------------------------------------------------------------------------

#[test]
fn jitter_spreads_a_hundred_simultaneous_failures() {
    const N: usize = 100;
    let (_cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(
        &mut c,
        &sim,
        "rt_jit",
        r#"{"max_in_flight": 200, "max_unverifiable_in_flight": 200, "retry": {"base_ms": 2000, "jitter": "full"}}"#,
    );
    // Every first attempt fails with 503. The default (not a plan of N × 503) keeps that
    // exact even if a retry with a near-zero jittered delay overtook another message's first
    // send; it turns to Accept once all first attempts are recorded.
    sim.set_default(&ch, Action::Status(503));
    let mut ids = Vec::with_capacity(N);
    {
        let mut tx = c.transaction().unwrap();
        for i in 0..N {
            let key = format!("{ch}_k{i}");
            let payload = format!(r#"{{"n": {i}}}"#);
            let id: i64 = one(
                &mut tx,
                "SELECT outbox.enqueue($1, $2::text::jsonb, $3)",
                &[&ch, &payload, &key],
            );
            ids.push(id);
        }
        tx.commit().unwrap();
    }

    // All first attempts recorded.
    let first_done = |c: &mut Client| -> i64 {
        c.query_one(
            "SELECT count(*) FROM outbox.attempts a
              WHERE a.message_id = ANY($1) AND a.attempt = 1 AND a.kind = 'send'
                AND a.finished_at IS NOT NULL",
            &[&ids],
        )
        .unwrap()
        .get(0)
    };
    assert!(
        wait_until(LONG, || first_done(&mut c) == N as i64),
        "only {} of {N} first attempts recorded",
        first_done(&mut c)
    );
    // One snapshot: attempt 1 of every message, and the message's scheduled retry.
    let rows = c
        .query(
            "SELECT m.id, m.attempts,
                    (extract(epoch FROM m.next_attempt_at) * 1000)::float8,
                    (extract(epoch FROM a.finished_at) * 1000)::float8,
                    a.http_status, a.error_class::text, a.error
               FROM outbox._messages m
               JOIN outbox.attempts a ON a.message_id = m.id AND a.attempt = 1 AND a.kind = 'send'
              WHERE m.id = ANY($1)",
            &[&ids],
        )
        .unwrap();
    sim.set_default(&ch, Action::Accept);
    assert_eq!(rows.len(), N);

    let mut finished = Vec::new();
    let mut delays = Vec::new();
    let mut next_of_first = Vec::new();
    for r in &rows {
        let attempts: i32 = r.get(1);
        let next_ms: f64 = r.get(2);
        let finished_ms: f64 = r.get(3);
        let status: Option<i32> = r.get(4);
        let class: Option<String> = r.get(5);
        let error: String = r.get::<_, Option<String>>(6).unwrap_or_default();
        assert_eq!(
            status,
            Some(503),
            "attempt 1 of message {}",
            r.get::<_, i64>(0)
        );
        assert_eq!(class.as_deref(), Some("transient"));
        // "HTTP 503 after N ms; retry in D ms"
        let d: f64 = error
            .split("retry in ")
            .nth(1)
            .and_then(|s| s.split(" ms").next())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| panic!("no retry delay in {error:?}"));
        assert!((0.0..=2000.0).contains(&d), "delay {d} outside [0, 2000]");
        delays.push(d);
        finished.push(finished_ms);
        if attempts == 1 {
            // Still waiting for its first retry: next_attempt_at is the one set by attempt 1.
            next_of_first.push(next_ms);
        }
    }
    let spread = |v: &[f64]| {
        v.iter().cloned().fold(f64::MIN, f64::max) - v.iter().cloned().fold(f64::MAX, f64::min)
    };
    assert!(
        spread(&finished) < 1000.0,
        "the failures did not happen together: spread {:.0} ms",
        spread(&finished)
    );
    assert!(
        spread(&delays) >= 1000.0,
        "jittered delays spread over only {:.0} ms of the 2000 ms window",
        spread(&delays)
    );
    assert!(
        next_of_first.len() >= N / 2,
        "only {} messages still waited for their first retry",
        next_of_first.len()
    );
    assert!(
        spread(&next_of_first) >= 1000.0,
        "next_attempt_at spread over only {:.0} ms",
        spread(&next_of_first)
    );

    // Then every one is delivered, once.
    let delivered = |c: &mut Client| -> i64 {
        c.query_one(
            "SELECT count(*) FROM outbox.messages WHERE id = ANY($1) AND state = 'delivered'",
            &[&ids],
        )
        .unwrap()
        .get(0)
    };
    assert!(
        wait_until(LONG, || delivered(&mut c) == N as i64),
        "only {} of {N} delivered",
        delivered(&mut c)
    );
    assert_eq!(sim.stored(&ch).len(), N);
    let ledger = count(
        &mut c,
        "SELECT count(*) FROM outbox.ledger WHERE message_id = ANY($1)",
        &[&ids],
    );
    assert_eq!(ledger, N as i64);
}

// ---------------------------------------------------------------------------------------
// 9. garbage Retry-After
// ---------------------------------------------------------------------------------------

#[test]
fn garbage_retry_after_is_recorded_and_ignored() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(
        &mut c,
        &sim,
        "rt_soon",
        r#"{"retry": {"base_ms": 300, "jitter": "none"}}"#,
    );
    sim.set_plan(&ch, vec![retry_after(503, "soon")]);
    let id = enqueue(&mut c, &ch, &unique("rt_soon_key"));
    expect_state(&cluster, &mut c, id, "delivered");

    let rows = send_attempts(&attempts(&mut c, id));
    assert_eq!(rows.len(), 2, "{rows:#?}");
    let a = &rows[0];
    assert_eq!(a.http_status, Some(503), "{a:?}");
    assert_eq!(a.error_class.as_deref(), Some("transient"), "{a:?}");
    assert_eq!(a.retry_after_ms, None, "{a:?}");
    let e = a.error.as_deref().unwrap_or_default();
    assert!(
        e.contains("Retry-After"),
        "the attempt error does not mention Retry-After: {e}"
    );
    assert!(
        e.contains("soon"),
        "the attempt error does not quote the value: {e}"
    );
    assert!(
        e.contains("retry in 300 ms"),
        "not retried on its backoff: {e}"
    );
    assert_eq!(rows[1].outcome.as_deref(), Some("delivered"));

    let sends = sim.sends(&ch);
    assert_eq!(sends.len(), 2);
    let g = gaps(&received_ms(&sends));
    assert!(
        g[0] >= 300.0 && g[0] < 2500.0,
        "retry gap {:.1} ms: expected the 300 ms backoff",
        g[0]
    );
    assert_eq!(sim.stored(&ch).len(), 1);
}

// ---------------------------------------------------------------------------------------
// 10. connection refused
// ---------------------------------------------------------------------------------------

#[test]
fn connection_refused_is_transient_and_exhausts() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let ch = unique("rt_refused");
    create_channel(
        &mut c,
        &ch,
        "http://127.0.0.1:1/x",
        r#"{"retry": {"max_attempts": 2, "base_ms": 100}}"#,
    );
    let id = enqueue(&mut c, &ch, &unique("rt_refused_key"));
    expect_state(&cluster, &mut c, id, "exhausted");

    let m = message(&mut c, id);
    assert_eq!(m.attempts, 2, "{m:?}");
    assert_eq!(m.last_error_class.as_deref(), Some("transient"), "{m:?}");
    assert_eq!(m.last_http_status, None, "{m:?}");
    let e = m.last_error.clone().unwrap_or_default();
    assert!(e.starts_with("connect:"), "{e}");
    assert!(e.contains("2 of 2 attempts"), "{e}");
    let rows = send_attempts(&attempts(&mut c, id));
    assert_eq!(rows.len(), 2, "{rows:#?}");
    for a in &rows {
        assert_eq!(a.error_class.as_deref(), Some("transient"), "{a:?}");
        assert_eq!(a.http_status, None, "{a:?}");
        assert!(
            a.error
                .as_deref()
                .unwrap_or_default()
                .starts_with("connect:"),
            "{a:?}"
        );
    }
}
