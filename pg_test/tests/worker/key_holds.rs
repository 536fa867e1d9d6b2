//! Messages held behind their ordering key (src/worker/key_hold.rs): a queue behind one
//! key leaves the claim's part of the due index, the views still count and age it, and
//! the message before each held one releases it, so that the queue drains in order.

use super::*;

/// Messages of channel `$1` held behind their key.
const HELD: &str =
    "SELECT count(*) FROM outbox._messages m JOIN outbox._channels k ON k.id = m.channel_id
                     WHERE k.name = $1 AND m.held_by_key";

/// Messages of channel `ch` held behind their key.
fn held(c: &mut Client, ch: &str) -> i64 {
    count(c, HELD, &[&ch])
}

/// Waits until `n` messages of channel `ch` are in the ledger.
fn wait_drained(cluster: &Cluster, c: &mut Client, sim: &Simulator, ch: &str, n: i64) {
    assert!(
        wait_for_count(
            cluster,
            SETTLE,
            "SELECT count(*) FROM outbox.ledger l JOIN outbox.messages m ON m.id = l.message_id
              WHERE m.channel = $1",
            &[&ch],
            |got| got == n
        ),
        "the held queue did not drain: {} held, {} sent",
        held(c, ch),
        sim.send_count(ch)
    );
}

/// The `seq` of each request the provider stored, in the order it stored them.
fn stored_seqs(sim: &Simulator, ch: &str) -> Vec<i64> {
    sim.stored(ch)
        .iter()
        .map(|s| {
            serde_json::from_slice::<serde_json::Value>(&s.body)
                .map_or(-1, |b| b["seq"].as_i64().unwrap_or(-1))
        })
        .collect()
}

