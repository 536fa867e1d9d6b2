//! What one send of an `http://` channel costs the worker's process, on each transport: the
//! channel's own HTTP/1.1 connections (`wire`, what such a channel uses) and reqwest (what
//! an `https://` channel uses), in CPU time (user and system) of this whole process per
//! request. A batch of 200 sends is prepared on this thread and run on the worker's kind of
//! runtime (`runtime::IoRuntime`, one send thread) through the channel's connection slots,
//! exactly as a worker runs a claimed batch; the lanes alternate, round after round,
//! against a provider simulator already listening on PORT. The first batch of each round
//! opens its connections and is not counted. Prints, per lane, the median µs a request
//! over the rounds and each round's figure. No database.
//!
//! Run:
//!   target/release/provider-sim --port 18900 --quiet --no-record-requests --no-record-bodies &
//!   cargo bench --bench send -- 18900 [rounds = 8] [batches = 100]

use outbox_delivery::channels::connection_slots::ConnectionSlots;
use outbox_delivery::channels::http::Transport;
use outbox_delivery::channels::options::ChannelOptions;
use outbox_delivery::channels::pool_budget::Demand;
use outbox_delivery::channels::remote::{self, Channel, HttpChannel, Sent};
use outbox_delivery::channels::request::Message;
use outbox_delivery::runtime::IoRuntime;
use std::sync::{mpsc, Arc};

const BATCH: usize = 200;
const LANES: [&str; 2] = ["wire", "reqwest"];

/// CPU time (user and system) of this process so far, in seconds.
fn process_cpu_s() -> f64 {
    // SAFETY: `usage` is a valid rusage for the call to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    s(usage.ru_utime) + s(usage.ru_stime)
}

/// One channel to the simulator: `wire` keeps the channel's own connections; otherwise its
/// sends go through reqwest, as an `https://` channel's do.
fn channel(port: u16, wire: bool) -> Arc<dyn Channel> {
    let mut transport = Transport::default();
    transport.set_allowed_hosts("127.0.0.1");
    let options = ChannelOptions::from_json(&serde_json::json!({
        "max_in_flight": 512, "max_unverifiable_in_flight": 512, "external_id": "/id"
    }))
    .expect("options");
    let endpoint = format!("http://127.0.0.1:{port}/ch/send_bench");
    let mut origins = outbox_delivery::channels::wire::Origins::default();
    let opened = remote::open(
        &mut transport,
        &mut origins,
        1,
        "v1",
        &endpoint,
        &options,
        2 * BATCH,
    )
    .expect("channel");
    if wire {
        return opened;
    }
    Arc::new(HttpChannel {
        client: transport
            .client(1, "v1", &options, 2 * BATCH)
            .expect("client"),
        url: reqwest::Url::parse(&endpoint).ok(),
        endpoint,
        options: Arc::new(options),
        demand: Arc::new(Demand::default()),
        slots: Arc::new(ConnectionSlots::new(2 * BATCH)),
        wire: None,
    })
}

/// Prepares a batch of sends here and runs them on `runtime`, waiting for every answer.
fn one_batch(
    runtime: &IoRuntime,
    channel: &Arc<dyn Channel>,
    allowed: &Arc<outbox_delivery::allow_list::AllowList>,
    first_key: usize,
) {
    let (done, answers) = mpsc::channel();
    for i in 0..BATCH {
        let key = format!("send-bench-{}", first_key + i);
        let message = Message {
            channel_id: 1,
            headers: None,
            payload: r#"{"to": "user-1", "text": "benchmark message"}"#,
            effect_key: &key,
            fence: outbox_delivery::channels::fence::Fence::open(),
        };
        let send = channel
            .prepare(&message, allowed.clone())
            .expect("prepared");
        let done = done.clone();
        runtime.spawn(async move {
            let sent = send.await;
            done.send(sent).unwrap();
        });
    }
    drop(done);
    for sent in answers.iter().take(BATCH) {
        match sent {
            Sent::Http(outbox_delivery::channels::http::Transmission::Answered {
                status: 200,
                ..
            }) => {}
            other => panic!("the simulator did not accept a send: {other:?}"),
        }
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let numbers: Vec<usize> = std::env::args().filter_map(|a| a.parse().ok()).collect();
    let Some(&port) = numbers.first() else {
        eprintln!("usage: cargo bench --bench send -- PORT [rounds = 8] [batches = 100]");
        std::process::exit(2);
    };
    let rounds = numbers.get(1).copied().unwrap_or(8);
    let batches = numbers.get(2).copied().unwrap_or(100);
    let runtime = IoRuntime::build(1).expect("runtime");
    let mut transport = Transport::default();
    transport.set_allowed_hosts("127.0.0.1");
    let allowed = transport.allowed();
    let mut figures = vec![Vec::new(); LANES.len()];
    let mut key = 0;
    for _ in 0..rounds {
        for (lane, name) in LANES.iter().enumerate() {
            let channel = channel(port as u16, *name == "wire");
            one_batch(&runtime, &channel, &allowed, key);
            key += BATCH;
            let before = process_cpu_s();
            for _ in 0..batches {
                one_batch(&runtime, &channel, &allowed, key);
                key += BATCH;
            }
            let cpu = process_cpu_s() - before;
            figures[lane].push(cpu * 1e6 / (BATCH * batches) as f64);
        }
    }
    for (lane, name) in LANES.iter().enumerate() {
        let shown: Vec<String> = figures[lane].iter().map(|f| format!("{f:.1}")).collect();
        println!(
            "send_cpu_us_{name} {:.1} us a request (median of {rounds} rounds: {})",
            median(&figures[lane]),
            shown.join(" / ")
        );
    }
    let (wire, reqwest) = (median(&figures[0]), median(&figures[1]));
    println!("wire/reqwest {:.2}x", wire / reqwest);
}
