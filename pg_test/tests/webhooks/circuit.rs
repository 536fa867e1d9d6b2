//! `circuit`: a provider down for 30 s gets a handful of probes, not hundreds of requests;
//! the circuit shows in `outbox.channels`, `outbox.alerts` and `outbox.operator_log`; a
//! manual pause wins; once the provider is back the backlog is delivered, in order per
//! ordering key.

use outbox_e2e::cluster::{unique, wait_until};
use outbox_e2e::helpers::{cluster_and_sim, count, create_channel, enqueue_with, one};
use outbox_e2e::sim::Action;
use postgres::Client;
use std::time::{Duration, Instant};

const OPEN_MS: u64 = 3000;
const DOWN: Duration = Duration::from_secs(30);
const MAX_IN_FLIGHT: usize = 4;

fn circuit_state(c: &mut Client, ch: &str) -> Option<String> {
    one(
        c,
        "SELECT circuit_state FROM outbox.channels WHERE name = $1",
        &[&ch],
    )
}

#[test]
fn a_provider_down_for_30_s_gets_probes_not_hundreds_of_requests() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = unique("circuit");
    sim.set_default(&ch, Action::Status(503));
    let options = serde_json::json!({
        "idempotency_header": "Idempotency-Key",
        "max_in_flight": MAX_IN_FLIGHT,
        "circuit": {"open_after": 3, "open_ms": OPEN_MS},
        "retry": {"max_attempts": 50, "base_ms": 100, "max_ms": 1000, "jitter": "none"},
    });
    create_channel(&mut c, &ch, &sim.send_url(&ch), &options.to_string());
    assert_eq!(circuit_state(&mut c, &ch).as_deref(), Some("closed"));
    let down_since = Instant::now();
    let mut ids = Vec::new();
    for i in 0..40 {
        let key = unique(&format!("cb{i}"));
        let ordering = format!("{ch}-order-{}", i % 2);
        let payload = serde_json::json!({"n": i}).to_string();
        ids.push(enqueue_with(
            &mut c,
            &ch,
            &payload,
            &key,
            Some(&ordering),
            None,
        ));
    }
    assert!(
        wait_until(Duration::from_secs(10), || circuit_state(&mut c, &ch)
            .as_deref()
            == Some("open")),
        "the circuit opens; sends so far: {}",
        sim.send_count(&ch)
    );
    let alerts = count(
        &mut c,
        "SELECT count(*) FROM outbox.alerts WHERE alert = 'circuit_open' AND channel = $1",
        &[&ch],
    );
    assert_eq!(alerts, 1, "outbox.alerts raises circuit_open");
    // A manual pause wins over a probe: nothing is sent while paused, whatever the circuit.
    std::thread::sleep(Duration::from_secs(5));
    c.execute(
        "SELECT outbox.pause_channel($1, 'circuit test: paused by hand')",
        &[&ch],
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let before_pause = sim.send_count(&ch);
    std::thread::sleep(Duration::from_millis(2 * OPEN_MS + 500));
    assert_eq!(sim.send_count(&ch), before_pause, "no probe while paused");
    c.execute("SELECT outbox.resume_channel($1)", &[&ch])
        .unwrap();
    std::thread::sleep(DOWN.saturating_sub(down_since.elapsed()));
    let during = sim.send_count(&ch);
    sim.set_default(&ch, Action::Accept);
    // The failures that opened it (at most a batch in flight), then one probe per open_ms.
    let bound = MAX_IN_FLIGHT + 3 + 1 + (DOWN.as_millis() as usize / OPEN_MS as usize);
    println!("requests while the provider was down for {DOWN:?}: {during} (bound {bound})");
    assert!(
        during <= bound,
        "{during} requests in {DOWN:?}, at most {bound} expected"
    );
    assert!(
        during >= 3 + 5,
        "probes went on while it was down: {during}"
    );
    for id in &ids {
        assert!(
            wait_until(Duration::from_secs(30), || {
                one::<String>(
                    &mut c,
                    "SELECT state::text FROM outbox.messages WHERE id = $1",
                    &[id],
                ) == "delivered"
            }),
            "message {id} delivered once the provider is back"
        );
    }
    assert_eq!(circuit_state(&mut c, &ch).as_deref(), Some("closed"));
    let alerts = count(
        &mut c,
        "SELECT count(*) FROM outbox.alerts WHERE alert = 'circuit_open' AND channel = $1",
        &[&ch],
    );
    assert_eq!(alerts, 0, "the alert clears");
    // In order per ordering key: the accepted sends of each key in enqueue order.
    let accepted: Vec<i64> = sim
        .sends(&ch)
        .iter()
        .filter(|r| r.outcome == "accepted")
        .map(|r| {
            serde_json::from_slice::<serde_json::Value>(&r.body).unwrap()["n"]
                .as_i64()
                .unwrap()
        })
        .collect();
    assert_eq!(accepted.len(), 40);
    for parity in 0..2 {
        let order: Vec<i64> = accepted
            .iter()
            .copied()
            .filter(|n| n % 2 == parity)
            .collect();
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(order, sorted, "ordering key {parity} delivered in order");
    }
    // The operator log: every change, by the worker's role.
    let changes: Vec<(String, String)> = c
        .query(
            "SELECT action, actor FROM outbox.operator_log WHERE channel = $1 AND action LIKE 'circuit_%' ORDER BY at",
            &[&ch],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        changes.first().map(|c| c.0.as_str()),
        Some("circuit_open"),
        "{changes:?}"
    );
    assert_eq!(
        changes.last().map(|c| c.0.as_str()),
        Some("circuit_closed"),
        "{changes:?}"
    );
    assert!(
        changes.iter().any(|c| c.0 == "circuit_half_open"),
        "{changes:?}"
    );
    assert!(
        changes.iter().all(|c| c.1 == "outbox_worker"),
        "actor: the worker's role: {changes:?}"
    );
    let exhausted = count(
        &mut c,
        "SELECT count(*) FROM outbox.messages m WHERE m.channel = $1 AND m.attempts > 10",
        &[&ch],
    );
    assert_eq!(
        exhausted, 0,
        "no message spent its budget while the circuit was open"
    );
    drop(cluster);
}
