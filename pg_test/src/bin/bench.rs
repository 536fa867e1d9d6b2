//! Delivery benchmarks against the real cluster (`scripts/bench.sh` runs this):
//! - deliveries per second for a backlog of N messages to a loopback sink that only
//!   answers 200 (the provider simulator in accept mode, bodies not kept);
//! - latency from COMMIT of an enqueue to the request arriving at the sink, p50/p99,
//!   idle and while a backlog is being delivered.
//!
//! Prints one `name value unit` line per figure. Never asserts anything.
//!
//! - with `--large-backlog N`, the same throughput for a backlog of N, and the execution
//!   time of `SELECT * FROM outbox.metrics` and `outbox.prometheus()` with N queued.
//!
//!   bench [--backlog 10000] [--large-backlog 0] [--latency-samples 200]

use outbox_e2e::cluster::{unique, wait_until, Cluster};
use outbox_e2e::sim::{Received, Simulator};
use postgres::Client;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

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

/// Enqueues `n` messages on a paused channel in batches of 1,000, then resumes it and
/// measures until all are delivered.
fn throughput(cluster: &Cluster, sim: &Simulator, n: usize) -> f64 {
    let mut c = cluster.connect();
    let ch = unique("bench_tp");
    c.execute(
        "SELECT outbox.create_channel($1, $2, '{\"max_in_flight\": 512, \"external_id\": \"/id\"}'::jsonb)",
        &[&ch, &sim.send_url(&ch)],
    )
    .unwrap();
    c.execute(
        "SELECT outbox.pause_channel($1, 'loading the backlog')",
        &[&ch],
    )
    .unwrap();
    let mut done = 0;
    while done < n {
        let k = (n - done).min(1000) as i64;
        c.execute(
            "SELECT outbox.enqueue($1, jsonb_build_object('n', g, 'text', 'benchmark message'), $2 || ':' || g)
               FROM generate_series(1, $3::int8) g",
            &[&ch, &format!("{ch}-{done}"), &k],
        )
        .unwrap();
        done += k as usize;
    }
    c.batch_execute("VACUUM ANALYZE outbox._messages; CHECKPOINT")
        .unwrap();
    if n >= 100_000 {
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
    let start = Instant::now();
    c.execute("SELECT outbox.resume_channel($1)", &[&ch])
        .unwrap();
    let ok = wait_until(Duration::from_secs(900), || !pending(&mut c, &ch));
    let secs = start.elapsed().as_secs_f64();
    if !ok {
        eprintln!("backlog of {n} not delivered within 900 s");
    }
    n as f64 / secs
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// COMMIT → request at the sink, for `samples` single-message transactions.
fn latency(cluster: &Cluster, sim: &Simulator, samples: usize) -> (f64, f64) {
    let arrivals: Arc<Mutex<HashMap<String, SystemTime>>> = Arc::default();
    let seen = arrivals.clone();
    sim.set_observer(move |r: &Received| {
        if let Some(k) = &r.key {
            seen.lock().unwrap().insert(k.clone(), r.received_at);
        }
    });
    let mut c = cluster.connect();
    let ch = unique("bench_lat");
    c.execute(
        "SELECT outbox.create_channel($1, $2, '{\"idempotency_header\": \"Idempotency-Key\"}'::jsonb)",
        &[&ch, &sim.send_url(&ch)],
    )
    .unwrap();
    let mut ms = Vec::with_capacity(samples);
    for i in 0..samples {
        let key = format!("{ch}-{i}");
        let mut tx = c.transaction().unwrap();
        tx.execute(
            "SELECT outbox.enqueue($1, '{\"t\": 1}'::jsonb, $2)",
            &[&ch, &key],
        )
        .unwrap();
        let committed = SystemTime::now();
        tx.commit().unwrap();
        let got = wait_until(Duration::from_secs(10), || {
            arrivals.lock().unwrap().contains_key(&key)
        });
        if got {
            let at = arrivals.lock().unwrap()[&key];
            ms.push(
                at.duration_since(committed)
                    .map(|d| d.as_secs_f64() * 1000.0)
                    .unwrap_or(0.0),
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    sim.clear_observer();
    ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (percentile(&ms, 0.5), percentile(&ms, 0.99))
}

fn main() {
    let backlog = arg("--backlog", 10_000);
    let samples = arg("--latency-samples", 200);
    let cluster = Cluster::from_env();
    let sim = Simulator::start();
    sim.set_record_bodies(false);
    sim.set_record_requests(false);

    let (p50, p99) = latency(&cluster, &sim, samples);
    println!("latency_idle_p50 {p50:.2} ms");
    println!("latency_idle_p99 {p99:.2} ms");

    let rate = throughput(&cluster, &sim, backlog);
    println!("deliveries_per_s_backlog_{backlog} {rate:.0} msg/s");
    let large = arg("--large-backlog", 0);
    if large > 0 {
        let enqueue_started = Instant::now();
        let rate = throughput(&cluster, &sim, large);
        println!(
            "deliveries_per_s_backlog_{large} {rate:.0} msg/s (enqueue and delivery took {:.0} s)",
            enqueue_started.elapsed().as_secs_f64()
        );
    }

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
            };
            let mut c = cluster.connect();
            let ch = unique("bench_bg");
            c.execute(
                "SELECT outbox.create_channel($1, $2, '{\"max_in_flight\": 512}'::jsonb)",
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
    let (lp50, lp99) = latency(&cluster, &sim, samples.min(100));
    bg.join().unwrap();
    let offered = loaded.lock().unwrap().unwrap_or(0);
    println!("latency_loaded_p50 {lp50:.2} ms");
    println!("latency_loaded_p99 {lp99:.2} ms");
    println!("loaded_background_enqueued {offered} msgs");
}
