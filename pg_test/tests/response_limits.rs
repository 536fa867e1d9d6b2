//! How much of a provider's answer the delivery worker reads: at most the channel's
//! `max_response_bytes` of each body (65536 by default, at most 16 MiB), the rest left
//! unread. A 2xx with a longer body is still delivered, with no error, its external id taken
//! from what was read (a JSON pointer is followed through the start of a document cut
//! short); the worker's private memory stays bounded while a batch of 10 MB answers comes in.
//!
//! Run against the cluster of `scripts/cluster.sh` (settings from `OUTBOX_BASE` /
//! `OUTBOX_PGPORT`): `cargo test -p outbox_e2e --release --test response_limits --
//! --test-threads=1 --nocapture`.

use outbox_e2e::cluster::{unique, wait_for_state, wait_until, Cluster};
use outbox_e2e::helpers::{cluster_and_sim, code_of, create_channel, sim_channel};
use outbox_e2e::sim::{Action, Simulator};
use postgres::Client;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const MB: u64 = 1024 * 1024;
/// The target: a worker's private memory (RssAnon) while it reads a batch of large answers.
const PEAK_LIMIT: u64 = 64 * MB;

/// The PIDs of the running delivery workers.
fn worker_pids(c: &mut Client) -> Vec<i32> {
    c.query(
        "SELECT pid FROM outbox.worker_status() WHERE pid IS NOT NULL ORDER BY pid",
        &[],
    )
    .expect("outbox.worker_status()")
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// A process's private resident memory (`RssAnon` of `/proc/PID/status`) in bytes.
fn rss_anon(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("RssAnon:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Samples the `RssAnon` of some processes every 10 ms in a thread, keeping each one's peak.
struct RssSampler {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<(i32, u64)>>,
}

impl RssSampler {
    fn start(pids: Vec<i32>) -> RssSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peaks: Vec<(i32, u64)> = pids.iter().map(|&p| (p, 0)).collect();
            while !flag.load(Ordering::Relaxed) {
                for (pid, peak) in peaks.iter_mut() {
                    *peak = (*peak).max(rss_anon(*pid).unwrap_or(0));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            peaks
        });
        RssSampler { stop, thread }
    }

    /// Stops sampling; each process's peak in bytes.
    fn stop(self) -> Vec<(i32, u64)> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("sampler thread")
    }
}

/// Enqueues `n` messages on the channel in one statement (one transaction).
fn enqueue_many(c: &mut Client, channel: &str, n: i64) {
    c.execute(
        "SELECT outbox.enqueue($1, jsonb_build_object('n', g), $2 || ':' || g)
           FROM generate_series(1, $3::int8) g",
        &[&channel, &channel, &n],
    )
    .expect("enqueue");
}

fn delivered(c: &mut Client, channel: &str) -> i64 {
    c.query_one(
        "SELECT count(*) FROM outbox.messages WHERE channel = $1 AND state = 'delivered'",
        &[&channel],
    )
    .expect("count delivered")
    .get(0)
}

/// A delivered message's external id, its `last_error` and its send attempt's `error`.
#[derive(Debug)]
struct Outcome {
    id: i64,
    state: String,
    external_id: Option<String>,
    last_error: Option<String>,
    attempt_error: Option<String>,
}

fn outcomes(c: &mut Client, channel: &str) -> Vec<Outcome> {
    c.query(
        "SELECT m.id, m.state::text, m.external_id, m.last_error, a.error
           FROM outbox.messages m
           LEFT JOIN outbox.attempts a ON a.message_id = m.id AND a.kind = 'send'
          WHERE m.channel = $1 ORDER BY m.id, a.attempt",
        &[&channel],
    )
    .expect("read messages and attempts")
    .iter()
    .map(|r| Outcome {
        id: r.get(0),
        state: r.get(1),
        external_id: r.get(2),
        last_error: r.get(3),
        attempt_error: r.get(4),
    })
    .collect()
}

/// A delivered message records no error, however long its answer was.
fn no_error(o: &Outcome) -> bool {
    o.last_error.is_none() && o.attempt_error.is_none()
}

/// One message on a new channel with `options` whose provider answers `answer_bytes`;
/// returns it once delivered, with the external id the provider gave it.
fn deliver_one(
    c: &mut Client,
    cluster: &Cluster,
    options: &str,
    answer_bytes: usize,
) -> (Outcome, String) {
    let sim = Simulator::start();
    let ch = unique("rl_one");
    sim.set_default(&ch, Action::AcceptLarge(answer_bytes));
    create_channel(c, &ch, &sim.send_url(&ch), options);
    enqueue_many(c, &ch, 1);
    let mut o = outcomes(c, &ch).remove(0);
    wait_for_state(cluster, o.id, "delivered", T);
    o = outcomes(c, &ch).remove(0);
    assert_eq!(o.state, "delivered", "within {T:?}: {o:?}");
    let stored = sim.stored(&ch);
    assert_eq!(stored.len(), 1);
    (o, stored[0].external_id.clone())
}

#[test]
fn large_answers_are_read_only_up_to_max_response_bytes_and_still_delivered() {
    let (_cluster, mut c, sim) = cluster_and_sim();
    sim.set_record_bodies(false);
    let ch = sim_channel(&mut c, &sim, "rl_large", r#"{"external_id": "/id"}"#);
    sim.set_default(&ch, Action::AcceptLarge(10_000_000));
    let pids = worker_pids(&mut c);
    assert!(!pids.is_empty(), "no delivery worker runs");
    let idle: Vec<_> = pids
        .iter()
        .map(|&p| rss_anon(p).unwrap_or(0) / MB)
        .collect();

    let sampler = RssSampler::start(pids);
    enqueue_many(&mut c, &ch, 200);
    let all = wait_until(T, || delivered(&mut c, &ch) == 200);
    let peaks = sampler.stop();
    let shown: Vec<_> = peaks
        .iter()
        .map(|(pid, p)| format!("pid {pid}: {} MB", p / MB))
        .collect();
    println!(
        "200 answers of 10 MB: worker peak private memory (RssAnon) {} (idle {idle:?} MB; target < 64 MB)",
        shown.join(", ")
    );
    assert!(
        all,
        "{} of 200 delivered within {T:?}",
        delivered(&mut c, &ch)
    );

    let rows = outcomes(&mut c, &ch);
    assert_eq!(rows.len(), 200, "one send attempt each");
    let no_id = rows.iter().filter(|o| o.external_id.is_none()).count();
    let with_error = rows.iter().filter(|o| !no_error(o)).count();
    assert!(
        no_id == 0 && with_error == 0,
        "of 200 delivered, {no_id} have no external id and {with_error} an error; the first: {:?}",
        rows[0]
    );
    let mut ids: Vec<_> = sim.stored(&ch).into_iter().map(|s| s.external_id).collect();
    let mut got: Vec<_> = rows.iter().filter_map(|o| o.external_id.clone()).collect();
    ids.sort();
    got.sort();
    assert!(
        got == ids,
        "the external ids are not the ones the answers began with"
    );
    for (pid, peak) in peaks {
        assert!(peak < PEAK_LIMIT, "worker {pid} peaked at {} MB", peak / MB);
    }
}

#[test]
fn a_channel_may_read_a_longer_body() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let refused = c.execute(
        "SELECT outbox.create_channel($1, 'http://127.0.0.1:9/x', '{\"max_response_bytes\": 20000000}'::jsonb)",
        &[&unique("rl_over")],
    );
    assert_eq!(code_of(&refused.expect_err("over the 16 MiB max")), "22023");

    for (limit, options, answer_bytes) in [
        // The largest limit: a 10 MB answer is read whole, nothing to note.
        (
            "the largest limit",
            r#"{"external_id": "/id", "max_response_bytes": 16777216}"#,
            10_000_000,
        ),
        // A short limit: the id at the start is still read.
        (
            "a short limit",
            r#"{"external_id": "/id", "max_response_bytes": 4096}"#,
            10_000,
        ),
    ] {
        let (got, id) = deliver_one(&mut c, &cluster, options, answer_bytes);
        assert!(
            got.external_id.as_deref() == Some(id.as_str()) && no_error(&got),
            "{limit}: want external id {id:?} and no error: {got:?}"
        );
    }
}

/// What a provider said when it refused: a 404's body is kept with the attempt (its
/// `error`) and shows in the work queue's `last_error`, up to the channel's
/// `response_excerpt_bytes`; 0 keeps nothing. A delivery keeps no excerpt.
#[test]
fn a_refusals_answer_is_kept_with_its_attempt_up_to_response_excerpt_bytes() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let refused = |c: &mut Client, options: &str| -> (String, String) {
        let ch = sim_channel(c, &sim, "rl_excerpt", options);
        sim.set_default(&ch, Action::Status(404));
        enqueue_many(c, &ch, 1);
        let id = outcomes(c, &ch).remove(0).id;
        wait_for_state(&cluster, id, "failed", T);
        let r = c
            .query_one(
                "SELECT w.last_error, a.error FROM outbox.work_queue w
                   JOIN outbox.attempts a ON a.message_id = w.id AND a.kind = 'send'
                  WHERE w.id = $1",
                &[&id],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    let said = r#"answer: {"error":"simulated status 404"}"#;
    let (last_error, attempt_error) = refused(&mut c, "{}");
    assert!(last_error.starts_with("HTTP 404 after "), "{last_error}");
    assert!(last_error.contains(said), "{last_error}");
    assert!(attempt_error.contains(said), "{attempt_error}");

    let (last_error, _) = refused(&mut c, r#"{"response_excerpt_bytes": 10}"#);
    assert!(
        last_error.contains(r#"answer: {"error":" …"#),
        "cut at 10 bytes: {last_error}"
    );
    let (last_error, _) = refused(&mut c, r#"{"response_excerpt_bytes": 0}"#);
    assert!(
        !last_error.contains("answer:"),
        "nothing kept: {last_error}"
    );

    let refused = c
        .execute(
            "SELECT outbox.create_channel('rl_excerpt_bad', 'http://127.0.0.1:9/x', '{\"response_excerpt_bytes\": 70000}')",
            &[],
        )
        .unwrap_err();
    assert_eq!(code_of(&refused), "22023", "{refused}");
}

/// `classify_answers`: a 400 whose answer says "simulated status 400" is transient by the
/// channel's rule (the status alone would fail it), retried, and delivered by the next
/// attempt; the attempt says which rule decided.
#[test]
fn classify_answers_retries_a_refusal_its_text_calls_transient() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(
        &mut c,
        &sim,
        "rl_rules",
        r#"{"retry": {"base_ms": 100, "jitter": "none"},
            "classify_answers": [{"status": "4xx", "contains": "simulated status 400", "class": "transient"}]}"#,
    );
    sim.set_plan(&ch, vec![Action::Status(400), Action::Accept]);
    enqueue_many(&mut c, &ch, 1);
    let id = outcomes(&mut c, &ch).remove(0).id;
    wait_for_state(&cluster, id, "delivered", T);
    let first: (String, String) = c
        .query_one(
            "SELECT error_class::text, error FROM outbox.attempts WHERE message_id = $1 AND attempt = 1",
            &[&id],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(first.0, "transient", "{first:?}");
    assert!(
        first.1.contains("transient by classify_answers[0]"),
        "{first:?}"
    );
    // A rule whose text the excerpt cannot hold is refused.
    let refused = c
        .execute(
            "SELECT outbox.create_channel($1, 'http://127.0.0.1:9/x',
                    '{\"response_excerpt_bytes\": 8, \"classify_answers\": [{\"contains\": \"quota exceeded\", \"class\": \"transient\"}]}')",
            &[&unique("rl_rules_bad")],
        )
        .unwrap_err();
    assert_eq!(code_of(&refused), "22023", "{refused}");
}
