//! Sections 1-3: a commit is delivered; a re-enqueue returns the same message and the ledger
//! bars a resend; an ordering key waits for a failing first message.

use super::*;

// ---------------------------------------------------------------------------------------
// 1. Commit → delivered
// ---------------------------------------------------------------------------------------

#[test]
fn commit_is_delivered_with_ledger_attempt_and_headers() {
    let (cluster, mut c, sim) = cluster_and_sim();
    cluster.wait_for_worker();
    let ch = unique("w_deliver");
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

/// A send in progress is the `sending` message: `outbox.attempts` shows it (no outcome, no
/// finished_at, the key it carries, the pid of the worker sending it) while the attempt
/// table has no row for it. When it delivers, the delivered message goes on standing for
/// it, now with its outcome, keeping the start and the pid seen while it was in progress:
/// the attempt table gets no row. A send that fails first is written, once, with its
/// outcome, and the delivering one after it still is not.
#[test]
fn a_send_in_progress_and_the_send_that_delivers_are_shown_from_their_message() {
    let (cluster, mut c, sim) = cluster_and_sim();
    cluster.wait_for_worker();
    let ch = sim_channel(&mut c, &sim, "w_in_progress", r#"{"timeout_ms": 10000}"#);
    sim.set_default(&ch, Action::AcceptAfter(Duration::from_millis(1500)));
    let key = unique("in-progress");
    let id = enqueue_payload(&mut c, &ch, r#"{"to": "slow"}"#, &key);
    assert!(
        sim.wait_for_sends(&ch, 1, SETTLE),
        "the provider got no request"
    );
    let open = attempts(&mut c, id);
    assert_eq!(open.len(), 1, "one attempt in progress: {open:?}");
    let a = &open[0];
    assert_eq!((a.attempt, a.kind.as_str()), (1, "send"));
    assert_eq!(
        (&a.outcome, a.finished_ms),
        (&None, None),
        "not finished yet"
    );
    assert_eq!(a.effect_key_sent.as_deref(), Some(key.as_str()));
    let pid = a.worker_pid.expect("the pid of the sending worker");
    let is_worker: bool = one(
        &mut c,
        "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND backend_type = 'outbox_delivery worker')",
        &[&pid],
    );
    assert!(is_worker, "pid {pid} is not a delivery worker");
    // Rows of the attempt table for a message.
    let rows = |c: &mut Client, id: i64| -> i64 {
        count(
            c,
            "SELECT count(*) FROM outbox._attempts WHERE message_id = $1",
            &[&id],
        )
    };
    assert_eq!(
        rows(&mut c, id),
        0,
        "no attempt row before the outcome is known"
    );

    wait_message(&cluster, id, "delivered");
    let done = attempts(&mut c, id);
    assert_eq!(done.len(), 1, "one attempt: {done:?}");
    let d = &done[0];
    assert_eq!(d.outcome.as_deref(), Some("delivered"));
    assert_eq!(d.http_status, Some(200));
    assert!(d.finished_ms.is_some_and(|f| f >= d.started_ms));
    assert_eq!(
        (d.started_at_us, d.worker_pid, &d.effect_key_sent),
        (a.started_at_us, a.worker_pid, &a.effect_key_sent),
        "the row keeps what the attempt in progress showed"
    );
    assert_eq!(
        rows(&mut c, id),
        0,
        "a delivering send writes no attempt row"
    );

    // A first attempt refused with a 503, then a delivery: one written row, one shown.
    sim.set_default(&ch, Action::Accept);
    sim.set_plan(&ch, vec![Action::Status(503)]);
    c.execute(
        "SELECT outbox.alter_channel($1, '{\"retry\": {\"base_ms\": 50, \"jitter\": \"none\"}}')",
        &[&ch],
    )
    .unwrap();
    let retried = enqueue_payload(&mut c, &ch, r#"{"to": "twice"}"#, &unique("retried"));
    wait_message(&cluster, retried, "delivered");
    let both = attempts(&mut c, retried);
    let seen: Vec<(i32, Option<&str>, Option<i32>)> = both
        .iter()
        .map(|a| (a.attempt, a.outcome.as_deref(), a.http_status))
        .collect();
    assert_eq!(
        seen,
        vec![
            (1, Some("transient"), Some(503)),
            (2, Some("delivered"), Some(200))
        ],
        "{both:?}"
    );
    assert_eq!(rows(&mut c, retried), 1, "only the refused send is written");
}

// ---------------------------------------------------------------------------------------
// 2. Re-enqueue of a delivered key; the ledger barrier against a queue row of a recorded key
// ---------------------------------------------------------------------------------------

#[test]
fn reenqueue_returns_same_id_and_ledger_blocks_resend_of_a_recorded_key() {
    let (cluster, mut c, sim) = cluster_and_sim();
    cluster.wait_for_worker();
    let ch = sim_channel(
        &mut c,
        &sim,
        "w_ledger",
        r#"{"idempotency_header": "Idempotency-Key", "external_id": "/id"}"#,
    );
    let key = effect_key(&mut c, &unique("turn"), "send_reply");
    let payload = r#"{"text": "once"}"#;
    let id = enqueue_payload(&mut c, &ch, payload, &key);
    let delivered = wait_message(&cluster, id, "delivered");
    assert_eq!(sim.send_count(&ch), 1);
    let ext = sim.stored(&ch)[0].external_id.clone();
    assert_eq!(delivered.external_id.as_deref(), Some(ext.as_str()));

    // The delivered message left the queue table for its ledger entry, whole.
    let queued_rows = count(
        &mut c,
        "SELECT count(*) FROM outbox._messages WHERE id = $1",
        &[&id],
    );
    assert_eq!(queued_rows, 0, "a delivered message leaves the queue table");
    let entry = c
        .query_one(
            "SELECT l.message_id, l.payload::text, c.name, l.attempts
               FROM outbox._ledger l JOIN outbox._channels c ON c.id = l.channel_id
              WHERE l.effect_key = $1",
            &[&key],
        )
        .unwrap();
    assert_eq!(entry.get::<_, i64>(0), id);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&entry.get::<_, String>(1)).unwrap(),
        serde_json::from_str::<serde_json::Value>(payload).unwrap()
    );
    assert_eq!(entry.get::<_, String>(2), ch);
    assert_eq!(entry.get::<_, i32>(3), 1);

    // The same effect again: the same message, nothing new.
    let again = enqueue_payload(&mut c, &ch, payload, &key);
    assert_eq!(again, id, "re-enqueue of a delivered effect returns its id");
    let n = count(
        &mut c,
        "SELECT count(*) FROM outbox.messages WHERE effect_key = $1",
        &[&key],
    );
    assert_eq!(n, 1, "still one message for the key");
    std::thread::sleep(QUIET);
    assert_eq!(sim.send_count(&ch), 1, "no second request");
    assert_eq!(attempts(&mut c, id).len(), 1, "no second attempt");
    assert_eq!(
        cluster_status(&mut c, id).as_deref(),
        Some("delivered"),
        "status() of a message that lives in the ledger"
    );

    // The barrier: a queue row for a recorded key (a database restored or moved without
    // its queue, an entry whose message retention removed) is never sent; the worker marks
    // it delivered from the ledger and the entry keeps naming the first message.
    let new_id: i64 = c
        .query_one(
            "INSERT INTO outbox._messages (tenant, channel_id, effect_key, payload, next_attempt_at)
             SELECT 'default', id, $2, $3::text::jsonb, now() FROM outbox._channels WHERE name = $1
             RETURNING id",
            &[&ch, &key, &payload],
        )
        .unwrap()
        .get(0);
    // No wake at commit for a row written by hand: the worker's poll finds it.
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
    // The ledger still names the first message, once; the second stays in the queue table,
    // delivered, until retention removes it.
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
    let state: String = c
        .query_one(
            "SELECT state::text FROM outbox._messages WHERE id = $1",
            &[&new_id],
        )
        .unwrap()
        .get(0);
    assert_eq!(state, "delivered");
}

pub(super) fn cluster_status(c: &mut Client, id: i64) -> Option<String> {
    c.query_one("SELECT outbox.status($1)::text", &[&id])
        .unwrap()
        .get(0)
}

/// Transactions committed in the cluster's database so far.
fn commits(c: &mut postgres::Client) -> i64 {
    c.query_one(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
        &[],
    )
    .unwrap()
    .get(0)
}

/// The transactions the database committed during `span`, counted from here.
fn commits_within(c: &mut Client, span: Duration) -> i64 {
    let before = commits(c);
    std::thread::sleep(span);
    commits(c) - before
}

#[test]
fn an_ordering_key_behind_an_uncertain_message_leaves_the_workers_asleep() {
    let (cluster, mut c, sim) = cluster_and_sim();
    cluster.wait_for_worker();
    let ch = unique("w_order_stuck");
    create_channel(
        &mut c,
        &ch,
        &sim.send_url(&ch),
        r#"{"idempotency_header": "Idempotency-Key"}"#,
    );
    c.execute("SELECT outbox.pause_channel($1::text, 'set up')", &[&ch])
        .unwrap();
    let okey = unique("conversation");
    let first = enqueue_with(
        &mut c,
        &ch,
        r#"{"seq": 0}"#,
        &unique("o0"),
        Some(&okey),
        None,
    );
    // The first message of the key waits for an operator (as after an ambiguous outcome
    // on a channel that cannot be asked).
    c.execute(
        "UPDATE outbox._messages SET state = 'uncertain' WHERE id = $1",
        &[&first],
    )
    .unwrap();
    let second = enqueue_with(
        &mut c,
        &ch,
        r#"{"seq": 1}"#,
        &unique("o1"),
        Some(&okey),
        None,
    );
    c.execute("SELECT outbox.resume_channel($1::text)", &[&ch])
        .unwrap();

    // The second is due and cannot be claimed: the workers claim it a few times a second,
    // not a thousand (each claim is a transaction of its own). It is not held meanwhile
    // (its creation moved ahead: a message is held once it has waited a second,
    // key_hold::HOLD_AFTER_MS), so that the claims meet it.
    c.execute(
        "UPDATE outbox._messages SET created_at = now() + interval '1 hour' WHERE id = $1",
        &[&second],
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let during = commits_within(&mut c, Duration::from_secs(3));
    assert!(
        during < 300,
        "{during} transactions in 3 s while the only due message waits for its ordering key"
    );
    let held: bool = one(
        &mut c,
        "SELECT held_by_key FROM outbox._messages WHERE id = $1",
        &[&second],
    );
    assert!(!held, "the claims met the message, not held");
    // Once it has waited long enough, it is held, and the workers stay as quiet.
    c.execute(
        "UPDATE outbox._messages SET created_at = now() - interval '2 seconds' WHERE id = $1",
        &[&second],
    )
    .unwrap();
    assert!(
        wait_for_count(
            &cluster,
            SETTLE,
            "SELECT count(*) FROM outbox._messages WHERE id = $1 AND held_by_key",
            &[&second],
            |n| n == 1
        ),
        "the message behind the uncertain one was not held"
    );
    let during = commits_within(&mut c, Duration::from_secs(3));
    assert!(
        during < 300,
        "{during} transactions in 3 s while the only due message is held behind its ordering key"
    );
    let m = message(&mut c, second).unwrap().unwrap();
    assert_eq!((m.state.as_str(), m.attempts), ("queued", 0));
    assert_eq!(sim.send_count(&ch), 0);

    // The operator settles the first: the second is delivered.
    c.execute(
        "SELECT outbox.resolve($1, 'failed', 'the provider never got it')",
        &[&first],
    )
    .unwrap();
    wait_message(&cluster, second, "delivered");
    assert_eq!(sim.send_count(&ch), 1);
}

// ---------------------------------------------------------------------------------------
// 3. Ordering key while the first message keeps failing
// ---------------------------------------------------------------------------------------

#[test]
fn ordering_key_waits_for_a_failing_first_message() {
    let (cluster, mut c, sim) = cluster_and_sim();
    cluster.wait_for_worker();
    let ch = unique("w_order");
    sim.set_plan(&ch, vec![Action::Status(503), Action::Status(503)]);
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
