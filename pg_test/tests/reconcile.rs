//! Ambiguous outcomes end to end: a provider that reads the request, stores the message and
//! drops the connection. The outcome follows the channel kind — same-key retry where the
//! provider dedupes, a read-only lookup where it can be asked, `uncertain` otherwise — and
//! the operator's actions are checked against the provider and the audit log.

use outbox_e2e::cluster::{unique, wait_for_state, wait_until};
use outbox_e2e::helpers::{
    cluster_and_sim, count, create_channel, effect_key_of, enqueue, external_id_of,
    ledger_recorded_by, one, sim_channel,
};
use outbox_e2e::sim::{Action, LookupAction};
use postgres::Client;
use std::time::Duration;

const T: Duration = Duration::from_secs(30);

fn attempts_of(c: &mut Client, id: i64, kind: &str) -> i64 {
    c.query_one(
        "SELECT count(*) FROM outbox.attempts WHERE message_id = $1 AND kind = $2",
        &[&id, &kind],
    )
    .unwrap()
    .get(0)
}

fn log_rows(c: &mut Client, id: i64, action: &str) -> Vec<(String, String, String)> {
    c.query(
        "SELECT actor, coalesce(reason, ''), coalesce(state_after::text, '') FROM outbox.operator_log WHERE message_id = $1 AND action = $2 ORDER BY id",
        &[&id, &action],
    )
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

#[test]
fn deduping_channel_retries_with_the_same_key_and_the_provider_keeps_one() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(
        &mut c,
        &sim,
        "rc_dedupe",
        r#"{"idempotency_header": "Idempotency-Key", "external_id": "/id", "retry": {"base_ms": 100, "jitter": "none"}}"#,
    );
    sim.set_dedupe(&ch, "Idempotency-Key");
    sim.set_plan(&ch, vec![Action::DropAfterRead { store: true }]);
    let key = unique("key");
    let id = enqueue(&mut c, &ch, &key);
    assert!(
        wait_for_state(&cluster, id, "delivered", T),
        "state: {:?}",
        outbox_e2e::cluster::state_of(&cluster, id)
    );
    assert_eq!(
        sim.stored(&ch).len(),
        1,
        "the provider holds exactly one message"
    );
    let keys = sim.header_values(&ch, "Idempotency-Key");
    assert_eq!(keys.len(), 2, "one dropped request and one same-key retry");
    assert!(
        keys.iter().all(|k| k == &key),
        "the key was the same on both requests: {keys:?}"
    );
    let ext = external_id_of(&mut c, id);
    assert_eq!(
        ext.as_deref(),
        Some(sim.stored(&ch)[0].external_id.as_str())
    );
    let classes: Vec<Option<String>> = c
        .query("SELECT error_class::text FROM outbox.attempts WHERE message_id = $1 AND kind = 'send' ORDER BY attempt", &[&id])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(classes, vec![Some("ambiguous".to_string()), None]);
}

#[test]
fn reconcile_channel_finds_the_message_and_never_resends() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = unique("rc_lookup");
    sim.set_plan(&ch, vec![Action::DropAfterRead { store: true }]);
    let options = format!(
        r#"{{"reference_header": "X-Effect-Key", "external_id": "/id",
            "reconcile": {{"url": "{}", "found": "/found", "external_id": "/id", "settle_ms": 300}},
            "retry": {{"base_ms": 200, "jitter": "none"}}}}"#,
        sim.lookup_url_by_key(&ch)
    );
    create_channel(&mut c, &ch, &sim.send_url(&ch), &options);
    let key = unique("key");
    let id = enqueue(&mut c, &ch, &key);
    assert!(wait_for_state(&cluster, id, "delivered", T));
    assert_eq!(sim.send_count(&ch), 1, "0 resends: reconcile settled it");
    let stored = sim.stored(&ch);
    assert_eq!(stored.len(), 1);
    let (ext, by): (Option<String>, String) = c
        .query_one(
            "SELECT m.external_id, l.recorded_by FROM outbox.messages m JOIN outbox.ledger l ON l.message_id = m.id WHERE m.id = $1",
            &[&id],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(
        ext.as_deref(),
        Some(stored[0].external_id.as_str()),
        "the provider's external id"
    );
    assert_eq!(by, "reconcile");
    assert!(attempts_of(&mut c, id, "reconcile") >= 1);
}

