//! `--kinds R`: the three channel kinds side by side (`bench/bench_nats.sh`). In each of R
//! rounds, a backlog drained over HTTP (the provider simulator), into JetStream (a nats-server
//! of the script's: one stream on file storage, `--nats-url`) and into a `sql` effect (an
//! INSERT into a table of the application), alternately; the median of each. Beside each
//! rate, what one delivery cost: CPU of the delivery workers and of the whole server, CPU
//! of the sink (the simulator's process, or nats-server: `--nats-pid`), WAL and growth of
//! the extension's tables; and what one enqueue cost. `--costs-json PATH` writes the medians
//! for `bench/scaling_model.py`.

use super::{costed_drain, median, shown, wait_for_delivery_loop};
use outbox_e2e::cluster::Cluster;
use outbox_e2e::costs::Cost;
use outbox_e2e::nats::{create_file_stream, stream_count};
use outbox_e2e::sim::Simulator;
use std::time::Duration;

/// The stream every nats drain publishes into, on `bench.>`.
const STREAM: &str = "BENCH";

/// The application's side of the `sql` lane: a table, a function that inserts into it, and
/// the role it runs as.
const SQL_EFFECT: &str = r#"
CREATE SCHEMA IF NOT EXISTS bench_app;
CREATE TABLE IF NOT EXISTS bench_app.effects (id bigserial PRIMARY KEY, effect_key text NOT NULL, payload jsonb NOT NULL);
DO $$ BEGIN CREATE ROLE bench_effects NOLOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
GRANT USAGE ON SCHEMA bench_app TO bench_effects;
GRANT INSERT ON bench_app.effects TO bench_effects;
-- RETURNING reads the id it returns.
GRANT SELECT (id) ON bench_app.effects TO bench_effects;
GRANT USAGE ON SEQUENCE bench_app.effects_id_seq TO bench_effects;
CREATE OR REPLACE FUNCTION bench_app.record(payload jsonb, effect_key text) RETURNS text LANGUAGE sql AS
  $f$ INSERT INTO bench_app.effects (effect_key, payload) VALUES (effect_key, payload) RETURNING 'effect-' || id $f$;
GRANT EXECUTE ON FUNCTION bench_app.record(jsonb, text) TO bench_effects;
"#;

/// One kind of channel: how its endpoint and options are made, and whose CPU is its sink's.
struct Lane {
    label: &'static str,
    endpoint: Box<dyn Fn(&str) -> String>,
    options: Box<dyn Fn(&str) -> String>,
    sink_pids: Vec<i32>,
    rates: Vec<f64>,
    enqueue: Vec<Cost>,
    delivery: Vec<Cost>,
}

fn lanes(sim: &Simulator, nats_url: &str, nats_pid: Option<i32>) -> Vec<Lane> {
    let sim_url = {
        let base = sim.send_url("x");
        move |ch: &str| base.trim_end_matches('x').to_string() + ch
    };
    let url = nats_url.to_string();
    let lane = |label,
                endpoint: Box<dyn Fn(&str) -> String>,
                options: Box<dyn Fn(&str) -> String>,
                sink_pids| Lane {
        label,
        endpoint,
        options,
        sink_pids,
        rates: Vec::new(),
        enqueue: Vec::new(),
        delivery: Vec::new(),
    };
    vec![
        lane(
            "http",
            Box::new(sim_url),
            Box::new(|_| super::THROUGHPUT_OPTIONS.to_string()),
            // The simulator runs in this process (which also polls the counters).
            vec![std::process::id() as i32],
        ),
        lane(
            "nats",
            Box::new(move |_| url.clone()),
            Box::new(|ch| {
                format!(
                    r#"{{"kind": "nats", "subject": "bench.{ch}", "stream": "{STREAM}", "max_in_flight": 512}}"#
                )
            }),
            nats_pid.into_iter().collect(),
        ),
        lane(
            "sql",
            Box::new(|_| "sql".to_string()),
            Box::new(|_| {
                r#"{"kind": "sql", "function": "bench_app.record", "run_as": "bench_effects", "max_in_flight": 512, "tenants": ["*"]}"#.to_string()
            }),
            Vec::new(),
        ),
    ]
}

