//! Section 10 and after: a fast shutdown under load, leases longer than a request, ordering
//! behind an uncertain message, `not_before`, a reused effect key, `max_in_flight`.

use super::*;

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
    let (cluster, mut c, sim) = cluster_and_sim();
    wait_for_workers(&cluster, &[]);
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
    let ch = sim_channel(
        &mut c,
        &sim,
        "slow_lease",
        r#"{"idempotency_header": "Idempotency-Key", "timeout_ms": 6000}"#,
    );
    sim.set_dedupe(&ch, "Idempotency-Key");
    sim.set_default(&ch, Action::AcceptAfter(Duration::from_millis(3000)));
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
            r#"{{"kind": "sql", "function": "{s}.slow", "run_as": "{role}", "timeout_ms": 1000, "connect_timeout_ms": 500, "tenants": ["*"]}}"#
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
    let (cluster, mut c, sim) = cluster_and_sim();
    cluster.wait_for_worker();
    let ch = sim_channel(&mut c, &sim, "w_order_u", r#"{}"#);
    // The first send is read and stored, and its answer lost: no key, no lookup, so the
    // message stops in uncertain.
    sim.set_plan(&ch, vec![Action::DropAfterRead { store: true }]);
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
    let (cluster, mut c, sim) = cluster_and_sim();
    cluster.wait_for_worker();
    let ch = sim_channel(&mut c, &sim, "w_later", r#"{}"#);
    let id: i64 = one(&mut c, "SELECT outbox.enqueue($1, '{\"to\": \"later\"}'::jsonb, $2, NULL, clock_timestamp() + interval '2 seconds')", &[&ch, &unique("later")]);
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(sim.send_count(&ch), 0, "sent before not_before");
    assert_eq!(message(&mut c, id).unwrap().unwrap().state, "queued");
    wait_message(&cluster, id, "delivered");
    let on_time: bool = one(
        &mut c,
        "SELECT a.started_at >= m.not_before FROM outbox.messages m
               JOIN outbox.attempts a ON a.message_id = m.id WHERE m.id = $1",
        &[&id],
    );
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
    // The channel can neither dedupe nor be asked, and create_channel said so; what
    // follows is about enqueue's own notices.
    let created: Vec<_> = warnings.lock().unwrap().drain(..).collect();
    assert!(
        created
            .iter()
            .all(|(_, message, _)| message.contains("can neither dedupe nor be asked")),
        "{created:?}"
    );
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

/// The most attempts of `channel` open at one moment, read from the attempts' own start
/// and end times: for each attempt's start, how many were open then.
fn peak_open_attempts(c: &mut Client, channel: &str) -> i64 {
    c.query_one(
        "SELECT max(n) FROM (
             SELECT (SELECT count(*) FROM outbox.attempts b JOIN outbox.messages mb ON mb.id = b.message_id
                      WHERE mb.channel = $1 AND b.kind = 'send'
                        AND b.started_at <= a.started_at AND b.finished_at > a.started_at) AS n
               FROM outbox.attempts a JOIN outbox.messages m ON m.id = a.message_id
              WHERE m.channel = $1 AND a.kind = 'send') s",
        &[&channel],
    )
    .unwrap()
    .get(0)
}

/// Delivers `n` messages on a new channel with `options` whose provider takes 400 ms per
/// request, with both workers; returns the most attempts open at once and the sends.
fn deliver_slowly(prefix: &str, options: &str, n: i64) -> (i64, usize) {
    let cluster = with_two_workers();
    let sim = Simulator::start();
    let mut c = cluster.connect();
    let ch = unique(prefix);
    sim.set_default(&ch, Action::AcceptAfter(Duration::from_millis(400)));
    create_channel(&mut c, &ch, &sim.send_url(&ch), options);
    enqueue_backlog(&mut c, &ch, n);
    assert!(
        no_message_left(&cluster, &ch, "state <> 'delivered'"),
        "not all delivered: {:?}",
        states_of(&mut c, &ch)
    );
    (peak_open_attempts(&mut c, &ch), sim.send_count(&ch))
}

/// `max_in_flight` bounds the attempts open at once on a channel, across both workers and
/// across claims: read from the attempts' own start and end times.
#[test]
fn max_in_flight_bounds_the_attempts_open_at_once() {
    let options = r#"{"max_in_flight": 3, "idempotency_header": "Idempotency-Key"}"#;
    let (peak, sends) = deliver_slowly("w_inflight", options, 15);
    assert!((1..=3).contains(&peak), "attempts open at once: {peak}");
    assert_eq!(sends, 15);
}

/// On a channel that can neither dedupe nor be asked, `max_unverifiable_in_flight` bounds
/// the attempts open at once, all workers together, whatever its `max_in_flight` says: they
/// are what one crash leaves for an operator.
#[test]
fn max_unverifiable_in_flight_bounds_a_channel_that_cannot_be_asked() {
    let options = r#"{"max_in_flight": 50, "max_unverifiable_in_flight": 2}"#;
    let (peak, sends) = deliver_slowly("w_unverifiable", options, 10);
    assert!((1..=2).contains(&peak), "attempts open at once: {peak}");
    assert_eq!(sends, 10);
}
