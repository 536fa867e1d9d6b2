//! `--anchors R`: the extension's drain beside the outbox an application would write by hand
//! (`outbox_e2e::handwritten`, the `handwritten-outbox` program), both to this process's
//! provider simulator, in R alternating rounds (each round starts with another lane). Each
//! round of the hand-written lane loads a backlog of N rows into its table (transactions of
//! 1,000, as the extension's backlog is enqueued), vacuums and checkpoints, then runs the
//! program until its claims come back empty. The program runs once with each loop count of
//! `--handwritten-loops` (default `1,2`: one loop, and as many as the extension has workers).
//! Prints the medians, the ratio, and the WAL each writes per message.

use super::{backend_pid, costed_drain, median, shown, text_arg, THROUGHPUT_OPTIONS};
use outbox_e2e::cluster::Cluster;
use outbox_e2e::costs::{server_pids, Cost, Snapshot};
use outbox_e2e::handwritten::{LOAD, SCHEMA};
use outbox_e2e::sim::Simulator;
use std::process::Command;

/// One lane's rounds: rates, and the WAL per message of its enqueue (or load) and drain.
#[derive(Default)]
struct Lane {
    rates: Vec<f64>,
    wal_enqueue: Vec<f64>,
    wal_delivery: Vec<f64>,
}

impl Lane {
    fn push(&mut self, rate: f64, enqueue: &Cost, delivery: &Cost, n: usize) {
        self.rates.push(rate);
        self.wal_enqueue.push(enqueue.per_message(n)[3]);
        self.wal_delivery.push(delivery.per_message(n)[3]);
    }
}

/// The `handwritten-outbox` program, built beside this one.
fn program() -> std::path::PathBuf {
    std::env::current_exe()
        .expect("own path")
        .with_file_name("handwritten-outbox")
}

/// One round of the hand-written outbox with `loops` loops: (rate, load cost, drain cost).
fn handwritten_round(cluster: &Cluster, url: &str, n: usize, loops: usize) -> (f64, Cost, Cost) {
    let mut c = cluster.connect();
    c.batch_execute(SCHEMA).unwrap();
    let server = server_pids(&cluster.base.join("pgdata"));
    let me = [backend_pid(&mut c)];
    let before = Snapshot::take(&mut c, &me, &server, &[]);
    let first: i64 = c
        .query_one("SELECT coalesce(max(id), 0) FROM handwritten.outbox", &[])
        .unwrap()
        .get(0);
    for from in (0..n as i64).step_by(1000) {
        let to = (from + 1000).min(n as i64);
        c.execute(LOAD, &[&(first + from + 1), &(first + to)])
            .unwrap();
    }
    let load = before.cost(&mut c, &me, &server, &[]);
    c.batch_execute("VACUUM ANALYZE handwritten.outbox")
        .unwrap();
    c.batch_execute("CHECKPOINT").unwrap();
    let before = Snapshot::take(&mut c, &[], &server, &[]);
    let out = Command::new(program())
        .args(["--conninfo", &cluster.conninfo(), "--url", url])
        .args(["--loops", &loops.to_string()])
        .output()
        .expect("run handwritten-outbox");
    let drain = before.cost(&mut c, &[], &server, &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    // `handwritten_drain N messages in S s (...)`
    let words: Vec<&str> = text.split_whitespace().collect();
    let sent: f64 = words.get(1).and_then(|w| w.parse().ok()).unwrap_or(0.0);
    let secs: f64 = words
        .get(4)
        .and_then(|w| w.parse().ok())
        .unwrap_or(f64::NAN);
    if !out.status.success() || sent as usize != n {
        eprintln!(
            "handwritten-outbox: {} ({text}{})",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    (sent / secs, load, drain)
}

pub fn anchors(cluster: &Cluster, sim: &Simulator, n: usize, rounds: usize) {
    let loops: Vec<usize> = text_arg("--handwritten-loops")
        .unwrap_or_else(|| "1,2".into())
        .split(',')
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    super::wait_for_delivery_loop(cluster);
    let url = sim.send_url("handwritten");
    let mut ours = Lane::default();
    let mut hand: Vec<Lane> = loops.iter().map(|_| Lane::default()).collect();
    let lanes = loops.len() + 1;
    for round in 0..rounds {
        for k in 0..lanes {
            match (k + round) % lanes {
                0 => {
                    let d = costed_drain(
                        cluster,
                        &|ch| sim.send_url(ch),
                        &|_| THROUGHPUT_OPTIONS.to_string(),
                        n,
                        &[],
                    );
                    ours.push(d.rate, &d.enqueue, &d.delivery, n);
                }
                i => {
                    let (rate, load, drain) = handwritten_round(cluster, &url, n, loops[i - 1]);
                    hand[i - 1].push(rate, &load, &drain, n);
                }
            }
        }
    }
    report(&ours, &hand, &loops, n);
}

fn report(ours: &Lane, hand: &[Lane], loops: &[usize], n: usize) {
    let m = median(&ours.rates);
    println!(
        "anchors_outbox_delivery_backlog_{n} {m:.0} msg/s (drains: {}); WAL per delivery {:.0} B, per enqueue {:.0} B",
        shown(&ours.rates),
        median(&ours.wal_delivery),
        median(&ours.wal_enqueue)
    );
    for (lane, loops) in hand.iter().zip(loops) {
        let h = median(&lane.rates);
        println!(
            "handwritten_outbox_{loops}_loop {h:.0} msg/s | outbox_delivery {m:.0} msg/s | outbox/handwritten {:.2}x (drains: {} | {})",
            m / h,
            shown(&lane.rates),
            shown(&ours.rates)
        );
        println!(
            "wal_per_delivery_handwritten_{loops}_loop {:.0} B (drains: {} B), per insert {:.0} B; outbox_delivery {:.0} B, {:.0} B",
            median(&lane.wal_delivery),
            shown(&lane.wal_delivery),
            median(&lane.wal_enqueue),
            median(&ours.wal_delivery),
            median(&ours.wal_enqueue)
        );
    }
}
