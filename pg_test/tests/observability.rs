//! End-to-end tests of the observability surface (`sql/observability.sql`: `outbox.metrics`,
//! `outbox.alerts`, `outbox.prometheus()`; `outbox.worker_status()`), against the real
//! cluster (`scripts/cluster.sh`, located by `OUTBOX_BASE` / `OUTBOX_PGPORT`, started with
//! `OUTBOX_WORKERS=2`), the real delivery workers and the provider simulator:
//!
//! 1. every alert condition raised by real traffic and cleared again (`queue_age`,
//!    `error_streak`, `terminal_failures`, `uncertain`);
//! 2. `outbox.prometheus()` read by an independent Prometheus text-format parser
//!    (`openmetrics-parser`): families with HELP and TYPE, escaped label values that
//!    round-trip, counters typed as such, figures equal to `outbox.metrics` and one
//!    `outbox_alert` sample per `outbox.alerts` row;
//! 3. `*_total` counters survive a server crash and keep counting;
//! 4. `outbox.worker_status()` against `pg_stat_activity`;
//! 5. `pg_monitor` reads metrics, alerts and the exposition, and not the private tables;
//! 6. `outbox.metrics` stays on indexes at a backlog of 200,000 queued messages.
//!
//! Run: `cargo test -p outbox_e2e --release --test observability`.
//!
//! The tests change server-wide alert thresholds and one restarts the server, so they take
//! one lock and run one at a time whatever `--test-threads` says; every setting a test
//! changes is reset by a guard, also when the test fails.

use openmetrics_parser::prometheus::parse_prometheus;
use openmetrics_parser::{MetricsExposition, PrometheusType, PrometheusValue};
use outbox_e2e::cluster::{unique, wait_for_workers, wait_until, Cluster};
use outbox_e2e::helpers::{
    create_channel, enqueue, serial, set_setting_seen, wait_state, SettingsGuard, SETTLE,
};
use outbox_e2e::sim::{Action, Simulator};
use postgres::{Client, IsolationLevel, NoTls, SimpleQueryMessage};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

type Exposition = MetricsExposition<PrometheusType, PrometheusValue>;

// ---------------------------------------------------------------------------------------
// Helpers (local to this file)
// ---------------------------------------------------------------------------------------

fn state(c: &mut Client, id: i64) -> Result<Option<String>, postgres::Error> {
    Ok(c.query_one("SELECT outbox.status($1)::text", &[&id])?
        .get(0))
}

/// One row of `outbox.alerts`, with `since` as "seconds ago" (now() - since).
#[derive(Debug, Clone, PartialEq)]
struct AlertRow {
    alert: String,
    channel: Option<String>,
    severity: String,
    value: f64,
    threshold: f64,
    since_age_s: Option<f64>,
}

const ALERT_COLUMNS: &str = "alert, channel, severity, value::float8, threshold::float8,
                             extract(epoch FROM now() - since)::float8";

fn alert_row(r: &postgres::Row) -> AlertRow {
    AlertRow {
        alert: r.get(0),
        channel: r.get(1),
        severity: r.get(2),
        value: r.get(3),
        threshold: r.get(4),
        since_age_s: r.get(5),
    }
}

fn alerts_of<C: postgres::GenericClient>(c: &mut C, channel: &str) -> Vec<AlertRow> {
    c.query(
        &format!("SELECT {ALERT_COLUMNS} FROM outbox.alerts WHERE channel = $1 ORDER BY alert"),
        &[&channel],
    )
    .expect("read outbox.alerts")
    .iter()
    .map(alert_row)
    .collect()
}

/// One channel row of `outbox.metrics`.
#[derive(Debug, Clone, PartialEq)]
struct MetricsRow {
    channel: String,
    queued: i64,
    sending: i64,
    uncertain: i64,
    exhausted: i64,
    failed: i64,
    oldest_queued_age_s: Option<f64>,
    success_rate_5m: Option<f64>,
    error_streak: i64,
    exhausted_total: i64,
    delivered_total: i64,
    attempts_failed_total: i64,
    failed_total: i64,
    error_streak_since_age_s: Option<f64>,
    paused: bool,
}

const METRICS_COLUMNS: &str = "channel, queued, sending, uncertain, exhausted, failed,
    oldest_queued_age_s::float8, success_rate_5m::float8, error_streak::int8,
    exhausted_total, delivered_total, attempts_failed_total, failed_total,
    extract(epoch FROM now() - error_streak_since)::float8, paused";

fn metrics_row(r: &postgres::Row) -> MetricsRow {
    MetricsRow {
        channel: r.get(0),
        queued: r.get(1),
        sending: r.get(2),
        uncertain: r.get(3),
        exhausted: r.get(4),
        failed: r.get(5),
        oldest_queued_age_s: r.get(6),
        success_rate_5m: r.get(7),
        error_streak: r.get(8),
        exhausted_total: r.get(9),
        delivered_total: r.get(10),
        attempts_failed_total: r.get(11),
        failed_total: r.get(12),
        error_streak_since_age_s: r.get(13),
        paused: r.get(14),
    }
}

fn metrics_of<C: postgres::GenericClient>(c: &mut C, channel: &str) -> MetricsRow {
    let r = c
        .query_one(
            &format!(
                "SELECT {METRICS_COLUMNS} FROM outbox.metrics WHERE scope = 'channel' AND channel = $1"
            ),
            &[&channel],
        )
        .unwrap_or_else(|e| panic!("metrics row of {channel:?}: {e}"));
    metrics_row(&r)
}

fn all_channel_metrics<C: postgres::GenericClient>(c: &mut C) -> Vec<MetricsRow> {
    c.query(
        &format!(
            "SELECT {METRICS_COLUMNS} FROM outbox.metrics WHERE scope = 'channel' ORDER BY channel"
        ),
        &[],
    )
    .expect("read outbox.metrics")
    .iter()
    .map(metrics_row)
    .collect()
}

fn prometheus_text<C: postgres::GenericClient>(c: &mut C) -> String {
    c.query_one("SELECT outbox.prometheus()", &[])
        .expect("SELECT outbox.prometheus()")
        .get(0)
}

fn parse(text: &str) -> Exposition {
    parse_prometheus(text).unwrap_or_else(|e| {
        panic!("outbox.prometheus() is not valid Prometheus text: {e:?}\n--- text ---\n{text}")
    })
}

