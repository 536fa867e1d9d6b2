//! Delivery benchmarks against the real cluster (`bench/bench.sh` runs this):
//! - deliveries per second for a backlog of N messages to a loopback sink that only
//!   answers 200 (the provider simulator in accept mode, bodies not kept);
//! - latency from COMMIT of an enqueue to the request arriving at the sink, p50/p99,
//!   idle and while a backlog is being delivered. An idle sample is committed
//!   `--idle-rest-ms` (25) after the request of the one before arrived, a loaded one 5 ms
//!   after it; with `--rested-samples N`, N idle samples more, each `--rested-ms` (300)
//!   after the one before: a worker idle for longer than its periodic work's interval.
//!
//! Prints one `name value unit` line per figure. Never asserts anything.
//!
//! - with `--large-backlog N`, the same throughput for a backlog of N, and the execution
//!   time of `SELECT * FROM outbox.metrics` and `outbox.prometheus()` with N queued.
//!
//! - with `--steady-seconds S`, a steady load of `--steady-rate` messages per second (1,000)
//!   for S seconds with retention of 15 s: the size of every table of the extension (with indexes
//!   and TOAST) as it goes, to see that each stays flat, and the rows written to each
//!   (`bench/steady.rs`).
//!
//! - with `--price-of-safety R`, only the drains of a channel that can neither dedupe nor
//!   be asked, at its default bound and a few others, beside an ordinary channel's: R
//!   alternating rounds (`bench/bench_unverifiable.sh`).
//!
//! - with `--several-databases R`, for a server serving the databases of `OUTBOX_DB` (a
//!   comma-separated list, `outbox.database` the same): the drain of a backlog of N in the
//!   first database alone, beside the drains of N in every database at once (their sum), in
//!   R alternating rounds (`bench/bench_databases.sh`).
//! - with `--webhooks R`, only the drains of a plain HTTP channel, a signing one, one with
//!   three unsigned headers of the same sizes and one over HTTPS (a test CA, connections
//!   reused): R rounds, the lanes in a balanced order, every drain from emptied tables
//!   (`bench/bench_webhooks.sh`).
//!
//! - with `--kinds R`, the drains of an HTTP, a `nats` (`--nats-url`, `--nats-pid`) and a
//!   `sql` channel side by side in R alternating rounds, with what one delivery costs: CPU,
//!   WAL, growth of the tables (`bench/bench_nats.sh`; `--costs-json PATH` writes them).
//!
//! - with `--anchors R`, the drains of the extension beside those of the outbox an
//!   application writes by hand (`handwritten-outbox`), R alternating rounds
//!   (`bench/bench_anchors.sh`).
//!
//! ```text
//! bench [--backlog 10000] [--large-backlog 0] [--steady-seconds 0] [--steady-rate 1000]
//!       [--latency-samples 200]
//!       [--idle-rest-ms 25] [--rested-samples 0 --rested-ms 300]
//!       [--price-of-safety 0] [--several-databases 0] [--webhooks 0]
//!       [--kinds 0 --nats-url URL --nats-pid PID --costs-json PATH]
//!       [--anchors 0 --handwritten-loops 1,2] [--sim-port 0]
//! ```

use outbox_e2e::cli::{num_arg as arg, text_arg};
use outbox_e2e::cluster::{unique, wait_until, Cluster};
use outbox_e2e::costs::{server_pids, worker_pids, Cost, Snapshot};
use outbox_e2e::sim::{Received, Simulator};
use postgres::Client;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime};

#[path = "bench/anchors.rs"]
mod anchors;
#[path = "bench/kinds.rs"]
mod kinds;
#[path = "bench/steady.rs"]
mod steady;

/// Is a message of the channel still queued or in flight? Two probes of the heads of the
/// partial indexes: cheap enough to ask every 20 ms at any backlog.
fn pending(c: &mut Client, channel: &str) -> bool {
    c.query_one(
        "SELECT EXISTS (SELECT 1 FROM outbox._messages m WHERE m.channel_id = ch.id AND m.state = 'queued')
             OR EXISTS (SELECT 1 FROM outbox._messages m WHERE m.channel_id = ch.id AND m.state = 'sending')
           FROM outbox._channels ch WHERE ch.name = $1",
        &[&channel],
    )
    .map(|r| r.get(0))
    .unwrap_or(true)
}

/// Messages the worker has recorded delivered on the channel (its counter in
/// `_channel_stats`, written with each batch).
fn delivered(c: &mut Client, channel: &str) -> i64 {
    c.query_one(
        "SELECT coalesce((SELECT s.delivered_total FROM outbox._channel_stats s
                           JOIN outbox._channels ch ON ch.id = s.channel_id WHERE ch.name = $1), 0)",
        &[&channel],
    )
    .map(|r| r.get(0))
    .unwrap_or(0)
}

/// One drain: its rate, (seconds since the resume, messages delivered) at each look, about
/// once a second the vacuums running (table:phase, or '-'), and when it was seen to have
/// ended (unix seconds, the server's clock).
struct Drain {
    rate: f64,
    progress: Vec<(f64, i64)>,
    vacuums: Vec<(f64, String)>,
    seen_ended_at: f64,
}

impl Drain {
    /// The rate over the first `k` deliveries: to the first sample that reached them.
    fn rate_of_first(&self, k: i64) -> Option<f64> {
        self.progress
            .iter()
            .find(|(_, d)| *d >= k)
            .map(|(t, d)| *d as f64 / t)
    }

