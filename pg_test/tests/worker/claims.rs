//! Claims: a message in flight is a queued row in a claim (`outbox._claims`), written by
//! the claim without a new version of the message. The views show it `sending`, the
//! operator actions refuse it, and an operator transaction that keeps an older snapshot
//! than the claim is not allowed to act on a queued message at all.

use super::*;

/// The SQLSTATE of `sql` run in `c`, or None when it succeeds.
fn sqlstate_of(c: &mut Client, sql: &str) -> Option<String> {
    c.batch_execute(sql)
        .err()
        .map(|e| outbox_e2e::helpers::code_of(&e))
}

#[test]
fn a_message_in_flight_is_sending_everywhere_and_no_operator_acts_on_it() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = slow_channel(&mut c, &sim, "claim_op", Duration::from_secs(3), 64);
    c.execute("SELECT outbox.pause_channel($1, 'hold it queued')", &[&ch])
        .unwrap();
    let id = enqueue_payload(&mut c, &ch, r#"{"n": 1}"#, &unique("claim-op"));

    // An operator transaction whose snapshot is older than the claim to come.
    let mut op = cluster.connect();
    op.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .unwrap();

    c.execute("SELECT outbox.resume_channel($1)", &[&ch])
        .unwrap();
    assert!(
        sim.wait_for_sends(&ch, 1, SETTLE),
        "the message was not sent"
    );
    let (state, attempts): (String, i32) = {
        let r = c
            .query_one(
                "SELECT state::text, attempts FROM outbox.messages WHERE id = $1",
                &[&id],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(
        (state.as_str(), attempts),
        ("sending", 1),
        "the view of a message in flight"
    );
    let status: String = one(&mut c, "SELECT outbox.status($1)::text", &[&id]);
    assert_eq!(status, "sending");
    let (row_state, row_attempts, claims): (String, i32, i64) = {
        let r = c
            .query_one(
                "SELECT m.state::text, m.attempts,
                        (SELECT count(*) FROM outbox._claims w WHERE m.id = ANY (w.message_ids))
                   FROM outbox._messages m WHERE m.id = $1",
                &[&id],
            )
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    assert_eq!(
        (row_state.as_str(), row_attempts, claims),
        ("queued", 0, 1),
        "the claim wrote no new version of the message: its row is as enqueued, in one claim"
    );
    let open: i64 = count(
        &mut c,
        "SELECT count(*) FROM outbox.attempts WHERE message_id = $1 AND attempt = 1 AND finished_at IS NULL",
        &[&id],
    );
    assert_eq!(open, 1, "outbox.attempts shows the attempt under way");

    // The older snapshot does not see the claim: the action is refused as such.
    let code = sqlstate_of(&mut op, &format!("SELECT outbox.cancel({id}, 'too late')"));
    assert_eq!(
        code.as_deref(),
        Some("0A000"),
        "a repeatable-read cancel of a message claimed since its snapshot"
    );
    op.batch_execute("ROLLBACK").unwrap();
    // A fresh one sees it in flight.
    for sql in [
        format!("SELECT outbox.cancel({id}, 'in flight')"),
        format!("SELECT outbox.retry({id}, 'in flight')"),
        format!("SELECT outbox.resolve({id}, 'failed', 'in flight')"),
    ] {
        assert_eq!(sqlstate_of(&mut c, &sql).as_deref(), Some("55000"), "{sql}");
    }

    let m = wait_message(&cluster, id, "delivered");
    assert_eq!(m.attempts, 1, "{m:?}");
    let left: i64 = count(
        &mut c,
        "SELECT count(*) FROM outbox._claims WHERE $1 = ANY (message_ids)",
        &[&id],
    );
    assert_eq!(left, 0, "the record took the message out of its claim");
    assert_eq!(sim.stored(&ch).len(), 1, "sent once");
}

/// The workers vacuum the claims themselves (src/worker/claims_upkeep.rs): a claim and its
/// record leave dead row versions, which autovacuum, looking at a table at most once a
/// minute, would leave to pile up at the end of the table while every claim reads it whole.
/// A VACUUM command counts in `vacuum_count`, autovacuum's in `autovacuum_count`.
#[test]
fn the_workers_vacuum_the_claims_they_leave_behind() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let _ = with_two_workers();
    let guard = SettingsGuard::new(&cluster, &["outbox.batch_size"]);
    set_setting(&mut c, "outbox.batch_size", "1");
    // Both workers take a claim of one before the backlog comes: they read the new size.
    std::thread::sleep(Duration::from_millis(700));
    let vacuums = |c: &mut Client| -> i64 {
        one(
            c,
            "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'outbox._claims'::regclass",
            &[],
        )
    };
    let vacuums_before = vacuums(&mut c);
    let ch = sim_channel(&mut c, &sim, "claims_upkeep", "{}");
    enqueue_backlog(&mut c, &ch, 300);
    assert!(
        no_message_left(&cluster, &ch, "state <> 'delivered'"),
        "the backlog was not delivered: {:?}",
        states_of(&mut c, &ch)
    );
    assert_eq!(sim.stored(&ch).len(), 300, "each message sent once");
    // 300 claims of one message: each worker made at least the claims that start a vacuum.
    let ok = outbox_e2e::cluster::wait_until(SETTLE, || {
        vacuums(&mut cluster.connect()) > vacuums_before
    });
    assert!(ok, "no VACUUM of outbox._claims after 300 claims");
    drop(guard);
}
