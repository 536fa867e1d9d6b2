//! Steps of the wall clock, forward and back, under a server whose clock the test moves
//! (libfaketime, `OUTBOX_FAKETIME_FILE` of scripts/cluster.sh: the server's wall clock
//! jumps, its monotonic and boot clocks do not). What a step may not cause:
//!
//! - a live attempt taken back: the lease of a worker that beats is judged on the boot
//!   clock (`src/worker/liveness.rs`), so the request under way when the clock jumps is
//!   answered, recorded once and never sent again;
//! - a lookup before the settle window: the first lookup of an `uncertain` message waits
//!   `settle_ms` on the boot clock (`settle_boot_ms`), however far the wall clock jumped;
//!   a not-found answer that came before it would be a resend.
//!
//! What a step does (the documented limit, docs/reliability.md): times kept on the wall
//! clock move with it. After a step back, retries, lookups and `not_before` wait the
//! step longer; after a step forward, retries of refused requests come sooner.
//!
//! Each test starts a cluster of its own under `OUTBOX_CLOCK_BASE` (`/tmp/outbox_clock`)
//! on `OUTBOX_CLOCK_PGPORT` (54888), with two workers.
//!
//! Run: `cargo test -p outbox_e2e --release --test clock_steps -- --test-threads=1`

use outbox_e2e::cluster::{env_port, state_of, unique, wait_for_workers, wait_until, OwnCluster};
use outbox_e2e::helpers::{count, create_channel, enqueue, serial, SETTLE};
use outbox_e2e::sim::{Action, Simulator};
use postgres::Client;
use serde_json::json;
use std::sync::MutexGuard;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The wait before the first lookup of an uncertain message.
const SETTLE_MS: u64 = 5_000;

/// A cluster whose wall clock follows `file` (`+0` at the start), two workers serving it,
/// and a simulator.
fn stage(file: &str) -> (MutexGuard<'static, ()>, OwnCluster, Simulator) {
    let turn = serial();
    std::fs::write(file, "+0\n").unwrap();
    let base = std::env::var("OUTBOX_CLOCK_BASE").unwrap_or_else(|_| "/tmp/outbox_clock".into());
    let port = env_port("OUTBOX_CLOCK_PGPORT", 54888);
    let own = OwnCluster::fresh_with(
        base.into(),
        port,
        "outbox",
        2,
        "",
        &[("OUTBOX_FAKETIME_FILE", file)],
    );
    let workers = wait_for_workers(&own, &[]);
    assert!(workers.len() >= 2, "needs two workers");
    (turn, own, Simulator::start())
}

/// The server's wall clock ahead of this process's, in seconds.
fn server_offset_s(c: &mut Client) -> f64 {
    let server: f64 = c
        .query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[])
        .unwrap()
        .get(0);
    let here = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    server - here
}

/// Moves the server's wall clock to `offset` (libfaketime's syntax, e.g. `+2h`) and waits
/// until the server reads it (`expect_s` seconds ahead, within 60 s).
fn step_clock(file: &str, offset: &str, expect_s: f64, c: &mut Client) {
    let tmp = format!("{file}.new");
    std::fs::write(&tmp, format!("{offset}\n")).unwrap();
    std::fs::rename(&tmp, file).unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || (server_offset_s(c) - expect_s)
            .abs()
            < 60.0),
        "the server's clock did not move to {offset}: {} s",
        server_offset_s(c)
    );
}

/// A channel that can be asked (lookups by key, `settle_ms` of its own) and one that
/// dedupes by key, both sending to `sim`.
fn channels(c: &mut Client, sim: &Simulator) -> (String, String) {
    let asked = unique("clk_asked");
    create_channel(
        c,
        &asked,
        &sim.send_url(&asked),
        &json!({
            "reference_header": "X-Effect-Key",
            "external_id": "/id",
            "reconcile": {"url": sim.lookup_url_by_key(&asked), "found": "/found",
                          "external_id": "/id", "settle_ms": SETTLE_MS},
            "retry": {"base_ms": 200, "max_ms": 1000, "jitter": "none"}
        })
        .to_string(),
    );
    let deduped = unique("clk_deduped");
    sim.set_dedupe(&deduped, "Idempotency-Key");
    create_channel(
        c,
        &deduped,
        &sim.send_url(&deduped),
        &json!({"idempotency_header": "Idempotency-Key", "external_id": "/id", "timeout_ms": 20000})
            .to_string(),
    );
    (asked, deduped)
}