fn number(v: &PrometheusValue) -> f64 {
    match v {
        PrometheusValue::Gauge(n) | PrometheusValue::Unknown(n) => n.as_f64(),
        PrometheusValue::Counter(c) => c.value.as_f64(),
        other => panic!("unexpected sample value {other:?}"),
    }
}

/// The samples of a family as (label name → value) maps with their values.
fn samples(e: &Exposition, family: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    let f = e
        .families
        .get(family)
        .unwrap_or_else(|| panic!("family {family} missing from the exposition"));
    f.iter_samples()
        .map(|s| {
            let labels = s
                .get_labelset()
                .expect("labelset of a parsed sample")
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            (labels, number(&s.value))
        })
        .collect()
}

/// The value of the sample of `family` whose `channel` label is `channel` (and whose other
/// labels match `more`); panics unless exactly one matches.
fn sample_value(e: &Exposition, family: &str, channel: &str, more: &[(&str, &str)]) -> f64 {
    let hits: Vec<f64> = samples(e, family)
        .into_iter()
        .filter(|(l, _)| {
            l.get("channel").map(String::as_str) == Some(channel)
                && more
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, v)| v)
        .collect();
    assert_eq!(
        hits.len(),
        1,
        "{family}{{channel={channel:?}, {more:?}}}: expected one sample, got {hits:?}"
    );
    hits[0]
}

fn close(a: f64, b: f64, eps: f64) -> bool {
    (a - b).abs() <= eps
}

// ---------------------------------------------------------------------------------------
// 1. Alerts raised by real traffic, then cleared
// ---------------------------------------------------------------------------------------

/// A provider that hangs (no answer, nothing stored) on a channel with `max_in_flight` 1
/// holds the channel's later messages due in the queue: with `outbox.alert_queue_age_s` = 1
/// one `queue_age` alert appears whose `value` and `since` describe the oldest due queued
/// message; once the hung requests time out (ambiguous, retried with the same key on this
/// deduping channel) everything drains and the alert is gone.
#[test]
fn queue_age_alert_is_raised_by_a_stuck_channel_and_clears_when_it_drains() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let _settings = SettingsGuard::new(&cluster, &["outbox.alert_queue_age_s"]);
    let mut c = cluster.connect();
    set_setting_seen(&mut c, "outbox.alert_queue_age_s", "1");

    let sim = Simulator::start();
    let ch = unique("obs_qage");
    sim.set_dedupe(&ch, "Idempotency-Key");
    // Three hung sends of 1.5 s each block the channel for ~4.5 s; then Accept.
    sim.set_plan(&ch, vec![Action::Hang { store: false }; 3]);
    create_channel(
        &mut c,
        &ch,
        &sim.send_url(&ch),
        r#"{"idempotency_header": "Idempotency-Key", "max_in_flight": 1,
            "timeout_ms": 1500, "connect_timeout_ms": 500,
            "retry": {"base_ms": 100, "max_ms": 200, "jitter": "none", "max_attempts": 20}}"#,
    );
    assert!(alerts_of(&mut c, &ch).is_empty(), "no alert before traffic");

    let first = enqueue(&mut c, &ch, &unique("obs_qage_k"));
    assert!(
        sim.wait_for_sends(&ch, 1, Duration::from_secs(10)),
        "the first message was never sent"
    );
    let mut ids = vec![first];
    for _ in 0..3 {
        ids.push(enqueue(&mut c, &ch, &unique("obs_qage_k")));
    }

    // The alert appears once a due message has waited more than 1 s.
    let mut seen: Vec<AlertRow> = Vec::new();
    let raised = wait_until(Duration::from_secs(10), || {
        seen = alerts_of(&mut c, &ch);
        seen.iter().any(|a| a.alert == "queue_age")
    });
    assert!(raised, "no queue_age alert for {ch}; alerts: {seen:?}");

    // Read alert, metrics and the oldest due queued message in one snapshot (one now()).
    {
        let mut tx = c
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .start()
            .unwrap();
        let rows = alerts_of(&mut tx, &ch);
        let qa: Vec<&AlertRow> = rows.iter().filter(|a| a.alert == "queue_age").collect();
        let m = metrics_of(&mut tx, &ch);
        let head: Option<f64> = tx
            .query_one(
                "SELECT extract(epoch FROM now() - min(m.next_attempt_at))::float8
                   FROM outbox._messages m JOIN outbox._channels c ON c.id = m.channel_id
                  WHERE c.name = $1 AND m.state = 'queued' AND m.next_attempt_at <= now()",
                &[&ch],
            )
            .unwrap()
            .get(0);
        tx.commit().unwrap();
        // The channel stays blocked for ~4.5 s, long after the alert first showed.
        assert!(
            !qa.is_empty(),
            "queue_age alert vanished before it could be read; alerts: {rows:?}, metrics: {m:?}"
        );
        assert_eq!(qa.len(), 1, "one queue_age alert per channel: {rows:?}");
        let a = qa[0];
        assert_eq!(a.threshold, 1.0, "{a:?}");
        assert!(a.value > 1.0, "value over the threshold: {a:?}");
        let expect_sev = if a.value > 4.0 { "critical" } else { "warning" };
        assert_eq!(a.severity, expect_sev, "{a:?}");
        let since_age = a.since_age_s.expect("since is set");
        assert!(
            since_age > 1.0,
            "since lies more than the threshold in the past: {a:?}"
        );
        assert!(
            close(since_age, a.value, 0.002),
            "since = now() - value: {a:?}"
        );
        assert_eq!(
            m.oldest_queued_age_s,
            Some(a.value),
            "metrics agrees: {m:?}"
        );
        let head = head.expect("a due queued message exists while the alert is up");
        assert!(
            close(head, a.value, 0.002),
            "the alert's age is the oldest due queued message's ({head} s): {a:?}"
        );
        assert!(!m.paused);
    }

    // Drain: the hung requests time out, are retried with the same key, everything lands.
    for &id in &ids {
        wait_state(&cluster, id, "delivered");
    }
    let rows = alerts_of(&mut c, &ch);
    assert!(
        rows.is_empty(),
        "every alert of {ch} is gone once drained: {rows:?}"
    );
    let m = metrics_of(&mut c, &ch);
    assert_eq!((m.queued, m.sending), (0, 0), "{m:?}");
    assert_eq!(m.oldest_queued_age_s, None, "{m:?}");
    assert_eq!(m.delivered_total, 4, "{m:?}");
    assert_eq!(
        m.attempts_failed_total, 3,
        "three timed-out attempts: {m:?}"
    );
    assert_eq!(m.error_streak, 0, "a delivery ends the streak: {m:?}");

    // Provider side: 3 hung sends + 4 accepted, each effect stored exactly once.
    assert_eq!(sim.send_count(&ch), 7);
    let stored = sim.stored(&ch);
    assert_eq!(stored.len(), 4);
    let keys: HashSet<_> = stored.iter().map(|s| s.key.clone()).collect();
    assert_eq!(keys.len(), 4, "no effect stored twice: {stored:?}");
}

