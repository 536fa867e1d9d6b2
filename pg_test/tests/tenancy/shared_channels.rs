//! 12. Tenants that share a channel take turns: one tenant's backlog stands before another
//!     tenant's next message for one turn at most, on a rate-limited channel too, and the
//!     failures of one tenant alone open the circuit for that tenant's messages alone.

use super::*;

/// Enqueues `n` messages for `tenant` on `channel` in one transaction (keys `prefix1` …);
/// their ids.
fn enqueue_for(c: &mut Client, tenant: &str, channel: &str, n: i64, prefix: &str) -> Vec<i64> {
    let mut tx = c.transaction().unwrap();
    tx.execute("SELECT set_config('outbox.tenant', $1, true)", &[&tenant])
        .unwrap();
    let ids = tx
        .query(
            "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2 || g) FROM generate_series(1, $3::int8) g",
            &[&channel, &prefix, &n],
        )
        .unwrap_or_else(|e| panic!("enqueue for {tenant}: {}", describe(&e)))
        .iter()
        .map(|r| r.get(0))
        .collect();
    tx.commit().unwrap();
    ids
}

/// The key a provider gets for `tenant`'s messages begins with this.
fn key_prefix(tenant: &str) -> String {
    format!("{}:{tenant}:", tenant.len())
}

/// How many of `tenant`'s messages on `channel` are still queued.
fn queued_of(c: &mut Client, tenant: &str, channel: &str) -> i64 {
    count(
        c,
        "SELECT count(*) FROM outbox._messages m JOIN outbox._channels ch ON ch.id = m.channel_id
          WHERE ch.name = $1 AND m.tenant = $2 AND m.state = 'queued'",
        &[&channel, &tenant],
    )
}

/// The circuit of `channel`: its state and the tenant it holds back alone.
fn circuit_of(c: &mut Client, channel: &str) -> (String, Option<String>) {
    c.query_opt(
        "SELECT f.circuit_state, f.circuit_tenant FROM outbox._channel_flow f
           JOIN outbox._channels ch ON ch.id = f.channel_id WHERE ch.name = $1",
        &[&channel],
    )
    .unwrap()
    .map(|r| (r.get(0), r.get(1)))
    .unwrap_or_else(|| ("closed".into(), None))
}

#[test]
fn a_tenants_backlog_on_a_rate_limited_channel_delays_another_tenant_one_turn() {
    let (_serial, cluster, mut su) = start();
    cluster.wait_for_worker();
    let sim = Simulator::start();
    let ch = unique("shared_rate");
    create_channel(
        &mut su,
        &ch,
        &sim.send_url(&ch),
        r#"{"idempotency_header": "Idempotency-Key", "rate_limit": {"per_second": 4, "burst": 1}}"#,
    );
    let (a, b) = (tenant_name("busy"), tenant_name("quiet"));
    const BACKLOG: i64 = 60;
    enqueue_for(&mut su, &a, &ch, BACKLOG, "backlog-");
    // The backlog has started: a's messages go out at the channel's rate.
    assert!(
        sim.wait_for_sends(&ch, 1, SETTLE),
        "the backlog never started"
    );
    let b_id = enqueue_for(&mut su, &b, &ch, 1, "mine-")[0];
    wait_state(&cluster, b_id, "delivered");
    let left = queued_of(&mut su, &a, &ch);
    let keys: Vec<String> = sim
        .sends(&ch)
        .iter()
        .filter_map(|r| r.key.clone())
        .collect();
    let at = keys
        .iter()
        .position(|k| k.starts_with(&key_prefix(&b)))
        .expect("b's message at the provider");
    // Oldest first, b's message would have waited for the whole backlog (15 s at 4 a
    // second). With turns it goes at the next token or the one after.
    assert!(
        left >= BACKLOG - 12,
        "b waited behind a's backlog: {left} of {BACKLOG} left; sends {keys:?}"
    );
    assert!(
        at <= 4,
        "b's message was send {at} of {}: {keys:?}",
        keys.len()
    );
    // The backlog still drains whole, at the channel's rate.
    su.execute("SELECT outbox.pause_channel($1, 'end of the test')", &[&ch])
        .unwrap();
}

#[test]
fn one_tenants_failures_open_the_circuit_for_its_own_messages_alone() {
    let (_serial, cluster, mut su) = start();
    cluster.wait_for_worker();
    let sim = Simulator::start();
    let ch = unique("shared_circuit");
    create_channel(
        &mut su,
        &ch,
        &sim.send_url(&ch),
        r#"{"idempotency_header": "Idempotency-Key", "circuit": {"open_after": 3, "open_ms": 600000}}"#,
    );
    let (a, b) = (tenant_name("failing"), tenant_name("healthy"));
    // The provider refuses a's messages alone (a 500, transient: retried later).
    sim.set_default_for_keys(&ch, &key_prefix(&a), Action::Status(500));
    enqueue_for(&mut su, &a, &ch, 3, "refused-");
    assert!(
        outbox_e2e::cluster::wait_until(SETTLE, || circuit_of(&mut su, &ch)
            == ("open".to_string(), Some(a.clone()))),
        "the circuit did not open for {a} alone: {:?}",
        circuit_of(&mut su, &ch)
    );
    let a_sends = sim.send_count(&ch);
    // b's messages go, with a's circuit open for ten minutes.
    let b_ids = enqueue_for(&mut su, &b, &ch, 5, "fine-");
    for id in &b_ids {
        assert!(
            wait_for_state(&cluster, *id, "delivered", Duration::from_secs(10)),
            "b's message {id} held back by a's circuit: {:?}",
            state_of(&cluster, *id)
        );
    }
    assert_eq!(
        sim.send_count(&ch),
        a_sends + b_ids.len(),
        "a sent nothing meanwhile"
    );
    assert_eq!(circuit_of(&mut su, &ch), ("open".into(), Some(a.clone())));
    let logged: String = one(
        &mut su,
        "SELECT detail ->> 'tenant' FROM outbox._operator_log
          WHERE channel = $1 AND action = 'circuit_open' ORDER BY id DESC LIMIT 1",
        &[&ch],
    );
    assert_eq!(logged, a);

    // Failures of both tenants open it for the whole channel.
    sim.set_default_for_keys(&ch, &key_prefix(&b), Action::Status(500));
    enqueue_for(&mut su, &b, &ch, 3, "refused-");
    assert!(
        outbox_e2e::cluster::wait_until(SETTLE, || circuit_of(&mut su, &ch)
            == ("open".to_string(), None)),
        "the circuit did not open for the whole channel: {:?}",
        circuit_of(&mut su, &ch)
    );
    su.execute("SELECT outbox.pause_channel($1, 'end of the test')", &[&ch])
        .unwrap();
}