#[test]
fn a_queue_behind_a_key_is_held_counted_and_released_in_order() {
    const WAITING: i64 = 200;
    let (cluster, mut c, sim) = cluster_and_sim();
    cluster.wait_for_worker();
    let ch = sim_channel(&mut c, &sim, "w_key_hold", r#"{"max_in_flight": 64}"#);
    let okey = unique("conversation");
    let first: i64 = one(
        &mut c,
        "SELECT outbox.enqueue($1, '{\"seq\": 0}'::jsonb, $2, $3, now() + interval '1 hour')",
        &[&ch, &unique("first"), &okey],
    );
    {
        let mut tx = c.transaction().unwrap();
        for i in 1..=WAITING {
            enqueue_with(
                &mut tx,
                &ch,
                &format!(r#"{{"seq": {i}}}"#),
                &unique(&format!("wait{i}")),
                Some(&okey),
                None,
            );
        }
        tx.commit().unwrap();
    }
    // A message of another key on the same channel goes at once, held or not.
    let other = enqueue_with(
        &mut c,
        &ch,
        r#"{"seq": -5}"#,
        &unique("other"),
        Some(&unique("another-conversation")),
        None,
    );
    wait_message(&cluster, other, "delivered");

    assert!(
        wait_for_count(&cluster, SETTLE, HELD, &[&ch], |n| n == WAITING),
        "the messages behind the first were not all held: {} of {WAITING}",
        held(&mut c, &ch)
    );
    assert_eq!(
        sim.send_count(&ch),
        1,
        "only the other key's message was sent"
    );
    // The views answer as before: the held messages are queued, due, and waiting.
    let (queued, age): (i64, f64) = {
        let r = c
            .query_one(
                "SELECT queued, oldest_queued_age_s::float8 FROM outbox.metrics
                  WHERE scope = 'channel' AND channel = $1",
                &[&ch],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(
        queued,
        WAITING + 1,
        "metrics count the held messages as queued"
    );
    assert!(
        age >= 1.0,
        "the oldest held message is due and has waited at least a second: {age}"
    );
    let shown = count(
        &mut c,
        "SELECT count(*) FROM outbox.messages WHERE channel = $1 AND state = 'queued'",
        &[&ch],
    );
    assert_eq!(shown, WAITING + 1);

    // The first message stops being pending: the next one is released, and each one
    // delivered releases the one after it.
    let after: String = one(
        &mut c,
        "SELECT outbox.cancel($1, 'not needed any more')::text",
        &[&first],
    );
    assert_eq!(after, "cancelled");
    wait_drained(&cluster, &mut c, &sim, &ch, WAITING + 1);
    let mut expected = vec![-5];
    expected.extend(1..=WAITING);
    assert_eq!(stored_seqs(&sim, &ch), expected, "order at the provider");
    assert_eq!(sim.send_count(&ch), WAITING as usize + 1, "one send each");
    assert_eq!(held(&mut c, &ch), 0);
}

#[test]
fn a_message_held_with_nothing_before_it_is_released() {
    let (cluster, mut c, sim) = cluster_and_sim();
    cluster.wait_for_worker();
    let ch = sim_channel(&mut c, &sim, "w_key_stranded", r#"{}"#);
    c.execute(
        "SELECT outbox.pause_channel($1, 'holding a message by hand')",
        &[&ch],
    )
    .unwrap();
    let id = enqueue_with(
        &mut c,
        &ch,
        r#"{"seq": 1}"#,
        &unique("stranded"),
        Some(&unique("conversation")),
        None,
    );
    // As a release lost to a race would leave it: held, with nothing pending before it.
    c.execute(
        "UPDATE outbox._messages SET held_by_key = true WHERE id = $1",
        &[&id],
    )
    .unwrap();
    c.execute("SELECT outbox.resume_channel($1)", &[&ch])
        .unwrap();
    wait_message(&cluster, id, "delivered");
    assert_eq!(sim.send_count(&ch), 1);

    // Only a message with an ordering key can be held. The channel is paused so that the
    // message is still queued (not yet moved out as delivered) when the update is tried.
    c.execute(
        "SELECT outbox.pause_channel($1, 'holding a message by hand')",
        &[&ch],
    )
    .unwrap();
    let plain = outbox_e2e::helpers::enqueue(&mut c, &ch, &unique("plain"));
    let e = c
        .execute(
            "UPDATE outbox._messages SET held_by_key = true WHERE id = $1",
            &[&plain],
        )
        .unwrap_err();
    assert_eq!(outbox_e2e::helpers::code_of(&e), "23514", "{e}");
    c.execute("SELECT outbox.resume_channel($1)", &[&ch])
        .unwrap();
    wait_message(&cluster, plain, "delivered");
}

/// A key stopped at an `uncertain` message (a provider that dropped the connection after
/// reading the request, on a channel that can neither dedupe nor be asked): every queued
/// message behind it is held, the first one too, and the operator's `resolve` releases
/// them in order.
#[test]
fn a_queue_behind_an_uncertain_message_is_held_whole() {
    const WAITING: i64 = 3;
    let (cluster, mut c, sim) = cluster_and_sim();
    cluster.wait_for_worker();
    let ch = sim_channel(&mut c, &sim, "w_key_uncertain", r#"{}"#);
    sim.set_plan(&ch, vec![Action::DropAfterRead { store: true }]);
    let okey = unique("conversation");
    let first = enqueue_with(
        &mut c,
        &ch,
        r#"{"seq": 0}"#,
        &unique("first"),
        Some(&okey),
        None,
    );
    wait_message(&cluster, first, "uncertain");
    {
        let mut tx = c.transaction().unwrap();
        for i in 1..=WAITING {
            enqueue_with(
                &mut tx,
                &ch,
                &format!(r#"{{"seq": {i}}}"#),
                &unique(&format!("wait{i}")),
                Some(&okey),
                None,
            );
        }
        tx.commit().unwrap();
    }
    assert!(
        wait_for_count(&cluster, SETTLE, HELD, &[&ch], |n| n == WAITING),
        "the messages behind the uncertain one were not all held: {} of {WAITING}",
        held(&mut c, &ch)
    );
    assert_eq!(
        one::<String>(
            &mut c,
            "SELECT state::text FROM outbox._messages WHERE id = $1 AND NOT held_by_key",
            &[&first]
        ),
        "uncertain",
        "the uncertain message itself is not held"
    );
    assert_eq!(sim.send_count(&ch), 1, "nothing behind it was sent");

    let after: String = one(
        &mut c,
        "SELECT outbox.resolve($1, 'delivered', 'seen in the provider console')::text",
        &[&first],
    );
    assert_eq!(after, "delivered");
    wait_drained(&cluster, &mut c, &sim, &ch, WAITING + 1);
    let expected: Vec<i64> = (0..=WAITING).collect();
    assert_eq!(stored_seqs(&sim, &ch), expected, "order at the provider");
    assert_eq!(sim.send_count(&ch), WAITING as usize + 1, "one send each");
    assert_eq!(held(&mut c, &ch), 0);
}