/// 503s on a channel with `outbox.alert_error_streak` = 3: an `error_streak` alert whose
/// value is the channel's streak (>= 3) and whose `since` is the first failure; once the
/// provider accepts, the message is delivered, the streak is 0 and the alert is gone.
#[test]
fn error_streak_alert_follows_503s_and_clears_on_delivery() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let _settings = SettingsGuard::new(&cluster, &["outbox.alert_error_streak"]);
    let mut c = cluster.connect();
    set_setting_seen(&mut c, "outbox.alert_error_streak", "3");

    let sim = Simulator::start();
    let ch = unique("obs_streak");
    sim.set_default(&ch, Action::Status(503));
    create_channel(
        &mut c,
        &ch,
        &sim.send_url(&ch),
        r#"{"retry": {"base_ms": 100, "max_ms": 300, "jitter": "none", "max_attempts": 100}}"#,
    );
    let id = enqueue(&mut c, &ch, &unique("obs_streak_k"));

    let mut seen: Vec<AlertRow> = Vec::new();
    let raised = wait_until(SETTLE, || {
        seen = alerts_of(&mut c, &ch);
        seen.iter().any(|a| a.alert == "error_streak")
    });
    assert!(raised, "no error_streak alert for {ch}; alerts: {seen:?}");
    {
        let mut tx = c
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .start()
            .unwrap();
        let rows = alerts_of(&mut tx, &ch);
        let m = metrics_of(&mut tx, &ch);
        // When the first two attempts started, for `since`.
        let starts: Vec<f64> = tx
            .query(
                "SELECT extract(epoch FROM now() - started_at)::float8 FROM outbox.attempts
                  WHERE message_id = $1 AND kind = 'send' ORDER BY attempt_id LIMIT 2",
                &[&id],
            )
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        tx.commit().unwrap();
        let es: Vec<&AlertRow> = rows.iter().filter(|a| a.alert == "error_streak").collect();
        assert_eq!(es.len(), 1, "{rows:?}");
        let a = es[0];
        assert!(a.value >= 3.0, "{a:?}");
        assert_eq!(a.threshold, 3.0, "{a:?}");
        assert_eq!(a.severity, "warning", "{a:?}");
        assert_eq!(
            a.value, m.error_streak as f64,
            "alert value = metrics: {m:?}"
        );
        assert!(
            m.attempts_failed_total >= m.error_streak,
            "streak within failed attempts: {m:?}"
        );
        assert_eq!(m.delivered_total, 0, "{m:?}");
        // `since` is when the streak began: after the first attempt started, before the
        // second one did.
        let since = a.since_age_s.expect("since is set");
        assert_eq!(Some(since), m.error_streak_since_age_s, "{m:?}");
        assert_eq!(starts.len(), 2, "at least two attempts: {starts:?}");
        assert!(
            since <= starts[0] && since >= starts[1],
            "since ({since} s ago) lies between attempt 1 ({} s ago) and attempt 2 ({} s ago)",
            starts[0],
            starts[1]
        );
    }
    assert_eq!(
        state(&mut c, id)
            .unwrap()
            .as_deref()
            .map(|s| s != "delivered"),
        Some(true)
    );

    // The provider recovers.
    sim.set_default(&ch, Action::Accept);
    wait_state(&cluster, id, "delivered");
    let rows = alerts_of(&mut c, &ch);
    assert!(rows.is_empty(), "alert gone after the delivery: {rows:?}");
    let m = metrics_of(&mut c, &ch);
    assert_eq!(m.error_streak, 0, "{m:?}");
    assert_eq!(m.error_streak_since_age_s, None, "{m:?}");
    assert_eq!(m.delivered_total, 1, "{m:?}");
    let sends = sim.send_count(&ch) as i64;
    assert_eq!(sim.stored(&ch).len(), 1);
    assert!(sends >= 4, "at least three 503s and one accept: {sends}");
    assert_eq!(
        m.attempts_failed_total,
        sends - 1,
        "every 503 the provider answered is one failed attempt: {m:?}"
    );
    let attempts: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.attempts WHERE message_id = $1 AND kind = 'send'",
            &[&id],
        )
        .unwrap()
        .get(0);
    assert_eq!(attempts, sends, "one attempt row per request");
}

/// A 401 fails the message at once: one critical `terminal_failures` alert (value 1, since
/// = the message's last change); `outbox.cancel` clears it, the `failed_total` counter stays.
#[test]
fn terminal_failure_alert_on_401_clears_on_cancel() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let mut c = cluster.connect();
    let sim = Simulator::start();
    let ch = unique("obs_term");
    sim.set_plan(&ch, vec![Action::Status(401)]);
    create_channel(&mut c, &ch, &sim.send_url(&ch), "{}");
    let id = enqueue(&mut c, &ch, &unique("obs_term_k"));
    wait_state(&cluster, id, "failed");

    let (rows, updated_age): (Vec<AlertRow>, f64) = {
        let mut tx = c
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .start()
            .unwrap();
        let rows = alerts_of(&mut tx, &ch);
        let age: f64 = tx
            .query_one(
                "SELECT extract(epoch FROM now() - updated_at)::float8 FROM outbox._messages WHERE id = $1",
                &[&id],
            )
            .unwrap()
            .get(0);
        tx.commit().unwrap();
        (rows, age)
    };
    assert_eq!(rows.len(), 1, "exactly one alert: {rows:?}");
    let a = &rows[0];
    assert_eq!(a.alert, "terminal_failures");
    assert_eq!(a.severity, "critical");
    assert_eq!(a.value, 1.0);
    assert_eq!(a.threshold, 0.0);
    assert_eq!(
        a.since_age_s,
        Some(updated_age),
        "since = when it failed: {a:?}"
    );
    let m = metrics_of(&mut c, &ch);
    assert_eq!(
        (m.failed, m.failed_total, m.delivered_total),
        (1, 1, 0),
        "{m:?}"
    );
    assert_eq!(sim.send_count(&ch), 1, "a permanent error is not retried");
    assert_eq!(sim.stored(&ch).len(), 0);

    c.execute(
        "SELECT outbox.cancel($1, 'obs test: provider token revoked, handled')",
        &[&id],
    )
    .expect("cancel");
    assert_eq!(state(&mut c, id).unwrap().as_deref(), Some("cancelled"));
    let rows = alerts_of(&mut c, &ch);
    assert!(rows.is_empty(), "alert gone after cancel: {rows:?}");
    let m = metrics_of(&mut c, &ch);
    assert_eq!(m.failed, 0, "{m:?}");
    assert_eq!(m.failed_total, 1, "the counter does not go down: {m:?}");
    assert_eq!(sim.send_count(&ch), 1, "cancel sends nothing");
}