    /// Every `step` seconds: the rate in that window and the vacuums seen running in it.
    fn timeline(&self, step: f64) -> Vec<String> {
        let mut out = Vec::new();
        let mut from = (0.0, 0i64);
        let mut next = step;
        for &(t, d) in &self.progress {
            if t < next {
                continue;
            }
            let mut seen: Vec<&str> = self
                .vacuums
                .iter()
                .filter(|(at, v)| *at >= from.0 && *at <= t && v != "-")
                .map(|(_, v)| v.as_str())
                .collect();
            seen.dedup();
            out.push(format!(
                "{:>5.0} s {:>6.0} msg/s {}",
                t,
                (d - from.1) as f64 / (t - from.0),
                if seen.is_empty() {
                    "-".to_string()
                } else {
                    seen.join(",")
                }
            ));
            from = (t, d);
            next = t + step;
        }
        out
    }

    /// The rate in each tenth of the drain's messages.
    fn rates_by_tenth(&self, n: i64) -> Vec<f64> {
        let mut out = Vec::new();
        let mut from = (0.0, 0i64);
        for tenth in 1..=10 {
            let goal = n * tenth / 10;
            let Some(&at) = self.progress.iter().find(|(_, d)| *d >= goal) else {
                break;
            };
            if at.0 > from.0 {
                out.push((at.1 - from.1) as f64 / (at.0 - from.0));
            }
            from = at;
        }
        out
    }
}

/// The options of the throughput channels: 512 attempts open at once, whether or not the
/// sink dedupes (it does not: the figure is the worker's pace, not a provider's).
const THROUGHPUT_OPTIONS: &str =
    r#"{"max_in_flight": 512, "max_unverifiable_in_flight": 512, "external_id": "/id"}"#;

/// Enqueues `n` messages on a paused channel in batches of 1,000, then resumes it and
/// measures until all are delivered.
fn throughput(cluster: &Cluster, sim: &Simulator, n: usize) -> Drain {
    throughput_on(cluster, sim, n, THROUGHPUT_OPTIONS)
}

/// [`throughput`] on a channel with `options` (JSON text).
fn throughput_on(cluster: &Cluster, sim: &Simulator, n: usize, options: &str) -> Drain {
    throughput_at(cluster, n, options, &|ch| sim.send_url(ch))
}

/// As [`throughput_on`], to the endpoint `endpoint(channel)` (the simulator over HTTPS, say).
fn throughput_at(
    cluster: &Cluster,
    n: usize,
    options: &str,
    endpoint: &dyn Fn(&str) -> String,
) -> Drain {
    let mut c = cluster.connect();
    let ch = load_paused(&mut c, endpoint, n, options);
    if n >= 100_000 {
        explain_views_at_backlog(&mut c, n);
    }
    drain(&mut c, &ch, n)
}

/// The pause between two looks at a drain: 20 ms while its end is further away than two
/// such pauses at the rate so far, then 1 ms, so that the end is seen about a millisecond
/// after the last record commits rather than up to 20 ms after it (a drain of 10,000 lasts
/// about a third of a second). The hand-written outbox times its own end the same way: it
/// stops when its claim comes back empty.
fn pause_between_looks(elapsed_s: f64, done: i64, n: usize) -> Duration {
    let rate = done as f64 / elapsed_s.max(1e-3);
    let left_s = (n as i64 - done).max(0) as f64 / rate.max(1.0);
    if left_s < 0.04 {
        Duration::from_millis(1)
    } else {
        Duration::from_millis(20)
    }
}

/// Resumes the paused channel `ch` with `n` messages queued and measures until all are
/// delivered (see [`pause_between_looks`]).
fn drain(c: &mut Client, ch: &str, n: usize) -> Drain {
    let start = Instant::now();
    c.execute("SELECT outbox.resume_channel($1)", &[&ch])
        .unwrap();
    let mut progress = Vec::new();
    let mut vacuums = Vec::new();
    let (mut next_vacuum_look, mut next_pending_look) = (0.0, 0.5);
    let ok = loop {
        let at = start.elapsed().as_secs_f64();
        let done = delivered(c, ch);
        progress.push((at, done));
        if at >= next_vacuum_look {
            vacuums.push((at, vacuums_running(c)));
            next_vacuum_look = at + 1.0;
        }
        // Every half second at least, in case a message ends other than delivered.
        if done >= n as i64 || at >= next_pending_look {
            next_pending_look = at + 0.5;
            if !pending(c, ch) {
                break true;
            }
        }
        if at > 900.0 {
            break false;
        }
        std::thread::sleep(pause_between_looks(at, done, n));
    };
    let secs = start.elapsed().as_secs_f64();
    if !ok {
        eprintln!("backlog of {n} not delivered within 900 s");
    }
    // A drain whose messages ended other than delivered (an effect that fails, say) is timed
    // all the same: the line says so beside the figures, which then are not deliveries.
    let delivered_n = delivered(c, ch);
    if delivered_n < n as i64 {
        println!("warning_undelivered channel {ch}: {delivered_n} of {n} delivered; the drain's figures are not deliveries");
    }
    let seen_ended_at = c
        .query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[])
        .map(|r| r.get(0))
        .unwrap_or(f64::NAN);
    Drain {
        rate: n as f64 / secs,
        progress,
        vacuums,
        seen_ended_at,
    }
}

/// When the channel's last record transaction began (its newest ledger entry's
/// `recorded_at`, unix seconds). It reads the channel's entries of the whole ledger: asked
/// after a drain's costs are taken, so that they do not count it.
fn last_record_began_at(c: &mut Client, channel: &str) -> f64 {
    c.query_one(
        "SELECT coalesce(extract(epoch FROM max(l.recorded_at)), 'NaN')::float8
           FROM outbox._ledger l JOIN outbox._channels ch ON ch.id = l.channel_id WHERE ch.name = $1",
        &[&channel],
    )
    .map(|r| r.get(0))
    .unwrap_or(f64::NAN)
}

