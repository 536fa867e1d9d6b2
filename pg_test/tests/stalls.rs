//! Stalls, slow claims and failed records, end to end: what a worker that is stopped (a
//! paused VM, a frozen cgroup, `kill -STOP`), a claim that waits for a lock, a record that
//! fails, a gateway's 502/504 and a login role holding advisory locks can and cannot cause.
//!
//! Each stall lands where it is meant to, deterministically: the worker stops itself at an
//! `outbox.fault_injection` point (`stall_after_claim`, `stall_after_send`, …, a `SIGSTOP`
//! of its own process) and the test sends `SIGCONT` once the other worker has taken its
//! attempts back. Needs two workers (`OUTBOX_WORKERS=2`, as scripts/test.sh sets).
//!
//! Each test starts a cluster of its own under `OUTBOX_STALLS_BASE` (`/tmp/outbox_stalls`) on
//! `OUTBOX_STALLS_PGPORT` (54876), with two workers and `outbox.lease_ms` at its least: the
//! lease of a claim is the longest `timeout_ms` of any channel plus 5 s, and the channels of
//! other tests would lengthen it past the stalls here.
//!
//! Run: `cargo test -p outbox_e2e --release --test stalls -- --test-threads=1 --nocapture`

use outbox_e2e::cluster::{
    env_port, poll, state_of, unique, wait_for_workers, wait_until, Cluster, OwnCluster,
};
use outbox_e2e::helpers::{
    arm_fault, attempts, count, create_channel, describe, enqueue, ident, serial,
};
use outbox_e2e::nats::NatsServer;
use outbox_e2e::sim::{Action, Simulator};
use postgres::Client;
use serde_json::{json, Value};
use std::process::Command;
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

/// Long enough for recovery after a stall longer than the lease, a lookup's settle time and
/// a resend.
const SETTLE: Duration = Duration::from_secs(60);
/// The lease of the channels here: `outbox.lease_ms` at its least (1 s) is lengthened to the
/// channel's `timeout_ms` (1 s) plus 5 s.
const LEASE: Duration = Duration::from_secs(6);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Dedupe,
    Reconcile,
    Neither,
}

const KINDS: [Kind; 3] = [Kind::Dedupe, Kind::Reconcile, Kind::Neither];

fn options(kind: Kind, sim: &Simulator, ch: &str) -> Value {
    let mut o = match kind {
        Kind::Dedupe => json!({"idempotency_header": "Idempotency-Key"}),
        Kind::Reconcile => json!({
            "reference_header": "X-Effect-Key",
            "reconcile": {"url": sim.lookup_url_by_key(ch), "found": "/found", "external_id": "/id", "settle_ms": 500}
        }),
        Kind::Neither => json!({}),
    };
    o["timeout_ms"] = json!(1000);
    o["connect_timeout_ms"] = json!(500);
    o["external_id"] = json!("/id");
    o["retry"] = json!({"base_ms": 200, "max_ms": 1000, "jitter": "none"});
    o
}

/// One channel of `kind`, sending to `sim`.
fn channel(c: &mut Client, sim: &Simulator, tag: &str, kind: Kind) -> String {
    let ch = unique(&format!("st_{tag}_{kind:?}").to_lowercase());
    if kind == Kind::Dedupe {
        sim.set_dedupe(&ch, "Idempotency-Key");
    }
    create_channel(
        c,
        &ch,
        &sim.send_url(&ch),
        &options(kind, sim, &ch).to_string(),
    );
    ch
}

/// The state letter of a process (`/proc/PID/stat`): `T` when stopped.
fn process_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(") ")?.1;
    after.chars().next()
}

/// Waits for a worker that stopped itself; its PID.
fn stopped_worker(cluster: &Cluster, c: &mut Client) -> i32 {
    let mut found = 0;
    let ok = wait_until(Duration::from_secs(20), || {
        match cluster
            .worker_pids(c)
            .into_iter()
            .find(|pid| process_state(*pid) == Some('T'))
        {
            Some(pid) => {
                found = pid;
                true
            }
            None => false,
        }
    });
    assert!(ok, "no worker stopped itself at the fault point");
    found
}

/// A worker stopped by a test goes on when the guard is dropped (also on a failure).
struct Continue(i32);

impl Drop for Continue {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.0.to_string()])
            .status();
    }
}