/// A connection reset after the provider stored the message, on a channel that can neither
/// dedupe nor reconcile: `uncertain`, and at once (not after `alert_uncertain_age_s`) one
/// critical `uncertain` alert; the operator's `resolve(..., 'delivered', ...)` clears it.
#[test]
fn uncertain_alert_at_once_without_reconcile_clears_on_resolve() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let mut c = cluster.connect();
    let sim = Simulator::start();
    let ch = unique("obs_unc");
    sim.set_plan(&ch, vec![Action::DropAfterRead { store: true }]);
    create_channel(&mut c, &ch, &sim.send_url(&ch), "{}");
    let id = enqueue(&mut c, &ch, &unique("obs_unc_k"));
    wait_state(&cluster, id, "uncertain");

    let rows = alerts_of(&mut c, &ch);
    assert_eq!(rows.len(), 1, "exactly one alert: {rows:?}");
    let a = &rows[0];
    assert_eq!(a.alert, "uncertain");
    assert_eq!(a.severity, "critical");
    assert_eq!(a.value, 1.0);
    let threshold: i32 = c
        .query_one(
            "SELECT current_setting('outbox.alert_uncertain_age_s')::int",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(a.threshold, threshold as f64);
    let age = a.since_age_s.expect("since");
    assert!(
        (0.0..(threshold as f64)).contains(&age),
        "raised at once, long before the {threshold} s threshold: {a:?}"
    );
    let m = metrics_of(&mut c, &ch);
    assert_eq!(m.uncertain, 1, "{m:?}");
    assert_eq!(sim.stored(&ch).len(), 1, "the provider has it");
    assert_eq!(sim.send_count(&ch), 1, "never blindly resent");

    let after: String = c
        .query_one(
            "SELECT outbox.resolve($1, 'delivered', 'obs test: seen in the provider console')::text",
            &[&id],
        )
        .expect("resolve")
        .get(0);
    assert_eq!(after, "delivered");
    let rows = alerts_of(&mut c, &ch);
    assert!(rows.is_empty(), "alert gone after resolve: {rows:?}");
    assert_eq!(metrics_of(&mut c, &ch).uncertain, 0);
    let by: String = c
        .query_one(
            "SELECT recorded_by FROM outbox.ledger WHERE message_id = $1",
            &[&id],
        )
        .unwrap()
        .get(0);
    assert_eq!(by, "operator");
    assert_eq!(sim.send_count(&ch), 1, "resolve sends nothing");
}

// ---------------------------------------------------------------------------------------
// 2. The Prometheus exposition, parsed
// ---------------------------------------------------------------------------------------

const FAMILIES: [(&str, PrometheusType); 10] = [
    ("outbox_messages", PrometheusType::Gauge),
    ("outbox_oldest_queued_age_seconds", PrometheusType::Gauge),
    ("outbox_delivered_total", PrometheusType::Counter),
    ("outbox_attempts_failed_total", PrometheusType::Counter),
    ("outbox_exhausted_total", PrometheusType::Counter),
    ("outbox_failed_total", PrometheusType::Counter),
    ("outbox_error_streak", PrometheusType::Gauge),
    ("outbox_success_rate_5m", PrometheusType::Gauge),
    ("outbox_alert", PrometheusType::Gauge),
    ("outbox_worker_up", PrometheusType::Gauge),
];

