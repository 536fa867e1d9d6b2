// `#[pg_test]`s of metrics, alerts and the Prometheus text: each alert condition raised
// and cleared, figures matching the messages.

fn obs_channel(name: &str, options: &str) {
    Spi::run(&format!("SELECT outbox.create_channel('{name}', 'http://127.0.0.1:9/ch/{name}', '{options}')")).unwrap();
}

fn obs_enqueue(channel: &str, key: &str) -> i64 {
    Spi::get_one::<i64>(&format!("SELECT outbox.enqueue('{channel}', '{{}}', '{key}')")).unwrap().unwrap()
}

fn alerts(alert: &str, channel: &str) -> i64 {
    Spi::get_one::<i64>(&format!("SELECT count(*) FROM outbox.alerts WHERE alert = '{alert}' AND channel = '{channel}'"))
        .unwrap()
        .unwrap()
}

#[pg_test]
fn metrics_count_states_per_channel_and_in_total() {
    obs_channel("m1", "{}");
    obs_channel("m2", "{}");
    let a = obs_enqueue("m1", "m1-a");
    obs_enqueue("m1", "m1-b");
    let c = obs_enqueue("m2", "m2-a");
    Spi::run(&format!("UPDATE outbox._messages SET state = 'failed' WHERE id = {a}")).unwrap();
    Spi::run(&format!("UPDATE outbox._messages SET state = 'uncertain' WHERE id = {c}")).unwrap();
    let (queued, failed) = Spi::get_two::<i64, i64>("SELECT queued, failed FROM outbox.metrics WHERE channel = 'm1'").unwrap();
    assert_eq!((queued, failed), (Some(1), Some(1)));
    let (uncertain, scope) =
        Spi::get_two::<i64, String>("SELECT uncertain, scope FROM outbox.metrics WHERE channel = 'm2'").unwrap();
    assert_eq!((uncertain, scope.as_deref()), (Some(1), Some("channel")));
    let (tq, tf, tu) = Spi::get_three::<i64, i64, i64>("SELECT queued, failed, uncertain FROM outbox.metrics WHERE scope = 'total'").unwrap();
    assert_eq!((tq, tf, tu), (Some(1), Some(1), Some(1)));
}