#[test]
fn channel_with_neither_stops_in_uncertain_for_an_operator() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(&mut c, &sim, "rc_neither", r#"{"retry": {"base_ms": 100}}"#);
    sim.set_plan(&ch, vec![Action::DropAfterRead { store: true }]);
    let id = enqueue(&mut c, &ch, &unique("key"));
    assert!(wait_for_state(&cluster, id, "uncertain", T));
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(sim.send_count(&ch), 1, "0 resends");
    let rows = count(
        &mut c,
        "SELECT count(*) FROM outbox.work_queue WHERE id = $1",
        &[&id],
    );
    assert_eq!(rows, 1, "one work-queue row");
    let (reason, action): (String, String) = c
        .query_one(
            "SELECT reason, suggested_action FROM outbox.work_queue WHERE id = $1",
            &[&id],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert!(reason.contains("outcome unknown"), "{reason}");
    assert!(action.contains("resolve"), "{action}");
    assert_eq!(
        outbox_e2e::cluster::state_of(&cluster, id).as_deref(),
        Some("uncertain")
    );

    // The operator checked with the provider: it has it. resolve() writes the ledger (the
    // message moves into its entry), so a later enqueue of the same effect key names the
    // message and sends nothing.
    let key = effect_key_of(&mut c, id);
    let after: String = c
        .query_one("SELECT outbox.resolve($1, 'delivered', 'seen in the provider console', 'prov-1')::text", &[&id])
        .unwrap()
        .get(0);
    assert_eq!(after, "delivered");
    let by = ledger_recorded_by(&mut c, id);
    assert_eq!(by, "operator");
    let again = enqueue(&mut c, &ch, &key);
    assert_eq!(again, id, "the same effect names the delivered message");
    assert!(wait_for_state(&cluster, again, "delivered", T));
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        sim.send_count(&ch),
        1,
        "the ledger is the barrier: nothing sent again"
    );
    let logs = log_rows(&mut c, id, "resolve");
    assert_eq!(logs.len(), 1);
    assert!(!logs[0].0.is_empty());
    assert_eq!(logs[0].1, "seen in the provider console");
}

#[test]
fn manual_retry_reconciles_first_and_resends_with_the_same_key() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = unique("rc_manual");
    // The request is read but never stored; the provider's lookup is down at first.
    sim.set_plan(&ch, vec![Action::DropAfterRead { store: false }]);
    sim.set_lookup_plan(&ch, vec![LookupAction::Status(503); 50]);
    let options = format!(
        r#"{{"reference_header": "X-Effect-Key",
            "reconcile": {{"url": "{}", "found": "/found", "settle_ms": 300}},
            "retry": {{"base_ms": 60000, "jitter": "none"}}}}"#,
        sim.lookup_url_by_key(&ch)
    );
    create_channel(&mut c, &ch, &sim.send_url(&ch), &options);
    let key = unique("key");
    let id = enqueue(&mut c, &ch, &key);
    assert!(wait_for_state(&cluster, id, "uncertain", T));
    // Make the first automatic lookup due now; it fails (503) and the message stays uncertain.
    c.execute(
        "UPDATE outbox._messages SET next_attempt_at = now() WHERE id = $1",
        &[&id],
    )
    .unwrap();
    assert!(wait_until(T, || attempts_of(
        &mut cluster.connect(),
        id,
        "reconcile"
    ) >= 1));
    assert_eq!(
        outbox_e2e::cluster::state_of(&cluster, id).as_deref(),
        Some("uncertain")
    );

    // The lookup works again; the operator's retry asks first: not found → resent, same key.
    // A not-found is believed once the send has settled (settle_ms 300 after it started).
    sim.set_lookup_plan(&ch, vec![]);
    std::thread::sleep(Duration::from_millis(400));
    let lookups_before = sim
        .requests(&ch)
        .iter()
        .filter(|r| r.kind == "lookup")
        .count();
    let after: String = one(
        &mut c,
        "SELECT outbox.retry($1, 'customer says nothing arrived')::text",
        &[&id],
    );
    assert_eq!(after, "queued");
    let lookups_after = sim
        .requests(&ch)
        .iter()
        .filter(|r| r.kind == "lookup")
        .count();
    assert_eq!(
        lookups_after,
        lookups_before + 1,
        "retry ran the lookup first"
    );
    assert!(wait_for_state(&cluster, id, "delivered", T));
    let keys = sim.header_values(&ch, "X-Effect-Key");
    assert_eq!(keys.len(), 2);
    assert!(
        keys.iter().all(|k| k == &key),
        "the resend carries the same key: {keys:?}"
    );
    assert_eq!(sim.stored(&ch).len(), 1);
    let logs = log_rows(&mut c, id, "retry");
    assert_eq!(logs.len(), 1, "exactly one operator_log row");
    assert_eq!(logs[0].1, "customer says nothing arrived");
    assert_eq!(logs[0].2, "queued");
}