/// Real traffic on a channel whose name holds a `"`, a `\` and a newline, then
/// `outbox.prometheus()` parsed by `openmetrics-parser`: it parses; every family has one
/// HELP and one TYPE line; `*_total` are counters; label values round-trip; every figure
/// equals `outbox.metrics` and `outbox.alerts` read in the same snapshot.
#[test]
fn prometheus_exposition_parses_and_matches_metrics_and_alerts() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let mut c = cluster.connect();
    let sim = Simulator::start();
    let sim_ch = unique("obs_prom");
    let ch = format!("obs \"quoted\" \\back\\slash\nline {}", unique("x"));
    create_channel(&mut c, &ch, &sim.send_url(&sim_ch), "{}");

    // Two deliveries, one 401 (failed → terminal_failures alert), one queued for later.
    let a = enqueue(&mut c, &ch, &unique("obs_prom_k"));
    wait_state(&cluster, a, "delivered");
    let b = enqueue(&mut c, &ch, &unique("obs_prom_k"));
    wait_state(&cluster, b, "delivered");
    sim.set_plan(&sim_ch, vec![Action::Status(401)]);
    let f = enqueue(&mut c, &ch, &unique("obs_prom_k"));
    wait_state(&cluster, f, "failed");
    let later: i64 = c
        .query_one(
            "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text, NULL, now() + interval '1 hour')",
            &[&ch, &unique("obs_prom_later")],
        )
        .unwrap()
        .get(0);

    // One snapshot: the text, the metrics and the alerts it was made from.
    let (text, metrics, alerts, workers) = {
        let mut tx = c
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .start()
            .unwrap();
        let text = prometheus_text(&mut tx);
        let metrics = all_channel_metrics(&mut tx);
        let alerts: Vec<AlertRow> = tx
            .query(&format!("SELECT {ALERT_COLUMNS} FROM outbox.alerts"), &[])
            .unwrap()
            .iter()
            .map(alert_row)
            .collect();
        let workers: i64 = tx
            .query_one(
                "SELECT count(*) FROM outbox.worker_status() WHERE pid IS NOT NULL",
                &[],
            )
            .unwrap()
            .get(0);
        tx.commit().unwrap();
        (text, metrics, alerts, workers)
    };
    // Cleanup: the message queued for an hour must not deliver during a later test, and the
    // failed one need not raise a terminal_failures alert for the next hour.
    for id in [later, f] {
        c.execute("SELECT outbox.cancel($1, 'obs test cleanup')", &[&id])
            .unwrap();
    }

    let e = parse(&text);

    // Families: exactly the documented ones, each with one HELP and one TYPE line of the
    // parsed type, before its samples; `*_total` are counters.
    let names: HashSet<&str> = e.families.keys().map(String::as_str).collect();
    let expected: HashSet<&str> = FAMILIES.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, expected, "families in the exposition");
    for (name, kind) in &FAMILIES {
        let fam = &e.families[*name];
        assert_eq!(&fam.family_type, kind, "TYPE of {name}");
        assert!(!fam.help.trim().is_empty(), "HELP of {name} is empty");
        let help_lines = text
            .lines()
            .filter(|l| l.starts_with(&format!("# HELP {name} ")))
            .count();
        let type_lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with(&format!("# TYPE {name} ")))
            .collect();
        assert_eq!(help_lines, 1, "one HELP line for {name}");
        assert_eq!(
            type_lines,
            vec![format!("# TYPE {name} {kind}")],
            "TYPE line of {name}"
        );
        if name.ends_with("_total") {
            assert_eq!(kind, &PrometheusType::Counter, "{name} is a counter");
            for s in fam.iter_samples() {
                assert!(
                    matches!(s.value, PrometheusValue::Counter(_)),
                    "{name} sample parsed as a counter: {:?}",
                    s.value
                );
            }
        }
    }
    // Every sample line belongs to a family announced by HELP and TYPE above it.
    let mut announced: HashSet<String> = HashSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            announced.insert(rest.split(' ').next().unwrap().to_string());
        } else if !line.starts_with('#') && !line.is_empty() {
            let name = line.split(['{', ' ']).next().unwrap();
            assert!(
                announced.contains(name),
                "sample before/without its TYPE: {line:?}"
            );
        }
    }
    assert!(text.ends_with('\n'), "the exposition ends with a newline");

    // Label escaping: the raw text carries the escapes, the parser gives the name back.
    let escaped = ch
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    assert!(
        text.contains(&format!(
            "outbox_messages{{channel=\"{escaped}\",state=\"queued\"}} 1\n"
        )),
        "escaped label in the raw text:\n{text}"
    );
    assert_eq!(
        sample_value(&e, "outbox_messages", &ch, &[("state", "queued")]),
        1.0
    );
    assert_eq!(
        sample_value(&e, "outbox_messages", &ch, &[("state", "failed")]),
        1.0
    );
    assert_eq!(
        sample_value(&e, "outbox_messages", &ch, &[("state", "sending")]),
        0.0
    );
    assert_eq!(sample_value(&e, "outbox_delivered_total", &ch, &[]), 2.0);
    assert_eq!(sample_value(&e, "outbox_failed_total", &ch, &[]), 1.0);
    assert_eq!(
        sample_value(&e, "outbox_attempts_failed_total", &ch, &[]),
        1.0
    );
    assert_eq!(sample_value(&e, "outbox_error_streak", &ch, &[]), 1.0);
    assert_eq!(
        sample_value(&e, "outbox_oldest_queued_age_seconds", &ch, &[]),
        0.0,
        "the only queued message is not due"
    );
    assert_eq!(sample_value(&e, "outbox_success_rate_5m", &ch, &[]), 0.6667);
    assert_eq!(
        sample_value(
            &e,
            "outbox_alert",
            &ch,
            &[("alert", "terminal_failures"), ("severity", "critical")]
        ),
        1.0
    );

    // Every channel's figures equal outbox.metrics, one sample per channel and state.
    let mine = metrics
        .iter()
        .find(|m| m.channel == ch)
        .expect("metrics row");
    assert_eq!(
        (mine.queued, mine.failed, mine.delivered_total),
        (1, 1, 2),
        "{mine:?}"
    );
    assert_eq!(samples(&e, "outbox_messages").len(), 5 * metrics.len());
    for fam in [
        "outbox_oldest_queued_age_seconds",
        "outbox_delivered_total",
        "outbox_attempts_failed_total",
        "outbox_exhausted_total",
        "outbox_failed_total",
        "outbox_error_streak",
    ] {
        assert_eq!(
            samples(&e, fam).len(),
            metrics.len(),
            "one {fam} per channel"
        );
    }
    assert_eq!(
        samples(&e, "outbox_success_rate_5m").len(),
        metrics
            .iter()
            .filter(|m| m.success_rate_5m.is_some())
            .count()
    );
    for m in &metrics {
        for (st, n) in [
            ("queued", m.queued),
            ("sending", m.sending),
            ("uncertain", m.uncertain),
            ("exhausted", m.exhausted),
            ("failed", m.failed),
        ] {
            assert_eq!(
                sample_value(&e, "outbox_messages", &m.channel, &[("state", st)]),
                n as f64,
                "{st} of {:?}",
                m.channel
            );
        }
        let pairs = [
            ("outbox_delivered_total", m.delivered_total),
            ("outbox_attempts_failed_total", m.attempts_failed_total),
            ("outbox_exhausted_total", m.exhausted_total),
            ("outbox_failed_total", m.failed_total),
            ("outbox_error_streak", m.error_streak),
        ];
        for (fam, n) in pairs {
            assert_eq!(
                sample_value(&e, fam, &m.channel, &[]),
                n as f64,
                "{fam} of {:?}",
                m.channel
            );
        }
        assert!(close(
            sample_value(&e, "outbox_oldest_queued_age_seconds", &m.channel, &[]),
            m.oldest_queued_age_s.unwrap_or(0.0),
            1e-9
        ));
        if let Some(rate) = m.success_rate_5m {
            assert!(close(
                sample_value(&e, "outbox_success_rate_5m", &m.channel, &[]),
                rate,
                1e-9
            ));
        }
    }

    // One outbox_alert sample per alert row, same labels.
    let mut from_view: HashMap<(String, String, String), usize> = HashMap::new();
    for a in &alerts {
        *from_view
            .entry((
                a.alert.clone(),
                a.channel.clone().unwrap_or_default(),
                a.severity.clone(),
            ))
            .or_default() += 1;
    }
    let mut from_text: HashMap<(String, String, String), usize> = HashMap::new();
    let alert_samples = samples(&e, "outbox_alert");
    for (l, v) in &alert_samples {
        assert_eq!(*v, 1.0, "{l:?}");
        *from_text
            .entry((
                l["alert"].clone(),
                l["channel"].clone(),
                l["severity"].clone(),
            ))
            .or_default() += 1;
    }
    assert_eq!(
        alert_samples.len(),
        alerts.len(),
        "one sample per alert row"
    );
    assert_eq!(from_text, from_view);

    // Workers.
    let up = samples(&e, "outbox_worker_up");
    assert_eq!(up.len(), 1);
    assert!(up[0].0.is_empty(), "no labels on outbox_worker_up");
    assert_eq!(up[0].1, workers as f64);
    assert_eq!(up[0].1, 2.0, "two workers configured and running");
}