#[pg_test]
fn a_generation_of_the_ledger_whose_emptying_is_put_off_five_minutes_raises_an_alert() {
    let raised = || {
        Spi::get_one::<i64>("SELECT count(*) FROM outbox.alerts WHERE alert = 'ledger_retention_deferred' AND channel IS NULL")
            .unwrap()
            .unwrap()
    };
    Spi::run("INSERT INTO outbox._ledger_generations (generation, opened_at, closed_at, emptying_deferred_since)
              VALUES (1, now() - interval '3 days', now() - interval '2 days', now() - interval '4 minutes')").unwrap();
    assert_eq!(raised(), 0, "not before five minutes");
    Spi::run("UPDATE outbox._ledger_generations SET emptying_deferred_since = now() - interval '6 minutes' WHERE generation = 1").unwrap();
    assert_eq!(raised(), 1);
    let text = Spi::get_one::<String>("SELECT outbox.prometheus()").unwrap().unwrap();
    assert!(text.contains(r#"outbox_alert{alert="ledger_retention_deferred",channel="",severity="warning"} 1"#), "{text}");
    // Emptied at last: its row goes, and the alert with it.
    Spi::run("DELETE FROM outbox._ledger_generations WHERE generation = 1").unwrap();
    assert_eq!(raised(), 0);
}

#[pg_test]
fn each_alert_is_raised_and_cleared() {
    obs_channel("al", "{}");
    obs_channel("al_rc", r#"{"reconcile": {"url": "http://127.0.0.1:9/m/{effect_key}"}}"#);
    // Queue age: a due message that has waited an hour.
    let q = obs_enqueue("al", "al-q");
    assert_eq!(alerts("queue_age", "al"), 0);
    Spi::run(&format!("UPDATE outbox._messages SET next_attempt_at = now() - interval '1 hour' WHERE id = {q}")).unwrap();
    assert_eq!(alerts("queue_age", "al"), 1);
    let since = Spi::get_one::<bool>("SELECT since < now() - interval '59 minutes' FROM outbox.alerts WHERE alert = 'queue_age' AND channel = 'al'").unwrap();
    assert_eq!(since, Some(true));
    Spi::run(&format!("UPDATE outbox._messages SET state = 'delivered' WHERE id = {q}")).unwrap();
    assert_eq!(alerts("queue_age", "al"), 0);
    // Error streak.
    Spi::run("INSERT INTO outbox._channel_stats (channel_id, error_streak, error_streak_since) SELECT id, 10, now() FROM outbox._channels WHERE name = 'al'").unwrap();
    assert_eq!(alerts("error_streak", "al"), 1);
    Spi::run("UPDATE outbox._channel_stats SET error_streak = 0 WHERE channel_id = (SELECT id FROM outbox._channels WHERE name = 'al')").unwrap();
    assert_eq!(alerts("error_streak", "al"), 0);
    // Terminal failures in the last hour.
    let f = obs_enqueue("al", "al-f");
    Spi::run(&format!("UPDATE outbox._messages SET state = 'exhausted' WHERE id = {f}")).unwrap();
    assert_eq!(alerts("terminal_failures", "al"), 1);
    Spi::run(&format!("SELECT outbox.cancel({f}, 'handled')")).unwrap();
    assert_eq!(alerts("terminal_failures", "al"), 0);
    // Uncertain: at once without reconcile, only when old with it.
    let u = obs_enqueue("al", "al-u");
    let r = obs_enqueue("al_rc", "al-r");
    Spi::run(&format!("UPDATE outbox._messages SET state = 'uncertain' WHERE id IN ({u}, {r})")).unwrap();
    assert_eq!(alerts("uncertain", "al"), 1);
    assert_eq!(alerts("uncertain", "al_rc"), 0);
    Spi::run(&format!("UPDATE outbox._messages SET updated_at = now() - interval '1 hour' WHERE id = {r}")).unwrap();
    assert_eq!(alerts("uncertain", "al_rc"), 1);
    Spi::run(&format!("SELECT outbox.resolve({u}, 'failed', 'provider confirmed it never arrived')")).unwrap();
    assert_eq!(alerts("uncertain", "al"), 0);
    Spi::run(&format!("SELECT outbox.resolve({r}, 'failed', 'provider confirmed it never arrived')")).unwrap();
    assert_eq!(alerts("uncertain", "al_rc"), 0);
    // With reconcile, the age counts from the send that left the message uncertain: the
    // inconclusive lookups since change the row, not how long nobody has known.
    let s = obs_enqueue("al_rc", "al-s");
    Spi::run(&format!("UPDATE outbox._messages SET state = 'uncertain' WHERE id = {s}")).unwrap();
    Spi::run(&format!(
        "INSERT INTO outbox._attempts (message_id, tenant, attempt, kind, started_at, finished_at, outcome)
         VALUES ({s}, 'default', 1, 'send', now() - interval '1 minute', now() - interval '1 minute', 'ambiguous'),
                ({s}, 'default', 1, 'reconcile', now(), now(), 'unavailable')"
    ))
    .unwrap();
    assert_eq!(alerts("uncertain", "al_rc"), 0);
    Spi::run(&format!(
        "UPDATE outbox._attempts SET started_at = now() - interval '1 hour', finished_at = now() - interval '1 hour'
          WHERE message_id = {s} AND kind = 'send'"
    ))
    .unwrap();
    assert_eq!(alerts("uncertain", "al_rc"), 1);
    let since = Spi::get_one::<bool>("SELECT since < now() - interval '59 minutes' FROM outbox.alerts WHERE alert = 'uncertain' AND channel = 'al_rc'").unwrap();
    assert_eq!(since, Some(true));
}

#[pg_test]
fn prometheus_text_has_families_and_samples() {
    obs_channel("pr\"om", "{}");
    obs_enqueue("pr\"om", "p-1");
    let text = Spi::get_one::<String>("SELECT outbox.prometheus()").unwrap().unwrap();
    assert!(text.ends_with('\n'));
    assert!(text.contains("# HELP outbox_messages "));
    assert!(text.contains("# TYPE outbox_delivered_total counter"));
    assert!(text.contains("outbox_messages{channel=\"pr\\\"om\",state=\"queued\"} 1"), "{text}");
    // Every family's TYPE line comes before its samples.
    let type_at = text.find("# TYPE outbox_messages gauge").unwrap();
    let sample_at = text.find("outbox_messages{").unwrap();
    assert!(type_at < sample_at);
}

#[pg_test]
fn the_sql_latency_buckets_and_quantiles_are_the_workers() {
    use crate::metrics::latency::{quantile_ms, BOUNDS_MS, BUCKETS};
    let bounds = Spi::get_one::<Vec<i64>>("SELECT outbox._latency_bounds_ms()").unwrap().unwrap();
    assert_eq!(bounds, BOUNDS_MS.to_vec());
    let mut x: u64 = 11;
    let mut next = || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        x >> 33
    };
    let mut cases: Vec<Vec<i64>> = vec![vec![0; BUCKETS], vec![], vec![3], {
        let mut c = vec![0; BUCKETS];
        c[BUCKETS - 1] = 4;
        c
    }];
    for _ in 0..40 {
        cases.push((0..BUCKETS).map(|_| if next() % 3 == 0 { (next() % 50) as i64 } else { 0 }).collect());
    }
    for counts in cases {
        for q in [0.0, 0.01, 0.5, 0.95, 0.99, 1.0] {
            let sql = Spi::get_one_with_args::<f64>(
                "SELECT outbox._quantile_ms($1, $2)::float8",
                &[counts.clone().into(), q.into()],
            )
            .unwrap();
            let rust = quantile_ms(&counts, q);
            match (sql, rust) {
                (None, None) => {}
                (Some(a), Some(b)) => assert!((a - b).abs() < 1e-6, "{counts:?} q {q}: SQL {a}, Rust {b}"),
                other => panic!("{counts:?} q {q}: {other:?}"),
            }
        }
    }
    let added = Spi::get_one::<Vec<i64>>("SELECT outbox._add_counts('{1,2}', '{10,20,30}')").unwrap().unwrap();
    assert_eq!(added, vec![11, 22, 30]);
    let summed = Spi::get_one::<Vec<i64>>(
        "SELECT outbox._counts_sum(c) FROM (VALUES ('{1,1}'::bigint[]), (NULL), ('{0,2,5}')) AS v(c)",
    )
    .unwrap()
    .unwrap();
    assert_eq!(summed, vec![1, 3, 5]);
}

#[pg_test]
fn latency_shows_as_histograms_and_five_minute_quantiles() {
    obs_channel("lat1", "{}");
    let id = Spi::get_one::<i32>("SELECT id FROM outbox._channels WHERE name = 'lat1'").unwrap().unwrap();
    // 90 sends of up to 5 ms and 10 of up to 2.5 s; 100 deliveries, of which 4 after an hour.
    let mut send = [0i64; crate::metrics::latency::BUCKETS];
    send[0] = 90;
    send[crate::metrics::latency::bucket_of(2_000)] = 10;
    let mut delivery = [0i64; crate::metrics::latency::BUCKETS];
    delivery[crate::metrics::latency::bucket_of(40)] = 96;
    delivery[crate::metrics::latency::BUCKETS - 1] = 4;
    Spi::run_with_args(
        "INSERT INTO outbox._channel_stats (channel_id, delivered_total, send_ms_counts, send_ms_sum,
                                            delivery_ms_counts, delivery_ms_sum)
         VALUES ($1, 100, $2, 20450, $3, 14404000);
         ",
        &[id.into(), send.to_vec().into(), delivery.to_vec().into()],
    )
    .unwrap();
    // The 5-minute figures: two minutes' rows add up; one older than 5 minutes does not count.
    Spi::run_with_args(
        "INSERT INTO outbox._channel_minutes (channel_id, minute, send_ms_counts, delivery_ms_counts)
         VALUES ($1, date_trunc('minute', now()), $2, $3),
                ($1, date_trunc('minute', now()) - interval '1 minute', $2, $3),
                ($1, date_trunc('minute', now()) - interval '10 minutes', '{0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,500}', '{}')",
        &[id.into(), send.to_vec().into(), delivery.to_vec().into()],
    )
    .unwrap();
    let row = Spi::get_three::<pgrx::AnyNumeric, pgrx::AnyNumeric, pgrx::AnyNumeric>(
        "SELECT send_p50_ms, send_p95_ms, send_p99_ms FROM outbox.metrics WHERE channel = 'lat1'",
    )
    .unwrap();
    let f = |n: Option<pgrx::AnyNumeric>| n.map(|n| n.to_string());
    assert_eq!(
        (f(row.0), f(row.1), f(row.2)),
        (Some("2.8".into()), Some("1750.0".into()), Some("2350.0".into())),
        "p50 inside (0, 5], p95 and p99 inside (1000, 2500]"
    );
    let p99 = Spi::get_one::<pgrx::AnyNumeric>("SELECT delivery_p99_ms FROM outbox.metrics WHERE scope = 'total'")
        .unwrap()
        .map(|n| n.to_string());
    assert_eq!(p99, Some("3600000.0".into()), "a rank in +Inf is the highest bound");
    let text = Spi::get_one::<String>("SELECT outbox.prometheus()").unwrap().unwrap();
    for line in [
        "# TYPE outbox_send_duration_seconds histogram",
        "outbox_send_duration_seconds_bucket{channel=\"lat1\",le=\"0.005\"} 90",
        "outbox_send_duration_seconds_bucket{channel=\"lat1\",le=\"1\"} 90",
        "outbox_send_duration_seconds_bucket{channel=\"lat1\",le=\"2.5\"} 100",
        "outbox_send_duration_seconds_bucket{channel=\"lat1\",le=\"+Inf\"} 100",
        "outbox_send_duration_seconds_sum{channel=\"lat1\"} 20.45",
        "outbox_send_duration_seconds_count{channel=\"lat1\"} 100",
        "# TYPE outbox_delivery_latency_seconds histogram",
        "outbox_delivery_latency_seconds_bucket{channel=\"lat1\",le=\"0.05\"} 96",
        "outbox_delivery_latency_seconds_bucket{channel=\"lat1\",le=\"3600\"} 96",
        "outbox_delivery_latency_seconds_bucket{channel=\"lat1\",le=\"+Inf\"} 100",
        "outbox_delivery_latency_seconds_sum{channel=\"lat1\"} 14404",
    ] {
        assert!(text.lines().any(|l| l == line), "no line {line:?} in:\n{text}");
    }
    // The buckets of a histogram come in the order of their bounds.
    let les: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("outbox_send_duration_seconds_bucket{channel=\"lat1\""))
        .map(|l| l.split("le=\"").nth(1).unwrap().split('"').next().unwrap())
        .collect();
    assert_eq!(les.len(), crate::metrics::latency::BUCKETS);
    assert_eq!(les.first(), Some(&"0.005"));
    assert_eq!(les.last(), Some(&"+Inf"));
}
