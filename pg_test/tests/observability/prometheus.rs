//! Sections 2 and 3: the Prometheus exposition, parsed, and counters that only grow across
//! a crash.

use super::*;

// ---------------------------------------------------------------------------------------
// 2. The Prometheus exposition, parsed
// ---------------------------------------------------------------------------------------

const FAMILIES: [(&str, PrometheusType); 14] = [
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
    ("outbox_queued", PrometheusType::Gauge),
    ("outbox_channel_paused", PrometheusType::Gauge),
    ("outbox_send_duration_seconds", PrometheusType::Histogram),
    ("outbox_delivery_latency_seconds", PrometheusType::Histogram),
];

/// Real traffic on a channel whose name holds a `"`, a `\` and a newline, then
/// `outbox.prometheus()` parsed by `openmetrics-parser`: it parses; every family has one
/// HELP and one TYPE line; `*_total` are counters; label values round-trip; every figure
/// equals `outbox.metrics` and `outbox.alerts` read in the same snapshot.
#[test]
fn prometheus_exposition_parses_and_matches_metrics_and_alerts() {
    let _serial = serial();
    let (cluster, mut c, sim) = cluster_and_sim();
    wait_for_workers(&cluster, &[]);
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
    let later: i64 = one(
        &mut c,
        "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text, NULL, now() + interval '1 hour')",
        &[&ch, &unique("obs_prom_later")],
    );

    // One snapshot: the text, the metrics and the alerts it was made from.
    let (text, metrics, alerts, workers) = {
        let mut tx = snapshot(&mut c);
        let text = prometheus_text(&mut tx);
        let metrics = all_channel_metrics(&mut tx);
        let alerts: Vec<AlertRow> = tx
            .query(&format!("SELECT {ALERT_COLUMNS} FROM outbox.alerts"), &[])
            .unwrap()
            .iter()
            .map(alert_row)
            .collect();
        let workers = count(
            &mut tx,
            "SELECT count(*) FROM outbox.worker_status() WHERE pid IS NOT NULL",
            &[],
        );
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
            // A histogram's samples are its name with _bucket, _sum or _count.
            let name = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| {
                    name.strip_suffix(suffix)
                        .filter(|family| announced.contains(*family))
                })
                .unwrap_or(name);
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

    latency_histograms_count_the_sends_and_deliveries(&e, &ch, &metrics);

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

/// The latency histograms of `ch` after three sends (two delivered, one refused) and two
/// deliveries: cumulative buckets ending in +Inf at the count, a sum, and the 5-minute
/// quantiles of `outbox.metrics`.
fn latency_histograms_count_the_sends_and_deliveries(
    e: &Exposition,
    ch: &str,
    metrics: &[MetricsRow],
) {
    // Latency: three sends (two delivered, one refused), two deliveries; the buckets
    // cumulative and ending in +Inf at the count.
    for (family, count) in [
        ("outbox_send_duration_seconds", 3),
        ("outbox_delivery_latency_seconds", 2),
    ] {
        let h = histogram(e, family, ch);
        assert_eq!(h.count, Some(count), "{family}: {h:?}");
        let counts: Vec<f64> = h.buckets.iter().map(|b| b.count.as_f64()).collect();
        assert!(
            counts.windows(2).all(|w| w[0] <= w[1]),
            "{family}: {counts:?}"
        );
        let last = h.buckets.last().expect("buckets");
        assert!(last.upper_bound.is_infinite(), "{family}: {h:?}");
        assert_eq!(last.count.as_f64(), count as f64, "{family}: {h:?}");
        assert!(
            h.sum.as_ref().is_some_and(|s| s.as_f64() >= 0.0),
            "{family}: {h:?}"
        );
    }
    let mine = metrics
        .iter()
        .find(|m| m.channel == ch)
        .expect("metrics row");
    assert!(
        mine.send_p99_ms.is_some() && mine.delivery_p50_ms.is_some(),
        "5-minute quantiles of a channel with sends: {mine:?}"
    );
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