// ---------------------------------------------------------------------------------------
// 3. Counters only grow across a crash
// ---------------------------------------------------------------------------------------

fn delivered_total_from_prometheus(cluster: &Cluster, channel: &str) -> f64 {
    let mut c = cluster.connect();
    let text = prometheus_text(&mut c);
    sample_value(&parse(&text), "outbox_delivered_total", channel, &[])
}

#[test]
fn delivered_total_survives_a_crash_restart_and_keeps_counting() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let ch = unique("obs_crash");
    {
        let mut c = cluster.connect();
        create_channel(&mut c, &ch, &sim.send_url(&ch), "{}");
        let a = enqueue(&mut c, &ch, &unique("obs_crash_k"));
        wait_state(&cluster, a, "delivered");
    }
    let before = delivered_total_from_prometheus(&cluster, &ch);
    assert_eq!(before, 1.0, "one delivery counted");

    cluster.crash_restart();
    wait_for_workers(&cluster, &[]);
    assert_eq!(
        delivered_total_from_prometheus(&cluster, &ch),
        before,
        "the counter is not reset by a crash"
    );

    let mut c = cluster.connect();
    let b = enqueue(&mut c, &ch, &unique("obs_crash_k"));
    wait_state(&cluster, b, "delivered");
    // The slot/stats update commits with the delivery: read it right away.
    let after = delivered_total_from_prometheus(&cluster, &ch);
    assert_eq!(after, before + 1.0, "previous + 1, never reset");
    let m = metrics_of(&mut c, &ch);
    assert_eq!(m.delivered_total, 2, "{m:?}");
    assert_eq!(m.attempts_failed_total, 0, "{m:?}");
    assert_eq!(sim.stored(&ch).len(), 2);
    assert_eq!(sim.send_count(&ch), 2);
}

// ---------------------------------------------------------------------------------------
// 4. worker_status()
// ---------------------------------------------------------------------------------------

#[derive(Debug)]
#[allow(dead_code)]
struct WorkerRow {
    worker: i32,
    pid: Option<i32>,
    database: String,
    state: String,
    last_loop_age_s: Option<f64>,
    in_flight: i32,
    claimed_total: i64,
    delivered_total: i64,
}

fn worker_rows(c: &mut Client) -> Vec<WorkerRow> {
    c.query(
        "SELECT worker, pid, database, state,
                extract(epoch FROM clock_timestamp() - last_loop_at)::float8,
                in_flight, claimed_total, delivered_total
           FROM outbox.worker_status() ORDER BY worker",
        &[],
    )
    .expect("worker_status()")
    .iter()
    .map(|r| WorkerRow {
        worker: r.get(0),
        pid: r.get(1),
        database: r.get(2),
        state: r.get(3),
        last_loop_age_s: r.get(4),
        in_flight: r.get(5),
        claimed_total: r.get(6),
        delivered_total: r.get(7),
    })
    .collect()
}

#[test]
fn worker_status_matches_pg_stat_activity_and_counts_deliveries() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let pids = wait_for_workers(&cluster, &[]);
    let mut c = cluster.connect();

    let rows = worker_rows(&mut c);
    assert_eq!(rows.len(), 2, "one row per configured worker: {rows:#?}");
    assert_eq!(
        rows.iter().map(|r| r.worker).collect::<Vec<_>>(),
        vec![0, 1]
    );
    let mut status_pids: Vec<i32> = rows
        .iter()
        .map(|r| r.pid.expect("a running worker has a pid"))
        .collect();
    status_pids.sort_unstable();
    assert_eq!(status_pids, pids, "the same PIDs as pg_stat_activity");
    let activity = c
        .query(
            "SELECT pid, datname::text FROM pg_stat_activity
              WHERE backend_type = 'outbox_delivery worker' ORDER BY pid",
            &[],
        )
        .unwrap();
    assert_eq!(activity.len(), 2);
    for r in &activity {
        assert_eq!(r.get::<_, Option<String>>(1).as_deref(), Some("outbox"));
    }
    for r in &rows {
        assert_eq!(r.database, "outbox", "{r:?}");
        assert!(
            ["idle", "claiming", "sending", "recording"].contains(&r.state.as_str()),
            "{r:?}"
        );
        let age = r.last_loop_age_s.expect("last_loop_at is set");
        assert!(
            (-0.5..5.0).contains(&age),
            "last loop within the last few seconds: {r:?}"
        );
        assert!(r.in_flight >= 0, "{r:?}");
    }
    let delivered_before: i64 = rows.iter().map(|r| r.delivered_total).sum();
    let claimed_before: i64 = rows.iter().map(|r| r.claimed_total).sum();

    // Five deliveries.
    let sim = Simulator::start();
    let ch = unique("obs_ws");
    create_channel(&mut c, &ch, &sim.send_url(&ch), "{}");
    let ids: Vec<i64> = (0..5)
        .map(|_| enqueue(&mut c, &ch, &unique("obs_ws_k")))
        .collect();
    for &id in &ids {
        wait_state(&cluster, id, "delivered");
    }
    // The slot is updated right after the record transaction commits.
    let mut rows = Vec::new();
    let grew = wait_until(Duration::from_secs(5), || {
        rows = worker_rows(&mut c);
        rows.iter().map(|r| r.delivered_total).sum::<i64>() >= delivered_before + 5
    });
    assert!(grew, "delivered_total did not grow by 5: {rows:#?}");
    let delivered_after: i64 = rows.iter().map(|r| r.delivered_total).sum();
    let claimed_after: i64 = rows.iter().map(|r| r.claimed_total).sum();
    assert_eq!(
        delivered_after,
        delivered_before + 5,
        "exactly the five deliveries: {rows:#?}"
    );
    assert!(claimed_after >= claimed_before + 5, "{rows:#?}");
    assert_eq!(sim.stored(&ch).len(), 5);
    // Same PIDs still (nothing restarted), and they still loop.
    let mut again: Vec<i32> = rows.iter().filter_map(|r| r.pid).collect();
    again.sort_unstable();
    assert_eq!(again, pids);
}

