//! Ten thousand endpoints, one channel each, as a webhook sender with a channel per customer
//! has: a channel's backlog does not hold back the other channels' messages, and the
//! operator's views answer in well under a second.
//!
//! Starts a cluster of its own under `OUTBOX_MANY_BASE` (`/tmp/outbox_many_channels`) on
//! `OUTBOX_MANY_PGPORT` (54879), with two workers, and a provider simulator as the sink.
//!
//! Run: `cargo test -p outbox_e2e --release --test many_channels -- --nocapture`

use outbox_e2e::cluster::{env_port, wait_for_workers, wait_until, OwnCluster};
use outbox_e2e::helpers::{count, serial};
use outbox_e2e::sim::Simulator;
use postgres::Client;
use std::time::{Duration, Instant};

const CHANNELS: i64 = 10_000;
const BACKLOG: i64 = 100_000;
/// Channels with one message each, spread over the ids.
const SINGLES: i64 = 100;

fn stage() -> (OwnCluster, Simulator) {
    let base =
        std::env::var("OUTBOX_MANY_BASE").unwrap_or_else(|_| "/tmp/outbox_many_channels".into());
    let port = env_port("OUTBOX_MANY_PGPORT", 54879);
    let own = OwnCluster::fresh(base.into(), port, "outbox", 2, "");
    wait_for_workers(&own, &[]);
    (own, Simulator::start())
}

/// Runs `sql` and says how long it took.
fn timed(c: &mut Client, sql: &str) -> Duration {
    let started = Instant::now();
    c.batch_execute(sql)
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    started.elapsed()
}

/// 10,000 channels, a backlog of 100,000 on one and one message on each of 100 others,
/// released at once: every one of the 100 is delivered before half the backlog is. Then
/// the views an operator reads answer in under a second each, with 10,000 channels.
#[test]
fn a_backlog_on_one_channel_of_ten_thousand_does_not_hold_back_the_others() {
    let _turn = serial();
    let (own, sim) = stage();
    let mut c = own.connect();
    let options = r#"{"idempotency_header": "Idempotency-Key", "max_in_flight": 512}"#;
    let created = timed(
        &mut c,
        &format!(
            "SELECT count(outbox.create_channel('m' || g, '{}' || g, '{options}'))
               FROM generate_series(1, {CHANNELS}) g",
            sim.send_url("m")
        ),
    );
    eprintln!("create_channel x {CHANNELS} in one transaction: {created:?}");
    assert!(created < Duration::from_secs(60), "{created:?}");
    // The backlog on the first channel, one message on every 100th channel after it; all
    // enqueued while paused and released in one transaction.
    let singles: Vec<String> = (1..=SINGLES).map(|i| format!("m{}", 1 + i * 97)).collect();
    let mut tx = c.transaction().unwrap();
    tx.batch_execute("SELECT outbox.pause_channel('m1', 'test')")
        .unwrap();
    for ch in &singles {
        tx.execute("SELECT outbox.pause_channel($1, 'test')", &[ch])
            .unwrap();
    }
    tx.commit().unwrap();
    c.batch_execute(&format!(
        "SELECT count(outbox.enqueue('m1', jsonb_build_object('n', g), 'b' || g))
           FROM generate_series(1, {BACKLOG}) g"
    ))
    .unwrap();
    for ch in &singles {
        c.execute(
            "SELECT outbox.enqueue($1::text, '{}'::jsonb, 's-' || $1::text)",
            &[ch],
        )
        .unwrap();
    }
    let mut tx = c.transaction().unwrap();
    tx.batch_execute("SELECT outbox.resume_channel('m1')")
        .unwrap();
    for ch in &singles {
        tx.execute("SELECT outbox.resume_channel($1)", &[ch])
            .unwrap();
    }
    tx.commit().unwrap();
    let released = Instant::now();
    let mut backlog_done_then = None;
    let all_singles = wait_until(Duration::from_secs(120), || {
        let singles_left = count(
            &mut c,
            "SELECT count(*) FROM outbox.messages WHERE channel <> 'm1' AND state <> 'delivered'",
            &[],
        );
        if singles_left == 0 {
            backlog_done_then = Some(count(
                &mut c,
                "SELECT count(*) FROM outbox.messages WHERE channel = 'm1' AND state = 'delivered'",
                &[],
            ));
        }
        singles_left == 0
    });
    assert!(
        all_singles,
        "the {SINGLES} single messages were not all delivered"
    );
    let backlog_done = backlog_done_then.unwrap();
    eprintln!(
        "all {SINGLES} single messages delivered after {:?}, with {backlog_done} of the backlog of {BACKLOG} delivered",
        released.elapsed()
    );
    assert!(
        backlog_done < BACKLOG / 2,
        "{backlog_done} of the backlog went before the last single message"
    );
    // The operator's views, with 10,000 channels and the backlog under way.
    for sql in [
        "SELECT count(*) FROM outbox.channels",
        "SELECT count(*) FROM outbox.metrics",
        "SELECT count(*) FROM outbox.alerts",
        "SELECT length(outbox.prometheus())",
        "SELECT count(*) FROM outbox.worker_status()",
    ] {
        let took = timed(&mut c, sql);
        eprintln!("{sql}: {took:?}");
        assert!(took < Duration::from_secs(1), "{sql}: {took:?}");
    }
    assert!(sim.send_count("m1") > 0);
}
