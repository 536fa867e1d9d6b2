//! Section 8: retention purges old cancelled messages, and delivered ones that stayed in the
//! queue table, and keeps everything else; a delivered message lives in its ledger entry,
//! which the ledger's own retention removes a whole generation at a time.

use super::delivery::cluster_status;
use super::*;

// ---------------------------------------------------------------------------------------
// 8. Retention
// ---------------------------------------------------------------------------------------

#[test]
fn retention_purges_old_finished_queue_rows_and_keeps_everything_else() {
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
    let cancelled = enqueue_payload(&mut c, &held_ch, r#"{"r": 4}"#, &unique("ret_cancel"));
    c.execute("SELECT outbox.cancel($1, 'retention test')", &[&cancelled])
        .unwrap();
    let dm = wait_message(&cluster, delivered, "delivered");
    let fm = wait_message(&cluster, failed, "failed");
    assert_eq!(fm.last_http_status, Some(401));
    assert_eq!(fm.last_error_class.as_deref(), Some("permanent"));
    assert_eq!(attempts(&mut c, delivered).len(), 1);
    assert_eq!(attempts(&mut c, failed).len(), 1);
    // A queue row for the recorded key (a database restored without the ledger's messages):
    // marked delivered from the ledger, it stays in the queue table.
    let second: i64 = c
        .query_one(
            "INSERT INTO outbox._messages (tenant, channel_id, effect_key, payload, next_attempt_at)
             SELECT 'default', id, $2, '{\"r\": 1}', now() FROM outbox._channels WHERE name = $1
             RETURNING id",
            &[&ok_ch, &ok_key],
        )
        .unwrap()
        .get(0);
    wait_message(&cluster, second, "delivered");
    assert_eq!(attempts(&mut c, second).len(), 1);

    let _guard = SettingsGuard::new(&cluster, &["outbox.retention"]);
    set_setting(&mut c, "outbox.retention", "1");

    let gone = wait_for_count(
        &cluster,
        Duration::from_secs(40),
        "SELECT count(*) FROM outbox.messages WHERE id IN ($1, $2)",
        &[&cancelled, &second],
        |n| n == 0,
    );
    assert!(
        gone,
        "the cancelled message and the delivered queue row were not purged within 40 s with outbox.retention = 1"
    );
    assert_eq!(
        attempts(&mut c, second).len(),
        0,
        "its attempts are purged with it"
    );

    // The delivered message lives in its ledger entry, kept at least as long as the longest
    // retry horizon: still there, whole, with its attempt.
    let d = message(&mut c, delivered)
        .unwrap()
        .expect("the delivered message is kept with its ledger entry");
    assert_eq!(d.state, "delivered");
    assert_eq!(d.external_id, dm.external_id);
    assert_eq!(attempts(&mut c, delivered).len(), 1, "its attempt kept");
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

/// The generation of the ledger that holds `id`'s entry.
fn generation_of(c: &mut Client, id: i64) -> i16 {
    c.query_one(
        "SELECT generation FROM outbox._ledger WHERE message_id = $1",
        &[&id],
    )
    .unwrap()
    .get(0)
}

/// Ages the ledger's generations as if a long time had passed: `closing` (the current one)
/// closed two hundred years ago, past any keep, and `opening` current from now on.
fn close_long_ago(c: &mut Client, closing: i16, opening: i16) {
    c.execute(
        "UPDATE outbox._ledger_generations
            SET opened_at = now() - interval '201 years', closed_at = now() - interval '200 years'
          WHERE generation = $1",
        &[&closing],
    )
    .unwrap();
    c.execute(
        "INSERT INTO outbox._ledger_generations (generation, opened_at) VALUES ($1, now())",
        &[&opening],
    )
    .unwrap();
}

/// The ledger forgets a whole generation at a time: the worker empties a closed generation
/// once its close lies a keep in the past, with the attempts of the messages it held, and
/// leaves the current one alone. A session that holds the generation's table defers the
/// emptying to a later round (and says so in the log) without holding anything up.
#[test]
fn the_ledger_empties_a_whole_generation_once_it_closed_a_keep_ago_and_waits_for_a_session_holding_it(
) {
    let cluster = Cluster::from_env();
    cluster.wait_for_worker();
    let sim = Simulator::start();
    let ch = unique("w_gen");
    let mut c = cluster.connect();
    create_channel(
        &mut c,
        &ch,
        &sim.send_url(&ch),
        r#"{"external_id": "/id", "retry": {"base_ms": 50, "max_ms": 50, "jitter": "none"}}"#,
    );
    // The first message fails once, then is delivered: an attempt row besides its entry.
    sim.set_plan(&ch, vec![Action::Status(503), Action::Accept]);
    let first = enqueue_payload(&mut c, &ch, r#"{"g": 1}"#, &unique("gen_first"));
    wait_message(&cluster, first, "delivered");
    assert_eq!(attempts(&mut c, first).len(), 2);
    // A generation's row appears at the worker's first round of retention.
    assert!(
        wait_for_count(
            &cluster,
            Duration::from_secs(30),
            "SELECT count(*) FROM outbox._ledger_generations WHERE closed_at IS NULL",
            &[],
            |n| n == 1,
        ),
        "the current generation has its row"
    );
    let old = generation_of(&mut c, first);
    let current = (old + 1) % 3;
    let next = (current + 1) % 3;
    let filenode = |c: &mut Client, g: i16| -> u32 {
        c.query_one(
            "SELECT pg_relation_filenode(('outbox._ledger_' || $1::text)::regclass)",
            &[&g.to_string()],
        )
        .unwrap()
        .get(0)
    };
    let old_filenode = filenode(&mut c, old);

    // A session reads the ledger and keeps its transaction open; then the generation of the
    // first entry becomes due, and waits for it.
    let held_mark = cluster.log_mark();
    let mut holder = cluster.connect();
    let mut tx = holder.transaction().unwrap();
    tx.query_one("SELECT count(*) FROM outbox._ledger", &[])
        .unwrap();
    close_long_ago(&mut c, old, current);
    let second = enqueue_payload(&mut c, &ch, r#"{"g": 2}"#, &unique("gen_second"));
    wait_message(&cluster, second, "delivered");
    assert_eq!(
        generation_of(&mut c, second),
        current,
        "new entries go to the current generation"
    );
    let deferred = (0..60).any(|_| {
        std::thread::sleep(Duration::from_millis(500));
        cluster.log_since(held_mark).contains(&format!(
            "generation {old} of the ledger is due for emptying but its table is in use"
        ))
    });
    assert!(
        deferred,
        "the worker said it waits for the session:\n{}",
        cluster.log_since(held_mark)
    );
    assert_eq!(
        generation_of(&mut c, first),
        old,
        "the entry is kept while the table is held"
    );
    let deferred_since: Option<std::time::SystemTime> = c
        .query_one(
            "SELECT emptying_deferred_since FROM outbox._ledger_generations WHERE generation = $1",
            &[&old],
        )
        .unwrap()
        .get(0);
    assert!(
        deferred_since.is_some(),
        "the deferral is stamped on the generation"
    );
    // Meanwhile deliveries go on: the worker's records are not held up by the emptying.
    let third = enqueue_payload(&mut c, &ch, r#"{"g": 3}"#, &unique("gen_third"));
    wait_message(&cluster, third, "delivered");
    tx.commit().unwrap();

    // Once the session ends, the generation is emptied whole, with the attempts of its
    // messages; the current generation keeps its entries.
    assert!(
        wait_for_count(
            &cluster,
            Duration::from_secs(40),
            "SELECT count(*) FROM outbox._ledger WHERE generation = $1",
            &[&old],
            |n| n == 0,
        ),
        "generation {old} emptied"
    );
    assert_eq!(
        c.query_one(
            "SELECT count(*) FROM outbox._attempts WHERE message_id = $1",
            &[&first]
        )
        .unwrap()
        .get::<_, i64>(0),
        0,
        "its messages' attempts go with it"
    );
    assert_eq!(
        cluster_status(&mut c, first),
        None,
        "the first message is forgotten"
    );
    assert_eq!(cluster_status(&mut c, second).as_deref(), Some("delivered"));
    assert_eq!(cluster_status(&mut c, third).as_deref(), Some("delivered"));
    let states: Vec<(i16, bool)> = c
        .query(
            "SELECT generation, closed_at IS NULL FROM outbox._ledger_generations ORDER BY generation",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        states,
        vec![(current, true)],
        "only the current generation has a row"
    );
    // Emptied whole: its table was replaced (TRUNCATE), not deleted from row by row.
    assert_ne!(
        filenode(&mut c, old),
        old_filenode,
        "generation {old} was truncated"
    );

    // The current generation, open past its period, closes and the next one opens.
    c.execute(
        "UPDATE outbox._ledger_generations SET opened_at = now() - interval '200 years' WHERE generation = $1",
        &[&current],
    )
    .unwrap();
    assert!(
        wait_for_count(
            &cluster,
            Duration::from_secs(40),
            "SELECT count(*) FROM outbox._ledger_generations WHERE generation = $1 AND closed_at IS NULL",
            &[&next],
            |n| n == 1,
        ),
        "generation {next} opened"
    );
    let fourth = enqueue_payload(&mut c, &ch, r#"{"g": 4}"#, &unique("gen_fourth"));
    wait_message(&cluster, fourth, "delivered");
    assert_eq!(generation_of(&mut c, fourth), next);
    assert_eq!(
        generation_of(&mut c, second),
        current,
        "the closed generation keeps its entries"
    );
}