// ---------------------------------------------------------------------------------------
// 5. pg_monitor
// ---------------------------------------------------------------------------------------

struct DropRole<'a>(&'a Cluster, &'static str);

impl Drop for DropRole<'_> {
    fn drop(&mut self) {
        let mut c = self.0.connect();
        // Close its sessions first (a direct login below), then drop it.
        let _ = c.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1",
            &[&self.1],
        );
        if let Err(e) = c.batch_execute(&format!("DROP ROLE IF EXISTS {}", self.1)) {
            eprintln!("could not drop role {}: {e}", self.1);
        }
    }
}

fn check_monitor_reads(c: &mut Client, who: &str) {
    let me: String = c
        .query_one("SELECT current_user::text", &[])
        .unwrap()
        .get(0);
    assert_eq!(me, "obs_mon", "{who}");
    let metric_rows: i64 = c
        .query_one("SELECT count(*) FROM outbox.metrics", &[])
        .unwrap_or_else(|e| panic!("{who}: SELECT FROM outbox.metrics: {e:?}"))
        .get(0);
    assert!(metric_rows >= 2, "{who}: a total row and channel rows");
    let total: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.metrics WHERE scope = 'total'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(total, 1, "{who}");
    c.query(&format!("SELECT {ALERT_COLUMNS} FROM outbox.alerts"), &[])
        .unwrap_or_else(|e| panic!("{who}: SELECT FROM outbox.alerts: {e:?}"));
    let text = c
        .query_one("SELECT outbox.prometheus()", &[])
        .unwrap_or_else(|e| panic!("{who}: SELECT outbox.prometheus(): {e:?}"))
        .get::<_, String>(0);
    let e = parse(&text);
    assert_eq!(samples(&e, "outbox_worker_up")[0].1, 2.0, "{who}");
    let err = c
        .query("SELECT * FROM outbox._messages LIMIT 1", &[])
        .expect_err("pg_monitor must not read the private message table");
    assert_eq!(
        err.code(),
        Some(&postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
        "{who}: {err:?}"
    );
}

#[test]
fn pg_monitor_reads_metrics_alerts_and_prometheus_but_not_messages() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let mut admin = cluster.connect();
    admin
        .batch_execute("DROP ROLE IF EXISTS obs_mon")
        .expect("drop a leftover obs_mon");
    let _role = DropRole(&cluster, "obs_mon");
    admin
        .batch_execute("CREATE ROLE obs_mon LOGIN IN ROLE pg_monitor")
        .expect("create obs_mon");
    // One channel at least, so that the metrics have channel rows.
    create_channel(
        &mut admin,
        &unique("obs_mon_ch"),
        "http://127.0.0.1:9/ch/none",
        "{}",
    );
    let channels_as_admin: i64 = admin
        .query_one(
            "SELECT count(*) FROM outbox.metrics WHERE scope = 'channel'",
            &[],
        )
        .unwrap()
        .get(0);

    // SET ROLE on a superuser's connection.
    let mut c = cluster.connect();
    c.batch_execute("SET ROLE obs_mon").unwrap();
    check_monitor_reads(&mut c, "SET ROLE obs_mon");
    let channels_as_monitor: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.metrics WHERE scope = 'channel'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        channels_as_monitor, channels_as_admin,
        "pg_monitor sees every channel's figures"
    );
    drop(c);

    // A session that logs in as obs_mon.
    let conninfo = cluster.conninfo().replace("user=postgres", "user=obs_mon");
    let mut m = Client::connect(&conninfo, NoTls).expect("log in as obs_mon");
    check_monitor_reads(&mut m, "login obs_mon");
    drop(m);
}

// ---------------------------------------------------------------------------------------
// 6. Cheap at scale
// ---------------------------------------------------------------------------------------

struct DeleteBacklog<'a> {
    cluster: &'a Cluster,
    channel_id: i32,
}

impl Drop for DeleteBacklog<'_> {
    fn drop(&mut self) {
        let mut c = self.cluster.connect();
        if let Err(e) = c.execute(
            "DELETE FROM outbox._messages WHERE channel_id = $1",
            &[&self.channel_id],
        ) {
            eprintln!("could not delete the backlog: {e}");
        }
        let _ = c.batch_execute("VACUUM ANALYZE outbox._messages");
    }
}

/// Every plan node that reads `relation`: (node type, index name, filter).
type Scan = (String, Option<String>, Option<String>);

fn scans_of(plan: &serde_json::Value, relation: &str, out: &mut Vec<Scan>) {
    match plan {
        serde_json::Value::Object(o) => {
            if o.get("Relation Name").and_then(|v| v.as_str()) == Some(relation) {
                out.push((
                    o["Node Type"].as_str().unwrap_or("?").to_string(),
                    o.get("Index Name")
                        .and_then(|v| v.as_str())
                        .map(String::from),
                    o.get("Filter").and_then(|v| v.as_str()).map(String::from),
                ));
            }
            for v in o.values() {
                scans_of(v, relation, out);
            }
        }
        serde_json::Value::Array(a) => {
            for v in a {
                scans_of(v, relation, out);
            }
        }
        _ => {}
    }
}

fn explain(c: &mut Client, query: &str) -> serde_json::Value {
    let msgs = c
        .simple_query(&format!("EXPLAIN (FORMAT JSON) {query}"))
        .expect("EXPLAIN");
    let text = msgs
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(r) => r.get(0).map(String::from),
            _ => None,
        })
        .expect("a plan");
    serde_json::from_str(&text).expect("JSON plan")
}