#[test]
fn manual_retry_of_a_message_the_provider_has_delivers_without_resending() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = unique("rc_found");
    sim.set_plan(&ch, vec![Action::DropAfterRead { store: true }]);
    sim.set_lookup_plan(&ch, vec![LookupAction::Status(503); 50]);
    let options = format!(
        r#"{{"reference_header": "X-Effect-Key", "reconcile": {{"url": "{}", "found": "/found", "external_id": "/id", "settle_ms": 300}},
            "retry": {{"base_ms": 60000}}}}"#,
        sim.lookup_url_by_key(&ch)
    );
    create_channel(&mut c, &ch, &sim.send_url(&ch), &options);
    let id = enqueue(&mut c, &ch, &unique("key"));
    assert!(wait_for_state(&cluster, id, "uncertain", T));
    sim.set_lookup_plan(&ch, vec![]);
    // Two operators at once: the row lock serializes them; one effect, two log rows.
    let conninfo = cluster.conninfo();
    let handles: Vec<_> = (0..2)
        .map(|i| {
            let conninfo = conninfo.clone();
            std::thread::spawn(move || {
                let mut c = postgres::Client::connect(&conninfo, postgres::NoTls).unwrap();
                c.query_one(
                    "SELECT outbox.retry($1, $2)::text",
                    &[&id, &format!("operator {i}")],
                )
                .unwrap()
                .get::<_, String>(0)
            })
        })
        .collect();
    let results: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(results.iter().all(|r| r == "delivered"), "{results:?}");
    assert_eq!(sim.send_count(&ch), 1, "nothing was resent");
    assert_eq!(log_rows(&mut c, id, "retry").len(), 2);
    let lookups = sim
        .requests(&ch)
        .iter()
        .filter(|r| r.kind == "lookup" && r.outcome == "lookup:found")
        .count();
    assert_eq!(
        lookups, 1,
        "the second operator saw it delivered and asked nobody"
    );
}