/// Waits until message `id` has settled in one of `states` and stays there for a second.
fn settled(cluster: &Cluster, id: i64, states: &[&str]) -> String {
    let mut last = None;
    let ok = wait_until(SETTLE, || {
        last = state_of(cluster, id);
        last.as_deref().is_some_and(|s| states.contains(&s))
    });
    assert!(
        ok,
        "message {id} did not reach {states:?} within {SETTLE:?}; last {last:?}; see {}",
        cluster.log_path().display()
    );
    std::thread::sleep(Duration::from_secs(1));
    state_of(cluster, id).unwrap_or_default()
}

/// How many requests carrying the message's key the provider received.
fn sends_of(sim: &Simulator, kind: Kind, ch: &str, key_sent: &str, key: &str) -> usize {
    sim.sends(ch)
        .iter()
        .filter(|r| match kind {
            Kind::Neither => String::from_utf8_lossy(&r.body).contains(key),
            _ => r.key.as_deref() == Some(key_sent),
        })
        .count()
}

fn key_sent(c: &mut Client, id: i64) -> String {
    c.query_one(
        "SELECT outbox._provider_key(tenant, effect_key) FROM outbox.messages WHERE id = $1",
        &[&id],
    )
    .map(|r| r.get(0))
    .unwrap_or_else(|e| panic!("the key of message {id}: {}", describe(&e)))
}

/// What every test here starts from: the test's turn, a cluster of its own started fresh
/// with two workers and the least lease (`outbox.lease_ms` = 1000, in its configuration),
/// their PIDs once both serve, and a provider simulator.
fn stage() -> (MutexGuard<'static, ()>, OwnCluster, Vec<i32>, Simulator) {
    let turn = serial();
    let base = std::env::var("OUTBOX_STALLS_BASE").unwrap_or_else(|_| "/tmp/outbox_stalls".into());
    let port = env_port("OUTBOX_STALLS_PGPORT", 54876);
    let own = OwnCluster::fresh(base.into(), port, "outbox", 2, "outbox.lease_ms = 1000");
    let workers = wait_for_workers(&own, &[]);
    assert!(workers.len() >= 2, "needs two workers");
    (turn, own, workers, Simulator::start())
}

/// One message on a fresh channel of each kind, enqueued in one transaction (one claim
/// takes all three) while the stall `point` is armed; the worker that stops there stays
/// stopped past the lease, while the other takes back what it can (a lookup, a resend with
/// the same key, an operator's queue), then runs again. The messages: kind, channel, key, id.
fn stalled_at(
    cluster: &Cluster,
    sim: &Simulator,
    c: &mut Client,
    point: &str,
) -> Vec<(Kind, String, String, i64)> {
    let lanes: Vec<(Kind, String)> = KINDS
        .iter()
        .map(|&k| (k, channel(c, sim, point, k)))
        .collect();
    let fault = arm_fault(cluster, point);
    let mut tx = c.transaction().unwrap();
    let ids = lanes
        .iter()
        .map(|(k, ch)| {
            let key = unique("stk");
            let id = enqueue(&mut tx, ch, &key);
            (*k, ch.clone(), key, id)
        })
        .collect();
    tx.commit().unwrap();
    let stopped = stopped_worker(cluster, c);
    let resume = Continue(stopped);
    drop(fault);
    std::thread::sleep(LEASE + Duration::from_secs(2));
    drop(resume);
    ids
}

/// A worker stops right after its claim committed, before any byte of its requests left,
/// for longer than the lease. The other worker takes the attempts back; when the stopped
/// one runs again, it does not send them: their fence has passed. No key reaches a
/// provider that can be asked, or one that can neither dedupe nor be asked, twice.
#[test]
fn a_worker_stopped_between_its_claim_and_its_requests_sends_nothing_when_it_resumes() {
    let (_turn, own, _workers, sim) = stage();
    let cluster: &Cluster = &own;
    let mut c = cluster.connect();
    let mark = cluster.log_mark();
    let ids = stalled_at(cluster, &sim, &mut c, "stall_after_claim");
    let mut rows = Vec::new();
    for (kind, ch, key, id) in &ids {
        let expected: &[&str] = match kind {
            Kind::Neither => &["uncertain"],
            _ => &["delivered"],
        };
        let state = settled(cluster, *id, expected);
        let sent = key_sent(&mut c, *id);
        let n = sends_of(&sim, *kind, ch, &sent, key);
        rows.push(format!("{kind:?}: {state}, {n} send(s)"));
        match kind {
            // Taken back as interrupted: resent with the same key, which the provider dedupes.
            Kind::Dedupe => assert!(n <= 2 && sim.stored(ch).len() == 1, "{rows:?}"),
            // Looked up (not found: nothing was sent), then sent once.
            Kind::Reconcile => assert_eq!(n, 1, "{rows:?}"),
            // Nothing was sent; it waits for an operator, who may retry it safely.
            Kind::Neither => assert_eq!(n, 0, "{rows:?}"),
        }
    }
    let log = cluster.log_since(mark);
    assert!(
        log.contains("not sent: their lease ran out"),
        "the resumed worker says it sent nothing: {rows:?}"
    );
    eprintln!("stall after the claim: {rows:?}");
}

