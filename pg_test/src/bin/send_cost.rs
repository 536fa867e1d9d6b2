//! The CPU one HTTP send costs the sending process on each of tokio's schedulers, as a
//! delivery worker's send threads send (`outbox.http_threads`, src/runtime.rs): batches of
//! `--batch` concurrent POSTs of a benchmark message with an `Idempotency-Key`, each read
//! whole, spawned from the main thread onto
//! - `multi`: the multi-thread scheduler with one worker thread;
//! - `current`: the current-thread scheduler, driven by a thread of its own;
//!
//! each with reqwest's per-request timeout, as the worker sets it, and without
//! (`…_no_timeout`). The lanes alternate, round after round, against a provider simulator
//! already listening on `--port`; the first batch of each round opens its connections and
//! is not counted. Prints one line per lane: the median µs of process CPU (user + system) a
//! request over the rounds, and each round's figure. No database.
//!
//!   send-cost --port PORT [--batch 200] [--batches 100] [--rounds 8]

use outbox_e2e::cli::num_arg;
use outbox_e2e::costs::cpu_seconds;
use std::sync::mpsc;
use std::time::Duration;

const LANES: [&str; 4] = ["multi", "multi_no_timeout", "current", "current_no_timeout"];

/// A runtime of the lane's scheduler; the current-thread one is driven by a thread that
/// runs until the process ends.
fn handle(lane: &str) -> tokio::runtime::Handle {
    if lane.starts_with("multi") {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let handle = rt.handle().clone();
        // Kept for the whole process: dropping it would stop its worker thread.
        std::mem::forget(rt);
        handle
    } else {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let handle = rt.handle().clone();
        std::thread::spawn(move || rt.block_on(std::future::pending::<()>()));
        handle
    }
}

/// Sends `batch` requests at once on `handle` and waits for every answer.
fn one_batch(
    handle: &tokio::runtime::Handle,
    client: &reqwest::Client,
    url: &reqwest::Url,
    batch: usize,
    timeout: bool,
    first_key: usize,
) {
    let (done, answers) = mpsc::channel();
    for i in 0..batch {
        let (client, url, done) = (client.clone(), url.clone(), done.clone());
        handle.spawn(async move {
            let mut request = client
                .post(url)
                .header("content-type", "application/json")
                .header("idempotency-key", format!("send-cost-{}", first_key + i))
                .body(r#"{"to": "user-1", "text": "benchmark message"}"#);
            if timeout {
                request = request.timeout(Duration::from_secs(30));
            }
            let mut response = request.send().await.expect("answer");
            let mut body = Vec::new();
            while let Some(chunk) = response.chunk().await.expect("body") {
                body.extend_from_slice(&chunk);
            }
            done.send(body.len()).unwrap();
        });
    }
    drop(done);
    assert_eq!(answers.iter().count(), batch);
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let port = num_arg("--port", 0);
    assert!(
        port > 0,
        "usage: send-cost --port PORT [--batch 200] [--batches 100] [--rounds 8]"
    );
    let batch = num_arg("--batch", 200);
    let batches = num_arg("--batches", 100);
    let rounds = num_arg("--rounds", 8);
    let url = reqwest::Url::parse(&format!("http://127.0.0.1:{port}/ch/send_cost/send")).unwrap();
    let me = std::process::id() as i32;
    let handles: Vec<tokio::runtime::Handle> = LANES.iter().map(|l| handle(l)).collect();
    let mut figures: Vec<Vec<f64>> = vec![Vec::new(); LANES.len()];
    let mut key = 0;
    for _ in 0..rounds {
        for (lane, name) in LANES.iter().enumerate() {
            // A client of its own for each round, as a worker has for each channel.
            let client = reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(5))
                .redirect(reqwest::redirect::Policy::none())
                .no_proxy()
                .build()
                .unwrap();
            let timeout = !name.ends_with("no_timeout");
            one_batch(&handles[lane], &client, &url, batch, timeout, key);
            key += batch;
            let before = cpu_seconds(me).unwrap();
            for _ in 0..batches {
                one_batch(&handles[lane], &client, &url, batch, timeout, key);
                key += batch;
            }
            let cpu = cpu_seconds(me).unwrap() - before;
            figures[lane].push(cpu * 1e6 / (batch * batches) as f64);
        }
    }
    for (lane, name) in LANES.iter().enumerate() {
        let shown: Vec<String> = figures[lane].iter().map(|f| format!("{f:.1}")).collect();
        let m = median(&mut figures[lane].clone());
        println!(
            "send_cpu_us_{name} {m:.1} us a request (median of {rounds} rounds: {})",
            shown.join(" / ")
        );
    }
}
