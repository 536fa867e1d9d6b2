//! `rate_limit`: 600 messages at 100 per second over two workers are claimed at most the
//! bucket's capacity + 100 in any one-second window, reach the provider at most `burst` + 100
//! while each arrives within the bucket's allowance after its claim, and all in about 6 s
//! (a worker claims when the next token comes, not after a starved worker's wait); a
//! Retry-After answered on a rate-limited channel holds the whole channel.

use outbox_e2e::cluster::{unique, Cluster};
use outbox_e2e::helpers::{cluster_and_sim, create_channel, enqueue, wait_for_count};
use outbox_e2e::sim::Action;
use postgres::Client;
use std::time::{Duration, SystemTime};

const BURST: usize = 10;

fn ms(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// The most of `times` (ms) in any window of `window_ms`.
fn busiest_window(times: &[i64], window_ms: i64) -> usize {
    let mut times = times.to_vec();
    times.sort();
    let mut best = 0;
    let mut start = 0;
    for end in 0..times.len() {
        while times[end] - times[start] >= window_ms {
            start += 1;
        }
        best = best.max(end - start + 1);
    }
    best
}

/// How long after its claim a request may arrive and still be counted by the bucket's
/// allowance (`ARRIVAL_SKEW_MS`, src/channels/rate_limit.rs): the bucket holds that much
/// of the rate less than `burst`, 3 of the 10 at 100 a second.
const ARRIVAL_SKEW_MS: i64 = 30;
const CAPACITY: usize = BURST - 3;

#[test]
fn six_hundred_messages_at_100_per_second_over_two_workers() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let workers = cluster.worker_pids(&mut c).len();
    assert!(
        workers >= 2,
        "the cluster runs 2 workers (OUTBOX_WORKERS=2), not {workers}"
    );
    let ch = unique("rate");
    let options = serde_json::json!({
        "idempotency_header": "Idempotency-Key",
        "rate_limit": {"per_second": 100, "burst": BURST},
    });
    create_channel(&mut c, &ch, &sim.send_url(&ch), &options.to_string());
    enqueue_and_wait_delivered(&cluster, &mut c, &ch, "rl", 600);
    let sends = sim.sends(&ch);
    assert_eq!(sends.len(), 600);
    // Each attempt's claim (the database's clock), by the key it sent.
    let rows = c
        .query(
            "SELECT a.effect_key_sent, (extract(epoch FROM a.started_at) * 1000)::int8, a.worker_pid
               FROM outbox.attempts a JOIN outbox.messages m ON m.id = a.message_id
              WHERE m.channel = $1",
            &[&ch],
        )
        .unwrap();
    let claimed: std::collections::HashMap<String, i64> =
        rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let pids: std::collections::HashSet<i32> = rows.iter().map(|r| r.get(2)).collect();
    let claims: Vec<i64> = claimed.values().copied().collect();
    let mut arrivals: Vec<i64> = sends.iter().map(|r| ms(r.received_at)).collect();
    arrivals.sort();
    let (first_arrival, last_arrival) = (arrivals[0], arrivals[arrivals.len() - 1]);
    // How long each request took from its claim to the provider.
    let lags: Vec<i64> = sends
        .iter()
        .map(|r| {
            let key = r.key.as_deref().expect("the request carried its key");
            ms(r.received_at) - claimed[key]
        })
        .collect();
    let late = lags.iter().filter(|l| **l > ARRIVAL_SKEW_MS).count();
    // Each request that came later than the allowance, for a run that shows some.
    for (r, l) in sends.iter().zip(&lags) {
        if *l > ARRIVAL_SKEW_MS {
            println!(
                "request {} arrived {} ms after the first, {l} ms after its claim",
                r.seq,
                ms(r.received_at) - first_arrival
            );
        }
    }
    let busiest_claims = busiest_window(&claims, 1000);
    let busiest = busiest_window(&arrivals, 1000);
    let span_s = (last_arrival - first_arrival) as f64 / 1000.0;
    let longest_pause = arrivals.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    println!(
        "600 messages: busiest 1 s window {busiest} at the provider, {busiest_claims} of the claims; \
         first to last {span_s:.2} s, longest pause {longest_pause} ms; from claim to provider at most \
         {} ms, {late} later than {ARRIVAL_SKEW_MS} ms; by {} workers",
        lags.iter().max().unwrap(),
        pids.len()
    );
    // The bucket itself: its capacity and a second's rate in any one second of claims (and
    // one more: a claim's time is read a moment after its gate took the tokens, so a token
    // of the next moment may fall within the same second).
    assert!(
        busiest_claims <= CAPACITY + 100 + 1,
        "{busiest_claims} claimed in one second"
    );
    // The provider's count: within burst + rate while every request arrives within the
    // allowance after its claim (a stall of the machine past it is outside the promise).
    if late == 0 {
        assert!(busiest <= BURST + 100, "{busiest} requests in one second");
    }
    assert!(
        (5.0..=8.0).contains(&span_s),
        "600 at 100/s take about 6 s, not {span_s:.2} s"
    );
    assert_eq!(pids.len(), 2, "both workers sent: {pids:?}");
}

#[test]
fn a_retry_after_holds_the_whole_channel() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = unique("rate_hold");
    sim.set_plan(
        &ch,
        vec![Action::StatusWithHeaders(
            429,
            vec![("Retry-After".into(), "2".into())],
        )],
    );
    let options = serde_json::json!({
        "idempotency_header": "Idempotency-Key",
        "rate_limit": {"per_second": 50, "burst": 1},
        "retry": {"base_ms": 100, "jitter": "none"},
    });
    create_channel(&mut c, &ch, &sim.send_url(&ch), &options.to_string());
    enqueue_and_wait_delivered(&cluster, &mut c, &ch, "hold", 20);
    let sends = sim.sends(&ch);
    let refused = sends
        .iter()
        .find(|r| r.status == Some(429))
        .expect("the 429");
    let at = ms(refused.received_at);
    // Requests claimed before the 429 was recorded may still arrive just after it; then the
    // channel sends nothing until the Retry-After has passed.
    let in_flight_ms = 300;
    let next = sends
        .iter()
        .map(|r| ms(r.received_at))
        .filter(|t| *t > at + in_flight_ms)
        .min()
        .expect("sends after the 429");
    println!(
        "after the 429 with Retry-After: 2 the channel sent again after {} ms",
        next - at
    );
    assert!(
        next - at >= 1900,
        "the channel waited for the Retry-After: {} ms",
        next - at
    );
}

/// `n` messages on `channel` in one transaction (keys from `prefix`); returns once all are
/// delivered (30 s at most).
fn enqueue_and_wait_delivered(
    cluster: &Cluster,
    c: &mut Client,
    channel: &str,
    prefix: &str,
    n: i64,
) {
    let mut tx = c.transaction().unwrap();
    for i in 0..n {
        enqueue(&mut tx, channel, &unique(&format!("{prefix}{i}")));
    }
    tx.commit().unwrap();
    assert!(
        wait_for_count(
            cluster,
            Duration::from_secs(30),
            "SELECT count(*) FROM outbox.messages WHERE channel = $1 AND state = 'delivered'",
            &[&channel],
            |d| d == n,
        ),
        "all {n} delivered on {channel}"
    );
}
