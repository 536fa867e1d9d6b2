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
    cluster_and_sim, count, create_channel, enqueue, ledger_recorded_by, one, serial,
    set_setting_seen, sim_channel, wait_state, SettingsGuard, SETTLE,
};
use outbox_e2e::sim::{Action, Simulator};
use postgres::{Client, IsolationLevel, NoTls, SimpleQueryMessage};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

// The tests, by area (numbered as in the sections).
mod alerts;
mod prometheus;
mod scale;
mod worker_status;

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

/// Waits until `alert` shows for channel `ch`; panics with the alerts last seen.
fn wait_for_alert(c: &mut Client, ch: &str, alert: &str, timeout: Duration) {
    let mut seen: Vec<AlertRow> = Vec::new();
    let raised = wait_until(timeout, || {
        seen = alerts_of(c, ch);
        seen.iter().any(|a| a.alert == alert)
    });
    assert!(raised, "no {alert} alert for {ch}; alerts: {seen:?}");
}

/// A repeatable-read transaction: what it reads is one snapshot, at one `now()`.
fn snapshot(c: &mut Client) -> postgres::Transaction<'_> {
    c.build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .start()
        .unwrap()
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
    send_p99_ms: Option<f64>,
    delivery_p50_ms: Option<f64>,
}

const METRICS_COLUMNS: &str = "channel, queued, sending, uncertain, exhausted, failed,
    oldest_queued_age_s::float8, success_rate_5m::float8, error_streak::int8,
    exhausted_total, delivered_total, attempts_failed_total, failed_total,
    extract(epoch FROM now() - error_streak_since)::float8, paused, send_p99_ms::float8,
    delivery_p50_ms::float8";

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
        send_p99_ms: r.get(15),
        delivery_p50_ms: r.get(16),
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

/// The histogram of `family` whose `channel` label is `channel`; panics unless exactly one.
fn histogram(e: &Exposition, family: &str, channel: &str) -> openmetrics_parser::HistogramValue {
    let f = e
        .families
        .get(family)
        .unwrap_or_else(|| panic!("family {family} missing from the exposition"));
    let hits: Vec<_> = f
        .iter_samples()
        .filter(|s| {
            s.get_labelset()
                .ok()
                .and_then(|l| l.get_label_value("channel").map(|v| v == channel))
                .unwrap_or(false)
        })
        .map(|s| match &s.value {
            PrometheusValue::Histogram(h) => h.clone(),
            other => panic!("{family}: not a histogram: {other:?}"),
        })
        .collect();
    assert_eq!(hits.len(), 1, "{family}{{channel={channel:?}}}: {hits:?}");
    hits.into_iter().next().unwrap()
}

fn close(a: f64, b: f64, eps: f64) -> bool {
    (a - b).abs() <= eps
}
