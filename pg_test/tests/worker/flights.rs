//! Batches under way: a provider that hangs holds back its own messages only. A worker
//! claims and sends the next batch while one is in flight, and records what has arrived
//! without waiting for the slowest request of its batch (src/worker/flight.rs). The
//! connections its batches leave idle are held to a budget across channels
//! (src/channels/pool_budget.rs). A batch larger than the connection slots still reaches a
//! slow provider at once (src/channels/connection_slots.rs).

use super::*;

/// How long the slow provider takes to answer: far longer than a fast delivery.
const SLOW: Duration = Duration::from_secs(6);
/// How soon a fast message must be delivered (recorded) while the slow ones are in flight.
const PROMPT: Duration = Duration::from_secs(3);

/// How many of the messages `$1` are delivered.
const DELIVERED_OF: &str =
    "SELECT count(*) FROM outbox.messages WHERE id = ANY($1) AND state = 'delivered'";

/// Two workers, a simulator, and two channels to it: `{prefix}_slow`, whose every answer
/// takes [`SLOW`], and `{prefix}_fast`.
fn slow_and_fast(prefix: &str) -> (Cluster, Client, Simulator, String, String) {
    let cluster = with_two_workers();
    let (_, mut c, sim) = cluster_and_sim();
    let timeout = r#"{"timeout_ms": 20000}"#;
    let slow = sim_channel(&mut c, &sim, &format!("{prefix}_slow"), timeout);
    let fast = sim_channel(&mut c, &sim, &format!("{prefix}_fast"), "{}");
    sim.set_default(&slow, Action::AcceptAfter(SLOW));
    (cluster, c, sim, slow, fast)
}

/// Messages of `ids` in state `delivered`.
fn delivered(c: &mut Client, ids: &[i64]) -> i64 {
    count(c, DELIVERED_OF, &[&ids])
}

/// `n` messages for `channel`, with effect keys `{key}0`, `{key}1`, ..., in the transaction `tx`.
fn enqueue_fast(
    tx: &mut impl postgres::GenericClient,
    channel: &str,
    n: usize,
    key: &str,
) -> Vec<i64> {
    (0..n)
        .map(|i| {
            enqueue_payload(
                tx,
                channel,
                r#"{"fast": true}"#,
                &unique(&format!("{key}{i}")),
            )
        })
        .collect()
}

/// Whether every message of `ids` is delivered within [`PROMPT`].
fn all_delivered_promptly(cluster: &Cluster, ids: &[i64]) -> bool {
    wait_for_count(cluster, PROMPT, DELIVERED_OF, &[&ids], |n| {
        n == ids.len() as i64
    })
}

