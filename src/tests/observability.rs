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
