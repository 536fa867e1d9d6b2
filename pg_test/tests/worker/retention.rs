//! Section 8: retention purges old cancelled messages, and delivered ones that stayed in the
//! queue table, and keeps everything else; a delivered message lives in its ledger entry,
//! which the ledger's own retention removes (a `#[pg_test]` of `crate::ledger::purge`).

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