/// One lane's round: enqueue `n`, settle, drain; the rate and both costs.
fn round(cluster: &Cluster, lane: &mut Lane, n: usize) {
    let d = costed_drain(cluster, &*lane.endpoint, &*lane.options, n, &lane.sink_pids);
    lane.enqueue.push(d.enqueue);
    lane.delivery.push(d.delivery);
    lane.rates.push(d.rate);
}

/// The median of each per-message figure over the costs.
fn median_costs(costs: &[Cost], n: usize) -> [f64; 5] {
    let per: Vec<[f64; 5]> = costs.iter().map(|c| c.per_message(n)).collect();
    let mut out = [0.0; 5];
    for (i, o) in out.iter_mut().enumerate() {
        *o = median(&per.iter().map(|p| p[i]).collect::<Vec<_>>());
    }
    out
}

pub fn kinds(cluster: &Cluster, sim: &Simulator, n: usize, rounds: usize) {
    let url = super::text_arg("--nats-url").expect("--nats-url nats://127.0.0.1:PORT");
    let nats_pid = super::text_arg("--nats-pid").and_then(|p| p.parse().ok());
    wait_for_delivery_loop(cluster);
    cluster.connect().batch_execute(SQL_EFFECT).unwrap();
    create_file_stream(&url, STREAM, &["bench.>"], Duration::from_secs(120));
    let mut lanes = lanes(sim, &url, nats_pid);
    for _ in 0..rounds {
        for lane in lanes.iter_mut() {
            round(cluster, lane, n);
        }
    }
    report(&lanes, n, rounds, &url);
}

fn report(lanes: &[Lane], n: usize, rounds: usize, url: &str) {
    let http = median(&lanes[0].rates);
    let mut json = serde_json::Map::new();
    for lane in lanes {
        let rate = median(&lane.rates);
        println!(
            "deliveries_per_s_backlog_{n}_{} {rate:.0} msg/s ({:.2}x http; drains: {})",
            lane.label,
            rate / http,
            shown(&lane.rates)
        );
        let [w, s, o, wal, t] = median_costs(&lane.delivery, n);
        println!(
            "delivery_cost_{} workers {w:.0} us/msg, server {s:.0} us/msg, sink {o:.0} us/msg, WAL {wal:.0} B/msg, outbox tables +{t:.0} B/msg; one core: {:.0} msg/s",
            lane.label,
            1e6 / s
        );
        json.insert(
            lane.label.into(),
            serde_json::json!({"rate": rate, "rounds": lane.rates, "worker_cpu_us": w,
                "server_cpu_us": s, "sink_cpu_us": o, "wal_bytes": wal, "table_bytes": t}),
        );
    }
    let all: Vec<Cost> = lanes.iter().flat_map(|l| l.enqueue.clone()).collect();
    let [b, s, _, wal, t] = median_costs(&all, n);
    println!(
        "enqueue_cost backend {b:.0} us/msg, server {s:.0} us/msg, WAL {wal:.0} B/msg, outbox tables +{t:.0} B/msg (transactions of 1,000)"
    );
    json.insert(
        "enqueue".into(),
        serde_json::json!({"backend_cpu_us": b, "server_cpu_us": s, "wal_bytes": wal, "table_bytes": t}),
    );
    let stored = stream_count(url, STREAM);
    println!(
        "nats_stream_{STREAM}_holds {stored} messages ({} published: {n} x {rounds} rounds)",
        n * rounds
    );
    if let Some(path) = super::text_arg("--costs-json") {
        json.insert("backlog".into(), n.into());
        json.insert("rounds".into(), rounds.into());
        json.insert(
            "cores".into(),
            std::thread::available_parallelism()
                .map(|p| p.get())
                .unwrap_or(1)
                .into(),
        );
        std::fs::write(path, serde_json::to_string_pretty(&json).unwrap()).expect("write costs");
    }
}
