//! The four restart points (1)-(4), each with its fault-injection point and with a real kill.

use super::*;
use outbox_e2e::cluster::wait_until;

// ---------------------------------------------------------------------------------------
// (1) The client dies before its COMMIT
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
pub(super) enum ClientKill {
    /// `outbox.fault_injection = crash_after_claim` armed (it would fire on any claim of
    /// these messages), then `pg_terminate_backend` of the client's backend.
    FaultArmedTerminate,
    /// `kill -9` of the client's backend process (the postmaster crash-restarts).
    Kill9Backend,
    /// `pg_ctl stop -m immediate` while the transaction is open, then start.
    ImmediateStop,
}

pub(super) fn client_dies(scenario: &str, how: ClientKill) -> Vec<Row> {
    let (cluster, before, sim, mut c, chans) = start_with_channels("p1", FAST_RETRY);
    let keys: Vec<String> = chans
        .iter()
        .map(|(k, _)| unique(&format!("p1_{}", k.short())))
        .collect();
    let mark = cluster.log_mark();
    let guard =
        (how == ClientKill::FaultArmedTerminate).then(|| arm_fault(&cluster, "crash_after_claim"));

    // The application's transaction: enqueue on every channel, no COMMIT.
    let mut app = cluster.connect();
    app.batch_execute("BEGIN").unwrap();
    let backend: i32 = app
        .query_one("SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    let ids: Vec<i64> = chans
        .iter()
        .zip(&keys)
        .map(|((_, ch), key)| {
            try_enqueue(&mut app, ch, key).expect("enqueue in the open transaction")
        })
        .collect();
    // Three poll intervals: a worker that could see the rows would have claimed them.
    std::thread::sleep(Duration::from_millis(1500));
    let visible = count(
        &mut c,
        "SELECT count(*) FROM outbox._messages WHERE effect_key = ANY($1)",
        &[&keys],
    );
    let mut pre = Vec::new();
    if visible != 0 {
        pre.push(format!(
            "{visible} uncommitted message(s) visible to others"
        ));
    }
    let sent_early: usize = chans.iter().map(|(_, ch)| sim.send_count(ch)).sum();
    if sent_early != 0 {
        pre.push(format!("{sent_early} send(s) before the COMMIT"));
    }

    match how {
        ClientKill::FaultArmedTerminate => {
            let ok: bool = c
                .query_one("SELECT pg_terminate_backend($1)", &[&backend])
                .unwrap()
                .get(0);
            assert!(ok, "pg_terminate_backend({backend})");
        }
        ClientKill::Kill9Backend => {
            drop(c);
            assert!(kill_9(backend), "kill -9 {backend}");
        }
        ClientKill::ImmediateStop => {
            drop(c);
            cluster.crash_restart();
        }
    }
    assert!(
        app.batch_execute("COMMIT").is_err(),
        "the client's COMMIT must fail: its backend is gone"
    );
    drop(app);
    if how == ClientKill::FaultArmedTerminate {
        wait_for_workers(&cluster, &[]);
    } else {
        wait_for_workers(&cluster, &before);
    }
    std::thread::sleep(QUIET);

    // Nothing exists, nothing was sent, nothing was claimed.
    let mut c = cluster.connect();
    let rows = count(
        &mut c,
        "SELECT count(*) FROM outbox._messages WHERE effect_key = ANY($1)",
        &[&keys],
    );
    let ledger = count(
        &mut c,
        "SELECT count(*) FROM outbox.ledger WHERE effect_key = ANY($1)",
        &[&keys],
    );
    if rows != 0 || ledger != 0 {
        pre.push(format!(
            "after the kill: {rows} message row(s), {ledger} ledger row(s)"
        ));
    }
    let sent: usize = chans.iter().map(|(_, ch)| sim.send_count(ch)).sum();
    if sent != 0 {
        pre.push(format!("after the kill: {sent} send(s)"));
    }
    let fired = fault_fired_for(&cluster.log_since(mark), "crash_after_claim");
    if ids.iter().any(|id| fired.contains(id)) {
        pre.push(format!("a worker claimed an uncommitted message: {ids:?}"));
    }
    drop(guard);

    // The application runs the turn again: same effect keys, committed this time.
    let lanes = enqueue_all(&mut c, &chans, Some(&keys));
    drop(c);
    let mut rows_out = settle_and_judge(
        &cluster,
        &sim,
        scenario,
        &lanes,
        &|_| delivered(1, 1, 0, 0, "worker").outcomes(&["accepted"]),
        &|_, _| pre.clone(),
    );
    for r in &mut rows_out {
        r.local = format!("after the kill: no message, 0 sent; re-run: {}", r.local);
    }
    rows_out
}

// ---------------------------------------------------------------------------------------
// (2)-(4) with the fault-injection points
// ---------------------------------------------------------------------------------------

/// Expectations after a crash at point (2): nothing reached the provider.
pub(super) fn after_claim(kind: Kind) -> Expect {
    match kind {
        // Recovery → same-key retry → delivered; the provider got one send.
        Kind::Dedupe => delivered(1, 2, 1, 0, "worker").outcomes(&["accepted"]),
        // Recovery → uncertain → lookup: not found → requeued, same key → delivered.
        Kind::Reconcile => delivered(1, 2, 1, 1, "worker").outcomes(&["accepted"]),
        // Recovery → uncertain; nothing sent, nothing resent.
        Kind::Neither => uncertain(0, 0, 1, 1),
    }
}

/// Expectations after a crash at points (3)/(4): the provider stored the message.
pub(super) fn after_provider_has_it(first_outcome: &'static str) -> impl Fn(Kind) -> Expect {
    move |kind| match kind {
        // Recovery → same-key retry → the provider answers from its dedupe store.
        Kind::Dedupe => delivered(2, 2, 1, 0, "worker").outcomes(&[first_outcome, "deduped"]),
        // Recovery → uncertain → lookup: found → delivered, 0 resends.
        Kind::Reconcile => delivered(1, 1, 1, 1, "reconcile").outcomes(&[first_outcome]),
        // Recovery → uncertain; the provider holds it; never resent.
        Kind::Neither => uncertain(1, 1, 1, 1).outcomes(&[first_outcome]),
    }
}

pub(super) fn fault_point(
    scenario: &str,
    point: &str,
    expect: &dyn Fn(Kind) -> Expect,
) -> Vec<Row> {
    let (cluster, mut c, sim) = cluster_and_sim();
    wait_for_workers(&cluster, &[]);
    let chans = make_channels(&mut c, &sim, "fp", FAST_RETRY, &json!({}), &|ch| {
        sim.send_url(ch)
    });
    let mark = cluster.log_mark();
    let guard = arm_fault(&cluster, point);
    let lanes = enqueue_all(&mut c, &chans, None);
    drop(c);
    // Claimed, the worker died at the point, and the restarted worker recovered the lease.
    let recovered = poll(&cluster, CRASH_SETTLE, |c| {
        for lane in &lanes {
            match state_attempts(c, lane.id)? {
                Some((s, n)) if n >= 1 && s != "sending" => {}
                _ => return Ok(None),
            }
        }
        Ok(Some(()))
    });
    drop(guard);
    assert!(
        recovered.is_some(),
        "{point}: the messages were not claimed and recovered within {CRASH_SETTLE:?}; see {}",
        cluster.log_path().display()
    );
    let fired = fault_fired_for(&cluster.log_since(mark), point);
    settle_and_judge(&cluster, &sim, scenario, &lanes, expect, &|lane, _| {
        if fired.contains(&lane.id) {
            Vec::new()
        } else {
            vec![format!(
                "the fault {point} did not fire with message {} in flight",
                lane.id
            )]
        }
    })
}

// ---------------------------------------------------------------------------------------
// (2) real kill: the worker is stuck in connect() (the request cannot be written) → kill -9
// ---------------------------------------------------------------------------------------

/// A loopback listener whose accept queue is full and is never accepted from: the kernel
/// drops further SYNs, so a client's connect() hangs and it can never write a request.
struct Blackhole {
    addr: SocketAddr,
    _listener: TcpListener,
    _fillers: Vec<TcpStream>,
}

impl Blackhole {
    fn new() -> Blackhole {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind blackhole");
        let addr = listener.local_addr().unwrap();
        let mut fillers = Vec::new();
        while let Ok(s) = TcpStream::connect_timeout(&addr, Duration::from_millis(300)) {
            fillers.push(s);
            assert!(fillers.len() < 5000, "the accept queue never filled");
        }
        let hole = Blackhole {
            addr,
            _listener: listener,
            _fillers: fillers,
        };
        assert!(!hole.reachable(), "the blackhole accepts connections");
        hole
    }

    fn reachable(&self) -> bool {
        TcpStream::connect_timeout(&self.addr, Duration::from_millis(300)).is_ok()
    }

    fn url(&self, ch: &str) -> String {
        format!("http://{}/ch/{ch}", self.addr)
    }
}

pub(super) fn after_claim_kill9(scenario: &str) -> Vec<Row> {
    let cluster = Cluster::from_env();
    let before = wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let hole = Blackhole::new();
    let mut c = cluster.connect();
    let chans = make_channels(
        &mut c,
        &sim,
        "p2k",
        FAST_RETRY,
        &json!({"connect_timeout_ms": 60000, "timeout_ms": 60000}),
        &|ch| hole.url(ch),
    );
    // Claimed: state sending, attempt row written; the worker now hangs in connect().
    let (lanes, ids) = enqueue_all_claimed(&cluster, &mut c, &chans);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!hole.reachable(), "the endpoint became reachable");
    let owners = attempt_owners(&mut c, &ids);
    assert!(
        owners.iter().all(|p| before.contains(p)) && !owners.is_empty(),
        "attempt owners {owners:?} are not the workers {before:?}"
    );
    // Move the channels to the simulator for what comes after the crash; the stuck attempt
    // keeps the endpoint it was claimed with.
    for lane in &lanes {
        alter_channel(
            &mut c,
            &lane.ch,
            &json!({"endpoint": sim.send_url(&lane.ch)}),
        );
    }
    let still: Vec<Option<(String, i32)>> = ids
        .iter()
        .map(|id| state_attempts(&mut c, *id).unwrap())
        .collect();
    assert!(
        still
            .iter()
            .all(|s| s.as_ref().map(|(s, _)| s.as_str()) == Some("sending")),
        "left the window before the kill: {still:?}"
    );
    drop(c);
    assert!(kill_9(owners[0]), "kill -9 {}", owners[0]);
    wait_for_workers(&cluster, &before);
    let rows = settle_and_judge(&cluster, &sim, scenario, &lanes, &after_claim, &no_extra);
    drop(hole);
    rows
}

