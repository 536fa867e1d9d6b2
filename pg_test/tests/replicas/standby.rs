//! A hot standby: the extension loads, the workers deliver nothing and say so, the views
//! and `status()` answer, and `enqueue` fails as any write on a standby does.

use super::*;
use outbox_e2e::helpers::{code_of, enqueue, try_enqueue};

#[test]
fn on_a_standby_nothing_is_delivered_and_everything_reads() {
    let pair = pair(false);
    let sim = Simulator::start();
    let mut primary = pair.primary.connect();
    make_channels(&mut primary, &sim);
    let delivered = enqueue(&mut primary, Kind::Dedupe.channel(), "before-standby-check");
    assert!(wait_until(Duration::from_secs(20), || sim
        .send_count(Kind::Dedupe.channel())
        == 1));
    // Due in 3 s: the primary is gone by then, and the standby's copy is due but never sent.
    let queued: i64 = primary
        .query_one(
            "SELECT outbox.enqueue($1, '{\"key\": \"queued-on-standby\"}'::jsonb, 'queued-on-standby', NULL, now() + interval '3 s')",
            &[&Kind::Neither.channel()],
        )
        .expect("enqueue with not_before")
        .get(0);
    let lsn: String = primary
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .expect("lsn")
        .get(0);

    let mut standby = pair.standby.connect();
    let ok = wait_until(Duration::from_secs(20), || {
        count(
            &mut standby,
            "SELECT count(*) FROM (SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn AS caught_up) s WHERE caught_up",
            &[&lsn],
        ) == 1
    });
    assert!(ok, "the standby did not replay up to {lsn}");
    pair.primary.kill();

    let rows = standby
        .query(
            "SELECT state, pid, database FROM outbox.worker_status() ORDER BY worker",
            &[],
        )
        .expect("worker_status() on the standby");
    assert_eq!(rows.len(), WORKERS as usize);
    for r in &rows {
        let (state, pid, db): (String, Option<i32>, String) = (r.get(0), r.get(1), r.get(2));
        assert_eq!((state.as_str(), db.as_str()), ("standby", "app"));
        assert!(pid.is_some(), "the standby's workers run (and wait)");
    }
    for view in [
        "messages",
        "attempts",
        "ledger",
        "work_queue",
        "operator_log",
        "metrics",
        "alerts",
        "channels",
    ] {
        standby
            .query(&format!("SELECT * FROM outbox.{view}"), &[])
            .unwrap_or_else(|e| panic!("outbox.{view} on the standby: {}", code_of(&e)));
    }
    let state_of = |c: &mut Client, id: i64| -> String {
        c.query_one("SELECT outbox.status($1)::text", &[&id])
            .expect("status()")
            .get(0)
    };
    assert_eq!(state_of(&mut standby, delivered), "delivered");
    assert_eq!(state_of(&mut standby, queued), "queued");
    standby
        .query("SELECT outbox.prometheus()", &[])
        .expect("prometheus() on the standby");

    let err = try_enqueue(&mut standby, Kind::Dedupe.channel(), "written-on-standby")
        .expect_err("enqueue on a standby");
    assert_eq!(code_of(&err), "25006", "read-only transaction: {err}");

    // Nothing is sent from the standby: the message due meanwhile stays queued there.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(sim.send_count(Kind::Neither.channel()), 0, "a standby sent");
    assert_eq!(state_of(&mut standby, queued), "queued");
    sim.shutdown();
}