/// A worker stops inside its claim's transaction, holding the claim lock and the rows it
/// claimed, for longer than the lease. The other worker goes on delivering: it waits for
/// the claim lock for a second, then claims without it. When the stopped worker runs again
/// its claim commits with a fence that has passed: it sends nothing, and what it claimed is
/// sent once, by whichever worker claims it next.
#[test]
fn a_worker_stopped_inside_its_claim_does_not_stop_the_other() {
    let (_turn, own, _workers, sim) = stage();
    let cluster: &Cluster = &own;
    let mut c = cluster.connect();
    let lanes: Vec<(Kind, String)> = KINDS
        .iter()
        .map(|&k| (k, channel(&mut c, &sim, "inclaim", k)))
        .collect();
    let fault = arm_fault(cluster, "stall_in_claim");
    let mut tx = c.transaction().unwrap();
    let held: Vec<(Kind, String, String, i64)> = lanes
        .iter()
        .map(|(k, ch)| {
            let key = unique("stc");
            (*k, ch.clone(), key.clone(), enqueue(&mut tx, ch, &key))
        })
        .collect();
    tx.commit().unwrap();
    let stopped = stopped_worker(cluster, &mut c);
    let resume = Continue(stopped);
    drop(fault);
    // While it is stopped, another channel's messages are delivered by the other worker.
    let other = channel(&mut c, &sim, "inclaim_other", Kind::Dedupe);
    let started = Instant::now();
    let others: Vec<i64> = (0..5)
        .map(|_| enqueue(&mut c, &other, &unique("sto")))
        .collect();
    let delivered = wait_until(Duration::from_secs(15), || {
        others
            .iter()
            .all(|id| state_of(cluster, *id).as_deref() == Some("delivered"))
    });
    assert!(
        delivered,
        "the other worker delivered nothing while one was stopped inside its claim; see {}",
        cluster.log_path().display()
    );
    let waited = started.elapsed();
    assert_eq!(
        process_state(stopped),
        Some('T'),
        "the worker was still stopped"
    );
    std::thread::sleep((LEASE + Duration::from_secs(2)).saturating_sub(waited));
    drop(resume);
    let mut rows = Vec::new();
    for (kind, ch, key, id) in &held {
        let state = settled(cluster, *id, &["delivered"]);
        let sent = key_sent(&mut c, *id);
        let n = sends_of(&sim, *kind, ch, &sent, key);
        rows.push(format!("{kind:?}: {state}, {n} send(s)"));
        assert_eq!(n, 1, "{rows:?}");
    }
    eprintln!("stall inside the claim: others delivered in {waited:?}; {rows:?}");
}

/// A worker stops with its answers in hand, for longer than the lease, at each of the points
/// after its requests went out: before it read the answers (`stall_after_send`), before it
/// recorded them (`stall_after_response`), and inside the record's transaction before its
/// commit (`stall_before_commit`). The other worker takes back what it can as interrupted;
/// when the stopped one runs again, its answers are recorded as confirmations: no confirmed
/// answer ends `uncertain`, and no key reaches a provider that can be asked twice.
#[test]
fn a_worker_stopped_with_its_answers_in_hand_loses_no_confirmation() {
    let (_turn, own, _workers, sim) = stage();
    let cluster: &Cluster = &own;
    let mut c = cluster.connect();
    for point in [
        "stall_after_send",
        "stall_after_response",
        "stall_before_commit",
    ] {
        let ids = stalled_at(cluster, &sim, &mut c, point);
        let mut rows = Vec::new();
        for (kind, ch, key, id) in &ids {
            let state = settled(cluster, *id, &["delivered"]);
            let sent = key_sent(&mut c, *id);
            let n = sends_of(&sim, *kind, ch, &sent, key);
            rows.push(format!("{kind:?}: {state}, {n} send(s)"));
            match kind {
                Kind::Dedupe => assert_eq!(sim.stored(ch).len(), 1, "{point}: {rows:?}"),
                Kind::Reconcile | Kind::Neither => assert_eq!(n, 1, "{point}: {rows:?}"),
            }
        }
        eprintln!("{point}: {rows:?}");
    }
}

