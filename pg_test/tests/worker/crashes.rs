//! Sections 4 and 5: `kill -9` of a worker mid-batch, and the fault-injection points.

use super::*;

// ---------------------------------------------------------------------------------------
// 4. kill -9 of a worker mid-batch on a deduping channel
// ---------------------------------------------------------------------------------------

#[test]
fn kill_9_mid_batch_on_deduping_channel_stores_each_effect_once() {
    let cluster = Cluster::from_env();
    let pids_before = wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let mut c = cluster.connect();
    let ch = sim_channel(
        &mut c,
        &sim,
        "w_kill",
        r#"{"idempotency_header": "Idempotency-Key", "external_id": "/id",
            "retry": {"base_ms": 200, "max_ms": 1000, "jitter": "none"}}"#,
    );
    sim.set_dedupe(&ch, "Idempotency-Key");
    sim.set_default(&ch, Action::Hang { store: true });
    let keys: Vec<String> = (0..5).map(|i| unique(&format!("k9_{i}"))).collect();
    let ids: Vec<i64> = {
        let mut tx = c.transaction().unwrap();
        let ids = keys
            .iter()
            .enumerate()
            .map(|(i, k)| enqueue_payload(&mut tx, &ch, &format!(r#"{{"n": {i}}}"#), k))
            .collect();
        tx.commit().unwrap();
        ids
    };
    assert!(
        sim.wait_for_stored(&ch, 5, SETTLE),
        "the provider did not get the batch: {} stored",
        sim.stored(&ch).len()
    );
    let states: Vec<String> = ids
        .iter()
        .map(|id| message(&mut c, *id).unwrap().unwrap().state)
        .collect();
    assert!(
        states.iter().all(|s| s == "sending"),
        "all in flight: {states:?}"
    );
    let in_flight_pids: Vec<i32> = c
        .query(
            "SELECT DISTINCT worker_pid FROM outbox.attempts WHERE message_id = ANY($1) AND kind = 'send'",
            &[&ids],
        )
        .unwrap()
        .iter()
        .filter_map(|r| r.get::<_, Option<i32>>(0))
        .collect();
    let victim = *in_flight_pids.first().expect("a worker has them in flight");
    assert!(
        pids_before.contains(&victim),
        "{victim} is a worker: {pids_before:?}"
    );
    drop(c);

    cluster.kill_worker(victim);
    sim.set_default(&ch, Action::Accept);

    // The postmaster crash-restarts the server and starts new workers.
    let pids_after = poll(&cluster, Duration::from_secs(60), |c| {
        let p = cluster.worker_pids(c);
        Ok((p.len() == 2 && p.iter().all(|p| !pids_before.contains(p))).then_some(p))
    })
    .unwrap_or_else(|| {
        panic!(
            "the workers were not restarted after kill -9 of {victim}; see {}",
            cluster.log_path().display()
        )
    });
    assert!(!pids_after.contains(&victim));

    for id in &ids {
        wait_msg(&cluster, *id, Duration::from_secs(60), "delivered", |m| {
            m.state == "delivered"
        });
    }

    // The provider stored each effect exactly once.
    let stored = sim.stored(&ch);
    let stored_keys: Vec<String> = stored.iter().filter_map(|s| s.key.clone()).collect();
    assert_eq!(stored.len(), 5, "stored: {stored_keys:?}");
    assert_eq!(
        stored_keys.iter().collect::<HashSet<_>>(),
        keys.iter().collect::<HashSet<_>>(),
        "each effect key stored exactly once"
    );
    let mut per_key: HashMap<String, Vec<String>> = HashMap::new();
    for r in sim.sends(&ch) {
        per_key
            .entry(r.key.clone().expect("every send carries the key"))
            .or_default()
            .push(r.outcome.clone());
    }
    for k in &keys {
        assert_eq!(
            per_key.get(k).map(Vec::as_slice),
            Some(&["hang".to_string(), "deduped".to_string()][..]),
            "key {k}: one hung send, then one same-key resend answered from the dedupe store"
        );
    }

    let mut c = cluster.connect();
    for (id, key) in ids.iter().zip(&keys) {
        let m = message(&mut c, *id).unwrap().unwrap();
        let ext = stored
            .iter()
            .find(|s| s.key.as_deref() == Some(key.as_str()))
            .map(|s| s.external_id.clone());
        assert_eq!(m.external_id, ext, "message {id} has the provider's id");
        let a = attempts(&mut c, *id);
        assert!(
            a.iter()
                .all(|a| a.effect_key_sent.as_deref() == Some(key.as_str())),
            "message {id}: the same key on every attempt: {a:?}"
        );
        assert_eq!(
            a.iter().filter(|a| a.kind == "send").count(),
            2,
            "message {id}: two send attempts: {a:?}"
        );
        assert!(
            a.iter().any(|a| a.kind == "recovery"),
            "message {id}: a recovery decision: {a:?}"
        );
        let ledger = count(
            &mut c,
            "SELECT count(*) FROM outbox.ledger WHERE effect_key = $1 AND message_id = $2",
            &[key, id],
        );
        assert_eq!(ledger, 1);
    }
}

// ---------------------------------------------------------------------------------------
// 5. Fault injection points
// ---------------------------------------------------------------------------------------

/// Enqueues one message with `point` armed and waits until the crash and its recovery
/// have happened (the fault is reset then); returns (simulator, channel, message id, the
/// server log written meanwhile) for the checks.
fn run_fault(point: &str, dedupe: bool) -> (Simulator, String, i64, String) {
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let ch = unique(&format!("w_{point}"));
    let mut c = cluster.connect();
    let options = if dedupe {
        sim.set_dedupe(&ch, "Idempotency-Key");
        r#"{"idempotency_header": "Idempotency-Key", "external_id": "/id",
            "retry": {"base_ms": 200, "max_ms": 1000, "jitter": "none"}}"#
    } else {
        r#"{"external_id": "/id", "retry": {"base_ms": 200, "max_ms": 1000, "jitter": "none"}}"#
    };
    create_channel(&mut c, &ch, &sim.send_url(&ch), options);

    let mark = cluster.log_mark();
    let guard = arm_fault(&cluster, point);
    let id = enqueue_payload(&mut c, &ch, r#"{"text": "fault"}"#, &unique("fault"));
    drop(c);
    // Claimed (attempt 1), the worker died, and the restarted worker recovered it.
    wait_msg(&cluster, id, SETTLE, "recovered (not sending)", |m| {
        m.attempts >= 1 && m.state != "sending"
    });
    drop(guard);

    let log = cluster.log_since(mark);
    // "... fault injection POINT: worker dies with messages [ID, ...] in flight" (the log
    // line prefix holds "[pid]" too: read the last bracket).
    let needle = format!("fault injection {point}:");
    let in_flight = |l: &str| -> Vec<i64> {
        l.rsplit_once('[')
            .and_then(|(_, rest)| rest.split_once(']'))
            .map(|(list, _)| {
                list.split(',')
                    .filter_map(|x| x.trim().parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    };
    let fired = log
        .lines()
        .any(|l| l.contains(&needle) && in_flight(l).contains(&id));
    assert!(
        fired,
        "the fault {point} did not fire with message {id} in flight; log:\n{log}"
    );
    assert!(
        log.contains("whose attempt was interrupted"),
        "a worker recovered the interrupted attempt; log:\n{log}"
    );
    (sim, ch, id, log)
}

fn assert_recovered_and_delivered_once(point: &str, expected_sends: usize) {
    let cluster = Cluster::from_env();
    let (sim, ch, id, _log) = run_fault(point, true);
    let m = wait_message(&cluster, id, "delivered");
    let stored = sim.stored(&ch);
    assert_eq!(stored.len(), 1, "{point}: stored exactly once");
    assert_eq!(
        m.external_id.as_deref(),
        Some(stored[0].external_id.as_str())
    );
    assert_eq!(stored[0].key.as_deref(), Some(m.effect_key.as_str()));
    let outcomes: Vec<String> = sim.sends(&ch).iter().map(|r| r.outcome.clone()).collect();
    assert_eq!(
        outcomes.len(),
        expected_sends,
        "{point}: sends {outcomes:?}"
    );
    if expected_sends == 2 {
        assert_eq!(outcomes, vec!["accepted", "deduped"], "{point}");
    }
    let mut c = cluster.connect();
    let a = attempts(&mut c, id);
    let recovery: Vec<&Attempt> = a.iter().filter(|a| a.kind == "recovery").collect();
    assert_eq!(recovery.len(), 1, "{point}: one recovery decision: {a:?}");
    assert_eq!(
        recovery[0].outcome.as_deref(),
        Some("recovered: queued"),
        "{point}: deduping channel → same-key retry: {a:?}"
    );
    assert_eq!(recovery[0].error_class.as_deref(), Some("ambiguous"));
    assert!(
        a.iter()
            .all(|a| a.effect_key_sent.as_deref() == Some(m.effect_key.as_str())),
        "{point}: the same key on every attempt: {a:?}"
    );
    let last_send = a.iter().rfind(|a| a.kind == "send").unwrap();
    assert_eq!(last_send.outcome.as_deref(), Some("delivered"));
    assert_eq!(last_send.http_status, Some(200));
    let ledger = ledger_entries(&mut c, id);
    assert_eq!(ledger, 1, "{point}: one ledger entry");
}

#[test]
fn fault_crash_after_claim_on_deduping_channel_is_delivered_once() {
    assert_recovered_and_delivered_once("crash_after_claim", 1);
}

#[test]
fn fault_crash_after_send_on_deduping_channel_is_delivered_once() {
    assert_recovered_and_delivered_once("crash_after_send", 2);
}

#[test]
fn fault_crash_after_response_on_deduping_channel_is_delivered_once() {
    assert_recovered_and_delivered_once("crash_after_response", 2);
}

#[test]
fn fault_crash_before_commit_on_deduping_channel_is_delivered_once() {
    assert_recovered_and_delivered_once("crash_before_commit", 2);
}

fn assert_uncertain_never_resent(point: &str, sends_left_by_crash: usize) {
    let cluster = Cluster::from_env();
    let (sim, ch, id, _log) = run_fault(point, false);
    let m = wait_message(&cluster, id, "uncertain");
    assert_eq!(m.last_error_class.as_deref(), Some("ambiguous"));
    assert_eq!(
        sim.send_count(&ch),
        sends_left_by_crash,
        "{point}: what the crash left"
    );
    std::thread::sleep(QUIET);
    assert_eq!(
        sim.send_count(&ch),
        sends_left_by_crash,
        "{point}: never blindly resent"
    );
    assert_eq!(sim.stored(&ch).len(), sends_left_by_crash);
    let mut c = cluster.connect();
    let m = message(&mut c, id).unwrap().unwrap();
    assert_eq!(m.state, "uncertain", "{point}: stays uncertain");
    assert_eq!(m.attempts, 1);
    let a = attempts(&mut c, id);
    let recovery: Vec<&Attempt> = a.iter().filter(|a| a.kind == "recovery").collect();
    assert_eq!(recovery.len(), 1, "{point}: one recovery decision: {a:?}");
    assert_eq!(recovery[0].outcome.as_deref(), Some("recovered: uncertain"));
    assert_eq!(a.iter().filter(|a| a.kind == "send").count(), 1, "{a:?}");
    let ledger = ledger_entries(&mut c, id);
    assert_eq!(
        ledger, 0,
        "{point}: no ledger entry for an unconfirmed effect"
    );
}

#[test]
fn fault_crash_after_claim_without_dedupe_is_uncertain_and_not_sent() {
    assert_uncertain_never_resent("crash_after_claim", 0);
}

#[test]
fn fault_crash_after_send_without_dedupe_is_uncertain_and_not_resent() {
    assert_uncertain_never_resent("crash_after_send", 1);
}
