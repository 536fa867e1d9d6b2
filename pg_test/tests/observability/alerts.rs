//! Section 1: alerts raised by real traffic, then cleared.

use super::*;

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
    wait_for_alert(&mut c, &ch, "queue_age", Duration::from_secs(10));

    // Read alert, metrics and the oldest due queued message in one snapshot (one now()).
    {
        let mut tx = snapshot(&mut c);
        let rows = alerts_of(&mut tx, &ch);
        let qa: Vec<&AlertRow> = rows.iter().filter(|a| a.alert == "queue_age").collect();
        let m = metrics_of(&mut tx, &ch);
        let head: Option<f64> = one(
            &mut tx,
            "SELECT extract(epoch FROM now() - min(m.next_attempt_at))::float8
                   FROM outbox.messages m
                  WHERE m.channel = $1 AND m.state = 'queued' AND m.next_attempt_at <= now()",
            &[&ch],
        );
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
    let ch = sim_channel(
        &mut c,
        &sim,
        "obs_streak",
        r#"{"retry": {"base_ms": 100, "max_ms": 300, "jitter": "none", "max_attempts": 100}}"#,
    );
    sim.set_default(&ch, Action::Status(503));
    let id = enqueue(&mut c, &ch, &unique("obs_streak_k"));

    wait_for_alert(&mut c, &ch, "error_streak", SETTLE);
    {
        let mut tx = snapshot(&mut c);
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
    let attempts = count(
        &mut c,
        "SELECT count(*) FROM outbox.attempts WHERE message_id = $1 AND kind = 'send'",
        &[&id],
    );
    assert_eq!(attempts, sends, "one attempt row per request");
}

/// A 401 fails the message at once: one critical `terminal_failures` alert (value 1, since
/// = the message's last change); `outbox.cancel` clears it, the `failed_total` counter stays.
#[test]
fn terminal_failure_alert_on_401_clears_on_cancel() {
    let _serial = serial();
    let (cluster, mut c, sim) = cluster_and_sim();
    wait_for_workers(&cluster, &[]);
    let ch = sim_channel(&mut c, &sim, "obs_term", "{}");
    sim.set_plan(&ch, vec![Action::Status(401)]);
    let id = enqueue(&mut c, &ch, &unique("obs_term_k"));
    wait_state(&cluster, id, "failed");

    let (rows, updated_age): (Vec<AlertRow>, f64) = {
        let mut tx = snapshot(&mut c);
        let rows = alerts_of(&mut tx, &ch);
        let age: f64 = one(&mut tx, "SELECT extract(epoch FROM now() - updated_at)::float8 FROM outbox._messages WHERE id = $1", &[&id]);
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
    let (cluster, mut c, sim) = cluster_and_sim();
    wait_for_workers(&cluster, &[]);
    let ch = sim_channel(&mut c, &sim, "obs_unc", "{}");
    sim.set_plan(&ch, vec![Action::DropAfterRead { store: true }]);
    let id = enqueue(&mut c, &ch, &unique("obs_unc_k"));
    wait_state(&cluster, id, "uncertain");

    let rows = alerts_of(&mut c, &ch);
    assert_eq!(rows.len(), 1, "exactly one alert: {rows:?}");
    let a = &rows[0];
    assert_eq!(a.alert, "uncertain");
    assert_eq!(a.severity, "critical");
    assert_eq!(a.value, 1.0);
    let threshold: i32 = one(
        &mut c,
        "SELECT current_setting('outbox.alert_uncertain_age_s')::int",
        &[],
    );
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

    let after: String = one(
        &mut c,
        "SELECT outbox.resolve($1, 'delivered', 'obs test: seen in the provider console')::text",
        &[&id],
    );
    assert_eq!(after, "delivered");
    let rows = alerts_of(&mut c, &ch);
    assert!(rows.is_empty(), "alert gone after resolve: {rows:?}");
    assert_eq!(metrics_of(&mut c, &ch).uncertain, 0);
    let by = ledger_recorded_by(&mut c, id);
    assert_eq!(by, "operator");
    assert_eq!(sim.send_count(&ch), 1, "resolve sends nothing");
}

/// A paused channel raises no queue_age alert (its messages wait by design), so a channel
/// left paused is its own alert, `channel_paused`, after `outbox.alert_paused_s`; /metrics
/// shows `outbox_channel_paused` 1 meanwhile. Resuming clears both.
#[test]
fn a_channel_left_paused_raises_channel_paused_and_the_gauge_shows_it() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let _settings = SettingsGuard::new(&cluster, &["outbox.alert_paused_s"]);
    let mut c = cluster.connect();
    set_setting_seen(&mut c, "outbox.alert_paused_s", "1");
    let sim = Simulator::start();
    let ch = unique("obs_paused");
    create_channel(&mut c, &ch, &sim.send_url(&ch), "{}");
    let gauge = |c: &mut Client| {
        let text = prometheus_text(c);
        let e = parse(&text);
        sample_value(&e, "outbox_channel_paused", &ch, &[])
    };
    assert_eq!(gauge(&mut c), 0.0, "not paused");
    c.execute(
        "SELECT outbox.pause_channel($1, 'provider maintenance')",
        &[&ch],
    )
    .unwrap();
    assert_eq!(gauge(&mut c), 1.0, "paused");
    assert!(
        !alerts_of(&mut c, &ch)
            .iter()
            .any(|a| a.alert == "channel_paused"),
        "not before outbox.alert_paused_s"
    );
    wait_for_alert(&mut c, &ch, "channel_paused", Duration::from_secs(10));
    let row = alerts_of(&mut c, &ch)
        .into_iter()
        .find(|a| a.alert == "channel_paused")
        .unwrap();
    assert_eq!(row.severity, "warning");
    c.execute("SELECT outbox.resume_channel($1)", &[&ch])
        .unwrap();
    assert!(
        !alerts_of(&mut c, &ch)
            .iter()
            .any(|a| a.alert == "channel_paused"),
        "cleared by the resume"
    );
    assert_eq!(gauge(&mut c), 0.0, "resumed");
}

/// `CREATE EXTENSION` in a database that `outbox.database` does not list succeeds (the
/// extension's tables are usable), but nothing enqueued there would ever be delivered: it
/// says so with a WARNING naming the setting, and `outbox.alerts` raises
/// `database_not_served` there, and not in a served database.
#[test]
fn create_extension_in_a_database_no_worker_serves_warns_and_raises_an_alert() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.alerts WHERE alert = 'database_not_served'",
            &[]
        ),
        0,
        "the served database raises none"
    );
    let db = unique("unserved");
    c.batch_execute(&format!("CREATE DATABASE {db}")).unwrap();
    struct DropDb<'a>(&'a mut Client, String);
    impl Drop for DropDb<'_> {
        fn drop(&mut self) {
            let _ = self
                .0
                .batch_execute(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.1));
        }
    }
    let _drop = DropDb(&mut c, db.clone());
    let notices = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = notices.clone();
    let mut config: postgres::Config = cluster.conninfo_for(&db).parse().unwrap();
    config.notice_callback(move |n| sink.lock().unwrap().push(n));
    let mut other = config.connect(NoTls).unwrap();
    other
        .batch_execute("CREATE EXTENSION outbox_delivery CASCADE")
        .unwrap();
    let warned: Vec<String> = notices
        .lock()
        .unwrap()
        .iter()
        .filter(|n| n.severity() == "WARNING")
        .map(|n| format!("{} | {:?} | {:?}", n.message(), n.detail(), n.hint()))
        .collect();
    assert!(
        warned
            .iter()
            .any(|w| w.contains("no delivery worker serves this database")
                && w.contains("outbox.database")),
        "the warning: {warned:?}"
    );
    let raised: Vec<String> = other
        .query("SELECT alert, severity FROM outbox.alerts", &[])
        .unwrap()
        .iter()
        .map(|r| format!("{}/{}", r.get::<_, String>(0), r.get::<_, String>(1)))
        .collect();
    assert_eq!(raised, vec!["database_not_served/critical".to_string()]);
    drop(other);
}