/// Both workers hold a request to a provider that answers after [`SLOW`]; then messages
/// for another channel are committed. Before, each worker waited for its whole batch: the
/// fast messages waited for the slow answers. Now a worker with a batch under way claims
/// the next one when a commit wakes it.
#[test]
fn a_hanging_provider_holds_back_no_other_channels_messages() {
    let (cluster, mut c, sim, slow, fast) = slow_and_fast("fl");
    // Slow messages committed one after the other until each worker holds one: a commit
    // wakes an idle worker, but a worker with a batch under way also claims when its sweep
    // is due, and may take the next one itself.
    let mut slow_ids = Vec::new();
    let mut pids = 0;
    while pids < 2 && slow_ids.len() < 6 {
        let n = slow_ids.len() + 1;
        slow_ids.push(enqueue_payload(
            &mut c,
            &slow,
            &format!(r#"{{"n": {n}}}"#),
            &unique(&format!("fl-s{n}")),
        ));
        assert!(
            sim.wait_for_sends(&slow, n, SETTLE),
            "slow request {n} was not sent"
        );
        pids = count(
            &mut c,
            "SELECT count(DISTINCT worker_pid) FROM outbox._claims WHERE message_ids && $1",
            &[&slow_ids],
        );
    }
    assert_eq!(pids, 2, "each worker holds a slow request");

    let started = std::time::Instant::now();
    let mut tx = c.transaction().unwrap();
    let ids = enqueue_fast(&mut tx, &fast, 10, "fl-f");
    tx.commit().unwrap();
    let all = all_delivered_promptly(&cluster, &ids);
    let took = started.elapsed();
    assert!(
        all,
        "the fast channel's messages waited for the slow provider: {} of {} delivered within {PROMPT:?}",
        delivered(&mut c, &ids),
        ids.len()
    );
    let still: i64 = count(
        &mut c,
        "SELECT count(*) FROM outbox.messages WHERE id = ANY($1) AND state = 'sending'",
        &[&slow_ids],
    );
    assert_eq!(
        still,
        slow_ids.len() as i64,
        "delivered in {took:?}, while every slow request was in flight"
    );

    for s in &slow_ids {
        wait_message(&cluster, *s, "delivered");
    }
    assert_eq!(
        sim.send_count(&slow),
        slow_ids.len(),
        "each slow message was sent once"
    );
    assert_eq!(sim.send_count(&fast), ids.len());
}

/// More slow requests than the workers' two batches each hold: with a batch of 5, two
/// workers keep 20 messages under way. Before, 20 requests to a provider answering after
/// [`SLOW`] filled that room, the other 20 slow messages waited for their answers, and so
/// did every fast message. Now the sends of a batch under way for `flight::LINGER_AFTER`
/// linger outside that room (src/worker/flight.rs): all 40 slow requests reach the
/// provider at once, and the fast channel's messages are delivered while every slow one is
/// still in flight.
#[test]
fn slow_requests_beyond_two_batches_hold_back_no_other_channels_messages() {
    const SLOW_MESSAGES: usize = 40;
    let cluster = with_two_workers();
    let (_, mut c, sim) = cluster_and_sim();
    let slow = sim_channel(
        &mut c,
        &sim,
        "fl_linger_slow",
        r#"{"timeout_ms": 20000, "max_in_flight": 64, "max_unverifiable_in_flight": 64}"#,
    );
    let fast = sim_channel(&mut c, &sim, "fl_linger_fast", "{}");
    sim.set_default(&slow, Action::AcceptAfter(SLOW));
    let guard = SettingsGuard::new(&cluster, &["outbox.batch_size"]);
    set_setting(&mut c, "outbox.batch_size", "5");
    // Both workers read the new size with their next claim: one message each.
    let mut tx = c.transaction().unwrap();
    let warm = enqueue_fast(&mut tx, &fast, 2, "fl-lw");
    tx.commit().unwrap();
    assert!(all_delivered_promptly(&cluster, &warm));
    std::thread::sleep(Duration::from_millis(700));

    let mut tx = c.transaction().unwrap();
    let slow_ids = enqueue_fast(&mut tx, &slow, SLOW_MESSAGES, "fl-ls");
    tx.commit().unwrap();
    assert!(
        sim.wait_for_sends(&slow, SLOW_MESSAGES, PROMPT),
        "{} of {SLOW_MESSAGES} slow requests reached the provider within {PROMPT:?}: \
         the first ones' answers held back the rest",
        sim.send_count(&slow)
    );
    let started = std::time::Instant::now();
    let mut tx = c.transaction().unwrap();
    let ids = enqueue_fast(&mut tx, &fast, 10, "fl-lf");
    tx.commit().unwrap();
    let all = all_delivered_promptly(&cluster, &ids);
    let took = started.elapsed();
    assert!(
        all,
        "the fast channel's messages waited for the slow provider: {} of {} delivered within {PROMPT:?}",
        delivered(&mut c, &ids),
        ids.len()
    );
    let still: i64 = count(
        &mut c,
        "SELECT count(*) FROM outbox.messages WHERE id = ANY($1) AND state = 'sending'",
        &[&slow_ids],
    );
    assert_eq!(
        still, SLOW_MESSAGES as i64,
        "delivered in {took:?}, while every slow request was in flight"
    );
    for s in &slow_ids {
        wait_message(&cluster, *s, "delivered");
    }
    assert_eq!(
        sim.send_count(&slow),
        SLOW_MESSAGES,
        "each slow message was sent once"
    );
    assert_eq!(sim.send_count(&fast), ids.len() + warm.len());
    drop(guard);
}

/// A batch larger than a worker's connection slots to a provider that answers slowly:
/// the requests beyond the slots wait for one only briefly (`connection_slots`), then go
/// side by side with the others, each on a connection of its own. Every request of the
/// batch reaches the provider while the first ones still wait for their answers.
#[test]
fn a_slow_provider_gets_a_whole_batch_at_once_beyond_the_connection_slots() {
    const N: usize = 150;
    /// Longer than any request may wait for a slot, many times over.
    const ANSWER_AFTER: Duration = Duration::from_secs(3);
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(
        &mut c,
        &sim,
        "fl_slots",
        &format!(
            r#"{{"timeout_ms": 20000, "max_in_flight": {N}, "max_unverifiable_in_flight": {N}}}"#
        ),
    );
    sim.set_default(&ch, Action::AcceptAfter(ANSWER_AFTER));
    let mut tx = c.transaction().unwrap();
    let ids = enqueue_fast(&mut tx, &ch, N, "fl-slot");
    tx.commit().unwrap();

    // Without the overflow, a worker would send its first 32 and the rest only as their
    // answers came back, ANSWER_AFTER later.
    assert!(
        sim.wait_for_sends(&ch, N, ANSWER_AFTER - Duration::from_millis(500)),
        "{} of {N} requests reached the provider before the first answers",
        sim.send_count(&ch)
    );
    let sends = sim.sends(&ch);
    let first = sends.iter().map(|r| r.received_at).min().unwrap();
    let last = sends.iter().map(|r| r.received_at).max().unwrap();
    let spread = last.duration_since(first).unwrap_or_default();
    assert!(
        spread < Duration::from_secs(1),
        "the batch's requests arrived over {spread:?}"
    );
    assert!(
        wait_for_count(
            &cluster,
            Duration::from_secs(30),
            DELIVERED_OF,
            &[&ids],
            |n| { n == N as i64 }
        ),
        "{} of {N} delivered",
        delivered(&mut c, &ids)
    );
    assert_eq!(sim.send_count(&ch), N, "each message was sent once");
}

/// A slow and several fast messages claimed in one batch: the fast ones are recorded
/// (delivered, with their ledger entries) while the slow one is still in flight.
#[test]
fn what_has_arrived_is_recorded_without_waiting_for_the_slowest_request_of_its_batch() {
    let (cluster, mut c, sim, slow, fast) = slow_and_fast("fl_batch");

    let mut tx = c.transaction().unwrap();
    let s = enqueue_payload(&mut tx, &slow, r#"{"slow": true}"#, &unique("fl-bs"));
    let ids = enqueue_fast(&mut tx, &fast, 5, "fl-bf");
    tx.commit().unwrap();
    // A commit wakes one idle worker, which claims all six in one batch.
    let mut all_six = ids.clone();
    all_six.push(s);
    let workers = poll(&cluster, SETTLE, |c| {
        let r = c.query_one(
            "SELECT count(DISTINCT message_id), count(DISTINCT worker_pid)
               FROM outbox.attempts WHERE message_id = ANY($1) AND kind = 'send'",
            &[&all_six],
        )?;
        let (claimed, pids): (i64, i64) = (r.get(0), r.get(1));
        Ok((claimed == 6).then_some(pids))
    });
    assert_eq!(
        workers,
        Some(1),
        "the six messages were not claimed in one batch"
    );

    let all = all_delivered_promptly(&cluster, &ids);
    assert!(
        all,
        "the fast messages waited for the slow one: {} of {} recorded within {PROMPT:?}",
        delivered(&mut c, &ids),
        ids.len()
    );
    assert_eq!(
        wait_message(&cluster, s, "delivered").attempts,
        1,
        "the slow message is recorded once its answer arrives"
    );
    for id in &ids {
        assert_eq!(ledger_entries(&mut c, *id), 1);
    }
    assert_eq!(
        sim.send_count(&fast),
        ids.len(),
        "each fast message was sent once"
    );
}

/// A worker keeps at most four batches' worth of idle connections across its channels'
/// pools (src/channels/pool_budget.rs). Eight channels are drained one after the other,
/// each by batches of 10 under way against a provider that answers in 100 ms: up to 20
/// connections a worker and channel, more in all than the two workers' budgets (40
/// each). Once the channels are no longer used, the workers close the pools of the ones
/// used least recently. Without the budget every pool would keep its connections for a
/// minute, and the provider would still hold all of them.
#[test]
fn the_pools_of_channels_no_longer_used_are_closed_beyond_the_budget() {
    const CHANNELS: usize = 8;
    const PER_CHANNEL: usize = 300;
    const BATCH: usize = 10;
    let cluster = with_two_workers();
    let workers = wait_for_workers(&cluster, &[]).len();
    let mut c = cluster.connect();
    let guard = SettingsGuard::new(&cluster, &["outbox.batch_size"]);
    let mark = cluster.log_mark();
    set_setting(&mut c, "outbox.batch_size", &BATCH.to_string());
    let applied = outbox_e2e::cluster::wait_until(SETTLE, || {
        super::concurrency::settings_lines_with(&cluster.log_since(mark), "batch_size=10").len()
            == workers
    });
    assert!(applied, "the workers did not take batch_size = 10");
    // Two batches under way a worker: the budget is twice their connections.
    let budget = (2 * 2 * BATCH * workers) as u64;
    // A pool may hold a connection or two more than its requests under way at once (one
    // made while another came free); a handful over the budgets is not a pool left open.
    let bound = budget + budget / 4;

    let sim = Simulator::start();
    for i in 0..CHANNELS {
        // A connect timeout of its own gives each channel a pool of its own: channels built
        // alike to one host and port share its connections (`wire::Origin`).
        let ch = sim_channel(
            &mut c,
            &sim,
            &format!("pools{i}"),
            &format!(
                r#"{{"max_in_flight": 64, "idempotency_header": "Idempotency-Key", "connect_timeout_ms": {}}}"#,
                1000 + i
            ),
        );
        sim.set_default(&ch, Action::AcceptAfter(Duration::from_millis(100)));
        let ids = {
            let mut tx = c.transaction().unwrap();
            let ids = enqueue_fast(&mut tx, &ch, PER_CHANNEL, &format!("pools{i}-"));
            tx.commit().unwrap();
            ids
        };
        let all = wait_for_count(
            &cluster,
            Duration::from_secs(60),
            DELIVERED_OF,
            &[&ids],
            |n| n == ids.len() as i64,
        );
        assert!(
            all,
            "channel {i}: {} of {PER_CHANNEL} delivered",
            delivered(&mut c, &ids)
        );
        // Past the time a channel in use keeps its pool whatever its size.
        std::thread::sleep(Duration::from_millis(1_200));
    }
    let accepted = sim.counters().connections;
    assert!(
        accepted > bound,
        "the drains opened {accepted} connections, not more than the budgets ({bound}): the test shows nothing"
    );
    // Idle workers look at their pools at each poll (1 s).
    let within = outbox_e2e::cluster::wait_until(Duration::from_secs(10), || {
        sim.open_connections() <= bound
    });
    assert!(
        within,
        "{} connections still open to the provider, more than the workers' budgets ({budget}, {bound} with room); {accepted} were opened",
        sim.open_connections()
    );
    drop(guard);
}