/// A channel of its own (its endpoint `endpoint(name)`) with `n` messages queued on it,
/// paused; vacuumed and checkpointed so that the drain starts from a settled table.
fn load_paused(
    c: &mut Client,
    endpoint: &dyn Fn(&str) -> String,
    n: usize,
    options: &str,
) -> String {
    let ch = create_paused(c, endpoint, &|_| options.to_string());
    enqueue_backlog(c, &ch, n);
    settle(c);
    ch
}

/// A drain and what it cost: the enqueue of its backlog (the session's backend) and the
/// drain itself (the delivery workers; CPU of the processes `sink` beside).
struct Costed {
    rate: f64,
    seen_after_last_record_ms: f64,
    enqueue: Cost,
    delivery: Cost,
}

fn backend_pid(c: &mut Client) -> i32 {
    c.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0)
}

/// `n` messages enqueued on a new paused channel (`endpoint`, `options` made from its name),
/// settled, and drained; with the costs of both.
fn costed_drain(
    cluster: &Cluster,
    endpoint: &dyn Fn(&str) -> String,
    options: &dyn Fn(&str) -> String,
    n: usize,
    sink: &[i32],
) -> Costed {
    let mut c = cluster.connect();
    let server = server_pids(&cluster.base.join("pgdata"));
    let workers = worker_pids(&mut c);
    let me = [backend_pid(&mut c)];
    let ch = create_paused(&mut c, endpoint, options);
    let before = Snapshot::take(&mut c, &me, &server, &[]);
    enqueue_backlog(&mut c, &ch, n);
    let enqueue = before.cost(&mut c, &me, &server, &[]);
    settle(&mut c);
    let before = Snapshot::take(&mut c, &workers, &server, sink);
    let drained = drain(&mut c, &ch, n);
    let delivery = before.cost(&mut c, &workers, &server, sink);
    Costed {
        rate: drained.rate,
        seen_after_last_record_ms: (drained.seen_ended_at - last_record_began_at(&mut c, &ch))
            * 1000.0,
        enqueue,
        delivery,
    }
}