/// A `nats` channel (JetStream, which drops a second publish of a `Nats-Msg-Id` inside its
/// duplicate window) stopped at each of the four points for longer than the lease: each
/// message ends `delivered`, and the stream holds its key once.
#[test]
fn a_nats_channel_stopped_at_each_point_keeps_each_key_once() {
    let (_turn, own, _workers, _sim) = stage();
    let cluster: &Cluster = &own;
    let mut c = cluster.connect();
    let nats = NatsServer::start(None);
    let mut rows = Vec::new();
    for point in [
        "stall_after_claim",
        "stall_after_send",
        "stall_after_response",
        "stall_before_commit",
    ] {
        let ch = unique("st_nats");
        let prefix = ch.replace(['-', '.'], "_");
        let stream = prefix.to_uppercase();
        nats.create_stream(&stream, &[&format!("{prefix}.>")], Duration::from_secs(600));
        create_channel(
            &mut c,
            &ch,
            &nats.url(),
            &json!({
                "kind": "nats", "subject": format!("{prefix}.out"), "stream": stream,
                "timeout_ms": 1000, "connect_timeout_ms": 500,
                "retry": {"base_ms": 200, "max_ms": 1000, "jitter": "none"}
            })
            .to_string(),
        );
        let fault = arm_fault(cluster, point);
        let id = enqueue(&mut c, &ch, &unique("stn"));
        let stopped = stopped_worker(cluster, &mut c);
        let resume = Continue(stopped);
        drop(fault);
        std::thread::sleep(LEASE + Duration::from_secs(2));
        drop(resume);
        let state = settled(cluster, id, &["delivered"]);
        let sent = key_sent(&mut c, id);
        let copies = nats.copies_by_id(&stream);
        let stored = nats.messages(&stream).len();
        rows.push(format!("{point}: {state}, {stored} stored"));
        assert_eq!(
            (copies.get(&sent).copied(), stored),
            (Some(1), 1),
            "{point}: the stream holds the key once: {copies:?}; {rows:?}"
        );
    }
    eprintln!("nats: {rows:?}");
}