fn lookups(sim: &Simulator, ch: &str) -> usize {
    sim.requests(ch)
        .iter()
        .filter(|r| r.kind == "lookup")
        .count()
}

fn recovered(c: &mut Client, id: i64) -> i64 {
    count(
        c,
        "SELECT count(*) FROM outbox._attempts WHERE message_id = $1 AND kind = 'recovery'",
        &[&id],
    )
}

/// The clock steps by `offset` (`expect_s` seconds) while a request is under way on the
/// deduping channel (its provider answers after 4 s) and a message of the other channel
/// waits out its settle window after a dropped connection.
fn step_while_waiting(offset: &str, expect_s: f64) {
    let file = format!("/tmp/outbox_clock_faketime_{}", std::process::id());
    let (_turn, own, sim) = stage(&file);
    let mut c = own.connect();
    sim.set_record_requests(true);
    let (asked, deduped) = channels(&mut c, &sim);

    // The provider stores the message and drops the connection: uncertain, first lookup
    // SETTLE_MS later.
    sim.set_plan(&asked, vec![Action::DropAfterRead { store: true }]);
    // The attempt, and so its settle window, starts after this: no lookup may come before
    // SETTLE_MS from here (`settling_since`, taken once the test sees the message
    // uncertain, is later by however long that took).
    let enqueued_at = Instant::now();
    let uncertain = enqueue(&mut c, &asked, &unique("settling"));
    assert!(
        wait_until(SETTLE, || state_of(&own, uncertain).as_deref()
            == Some("uncertain")),
        "not uncertain: {:?}",
        state_of(&own, uncertain)
    );
    let settling_since = Instant::now();

    // A request that is answered 4 s after it arrived.
    sim.set_plan(&deduped, vec![Action::AcceptAfter(Duration::from_secs(4))]);
    let live = enqueue(&mut c, &deduped, &unique("live"));
    assert!(
        sim.wait_for_sends(&deduped, 1, SETTLE),
        "the request never left"
    );

    step_clock(&file, offset, expect_s, &mut c);
    let stepped_after = settling_since.elapsed();
    assert!(
        stepped_after < Duration::from_millis(SETTLE_MS - 2_000),
        "the step came too late to be seen inside the settle window ({stepped_after:?})"
    );

    // Inside the settle window, on the real clock: no lookup, however far the wall clock
    // jumped.
    let quiet_until = Duration::from_millis(SETTLE_MS - 500);
    while enqueued_at.elapsed() < quiet_until {
        assert_eq!(
            lookups(&sim, &asked),
            0,
            "a lookup {:?} after the dropped send, before settle_ms ({SETTLE_MS} ms)",
            enqueued_at.elapsed()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // The live request is answered, recorded once and never taken back or sent again.
    assert!(
        wait_until(SETTLE, || state_of(&own, live).as_deref()
            == Some("delivered")),
        "the live attempt was not delivered: {:?}",
        state_of(&own, live)
    );
    assert_eq!(
        sim.send_count(&deduped),
        1,
        "the live request was sent again"
    );
    assert_eq!(
        recovered(&mut c, live),
        0,
        "the live attempt was taken back"
    );

    if expect_s > 0.0 {
        // After a step forward, the lookup runs once the settle window has passed on the
        // boot clock, finds the message, and nothing was sent twice.
        assert!(
            wait_until(SETTLE, || state_of(&own, uncertain).as_deref()
                == Some("delivered")),
            "the lookup never settled it: {:?}",
            state_of(&own, uncertain)
        );
        assert!(
            enqueued_at.elapsed() >= Duration::from_millis(SETTLE_MS),
            "settled {:?} after the enqueue, before settle_ms ({SETTLE_MS} ms)",
            enqueued_at.elapsed()
        );
    } else {
        // After a step back, the wall-clock time of its lookup lies the step ahead: it is
        // still uncertain, and was not sent again.
        std::thread::sleep(Duration::from_millis(1_000));
        assert_eq!(state_of(&own, uncertain).as_deref(), Some("uncertain"));
        assert_eq!(lookups(&sim, &asked), 0);
    }
    assert_eq!(
        sim.send_count(&asked),
        1,
        "the uncertain message was sent again"
    );
    std::fs::remove_file(&file).ok();
}

#[test]
fn a_forward_step_takes_back_no_live_attempt_and_brings_no_lookup_forward() {
    step_while_waiting("+2h", 7200.0);
}

#[test]
fn a_backward_step_takes_back_no_live_attempt_and_brings_no_lookup_forward() {
    step_while_waiting("-2h", -7200.0);
}