/// The median of `v` (the upper one of an even count); NaN when empty.
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Rates as `a / b / c`.
fn shown(v: &[f64]) -> String {
    v.iter()
        .map(|r| format!("{r:.0}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// A channel of its own, paused; its endpoint and options made from its name.
fn create_paused(
    c: &mut Client,
    endpoint: &dyn Fn(&str) -> String,
    options: &dyn Fn(&str) -> String,
) -> String {
    let ch = unique("bench_tp");
    c.execute(
        "SELECT outbox.create_channel($1, $2, $3::text::jsonb)",
        &[&ch, &endpoint(&ch), &options(&ch)],
    )
    .unwrap();
    c.execute(
        "SELECT outbox.pause_channel($1, 'loading the backlog')",
        &[&ch],
    )
    .unwrap();
    ch
}

/// `n` messages on `ch`, in transactions of 1,000. Their effect keys begin with the
/// message's number (zero-padded) and end with the channel's name: a drain writes its ledger
/// entries in key order, among those of every earlier drain, so that every channel's drain
/// meets the ledger's index alike. (Keys that began with the channel's name put one lane's
/// entries at the index's right edge and another's in its middle: in one A/B the same
/// signed channel cost 0.85× or 1.00× an unsigned one by the place of its keys alone.)
fn enqueue_backlog(c: &mut Client, ch: &str, n: usize) {
    let mut done = 0;
    while done < n {
        let k = (n - done).min(1000) as i64;
        c.execute(
            "SELECT outbox.enqueue($1, jsonb_build_object('n', g, 'text', 'benchmark message'),
                                   lpad(($2 + g)::text, 9, '0') || ':' || $1)
               FROM generate_series(1, $3::int8) g",
            &[&ch, &(done as i64), &k],
        )
        .unwrap();
        done += k as usize;
    }
}

/// Vacuums the messages and checkpoints.
fn settle(c: &mut Client) {
    // Two statements: VACUUM cannot run in the implicit transaction of a multi-statement query.
    c.batch_execute("VACUUM ANALYZE outbox._messages").unwrap();
    c.batch_execute("CHECKPOINT").unwrap();
}

/// The execution time of the views over `_messages` with a backlog of `n`.
fn explain_views_at_backlog(c: &mut Client, n: usize) {
    for (name, sql) in [
        ("metrics", "SELECT * FROM outbox.metrics"),
        ("prometheus", "SELECT outbox.prometheus()"),
    ] {
        let plan: Vec<String> = c
            .query(
                &format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT TEXT) {sql}"),
                &[],
            )
            .unwrap()
            .iter()
            .map(|r| r.get::<_, String>(0))
            .collect();
        let took = plan
            .iter()
            .find(|l| l.starts_with("Execution Time"))
            .cloned()
            .unwrap_or_default();
        let seq_scans = plan
            .iter()
            .filter(|l| l.contains("Seq Scan on _messages"))
            .count();
        println!("{name}_at_backlog_{n} {took} (sequential scans of _messages: {seq_scans})");
    }
}

/// The vacuums running now, as table:phase, or '-'.
fn vacuums_running(c: &mut Client) -> String {
    c.query_one(
        "SELECT coalesce(string_agg(relid::regclass::text || ':' || replace(phase, ' ', '_'), ','), '-')
           FROM pg_stat_progress_vacuum",
        &[],
    )
    .map(|r| r.get(0))
    .unwrap_or_else(|_| "?".into())
}

/// Sets a setting server-wide (ALTER SYSTEM must be its own statement) and reloads.
fn alter_system(c: &mut Client, setting: &str, value: Option<&str>) {
    let sql = match value {
        Some(v) => format!("ALTER SYSTEM SET {setting} = '{v}'"),
        None => format!("ALTER SYSTEM RESET {setting}"),
    };
    c.batch_execute(&sql).unwrap();
    c.batch_execute("SELECT pg_reload_conf()").unwrap();
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// COMMIT → request at the sink, for `samples` single-message transactions: p50 and p99
/// from the COMMIT call, which includes the application's own WAL flush (the figure of the
/// target), and from the COMMIT's return (what the workers add after it); and how long the
/// COMMIT call itself took (the application's flush, the server's reply, the client).
struct Latency {
    p50: f64,
    p99: f64,
    after_commit_p50: f64,
    after_commit_p99: f64,
    commit_p50: f64,
    commit_p99: f64,
}

impl Latency {
    /// The lines `latency_{label}_p50`, `_p99`, `_after_commit_p50` (with its p99) and
    /// `_commit_p50` (with its p99).
    fn print(&self, label: &str) {
        println!("latency_{label}_p50 {:.2} ms", self.p50);
        println!("latency_{label}_p99 {:.2} ms", self.p99);
        println!(
            "latency_{label}_after_commit_p50 {:.2} ms (from the COMMIT's return; p99 {:.2} ms)",
            self.after_commit_p50, self.after_commit_p99
        );
        println!(
            "latency_{label}_commit_p50 {:.2} ms (the COMMIT call alone, to its return; p99 {:.2} ms)",
            self.commit_p50, self.commit_p99
        );
    }
}

/// The requests seen at the sink by key, and a signal for each: a sample is over when its
/// request arrives, not at the next look of a poll.
#[derive(Default)]
struct Arrivals {
    at: Mutex<HashMap<String, SystemTime>>,
    arrived: Condvar,
}

impl Arrivals {
    /// When the request of `key` arrived, waiting for it `timeout` at most.
    fn wait_for(&self, key: &str, timeout: Duration) -> Option<SystemTime> {
        let at = self.at.lock().unwrap();
        let (at, _) = self
            .arrived
            .wait_timeout_while(at, timeout, |at| !at.contains_key(key))
            .unwrap();
        at.get(key).copied()
    }
}

/// `samples` single-message transactions, each committed `rest` after the request of the
/// one before arrived.
fn latency(cluster: &Cluster, sim: &Simulator, samples: usize, rest: Duration) -> Latency {
    let arrivals: Arc<Arrivals> = Arc::default();
    let seen = arrivals.clone();
    sim.set_observer(move |r: &Received| {
        if let Some(k) = &r.key {
            seen.at.lock().unwrap().insert(k.clone(), r.received_at);
            seen.arrived.notify_all();
        }
    });
    let mut c = cluster.connect();
    let ch = unique("bench_lat");
    c.execute(
        "SELECT outbox.create_channel($1, $2, '{\"idempotency_header\": \"Idempotency-Key\"}'::jsonb)",
        &[&ch, &sim.send_url(&ch)],
    )
    .unwrap();
    let ms_between = |from: SystemTime, to: SystemTime| {
        to.duration_since(from)
            .map(|d| d.as_secs_f64() * 1000.0)
            .unwrap_or(0.0)
    };
    let mut from_call = Vec::with_capacity(samples);
    let mut from_return = Vec::with_capacity(samples);
    let mut commits = Vec::with_capacity(samples);
    for i in 0..samples {
        let key = format!("{ch}-{i}");
        let mut tx = c.transaction().unwrap();
        tx.execute(
            "SELECT outbox.enqueue($1, '{\"t\": 1}'::jsonb, $2)",
            &[&ch, &key],
        )
        .unwrap();
        let committing = SystemTime::now();
        tx.commit().unwrap();
        let committed = SystemTime::now();
        commits.push(ms_between(committing, committed));
        if let Some(at) = arrivals.wait_for(&key, Duration::from_secs(10)) {
            from_call.push(ms_between(committing, at));
            from_return.push(ms_between(committed, at));
        }
        std::thread::sleep(rest);
    }
    sim.clear_observer();
    from_call.sort_by(f64::total_cmp);
    from_return.sort_by(f64::total_cmp);
    commits.sort_by(f64::total_cmp);
    Latency {
        p50: percentile(&from_call, 0.5),
        p99: percentile(&from_call, 0.99),
        after_commit_p50: percentile(&from_return, 0.5),
        after_commit_p99: percentile(&from_return, 0.99),
        commit_p50: percentile(&commits, 0.5),
        commit_p99: percentile(&commits, 0.99),
    }
}

/// What a flush of this disk costs after a rest, as each idle sample meets two of them (the
/// application's commit and the claim's): `samples` writes of 8 kB into a file beside the
/// cluster's data directory (the WAL's file system), each followed by `fdatasync` and
/// `rest` apart, as the idle samples are. Returns p50, p90 and p99 in ms.
fn disk_flush_after_rest(dir: &std::path::Path, samples: usize, rest: Duration) -> (f64, f64, f64) {
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    let path = dir.join("bench_flush_probe");
    let mut file = std::fs::File::create(&path).unwrap();
    let page: Vec<u8> = (0..8192u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    for _ in 0..2048 {
        file.write_all(&page).unwrap();
    }
    file.sync_all().unwrap();
    let mut ms = Vec::with_capacity(samples);
    for i in 0..samples {
        std::thread::sleep(rest);
        let start = Instant::now();
        file.write_all_at(&page, (i % 2048) as u64 * 8192).unwrap();
        file.sync_data().unwrap();
        ms.push(start.elapsed().as_secs_f64() * 1000.0);
    }
    drop(file);
    let _ = std::fs::remove_file(&path);
    ms.sort_by(f64::total_cmp);
    (
        percentile(&ms, 0.5),
        percentile(&ms, 0.9),
        percentile(&ms, 0.99),
    )
}

/// Waits until every delivery worker is in its delivery loop (past its start, the wait for
/// the extension and for its role), so that no sample measures a worker's start.
fn wait_for_delivery_loop(cluster: &Cluster) {
    let mut c = cluster.connect();
    let ready = wait_until(Duration::from_secs(60), || {
        c.query_one(
            "SELECT count(*) FILTER (WHERE state IN ('idle', 'claiming', 'sending', 'recording'))
                    = current_setting('outbox.workers')::int8
               FROM outbox.worker_status()",
            &[],
        )
        .map(|r| r.get::<_, bool>(0))
        .unwrap_or(false)
    });
    if !ready {
        eprintln!("the delivery workers did not reach their loop within 60 s");
    }
}

/// The price of safety on a channel that can neither dedupe nor be asked: drains of
/// `backlog` at its default bound (`max_unverifiable_in_flight`, 8) and at a few others,
/// beside an ordinary channel's (`idempotency_header`, default `max_in_flight` 64), in
/// alternating rounds; the median of `rounds` drains each.
fn price_of_safety(cluster: &Cluster, sim: &Simulator, backlog: usize, rounds: usize) {
    let lanes: [(&str, String); 5] = [
        (
            "ordinary_default_64",
            r#"{"idempotency_header": "Idempotency-Key"}"#.into(),
        ),
        ("unverifiable_default_8", "{}".into()),
        (
            "unverifiable_4",
            r#"{"max_unverifiable_in_flight": 4}"#.into(),
        ),
        (
            "unverifiable_16",
            r#"{"max_unverifiable_in_flight": 16}"#.into(),
        ),
        (
            "unverifiable_32",
            r#"{"max_unverifiable_in_flight": 32}"#.into(),
        ),
    ];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); lanes.len()];
    for _ in 0..rounds {
        for (i, (_, options)) in lanes.iter().enumerate() {
            rates[i].push(throughput_on(cluster, sim, backlog, options).rate);
        }
    }
    let labels: Vec<&str> = lanes.iter().map(|(label, _)| *label).collect();
    print_beside_first(&labels, &rates, |label, m, ratio, shown| {
        format!("deliveries_per_s_backlog_{backlog}_{label} {m:.0} msg/s ({ratio:.2}x the ordinary channel; drains: {shown})")
    });
}

/// A lane of [`webhooks`]: its label, its channel's options, and its endpoint made from the
/// channel's name.
type Lane<'a> = (&'a str, &'a str, &'a dyn Fn(&str) -> String);