#[test]
fn reconcile_all_counts_and_cancel_is_logged() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = unique("rc_all");
    sim.set_plan(
        &ch,
        vec![
            Action::DropAfterRead { store: true },
            Action::DropAfterRead { store: false },
        ],
    );
    sim.set_lookup_plan(&ch, vec![LookupAction::Status(503); 10]);
    let options = format!(
        r#"{{"reference_header": "X-Effect-Key", "reconcile": {{"url": "{}", "found": "/found", "settle_ms": 300}},
            "retry": {{"base_ms": 60000}}, "max_in_flight": 1}}"#,
        sim.lookup_url_by_key(&ch)
    );
    create_channel(&mut c, &ch, &sim.send_url(&ch), &options);
    let a = enqueue(&mut c, &ch, &unique("a"));
    assert!(wait_for_state(&cluster, a, "uncertain", T));
    let b = enqueue(&mut c, &ch, &unique("b"));
    assert!(wait_for_state(&cluster, b, "uncertain", T));
    sim.set_lookup_plan(&ch, vec![]);
    let row = c
        .query_one(
            "SELECT checked, delivered, not_found, unavailable FROM outbox.reconcile() ",
            &[],
        )
        .unwrap();
    let counts: (i32, i32, i32, i32) = (row.get(0), row.get(1), row.get(2), row.get(3));
    assert!(counts.0 >= 2, "{counts:?}");
    assert!(counts.1 >= 1 && counts.2 >= 1, "{counts:?}");
    assert_eq!(
        outbox_e2e::cluster::state_of(&cluster, a).as_deref(),
        Some("delivered")
    );
    // b was requeued with the same key (not found); cancel it before it is resent? It may
    // already be on its way: cancel is refused while sending and allowed otherwise.
    let cancelled = c.query_one("SELECT outbox.cancel($1, 'duplicate request')::text", &[&b]);
    match cancelled {
        Ok(r) => {
            let s: String = r.get(0);
            assert_eq!(s, "cancelled");
            assert_eq!(log_rows(&mut c, b, "cancel").len(), 1);
        }
        Err(e) => {
            let code = e.code().map(|c| c.code().to_string());
            assert!(
                code.as_deref() == Some("55000"),
                "cancel may only be refused because the message is in flight: {e}"
            );
            assert_eq!(log_rows(&mut c, b, "cancel").len(), 0);
        }
    }
    c.execute("SELECT outbox.assign($1, 'alice')", &[&a])
        .unwrap();
    assert_eq!(log_rows(&mut c, a, "assign").len(), 1);
}

/// `outbox.reconcile(id)` for one message answers what the provider says and never sends:
/// `unavailable` while the lookup fails, `not_found` while the provider does not have it
/// (the message stays `uncertain` until its last attempt has settled), `delivered` once it
/// has it.
#[test]
fn reconcile_of_one_message_answers_unavailable_not_found_or_delivered_and_never_sends() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = unique("rc_one");
    let options = format!(
        r#"{{"reference_header": "X-Effect-Key", "reconcile": {{"url": "{}", "found": "/found", "external_id": "/id", "settle_ms": 60000}},
            "retry": {{"base_ms": 60000}}}}"#,
        sim.lookup_url_by_key(&ch)
    );
    create_channel(&mut c, &ch, &sim.send_url(&ch), &options);
    let reconcile = |c: &mut Client, id: i64| -> String {
        c.query_one("SELECT outbox.reconcile($1)", &[&id])
            .unwrap()
            .get(0)
    };
    // An uncertain message; the worker's own lookup is a minute away (`base_ms`), so the
    // operator's calls below are the only lookups.
    let uncertain = |c: &mut Client, store: bool| -> i64 {
        sim.set_plan(&ch, vec![Action::DropAfterRead { store }]);
        sim.set_lookup_plan(&ch, vec![LookupAction::Status(503); 50]);
        let id = enqueue(c, &ch, &unique("key"));
        assert!(wait_for_state(&cluster, id, "uncertain", T));
        id
    };

    // The provider never stored this one.
    let lost = uncertain(&mut c, false);
    assert_eq!(reconcile(&mut c, lost), "unavailable");
    sim.set_lookup_plan(&ch, vec![]);
    assert_eq!(reconcile(&mut c, lost), "not_found");
    let state: String = c
        .query_one("SELECT outbox.status($1)::text", &[&lost])
        .unwrap()
        .get(0);
    assert_eq!(
        state, "uncertain",
        "not found before the attempt settled: nothing resent yet"
    );

    // The provider stored this one; only its answer was lost.
    let kept = uncertain(&mut c, true);
    sim.set_lookup_plan(&ch, vec![]);
    assert_eq!(reconcile(&mut c, kept), "delivered");
    let (state, ledger): (String, i64) = {
        let r = c
            .query_one(
                "SELECT outbox.status($1)::text, (SELECT count(*) FROM outbox.ledger WHERE message_id = $1)",
                &[&kept],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!((state.as_str(), ledger), ("delivered", 1));
    assert_eq!(
        sim.send_count(&ch),
        2,
        "each message was sent once, by the worker"
    );
    assert_eq!(
        (
            attempts_of(&mut c, lost, "reconcile"),
            attempts_of(&mut c, kept, "reconcile")
        ),
        (2, 1),
        "one recorded lookup per call"
    );
}
