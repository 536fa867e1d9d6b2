//! Synchronous replication: 2,000 messages over a deduping, a reconcile-only and a neither
//! channel; the primary is killed in the middle of them and the standby promoted while the
//! provider simulator keeps running.

use super::*;
use outbox_e2e::helpers::enqueue;
use outbox_e2e::sim::Action;
use std::collections::HashSet;
use std::time::Instant;

const MESSAGES: usize = 2_000;
/// How long the provider takes to accept: attempts are open on every channel when the
/// primary dies.
const PROVIDER_MS: u64 = 200;

/// Enqueues `keys` round-robin over the three channels, 50 to a transaction; the ids.
fn enqueue_all(c: &mut Client, keys: &[String]) -> Vec<i64> {
    let mut ids = Vec::with_capacity(keys.len());
    for chunk in keys.chunks(50) {
        let mut tx = c.transaction().expect("begin");
        for key in chunk {
            let kind = KINDS[key_index(key) % KINDS.len()];
            ids.push(enqueue(&mut tx, kind.channel(), key));
        }
        tx.commit().expect("commit");
    }
    ids
}

fn key_index(key: &str) -> usize {
    key.rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The messages in flight on the standby's copy: id, channel, the key sent to the provider.
fn in_flight(c: &mut Client) -> Vec<(i64, String, String)> {
    c.query(
        "SELECT m.id, m.channel, a.effect_key_sent FROM outbox.messages m
           JOIN outbox.attempts a ON a.message_id = m.id AND a.attempt = m.attempts AND a.kind = 'send'
          WHERE m.state = 'sending' ORDER BY m.id",
        &[],
    )
    .expect("messages in flight on the standby")
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

#[test]
fn failover_under_synchronous_replication_loses_nothing_and_never_resends_blindly() {
    let pair = pair(true);
    let sim = Simulator::start();
    sim.set_default_all(Action::AcceptAfter(Duration::from_millis(PROVIDER_MS)));
    let mut primary = pair.primary.connect();
    make_channels(&mut primary, &sim);
    let keys: Vec<String> = (0..MESSAGES).map(|i| format!("ha-{i}")).collect();
    let (before, after) = keys.split_at(MESSAGES / 2);

    let mut ids = enqueue_all(&mut primary, before);
    let ok = wait_until(Duration::from_secs(30), || {
        count(
            &mut primary,
            "SELECT count(*) FROM outbox.messages WHERE state = 'delivered'",
            &[],
        ) >= 300
    });
    assert!(ok, "the primary did not deliver");
    pair.primary.kill();

    let mut standby = pair.standby.connect();
    let held = count(
        &mut standby,
        "SELECT count(*) FROM outbox.messages WHERE id = ANY($1)",
        &[&ids],
    );
    assert_eq!(
        held,
        ids.len() as i64,
        "a committed message is missing on the standby"
    );
    let open = in_flight(&mut standby);
    assert!(
        !open.is_empty(),
        "no attempt was open when the primary died"
    );
    let promoted_at = SystemTime::now();
    let t = Instant::now();
    pair.standby.promote();
    let promote_s = t.elapsed().as_secs_f64();

    let resumed = wait_until(Duration::from_secs(10), || {
        first_request_after(&sim, promoted_at).is_some()
    });
    assert!(resumed, "nothing was sent after the promotion");
    let resume_s = first_request_after(&sim, promoted_at)
        .and_then(|at| at.duration_since(promoted_at).ok())
        .map(|d| d.as_secs_f64())
        .unwrap_or(f64::MAX);
    println!("promotion took {promote_s:.2} s; first request {resume_s:.2} s after it was asked for; {} attempts open at the crash", open.len());
    assert!(
        resume_s < 2.0,
        "delivery resumed {resume_s:.2} s after the promotion"
    );

    // The application goes on writing to the new primary.
    let mut promoted = pair.standby.connect();
    ids.extend(enqueue_all(&mut promoted, after));
    assert!(
        wait_settled(&pair.standby, Duration::from_secs(90)),
        "not settled on the new primary"
    );
    check_outcomes(&mut promoted, &sim, &ids, &open, promoted_at);
    sim.shutdown();
}

/// Every message exists; those open at the crash took the ambiguous path of their channel;
/// no provider got a message twice.
fn check_outcomes(
    c: &mut Client,
    sim: &Simulator,
    ids: &[i64],
    open: &[(i64, String, String)],
    promoted_at: SystemTime,
) {
    let open_ids: Vec<i64> = open.iter().map(|o| o.0).collect();
    let states: HashMap<i64, (String, String)> = c
        .query(
            "SELECT id, channel, state::text FROM outbox.messages WHERE id = ANY($1)",
            &[&ids],
        )
        .expect("states")
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect();
    assert_eq!(states.len(), MESSAGES, "messages lost");
    for (id, (channel, state)) in &states {
        let expected = if channel == Kind::Neither.channel() && open_ids.contains(id) {
            "uncertain"
        } else {
            "delivered"
        };
        assert_eq!(state, expected, "message {id} on {channel}");
    }
    let recovered = count(
        c,
        "SELECT count(DISTINCT message_id) FROM outbox.attempts WHERE kind = 'recovery' AND message_id = ANY($1)",
        &[&open_ids],
    );
    assert_eq!(
        recovered,
        open_ids.len() as i64,
        "an attempt open at the crash was not taken back as interrupted"
    );

    let stored: Vec<Option<String>> = sim
        .stored(Kind::Dedupe.channel())
        .into_iter()
        .map(|s| s.key)
        .collect();
    let distinct: HashSet<&Option<String>> = stored.iter().collect();
    assert_eq!(
        stored.len(),
        distinct.len(),
        "the deduping provider stored a key twice"
    );
    for kind in KINDS {
        let twice: Vec<(String, usize)> = sends_per_key(sim, kind)
            .into_iter()
            .filter(|(_, n)| *n > 1)
            .collect();
        if kind != Kind::Dedupe {
            assert!(twice.is_empty(), "{kind:?}: received twice: {twice:?}");
        }
    }
    // A reconcile message open at the crash: the provider is asked before anything is sent again.
    let reconcile = sim.requests(Kind::Reconcile.channel());
    for (_, _, key) in open.iter().filter(|o| o.1 == Kind::Reconcile.channel()) {
        let first_after = reconcile
            .iter()
            .filter(|r| r.received_at >= promoted_at && r.key.as_deref() == Some(key.as_str()))
            .min_by_key(|r| r.seq);
        if let Some(r) = first_after {
            assert_eq!(
                r.kind, "lookup",
                "{key}: sent again before the provider was asked"
            );
        }
    }
    let by_channel = |ch: &str| open.iter().filter(|o| o.1 == ch).count();
    println!(
        "open at the crash: dedupe {}, reconcile {}, neither {} (now uncertain)",
        by_channel(Kind::Dedupe.channel()),
        by_channel(Kind::Reconcile.channel()),
        by_channel(Kind::Neither.channel())
    );
}