/// The price of webhook-grade channels: drains of the same backlog on a plain HTTP channel,
/// a signing one (Standard Webhooks, one secret), one with three unsigned headers of the
/// signed ones' sizes and one over HTTPS to the simulator behind a test CA, in alternating
/// rounds, each drain from the same tables ([`reset_tables`]); the median of each, its
/// worker CPU per delivery, and the TLS handshakes (a reused connection needs none).
fn webhooks(cluster: &Cluster, sim: &Simulator, backlog: usize, rounds: usize) {
    let pki = outbox_e2e::test_ca::TestPki::generate();
    let front = outbox_e2e::tls_front::TlsFront::start(
        sim.port(),
        &pki.server.cert_pem,
        &pki.server.key_pem,
        None,
    );
    let plain = r#"{"idempotency_header": "Idempotency-Key"}"#.to_string();
    let signed = r#"{"idempotency_header": "Idempotency-Key", "signing": {"secrets": ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]}}"#.to_string();
    let https = serde_json::json!({"idempotency_header": "Idempotency-Key", "tls": {"ca_pem": pki.ca.cert_pem}}).to_string();
    // Three fixed headers of the sizes of the signed ones, unsigned: what the bytes of the
    // headers cost apart from the signature.
    let same_headers = serde_json::json!({"idempotency_header": "Idempotency-Key", "headers": {
        "x-webhook-id": "ok_4f1c2a7e9b3d8e60_send_key_of_a_message",
        "x-webhook-time": "1764600000",
        "x-webhook-sig": "v1,K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9NDN/H/pI4=",
    }})
    .to_string();
    let over_http = |ch: &str| sim.send_url(ch);
    let over_https = |ch: &str| front.send_url(ch);
    let lanes: [Lane; 4] = [
        ("plain_http", &plain, &over_http),
        ("signed", &signed, &over_http),
        ("same_headers_unsigned", &same_headers, &over_http),
        ("https", &https, &over_https),
    ];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); lanes.len()];
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); lanes.len()];
    let mut handshakes = Vec::new();
    let mut c = cluster.connect();
    for round in 0..rounds {
        // Round r starts with lane r mod 4 and goes on in the order of a balanced Latin
        // square (0 1 3 2, each plus r): in every four rounds each lane is once first,
        // second, third and last, and follows each other lane once, so that neither a place
        // in the round nor what the drain before left behind always falls on the same lane.
        for step in [0, 1, 3, 2] {
            let i = (step + round) % lanes.len();
            let (label, options, endpoint) = &lanes[i];
            let before = outbox_e2e::tls_front::TlsFront::count(&front.counters().handshakes);
            let (rate, cpu_ms) = lane_drain(&mut c, backlog, options, *endpoint);
            rates[i].push(rate);
            cpu[i].push(cpu_ms * 1000.0 / backlog as f64);
            if *label == "https" {
                handshakes.push(
                    outbox_e2e::tls_front::TlsFront::count(&front.counters().handshakes) - before,
                );
            }
        }
    }
    let labels: Vec<&str> = lanes.iter().map(|(label, _, _)| *label).collect();
    print_beside_first(&labels, &rates, |label, m, ratio, shown| {
        format!("deliveries_per_s_backlog_{backlog}_{label} {m:.0} msg/s ({ratio:.3}x plain HTTP; drains: {shown})")
    });
    print_beside_first(&labels, &cpu, |label, m, ratio, shown| {
        format!(
            "worker_cpu_ms_per_1000_{label} {m:.0} ms ({ratio:.3}x plain HTTP; drains: {shown})"
        )
    });
    println!(
        "signed_to_plain_ratio_of_medians deliveries_per_s {:.3} worker_cpu_per_delivery {:.3}",
        median(&rates[1]) / median(&rates[0]),
        median(&cpu[1]) / median(&cpu[0])
    );
    println!(
        "signed_to_plain_ratio_by_round deliveries_per_s {} worker_cpu_per_delivery {}",
        by_round(&rates[1], &rates[0]),
        by_round(&cpu[1], &cpu[0])
    );
    println!(
        "signed_to_same_headers_ratio_of_medians deliveries_per_s {:.3} worker_cpu_per_delivery {:.3}",
        median(&rates[1]) / median(&rates[2]),
        median(&cpu[1]) / median(&cpu[2])
    );
    let shown = handshakes
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(" / ");
    println!("tls_handshakes_per_https_drain_of_{backlog} {shown} (connections reused)");
}

