//! The baseline of the `nats` channel's benchmark (`bench/bench_nats.sh`): what a plain
//! async-nats client program publishes per second into one JetStream stream on file
//! storage, each publish with its acknowledgement, `in_flight` unacknowledged at once (as
//! `nats bench js pub` does with its batch). Each message carries what the worker's carry:
//! a `Nats-Msg-Id` (a new id each) and `Nats-Expected-Stream`, and a body of the same size.
//! No database, no ledger: the bus's own ceiling for this client on this machine.
//!
//! Prints one `name value unit` line per figure; with `--json PATH` also writes them.
//!
//!   nats_publish_baseline --url nats://127.0.0.1:4222 [--messages 10000] [--in-flight 256]
//!                         [--rounds 3] [--server-pid PID] [--json PATH]

use async_nats::jetstream::{self, context::PublishAckFuture};
use outbox_e2e::cli::{num_arg as num, text_arg as arg};
use outbox_e2e::costs::cpu_seconds;
use outbox_e2e::nats::create_file_stream;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// One round: `n` publishes on a fresh stream; returns the seconds it took.
async fn round(js: &jetstream::Context, stream: &str, n: usize, in_flight: usize) -> f64 {
    let subject = format!("{}.created", stream.to_lowercase());
    let start = Instant::now();
    let mut pending: VecDeque<PublishAckFuture> = VecDeque::with_capacity(in_flight);
    for i in 0..n {
        if pending.len() >= in_flight {
            pending.pop_front().unwrap().await.expect("ack");
        }
        let body = format!(r#"{{"n": {i}, "text": "benchmark message"}}"#);
        let message = jetstream::message::PublishMessage::build()
            .payload(body.into())
            .message_id(format!("{stream}-{i:08}-0123456789abcdef0123456789abcdef"))
            .expected_stream(stream);
        pending.push_back(
            js.send_publish(subject.clone(), message)
                .await
                .expect("publish"),
        );
    }
    while let Some(ack) = pending.pop_front() {
        ack.await.expect("ack");
    }
    start.elapsed().as_secs_f64()
}

fn main() {
    let url = arg("--url").expect("--url nats://host:port");
    let n = num("--messages", 10_000);
    let in_flight = num("--in-flight", 256);
    let rounds = num("--rounds", 3).max(1);
    let server_pid: Option<i32> = arg("--server-pid").and_then(|p| p.parse().ok());
    let me = std::process::id() as i32;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    // The JetStream context spawns a task of its own: made inside the runtime.
    let js = runtime.block_on(async {
        let client = async_nats::connect(url.clone())
            .await
            .expect("connect to nats-server");
        jetstream::new(client)
    });
    let (mut rates, mut client_us, mut server_us) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        let stream = format!("BASELINE{r}");
        let subject = format!("{}.>", stream.to_lowercase());
        create_file_stream(&url, &stream, &[&subject], Duration::from_secs(120));
        let (c0, s0) = (cpu_seconds(me), server_pid.and_then(cpu_seconds));
        let secs = runtime.block_on(round(&js, &stream, n, in_flight));
        let (c1, s1) = (cpu_seconds(me), server_pid.and_then(cpu_seconds));
        rates.push(n as f64 / secs);
        client_us.push((c1.unwrap_or(0.0) - c0.unwrap_or(0.0)) * 1e6 / n as f64);
        if let (Some(a), Some(b)) = (s0, s1) {
            server_us.push((b - a) * 1e6 / n as f64);
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let shown = rates
        .iter()
        .map(|r| format!("{r:.0}"))
        .collect::<Vec<_>>()
        .join(" / ");
    let (rate, cus, sus) = (median(&rates), median(&client_us), median(&server_us));
    println!("nats_publish_baseline {rate:.0} msg/s ({n} publishes with ack, {in_flight} in flight; rounds: {shown})");
    println!("nats_publish_baseline_client_cpu {cus:.1} us/msg");
    println!("nats_publish_baseline_server_cpu {sus:.1} us/msg (nats-server)");
    if let Some(path) = arg("--json") {
        let json = serde_json::json!({
            "rate": rate, "rounds": rates, "messages": n, "in_flight": in_flight,
            "client_cpu_us": cus, "server_cpu_us": sus,
        });
        std::fs::write(path, serde_json::to_string_pretty(&json).unwrap()).expect("write json");
    }
}