/// The record of a batch fails (here: it is cancelled twice while it waits for a row lock
/// an application holds, under a database whose `lock_timeout` would have failed it too).
/// The worker keeps the answers and records them once it can: the confirmed delivery on a
/// channel that can neither dedupe nor be asked ends `delivered`, sent once.
#[test]
fn a_record_that_fails_is_tried_again_with_the_answers_in_hand() {
    let (_turn, own, _workers, sim) = stage();
    let cluster: &Cluster = &own;
    let mut c = cluster.connect();
    let db: String = c
        .query_one("SELECT current_database()", &[])
        .unwrap()
        .get(0);
    // Applications' settings that the worker must not take for its own statements.
    c.batch_execute(&format!(
        "ALTER DATABASE {} SET lock_timeout = '200ms'",
        ident(&db)
    ))
    .unwrap();
    struct ResetDatabase<'a>(&'a Cluster, String);
    impl Drop for ResetDatabase<'_> {
        fn drop(&mut self) {
            let mut c = self.0.connect();
            let _ = c.batch_execute(&format!(
                "ALTER DATABASE {} RESET lock_timeout",
                ident(&self.1)
            ));
        }
    }
    let _reset = ResetDatabase(cluster, db.clone());
    // The workers read the database's settings when they connect: restart them.
    let before = wait_for_workers(cluster, &[]);
    c.batch_execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE backend_type = 'outbox_delivery worker'",
    )
    .unwrap();
    wait_for_workers(cluster, &before);

    let ch = channel(&mut c, &sim, "record", Kind::Neither);
    sim.set_default(&ch, Action::AcceptAfter(Duration::from_millis(700)));
    let key = unique("str");
    let id = enqueue(&mut c, &ch, &key);
    assert!(
        sim.wait_for_sends(&ch, 1, Duration::from_secs(10)),
        "no send"
    );
    // The application holds the message's row while the answer comes back.
    let mut app = cluster.connect();
    app.batch_execute("SET lock_timeout = 0").unwrap();
    let mut tx = app.transaction().unwrap();
    tx.execute(
        "SELECT 1 FROM outbox._messages WHERE id = $1 FOR UPDATE",
        &[&id],
    )
    .unwrap();
    // The record waits for the row: cancel it, twice. (Its WARNINGs are not in this
    // cluster's log, which keeps LOG and FATAL only: the outcome says it.)
    let mut cancelled = 0;
    let started = Instant::now();
    while cancelled < 2 && started.elapsed() < Duration::from_secs(20) {
        let waiting: Vec<i32> = c
            .query(
                "SELECT pid FROM pg_stat_activity
                  WHERE backend_type = 'outbox_delivery worker' AND wait_event_type = 'Lock'
                    AND wait_event IN ('transactionid', 'tuple')",
                &[],
            )
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        if let Some(pid) = waiting.first() {
            let cancelled_now: bool = c
                .query_one("SELECT pg_cancel_backend($1)", &[pid])
                .unwrap()
                .get(0);
            eprintln!("cancelled the record of worker {pid}: {cancelled_now}");
            cancelled += 1;
            std::thread::sleep(Duration::from_millis(300));
        } else {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    assert_eq!(cancelled, 2, "the record never waited for the row");
    std::thread::sleep(Duration::from_millis(500));
    tx.commit().unwrap();
    let state = settled(
        cluster,
        id,
        &["delivered", "uncertain", "failed", "exhausted"],
    );
    let tries = attempts(&mut c, id);
    assert_eq!(state, "delivered", "attempts: {tries:?}");
    assert_eq!(sim.send_count(&ch), 1, "sends");
    assert_eq!(tries.len(), 1, "attempts: {tries:?}");
}

/// A gateway's 502 or 504 may come after its upstream took the request: on a channel that
/// can neither dedupe nor be asked it is ambiguous, and the message stops `uncertain` after
/// one send instead of being sent again; on a deduping channel it is retried with the key.
#[test]
fn a_gateway_502_or_504_is_not_resent_blindly() {
    let (_turn, own, _workers, sim) = stage();
    let cluster: &Cluster = &own;
    let mut c = cluster.connect();
    for status in [502u16, 504] {
        let neither = channel(&mut c, &sim, &format!("gw{status}"), Kind::Neither);
        sim.set_default(&neither, Action::Status(status));
        let id = enqueue(&mut c, &neither, &unique("stg"));
        let state = settled(cluster, id, &["uncertain", "exhausted", "failed"]);
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(
            (state.as_str(), sim.send_count(&neither)),
            ("uncertain", 1),
            "{status} on a channel that can neither dedupe nor be asked"
        );
        let dedupe = channel(&mut c, &sim, &format!("gwd{status}"), Kind::Dedupe);
        sim.set_plan(&dedupe, vec![Action::Status(status)]);
        let id = enqueue(&mut c, &dedupe, &unique("stg"));
        assert_eq!(settled(cluster, id, &["delivered"]), "delivered");
        assert_eq!(
            sim.send_count(&dedupe),
            2,
            "{status} then a resend with the key"
        );
    }
}

/// A claim that waited for a lock longer than the lease keeps a whole lease from when it
/// was made: the other worker does not take its attempt back while it is being sent.
#[test]
fn a_claim_that_waited_for_a_lock_is_not_taken_back() {
    let (_turn, own, _workers, sim) = stage();
    let cluster: &Cluster = &own;
    let mut c = cluster.connect();
    let ch = channel(&mut c, &sim, "lockwait", Kind::Dedupe);
    sim.set_default(&ch, Action::AcceptAfter(Duration::from_millis(800)));
    let key = unique("stl");
    let id: i64 = c
        .query_one(
            "SELECT outbox.enqueue($1::text, $2::text::jsonb, $3::text, NULL, now() + interval '500 milliseconds')",
            &[&ch, &json!({"key": key}).to_string(), &key],
        )
        .unwrap()
        .get(0);
    // The claim's insert into the claims waits behind this lock for longer than a lease.
    let mut holder = cluster.connect();
    let mut tx = holder.transaction().unwrap();
    tx.batch_execute("LOCK TABLE outbox._claims IN SHARE MODE")
        .unwrap();
    std::thread::sleep(LEASE + Duration::from_secs(2));
    tx.commit().unwrap();
    let state = settled(cluster, id, &["delivered", "uncertain"]);
    let tries = attempts(&mut c, id);
    assert_eq!(state, "delivered");
    assert_eq!(sim.send_count(&ch), 1, "attempts: {tries:?}");
    assert_eq!(tries.len(), 1, "attempts: {tries:?}");
}

/// A login role with no grant at all holds every advisory lock it can name that the
/// workers ever used (the claim lock of two int4 keys, the oid-keyed locks of holding behind
/// ordering keys and of the ledger's retention), in a transaction left open: every tenant's
/// messages are delivered all the same.
#[test]
fn no_login_role_stops_delivery_with_advisory_locks() {
    let (_turn, own, _workers, sim) = stage();
    let cluster: &Cluster = &own;
    let mut c = cluster.connect();
    let role = unique("nobody");
    c.batch_execute(&format!("CREATE ROLE {} LOGIN", ident(&role)))
        .unwrap();
    let oids: (i64, i64) = {
        let r = c
            .query_one(
                "SELECT 'outbox._messages_key_held_idx'::regclass::oid::int8,
                        'outbox._ledger_generations'::regclass::oid::int8",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    let mut hostile = cluster.connect();
    hostile
        .batch_execute(&format!("SET ROLE {}", ident(&role)))
        .unwrap();
    let mut tx = hostile.transaction().unwrap();
    tx.batch_execute(&format!(
        "SELECT pg_advisory_lock(1868722040, 1);
         SELECT pg_advisory_xact_lock(1868722040, 1);
         SELECT pg_advisory_lock({});
         SELECT pg_advisory_lock({});
         SELECT pg_advisory_lock(k, s) FROM generate_series(0, 8) k, generate_series(0, 8) s;
         LISTEN outbox; NOTIFY outbox, 'x';",
        oids.0, oids.1
    ))
    .unwrap();
    let ch = channel(&mut c, &sim, "advisory", Kind::Dedupe);
    let ids: Vec<i64> = (0..5)
        .map(|_| enqueue(&mut c, &ch, &unique("sth")))
        .collect();
    let delivered = poll(cluster, Duration::from_secs(10), |c| {
        let n = count(
            c,
            "SELECT count(*) FROM outbox.messages WHERE id = ANY($1) AND state = 'delivered'",
            &[&ids],
        );
        Ok((n == ids.len() as i64).then_some(()))
    });
    tx.rollback().unwrap();
    drop(hostile);
    let _ = c.batch_execute(&format!("DROP ROLE {}", ident(&role)));
    assert!(
        delivered.is_some(),
        "delivery stopped while a role with no grant held advisory locks"
    );
}

/// A soak of stalls: while messages flow over the three channel kinds, a worker is stopped
/// (`kill -STOP`) and resumed (`kill -CONT`) again and again at random moments, several
/// times for longer than the lease. Then: no key reached a provider that can be asked, or
/// one that can neither dedupe nor be asked, twice; the deduping provider stored each key
/// once; nothing is lost (every message is `delivered`, or `uncertain` on the channel that
/// can neither dedupe nor be asked).
#[test]
fn random_stalls_of_the_workers_cause_no_blind_duplicate_and_lose_nothing() {
    let (_turn, own, workers, sim) = stage();
    let cluster: &Cluster = &own;
    let mut c = cluster.connect();
    let lanes: Vec<(Kind, String)> = KINDS
        .iter()
        .map(|&k| (k, channel(&mut c, &sim, "soak", k)))
        .collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stalls = {
        let stop = stop.clone();
        let workers = workers.clone();
        std::thread::spawn(move || {
            // A splitmix64 of its own: the same stalls for the same seed.
            let mut seed: u64 = 0x5eed_0057_a115;
            let mut next = move || {
                seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = seed;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d1_049b_1331_11eb);
                z ^ (z >> 31)
            };
            let mut stalls = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(300 + next() % 1200));
                let pid = workers[(next() % workers.len() as u64) as usize];
                // One stall in three outlasts the lease.
                let ms = if next() % 3 == 0 {
                    7_000 + next() % 2_000
                } else {
                    100 + next() % 2_000
                };
                let _ = Command::new("kill")
                    .args(["-STOP", &pid.to_string()])
                    .status();
                let resume = Continue(pid);
                std::thread::sleep(Duration::from_millis(ms));
                drop(resume);
                stalls.push(ms);
            }
            stalls
        })
    };
    let mut ids: Vec<(Kind, String, String, i64)> = Vec::new();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(45) {
        for (kind, ch) in &lanes {
            let key = unique("sts");
            let id = enqueue(&mut c, ch, &key);
            ids.push((*kind, ch.clone(), key, id));
        }
        std::thread::sleep(Duration::from_millis(150));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let stalls = stalls.join().expect("the stalls");
    for pid in &workers {
        let _ = Command::new("kill")
            .args(["-CONT", &pid.to_string()])
            .status();
    }
    // Everything settles: nothing queued or in flight on the soak's channels any more.
    let channels: Vec<String> = lanes.iter().map(|(_, ch)| ch.clone()).collect();
    let quiet = poll(cluster, Duration::from_secs(120), |c| {
        let open = count(
            c,
            "SELECT count(*) FROM outbox.messages WHERE channel = ANY($1) AND state IN ('queued', 'sending')",
            &[&channels],
        );
        Ok((open == 0).then_some(()))
    });
    assert!(
        quiet.is_some(),
        "the soak's messages did not settle within 120 s"
    );
    let states: std::collections::HashMap<i64, String> = c
        .query(
            "SELECT id, state::text FROM outbox.messages WHERE channel = ANY($1)",
            &[&channels],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let mut lost = Vec::new();
    let mut duplicates = Vec::new();
    let mut uncertain = 0;
    for (kind, ch, key, id) in &ids {
        let state = states.get(id).cloned().unwrap_or_default();
        let sent = key_sent(&mut c, *id);
        let n = sends_of(&sim, *kind, ch, &sent, key);
        match (kind, state.as_str()) {
            (Kind::Neither, "uncertain") => uncertain += 1,
            (_, "delivered") => {}
            _ => lost.push(format!("{kind:?} {id} {state}")),
        }
        if *kind != Kind::Dedupe && n > 1 {
            duplicates.push(format!("{kind:?} {id}: {n} sends"));
        }
    }
    for (kind, ch) in &lanes {
        if *kind == Kind::Dedupe {
            let stored = sim.stored(ch).len();
            let sent: usize = ids.iter().filter(|(k, _, _, _)| k == kind).count();
            assert_eq!(stored, sent, "the deduping provider stores each key once");
        }
    }
    let long = stalls
        .iter()
        .filter(|ms| **ms > LEASE.as_millis() as u64)
        .count();
    eprintln!(
        "stall soak: {} messages, {} stalls ({long} longer than the lease), {uncertain} uncertain on the channel that can neither dedupe nor be asked, {} lost, {} blind duplicates",
        ids.len(),
        stalls.len(),
        lost.len(),
        duplicates.len()
    );
    assert!(
        long >= 2,
        "the soak proves nothing without stalls past the lease: {stalls:?}"
    );
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert!(duplicates.is_empty(), "blind duplicates: {duplicates:?}");
}

/// A request answered while its worker was stopped (for longer than the request's timeout,
/// shorter than the lease) is recorded as answered when the worker resumes: the answer was
/// waiting in the socket, and the timeout that passed during the stop does not turn it into
/// an ambiguous outcome.
#[test]
fn a_request_answered_while_its_worker_was_stopped_is_recorded_as_answered() {
    let (_turn, own, workers, sim) = stage();
    let cluster: &Cluster = &own;
    let mut c = cluster.connect();
    let ch = channel(&mut c, &sim, "paused_answer", Kind::Neither);
    sim.set_default(&ch, Action::AcceptAfter(Duration::from_millis(300)));
    let id = enqueue(&mut c, &ch, &unique("stp"));
    assert!(
        sim.wait_for_sends(&ch, 1, Duration::from_secs(10)),
        "no send"
    );
    // Every worker stops while the provider answers, for three times the request's timeout.
    let resume: Vec<Continue> = workers
        .iter()
        .map(|pid| {
            let _ = Command::new("kill")
                .args(["-STOP", &pid.to_string()])
                .status();
            Continue(*pid)
        })
        .collect();
    std::thread::sleep(Duration::from_secs(3));
    drop(resume);
    let state = settled(cluster, id, &["delivered", "uncertain"]);
    let tries = attempts(&mut c, id);
    assert_eq!(state, "delivered", "attempts: {tries:?}");
    assert_eq!(
        (sim.send_count(&ch), tries.len()),
        (1, 1),
        "attempts: {tries:?}"
    );
}