/// `a / b` of each round, as `median (r1 / r2 / …)`: the two drains of a round ran seconds
/// apart, so a slow stretch of the machine weighs less on their ratio than on
/// either median.
fn by_round(a: &[f64], b: &[f64]) -> String {
    let ratios: Vec<f64> = a.iter().zip(b).map(|(a, b)| a / b).collect();
    let shown = ratios
        .iter()
        .map(|r| format!("{r:.3}"))
        .collect::<Vec<_>>()
        .join(" / ");
    format!("{:.3} ({shown})", median(&ratios))
}

/// One lane's drain from the same tables as every other: the tables reset, `n` messages
/// loaded on a new paused channel (`options`, `endpoint`) and settled, then drained. Its rate
/// and the delivery workers' CPU over the drain alone, in ms.
fn lane_drain(
    c: &mut Client,
    n: usize,
    options: &str,
    endpoint: &dyn Fn(&str) -> String,
) -> (f64, f64) {
    reset_tables(c);
    let ch = load_paused(c, endpoint, n, options);
    let cpu_before = workers_cpu_ms(c);
    let rate = drain(c, &ch, n).rate;
    (rate, workers_cpu_ms(c) - cpu_before)
}

/// Brings the extension's tables back to the state every drain of the webhook lanes starts
/// from: no channel, message, attempt, ledger entry, log line or per-channel figure, and
/// statistics that say so. Drains on one cluster otherwise meet tables grown by every earlier
/// drain (each lane slowed by half from its first drain to its fifth), and a lane's place in
/// a round or its keys' place in the ledger's index weigh more than the few percent looked
/// for. TRUNCATE rather than a fresh database: `outbox.database` is a postmaster setting,
/// so a fresh database would keep the name, be dropped under its workers (`DROP DATABASE …
/// WITH (FORCE)` ends them) and be served by restarted workers, and each drain would
/// measure their start (new connections, empty caches) beside the drain. TRUNCATE keeps the
/// server and its workers as they are and gives every drain new, empty files; the benchmark
/// cluster is throwaway. The sequences go on (the workers keep their claim positions per
/// channel id; a new channel has none).
fn reset_tables(c: &mut Client) {
    const TABLES: [&str; 8] = [
        "outbox._channels",
        "outbox._channel_flow",
        "outbox._channel_stats",
        "outbox._channel_minutes",
        "outbox._messages",
        "outbox._attempts",
        "outbox._ledger",
        "outbox._operator_log",
    ];
    c.batch_execute(&format!("TRUNCATE {}", TABLES.join(", ")))
        .unwrap();
    // One statement each: VACUUM cannot run in the implicit transaction of a multi-statement
    // query. ANALYZE sets the statistics (and autovacuum's counts) of the empty tables alike
    // before every drain.
    for table in TABLES {
        c.batch_execute(&format!("VACUUM ANALYZE {table}")).unwrap();
    }
}

/// CPU time (user and system) the delivery workers have used, in ms, from /proc (clock
/// ticks of 10 ms, the Linux default): less disturbed by a busy machine than a rate.
fn workers_cpu_ms(c: &mut Client) -> f64 {
    let pids: Vec<i32> = c
        .query(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox_delivery worker'",
            &[],
        )
        .map(|rows| rows.iter().map(|r| r.get(0)).collect())
        .unwrap_or_default();
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|stat| {
            let fields: Vec<f64> = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .map(|f| f.parse().unwrap_or(0.0))
                .collect();
            Some((fields.get(11)? + fields.get(12)?) * 10.0)
        })
        .sum()
}

/// The cluster `cluster`, connected to `db`.
fn in_database(cluster: &Cluster, db: &str) -> Cluster {
    Cluster {
        db: db.to_string(),
        ..cluster.clone()
    }
}

/// Drains of `n` messages in every database of `dbs` at once: the sum of their rates (all
/// the messages over the time until the last database is done).
fn drain_together(dbs: &[Cluster], sim: &Simulator, n: usize) -> f64 {
    let mut lanes: Vec<(Client, String)> = dbs
        .iter()
        .map(|db| {
            let mut c = db.connect();
            let ch = load_paused(&mut c, &|ch| sim.send_url(ch), n, THROUGHPUT_OPTIONS);
            (c, ch)
        })
        .collect();
    let start = Instant::now();
    for (c, ch) in lanes.iter_mut() {
        c.execute("SELECT outbox.resume_channel($1)", &[&*ch])
            .unwrap();
    }
    let ok = wait_until(Duration::from_secs(900), || {
        lanes.iter_mut().all(|(c, ch)| !pending(c, ch))
    });
    if !ok {
        eprintln!("backlogs of {n} not delivered within 900 s");
    }
    (n * dbs.len()) as f64 / start.elapsed().as_secs_f64()
}