// ---------------------------------------------------------------------------------------
// (3) real kill: the provider holds the request (Hang, stored) → kill -9 of the owner
// ---------------------------------------------------------------------------------------

pub(super) fn after_send_kill9(scenario: &str) -> Vec<Row> {
    let (cluster, before, sim, mut c, chans) = start_with_channels("p3k", FAST_RETRY);
    for (_, ch) in &chans {
        sim.set_default(ch, Action::Hang { store: true });
    }
    let lanes = enqueue_all(&mut c, &chans, None);
    for lane in &lanes {
        assert!(
            sim.wait_for_stored(&lane.ch, 1, CRASH_SETTLE),
            "the provider did not get message {}",
            lane.id
        );
    }
    let ids: Vec<i64> = lanes.iter().map(|l| l.id).collect();
    for id in &ids {
        let s = state_attempts(&mut c, *id).unwrap();
        assert_eq!(
            s.as_ref().map(|s| s.0.as_str()),
            Some("sending"),
            "message {id} must be in flight: {s:?}"
        );
    }
    let owners = attempt_owners(&mut c, &ids);
    assert!(!owners.is_empty() && owners.iter().all(|p| before.contains(p)));
    drop(c);
    for lane in &lanes {
        sim.set_default(&lane.ch, Action::Accept);
    }
    assert!(kill_9(owners[0]), "kill -9 {}", owners[0]);
    wait_for_workers(&cluster, &before);
    settle_and_judge(
        &cluster,
        &sim,
        scenario,
        &lanes,
        &after_provider_has_it("hang"),
        &no_extra,
    )
}