/// Creates a paused channel holding 200,000 due queued messages (one `INSERT ... SELECT`,
/// due for an hour), runs `VACUUM ANALYZE outbox._messages`, checks the figures and that
/// the paused channel raises no `queue_age` alert, and returns every `_messages` scan of
/// `EXPLAIN (FORMAT JSON) SELECT * FROM outbox.metrics`.
fn backlog_scans(c: &mut Client, ch: &str, channel_id: i32) -> Vec<Scan> {
    let n = c
        .execute(
            "INSERT INTO outbox._messages (channel_id, effect_key, payload, next_attempt_at)
             SELECT $1, $2::text || '-' || g, '{}'::jsonb, now() - interval '1 hour' + g * interval '1 ms'
               FROM generate_series(1, 200000) g",
            &[&channel_id, &ch],
        )
        .expect("insert the backlog");
    assert_eq!(n, 200_000);
    c.batch_execute("VACUUM ANALYZE outbox._messages").unwrap();

    // The figures at that backlog; a paused channel raises no queue_age alert even though
    // its head is far over the default threshold (300 s).
    let m = metrics_of(c, ch);
    assert_eq!(m.queued, 200_000, "{m:?}");
    assert!(m.paused, "{m:?}");
    let age = m.oldest_queued_age_s.expect("a due head");
    assert!((3599.0..3700.0).contains(&age), "{m:?}");
    let rows = alerts_of(c, ch);
    assert!(
        rows.is_empty(),
        "a paused channel raises no queue_age alert: {rows:?}"
    );
    let total_queued: i64 = c
        .query_one(
            "SELECT queued FROM outbox.metrics WHERE scope = 'total'",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(total_queued >= 200_000);

    let plan = explain(c, "SELECT * FROM outbox.metrics");
    let mut scans = Vec::new();
    scans_of(&plan, "_messages", &mut scans);
    assert!(!scans.is_empty(), "the plan reads _messages: {plan:#}");
    scans
}

fn paused_channel(c: &mut Client, ch: &str) -> i32 {
    create_channel(c, ch, "http://127.0.0.1:9/ch/scale", "{}");
    c.execute(
        "SELECT outbox.pause_channel($1, 'obs test: backlog for EXPLAIN')",
        &[&ch],
    )
    .unwrap();
    c.query_one("SELECT id FROM outbox._channels WHERE name = $1", &[&ch])
        .unwrap()
        .get(0)
}

/// Drops a scratch database, whatever happens.
struct DropDb<'a>(&'a Cluster, String);

impl Drop for DropDb<'_> {
    fn drop(&mut self) {
        let mut c = self.0.connect();
        if let Err(e) = c.batch_execute(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.1))
        {
            eprintln!("could not drop database {}: {e}", self.1);
        }
    }
}

/// At a backlog of 200,000 queued messages `outbox.metrics` reads `_messages` through its
/// indexes only (index, index-only or bitmap scans), never a `Seq Scan`: checked in the test database (whatever else it holds;
/// the plan there depends on what ANALYZE samples of the other channels) and in a scratch
/// database shaped like a small install (three channels, all messages on the paused one),
/// where the outcome does not depend on sampling.
#[test]
fn metrics_use_indexes_only_at_a_backlog_of_200k() {
    let _serial = serial();
    let cluster = Cluster::from_env();

    // The test database, as the other tests left it.
    let mut c = cluster.connect();
    let ch = unique("obs_scale");
    let channel_id = paused_channel(&mut c, &ch);
    let main_scans = {
        let _cleanup = DeleteBacklog {
            cluster: &cluster,
            channel_id,
        };
        backlog_scans(&mut c, &ch, channel_id)
    };

    // A small install: three channels, only the paused one holds messages (the backlog).
    // The planner's estimate per channel is then the whole table, whatever ANALYZE samples.
    let db = unique("obs_scale_db");
    c.batch_execute(&format!("CREATE DATABASE {db}"))
        .expect("create a scratch database");
    let _drop_db = DropDb(&cluster, db.clone());
    let mut s = Client::connect(
        &cluster
            .conninfo()
            .replace(&format!("dbname={}", cluster.db), &format!("dbname={db}")),
        NoTls,
    )
    .expect("connect to the scratch database");
    s.batch_execute("CREATE EXTENSION outbox_delivery")
        .expect("CREATE EXTENSION in the scratch database");
    for other in ["mail", "sms"] {
        create_channel(&mut s, other, "http://127.0.0.1:9/ch/other", "{}");
    }
    let backlog_id = paused_channel(&mut s, "backlog");
    let small_scans = backlog_scans(&mut s, "backlog", backlog_id);
    drop(s);

    for (where_, scans) in [
        ("test database", &main_scans),
        ("small install", &small_scans),
    ] {
        for (node, index, filter) in scans {
            assert!(
                // A bitmap heap scan is driven by one of the table's indexes too.
                ["Index Scan", "Index Only Scan", "Bitmap Heap Scan"].contains(&node.as_str()),
                "{where_}: outbox.metrics reads _messages with a {node} (index {index:?}, filter \
                 {filter:?}) at a backlog of 200,000 queued messages, not an index scan; every \
                 _messages scan: {scans:?}"
            );
        }
    }
}

/// The worker's own writes reach the statistics autovacuum reads. A background worker
/// must report them itself; before it did, `_attempts` and `_ledger` (written only by the
/// worker) showed no rows at all in `pg_stat_user_tables`, autovacuum never processed them,
/// and under a steady load with retention both grew without bound.
#[test]
fn worker_writes_reach_the_statistics_autovacuum_reads() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let mut c = cluster.connect();
    let counts = |c: &mut Client| -> HashMap<String, (i64, i64)> {
        c.query(
            "SELECT relname::text, n_tup_ins, n_tup_upd FROM pg_stat_user_tables
              WHERE schemaname = 'outbox' AND relname IN ('_attempts', '_ledger', '_channel_stats')",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect()
    };
    let before = counts(&mut c);

    let sim = Simulator::start();
    let ch = unique("obs_stats");
    create_channel(&mut c, &ch, &sim.send_url(&ch), "{}");
    const N: i64 = 40;
    let last = (0..N)
        .map(|i| enqueue(&mut c, &ch, &format!("{ch}-{i}")))
        .last()
        .unwrap();
    wait_state(&cluster, last, "delivered");
    assert!(
        sim.wait_for_sends(&ch, N as usize, SETTLE),
        "the provider did not receive {N} messages"
    );

    // Unforced reports flush at most once a second; the worker forces one before it idles.
    let mut now = HashMap::new();
    let reported = wait_until(Duration::from_secs(15), || {
        now = counts(&mut c);
        let grew =
            |t: &str, f: fn(&(i64, i64)) -> i64| f(&now[t]) - before.get(t).map(f).unwrap_or(0);
        grew("_attempts", |x| x.0) >= N
            && grew("_attempts", |x| x.1) >= N
            && grew("_ledger", |x| x.0) >= N
            && grew("_channel_stats", |x| x.0 + x.1) >= 1
    });
    assert!(
        reported,
        "the worker delivered {N} messages but pg_stat_user_tables does not show its writes \
         (inserts, updates): before {before:?}, now {now:?}"
    );
}