/// One database's drain beside every database's at once, in alternating rounds.
fn several_databases(cluster: &Cluster, sim: &Simulator, backlog: usize, rounds: usize) {
    let dbs: Vec<Cluster> = cluster
        .db
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| in_database(cluster, d))
        .collect();
    for db in &dbs {
        wait_for_delivery_loop(db);
    }
    let (mut one, mut all) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        one.push(throughput(&dbs[0], sim, backlog).rate);
        all.push(drain_together(&dbs, sim, backlog));
    }
    let n = dbs.len();
    print_beside_first(&["one", "all"], &[one, all], |label, m, ratio, shown| {
        if label == "one" {
            format!(
                "deliveries_per_s_backlog_{backlog}_one_database {m:.0} msg/s (drains: {shown})"
            )
        } else {
            format!("deliveries_per_s_backlog_{backlog}_each_of_{n}_databases_at_once_sum {m:.0} msg/s ({ratio:.2}x one database; drains: {shown})")
        }
    });
}

fn main() {
    let backlog = arg("--backlog", 10_000);
    let samples = arg("--latency-samples", 200);
    // How long the workers rest before each idle sample: the shorter the rest, the warmer
    // the caches and the CPUs the next wake finds (a rest of 5 ms gave an idle p50 a fifth to
    // two fifths lower than one of 24–25 ms, BENCHMARKS.md).
    let idle_rest = Duration::from_millis(arg("--idle-rest-ms", 25) as u64);
    let cluster = Cluster::from_env();
    // The sink: the simulator in this process, on `--sim-port` (0: a free port).
    let sim = Simulator::start_on(arg("--sim-port", 0) as u16);
    sim.set_record_bodies(false);
    sim.set_record_requests(false);
    let databases = arg("--several-databases", 0);
    if databases > 0 {
        several_databases(&cluster, &sim, backlog, databases);
        return;
    }
    let anchors_rounds = arg("--anchors", 0);
    if anchors_rounds > 0 {
        anchors::anchors(&cluster, &sim, backlog, anchors_rounds);
        return;
    }
    let kinds_rounds = arg("--kinds", 0);
    if kinds_rounds > 0 {
        kinds::kinds(&cluster, &sim, backlog, kinds_rounds);
        return;
    }
    wait_for_delivery_loop(&cluster);
    // The steady load alone (the sizes of the tables under it), for as long as asked.
    let seconds = arg("--steady-only", 0) as u64;
    if seconds > 0 {
        steady::steady(&cluster, &sim, seconds, arg("--steady-rate", 1000) as u64);
        return;
    }
    let rounds = arg("--price-of-safety", 0);
    if rounds > 0 {
        price_of_safety(&cluster, &sim, backlog, rounds);
        return;
    }
    let rounds = arg("--webhooks", 0);
    if rounds > 0 {
        webhooks(&cluster, &sim, backlog, rounds);
        return;
    }

    // Idle means a quiet disk too: the phases of bench/bench.sh before this one (the
    // enqueue rounds, a table of 2,000,000 rows for the claim-only loop) leave dirty pages
    // that the checkpointer would otherwise write out, spread over minutes, under the
    // samples, each of which waits for two WAL flushes.
    cluster.connect().batch_execute("CHECKPOINT").unwrap();
    latency(&cluster, &sim, samples, idle_rest).print("idle");
    // The floor under the idle figures: two flushes of this disk after a rest.
    let (f50, f90, f99) = disk_flush_after_rest(&cluster.base, samples.min(400), idle_rest);
    println!(
        "disk_flush_after_rest_p50 {f50:.2} ms (8 kB + fdatasync every {} ms; p90 {f90:.2} ms, p99 {f99:.2} ms)",
        idle_rest.as_millis()
    );
    // An application that commits a message now and then: the workers have been idle for
    // longer than the interval of their periodic work (a sweep every 250 ms) when the
    // commit wakes them. The lines `latency_idle_after_{R}ms_p50` and so on.
    let rested_samples = arg("--rested-samples", 0);
    if rested_samples > 0 {
        let rest = Duration::from_millis(arg("--rested-ms", 300) as u64);
        latency(&cluster, &sim, rested_samples, rest)
            .print(&format!("idle_after_{}ms", rest.as_millis()));
    }

    let small = small_drains(&cluster, &sim, backlog, "");

    // Latency under load: a second backlog drains while the samples are taken.
    let loaded = Arc::new(Mutex::new(None));
    let bg = {
        let loaded = loaded.clone();
        let base = cluster.base.clone();
        let port = cluster.port;
        let db = cluster.db.clone();
        let url = sim.send_url("bench_bg");
        std::thread::spawn(move || {
            let cluster = Cluster {
                base,
                port,
                db,
                script: Default::default(),
                env: Vec::new(),
            };
            let mut c = cluster.connect();
            let ch = unique("bench_bg");
            c.execute(
                "SELECT outbox.create_channel($1, $2, '{\"max_in_flight\": 512, \"max_unverifiable_in_flight\": 512}'::jsonb)",
                &[&ch, &url],
            )
            .unwrap();
            let start = Instant::now();
            let mut n = 0i64;
            while start.elapsed() < Duration::from_secs(8) {
                c.execute(
                    "SELECT outbox.enqueue($1, '{\"load\": true}'::jsonb, $2 || ':' || g) FROM generate_series(1, 200) g",
                    &[&ch, &format!("{ch}-{n}")],
                )
                .unwrap();
                n += 200;
                std::thread::sleep(Duration::from_millis(20));
            }
            *loaded.lock().unwrap() = Some(n);
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    // At most 500 samples, about 4 s of them (a sample waits 5 ms after its request
    // arrives), within the 8 s of background load.
    let busy = latency(&cluster, &sim, samples.min(500), Duration::from_millis(5));
    bg.join().unwrap();
    let offered = loaded.lock().unwrap().unwrap_or(0);
    busy.print("loaded");
    println!("loaded_background_enqueued {offered} msgs");

    let seconds = arg("--steady-seconds", 0) as u64;
    if seconds > 0 {
        steady::steady(&cluster, &sim, seconds, arg("--steady-rate", 1000) as u64);
    }

    // Last: the large backlog leaves a million rows behind.
    let large = arg("--large-backlog", 0);
    if large > 0 {
        let enqueue_started = Instant::now();
        let drain = throughput(&cluster, &sim, large);
        println!(
            "deliveries_per_s_backlog_{large} {:.0} msg/s (enqueue and delivery took {:.0} s)",
            drain.rate,
            enqueue_started.elapsed().as_secs_f64()
        );
        // The same drain seen in parts: its first `backlog` messages (a drain as long as the
        // small backlog's, from a large table), and each tenth.
        if let Some(first) = drain.rate_of_first(backlog as i64) {
            println!("deliveries_per_s_backlog_{large}_first_{backlog} {first:.0} msg/s");
        }
        let tenths = drain
            .rates_by_tenth(large as i64)
            .iter()
            .map(|r| format!("{r:.0}"))
            .collect::<Vec<_>>()
            .join(" / ");
        println!("deliveries_per_s_backlog_{large}_by_tenth {tenths} msg/s");
        for line in drain.timeline(5.0) {
            println!("deliveries_timeline_backlog_{large} {line}");
        }
        print_sizes(&cluster);

        // The small backlog again, on tables emptied as they were before it: the large
        // drain runs minutes after the first small drains, and this machine's pace drifts
        // by a fifth over minutes. Its ratio is to the median of all six small drains; the
        // ratios to the first three alone and to the three after it alone (the drains
        // nearest to it in time) show how far the pace moved in between.
        cluster
            .connect()
            .batch_execute("TRUNCATE outbox._messages, outbox._attempts, outbox._ledger")
            .unwrap();
        cluster
            .connect()
            .batch_execute("VACUUM ANALYZE outbox._messages")
            .unwrap();
        let after = small_drains(&cluster, &sim, backlog, "_after_large");
        let mut all: Vec<f64> = small.iter().chain(after.iter()).copied().collect();
        all.sort_by(f64::total_cmp);
        let median = (all[2] + all[3]) / 2.0;
        println!(
            "ratio_backlog_{large}_to_{backlog} {:.3} (to the median of the six small drains, {median:.0} msg/s; {:.3} to the first three alone, {:.3} to the three after it alone)",
            drain.rate / median,
            drain.rate / small[1],
            drain.rate / after[1]
        );
    } else {
        print_sizes(&cluster);
    }
}

/// Three drains, each of a fresh backlog on a channel of its own: one drain of 10,000 lasts
/// about a second, and single runs differ by up to a fifth on this machine. Prints their
/// median and the WAL written per delivery and per enqueue (the medians), and returns the
/// three rates, sorted.
fn small_drains(cluster: &Cluster, sim: &Simulator, backlog: usize, label: &str) -> Vec<f64> {
    let drains: Vec<Costed> = (0..3)
        .map(|_| {
            costed_drain(
                cluster,
                &|ch| sim.send_url(ch),
                &|_| THROUGHPUT_OPTIONS.to_string(),
                backlog,
                &[],
            )
        })
        .collect();
    let mut rates: Vec<f64> = drains.iter().map(|d| d.rate).collect();
    let seen: Vec<f64> = drains.iter().map(|d| d.seen_after_last_record_ms).collect();
    println!(
        "deliveries_per_s_backlog_{backlog}{label} {:.0} msg/s (median of 3 drains: {})",
        median(&rates),
        shown(&rates)
    );
    println!(
        "drain_end_seen{label} {} ms after the last record's transaction began (each of the 3 drains)",
        seen.iter().map(|m| format!("{m:.1}")).collect::<Vec<_>>().join(" / ")
    );
    let wal = |cost: &dyn Fn(&Costed) -> Cost| -> Vec<f64> {
        drains
            .iter()
            .map(|d| cost(d).per_message(backlog)[3])
            .collect()
    };
    let (delivery, enqueue) = (wal(&|d| d.delivery), wal(&|d| d.enqueue));
    println!(
        "wal_per_delivery{label} {:.0} B (median of the 3 drains: {} B; pg_current_wal_lsn() before and after each)",
        median(&delivery),
        shown(&delivery)
    );
    println!(
        "wal_per_enqueue{label} {:.0} B (median of the 3 backlogs: {} B; transactions of 1,000)",
        median(&enqueue),
        shown(&enqueue)
    );
    rates.sort_by(f64::total_cmp);
    rates
}

/// The largest tables and indexes of the extension.
fn print_sizes(cluster: &Cluster) {
    for row in cluster
        .connect()
        .query(
            "SELECT c.relname::text, pg_size_pretty(pg_relation_size(c.oid))
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = 'outbox' AND c.relkind IN ('r', 'i')
              ORDER BY pg_relation_size(c.oid) DESC LIMIT 8",
            &[],
        )
        .unwrap()
    {
        println!(
            "size {} {}",
            row.get::<_, String>(0),
            row.get::<_, String>(1)
        );
    }
}

/// One line per lane: `line(label, median, median / the first lane's median, the rounds)`.
fn print_beside_first(
    labels: &[&str],
    rounds: &[Vec<f64>],
    line: impl Fn(&str, f64, f64, String) -> String,
) {
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = median(&rounds[0]);
    for (label, values) in labels.iter().zip(rounds) {
        let shown = values
            .iter()
            .map(|r| format!("{r:.0}"))
            .collect::<Vec<_>>()
            .join(" / ");
        let m = median(values);
        println!("{}", line(label, m, m / base, shown));
    }
}