// ---------------------------------------------------------------------------------------
// (4) real kill: the answer was read, the record waits on a row lock → pg_ctl stop -m immediate
// ---------------------------------------------------------------------------------------

pub(super) fn before_commit_immediate_stop(scenario: &str) -> Vec<Row> {
    let (cluster, before, sim, mut c, chans) = start_with_channels("p4k", FAST_RETRY);
    for (_, ch) in &chans {
        sim.set_default(ch, Action::AcceptAfter(Duration::from_millis(2500)));
    }
    let (lanes, ids) = enqueue_all_claimed(&cluster, &mut c, &chans);
    // Hold the message rows: the worker's record transaction (which must update them) will
    // wait for this lock after it has read the answer.
    let mut locker = cluster.connect();
    locker.batch_execute("BEGIN").unwrap();
    let locked = locker
        .query(
            "SELECT m.id FROM outbox._messages m
              WHERE m.id = ANY($1) AND m.id IN (SELECT unnest(w.message_ids) FROM outbox._claims w)
                FOR UPDATE OF m",
            &[&ids],
        )
        .unwrap()
        .len();
    assert_eq!(locked, 3, "all three rows locked while in flight");
    for lane in &lanes {
        // Claimed is committed a moment before the request reaches the provider.
        wait_until(Duration::from_secs(2), || !sim.sends(&lane.ch).is_empty());
        let o = sim.sends(&lane.ch);
        assert!(
            o.len() == 1 && o[0].outcome == "delayed",
            "the provider answered before the lock was taken: {:?}",
            o.iter().map(|r| &r.outcome).collect::<Vec<_>>()
        );
    }
    // The provider answers (stored, 200) ...
    let answered = poll(&cluster, CRASH_SETTLE, |_| {
        Ok(lanes
            .iter()
            .all(|l| sim.sends(&l.ch).iter().any(|r| r.status == Some(200)))
            .then_some(()))
    });
    assert!(answered.is_some(), "the provider never answered");
    // ... and every worker that owns one of the attempts has read it and waits on our lock
    // inside its record transaction.
    let owners = attempt_owners(&mut c, &ids);
    let waiting = wait_for_count(
        &cluster,
        Duration::from_secs(20),
        "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1) AND wait_event_type = 'Lock'",
        &[&owners],
        |n| n as usize == owners.len(),
    );
    assert!(
        waiting,
        "the workers {owners:?} did not block in their record transaction"
    );
    let mut probe = cluster.connect();
    let ledger = count(
        &mut probe,
        "SELECT count(*) FROM outbox.ledger WHERE message_id = ANY($1)",
        &[&ids],
    );
    assert_eq!(ledger, 0, "nothing recorded yet");
    drop(probe);
    drop(c);
    for lane in &lanes {
        sim.set_default(&lane.ch, Action::Accept);
    }
    cluster.crash_restart();
    drop(locker);
    wait_for_workers(&cluster, &before);
    settle_and_judge(
        &cluster,
        &sim,
        scenario,
        &lanes,
        &after_provider_has_it("accepted"),
        &no_extra,
    )
}

/// One message a lane ([`enqueue_all`]), then waits until every one is claimed: state
/// `sending`, its attempt row written. Returns the lanes and the message ids.
fn enqueue_all_claimed(
    cluster: &Cluster,
    c: &mut Client,
    chans: &[(Kind, String)],
) -> (Vec<Lane>, Vec<i64>) {
    let lanes = enqueue_all(c, chans, None);
    let ids: Vec<i64> = lanes.iter().map(|l| l.id).collect();
    let claimed = poll(cluster, CRASH_SETTLE, |c| {
        for id in &ids {
            if state_attempts(c, *id)?.map(|(s, _)| s) != Some("sending".into()) {
                return Ok(None);
            }
        }
        Ok(Some(()))
    });
    assert!(claimed.is_some(), "the messages were not claimed");
    (lanes, ids)
}