/// A provider slower than the channel's timeout: every send times out, ambiguous. More than
/// `outbox.alert_ambiguous_pct` of the channel's sends of the last hour raises
/// `ambiguity_high`; `outbox.ambiguity_review()` counts them as timeouts, beside the
/// timeout, and says to raise it. The messages left for an operator raise
/// `work_queue_unowned` after `outbox.alert_unowned_s`, until someone takes them.
#[test]
fn a_timeout_shorter_than_the_provider_raises_ambiguity_high_and_the_review_says_why() {
    const MESSAGES: usize = 12;
    let _serial = serial();
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let _settings = SettingsGuard::new(&cluster, &["outbox.alert_unowned_s"]);
    let mut c = cluster.connect();
    set_setting_seen(&mut c, "outbox.alert_unowned_s", "1");

    let sim = Simulator::start();
    let ch = unique("obs_ambig");
    sim.set_dedupe(&ch, "Idempotency-Key");
    sim.set_default(&ch, Action::AcceptAfter(Duration::from_millis(900)));
    create_channel(
        &mut c,
        &ch,
        &sim.send_url(&ch),
        r#"{"idempotency_header": "Idempotency-Key", "timeout_ms": 300, "connect_timeout_ms": 200,
            "retry": {"base_ms": 50, "max_ms": 100, "jitter": "none", "max_attempts": 2}}"#,
    );
    let ids: Vec<i64> = (0..MESSAGES)
        .map(|_| enqueue(&mut c, &ch, &unique("obs_ambig_k")))
        .collect();
    // Every attempt times out: each message ends waiting for an operator.
    let settled = wait_until(Duration::from_secs(30), || {
        one::<i64>(
            &mut c,
            "SELECT count(*) FROM outbox.work_queue WHERE id = ANY($1)",
            &[&ids],
        ) == MESSAGES as i64
    });
    assert!(settled, "the messages did not reach the work queue");

    wait_for_alert(&mut c, &ch, "ambiguity_high", Duration::from_secs(10));
    let row = alerts_of(&mut c, &ch)
        .into_iter()
        .find(|a| a.alert == "ambiguity_high")
        .unwrap();
    assert_eq!(row.value, 100.0, "every send was ambiguous: {row:?}");
    assert_eq!(row.threshold, 5.0);

    let r = c
        .query_one(
            "SELECT sends, ambiguous, timed_out, gateway, worker_interrupted, timeout_ms, suggestion
               FROM outbox.ambiguity_review('1 hour') WHERE channel = $1",
            &[&ch],
        )
        .unwrap();
    let (sends, ambiguous, timed_out): (i64, i64, i64) = (r.get(0), r.get(1), r.get(2));
    let (gateway, interrupted, timeout_ms): (i64, i64, i32) = (r.get(3), r.get(4), r.get(5));
    let suggestion: String = r.get(6);
    assert!(sends >= 2 * MESSAGES as i64, "{sends} sends");
    assert_eq!(
        (ambiguous, timed_out),
        (sends, sends),
        "all of them timed out"
    );
    assert_eq!((gateway, interrupted, timeout_ms), (0, 0, 300));
    assert!(
        suggestion.contains("timed out") && suggestion.contains("raise timeout_ms"),
        "{suggestion}"
    );

    // Nobody took them: the daily review's alert, until an owner is named.
    wait_for_alert(&mut c, &ch, "work_queue_unowned", Duration::from_secs(10));
    for id in &ids {
        c.execute("SELECT outbox.assign($1, 'on-call')", &[id])
            .unwrap();
    }
    assert!(
        !alerts_of(&mut c, &ch)
            .iter()
            .any(|a| a.alert == "work_queue_unowned"),
        "cleared once every message has an owner"
    );
}
