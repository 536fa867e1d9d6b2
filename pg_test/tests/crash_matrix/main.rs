//! "Prove it": the crash matrix and the soak, end to end against the real cluster
//! (`scripts/cluster.sh`, located by `OUTBOX_BASE` / `OUTBOX_PGPORT`, two delivery workers)
//! and the provider simulator.
//!
//! Run: `cargo test -p outbox_e2e --release --test crash_matrix -- --test-threads=1 --nocapture`
//! (also part of the README's `bash scripts/test.sh`, which runs
//! `cargo test -p outbox_e2e --release -- --test-threads=1`).
//!
//! - `crash_matrix`: the four restart points — (1) the client dies before its COMMIT,
//!   (2) the worker dies after claiming and before sending, (3) the provider accepted and the
//!   worker dies before reading the answer, (4) the worker read the answer and dies before its
//!   local record commits — each with the `outbox.fault_injection` point and with a real kill
//!   (`kill -9`, `pg_terminate_backend`, `pg_ctl stop -m immediate`), each on three channel
//!   kinds (deduping, reconcile by lookup, neither); then a network cut mid-send, a server
//!   crash during backoff and a spent retry budget.
//! - `soak`: N messages (1,000; 10,000 with `OUTBOX_SOAK_FULL=1`) over the three channel kinds
//!   with random provider faults, `kill -9` of a worker every few seconds and two immediate
//!   server restarts; then 0 lost, 0 duplicates.
//!
//! Each test prints one table row per scenario and channel kind and fails if any row failed.
//! Then it compares what its rows claim (scenario, channel kind, key identical, verdict; the
//! soak's run-to-run figures masked) with its table in `docs/reliability.md` (between the
//! `crash-matrix` / `soak` markers) and fails, row by row, where the page says something else.
//! With `OUTBOX_WRITE_RELIABILITY=1` (`scripts/reliability_doc.sh`) it rewrites the table
//! instead. Every server-wide setting changed here is reset by a guard, also on failure.

use outbox_e2e::cluster::{poll, unique, wait_for_workers, Cluster};
use outbox_e2e::helpers::{
    arm_fault, cluster_and_sim, count, create_channel, one, try_enqueue, wait_for_count, QUIET,
};
use outbox_e2e::sim::{Action, RandomFaults, Received, Simulator};
use postgres::{Client, NoTls};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

// The scenarios, the matrix that runs them, the soak, and the page they are compared with.
mod matrix;
mod nats;
mod network_and_retries;
mod page;
mod restart_points;
mod soak;
mod unverifiable;

/// How long a message may take to reach the state it is expected to reach (recovery after a
/// crash restart included).
const CRASH_SETTLE: Duration = Duration::from_secs(60);
/// Retry policy of the matrix channels: fast and predictable.
const FAST_RETRY: &str = r#"{"base_ms": 200, "max_ms": 1000, "jitter": "none"}"#;
const RUN_COMMAND: &str =
    "cargo test -p outbox_e2e --release --test crash_matrix -- --test-threads=1 --nocapture";

// ---------------------------------------------------------------------------------------
// Channel kinds
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Kind {
    /// `idempotency_header`; the provider dedupes by it.
    Dedupe,
    /// `reference_header` + `reconcile` lookup by key; the provider does not dedupe.
    Reconcile,
    /// Neither: the provider can neither dedupe nor be asked.
    Neither,
}

const KINDS: [Kind; 3] = [Kind::Dedupe, Kind::Reconcile, Kind::Neither];

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Dedupe => "deduping",
            Kind::Reconcile => "reconcile",
            Kind::Neither => "neither",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Kind::Dedupe => "dd",
            Kind::Reconcile => "rc",
            Kind::Neither => "nn",
        }
    }

    /// The channel options of this kind (the simulator side is set up by [`make_channels`]).
    fn options(self, sim: &Simulator, ch: &str, retry: &str, extra: &Value) -> Value {
        let mut o = match self {
            Kind::Dedupe => json!({"idempotency_header": "Idempotency-Key"}),
            Kind::Reconcile => json!({
                "reference_header": "X-Effect-Key",
                "reconcile": {"url": sim.lookup_url_by_key(ch), "found": "/found", "external_id": "/id", "settle_ms": 500}
            }),
            Kind::Neither => json!({}),
        };
        o["external_id"] = json!("/id");
        o["retry"] = serde_json::from_str(retry).expect("retry policy is JSON");
        if let Some(extra) = extra.as_object() {
            for (k, v) in extra {
                o[k] = v.clone();
            }
        }
        o
    }
}

/// The key the provider saw on a send: the key header where the channel has one; on the
/// neither-channel (no key header at all) the `key` field of the payload.
fn provider_key(kind: Kind, r: &Received) -> Option<String> {
    match kind {
        Kind::Neither => body_key(&r.body),
        _ => r.key.clone(),
    }
}

fn body_key(body: &[u8]) -> Option<String> {
    serde_json::from_slice::<Value>(body)
        .ok()?
        .get("key")?
        .as_str()
        .map(str::to_string)
}

// ---------------------------------------------------------------------------------------
// Database helpers
// ---------------------------------------------------------------------------------------

fn kill_9(pid: i32) -> bool {
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn alter_channel(c: &mut Client, name: &str, options: &Value) {
    let options = options.to_string();
    c.execute(
        "SELECT outbox.alter_channel($1::text, $2::text::jsonb)",
        &[&name, &options],
    )
    .unwrap_or_else(|e| panic!("alter_channel({name}, {options}): {e}"));
}

/// One message of a scenario: its channel (one channel per kind and scenario), key and id.
#[derive(Debug, Clone)]
struct Lane {
    kind: Kind,
    ch: String,
    key: String,
    id: i64,
}

/// One fresh channel per kind; `endpoint` says where its sends go.
fn make_channels(
    c: &mut Client,
    sim: &Simulator,
    tag: &str,
    retry: &str,
    extra: &Value,
    endpoint: &dyn Fn(&str) -> String,
) -> Vec<(Kind, String)> {
    KINDS
        .iter()
        .map(|&kind| {
            let ch = unique(&format!("cm_{tag}_{}", kind.short()));
            if kind == Kind::Dedupe {
                sim.set_dedupe(&ch, "Idempotency-Key");
            }
            create_channel(
                c,
                &ch,
                &endpoint(&ch),
                &kind.options(sim, &ch, retry, extra).to_string(),
            );
            (kind, ch)
        })
        .collect()
}

/// How most scenarios start: the cluster with all its workers up (their PIDs), a simulator,
/// a connection, and one channel of each kind sending to the simulator ([`make_channels`]).
fn start_with_channels(
    tag: &str,
    retry: &str,
) -> (Cluster, Vec<i32>, Simulator, Client, Vec<(Kind, String)>) {
    let cluster = Cluster::from_env();
    let before = wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let mut c = cluster.connect();
    let chans = make_channels(&mut c, &sim, tag, retry, &json!({}), &|ch| sim.send_url(ch));
    (cluster, before, sim, c, chans)
}

/// One message on each channel, all in one committed transaction.
fn enqueue_all(c: &mut Client, chans: &[(Kind, String)], keys: Option<&[String]>) -> Vec<Lane> {
    let mut tx = c.transaction().expect("begin");
    let lanes = chans
        .iter()
        .enumerate()
        .map(|(i, (kind, ch))| {
            let key = keys.map_or_else(
                || unique(&format!("key_{}", kind.short())),
                |k| k[i].clone(),
            );
            let id =
                try_enqueue(&mut tx, ch, &key).unwrap_or_else(|e| panic!("enqueue on {ch}: {e}"));
            Lane {
                kind: *kind,
                ch: ch.clone(),
                key,
                id,
            }
        })
        .collect();
    tx.commit().expect("commit");
    lanes
}

fn state_attempts(c: &mut Client, id: i64) -> Result<Option<(String, i32)>, postgres::Error> {
    Ok(c.query_opt(
        "SELECT state::text, attempts FROM outbox.messages WHERE id = $1",
        &[&id],
    )?
    .map(|r| (r.get(0), r.get(1))))
}

/// The worker PIDs that own the latest send attempt of these messages.
fn attempt_owners(c: &mut Client, ids: &[i64]) -> Vec<i32> {
    let mut pids: Vec<i32> = c
        .query(
            "SELECT DISTINCT ON (message_id) worker_pid FROM outbox.attempts
              WHERE message_id = ANY($1) AND kind = 'send' ORDER BY message_id, attempt_id DESC",
            &[&ids],
        )
        .expect("attempt owners")
        .iter()
        .filter_map(|r| r.get::<_, Option<i32>>(0))
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// The message ids a `fault injection POINT:` log line names as in flight.
fn fault_fired_for(log: &str, point: &str) -> HashSet<i64> {
    let needle = format!("fault injection {point}:");
    log.lines()
        .filter(|l| l.contains(&needle))
        .flat_map(|l| {
            l.rsplit_once('[')
                .and_then(|(_, rest)| rest.split_once(']'))
                .map(|(list, _)| {
                    list.split(',')
                        .filter_map(|x| x.trim().parse::<i64>().ok())
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default()
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Observation, expectation, table row
// ---------------------------------------------------------------------------------------

#[derive(Debug, Default, Clone)]
struct Obs {
    exists: bool,
    state: String,
    attempts: i32,
    send_rows: usize,
    recovery_rows: usize,
    lookup_rows: usize,
    /// Sends the provider received on the lane's channel.
    sends: usize,
    /// Messages the provider stored on the lane's channel.
    stored: usize,
    lookups: usize,
    outcomes: Vec<String>,
    /// The attempt rows' `effect_key_sent` and the provider's keys are all the message's key.
    key_same: bool,
    key_detail: String,
    ledger: Vec<String>,
    work_queue_reason: Option<String>,
    last_error: Option<String>,
}

fn observe(cluster: &Cluster, sim: &Simulator, lane: &Lane) -> Obs {
    let mut c = cluster.connect();
    let mut o = Obs::default();
    if let Some(r) = c
        .query_opt(
            "SELECT state::text, attempts, last_error FROM outbox.messages WHERE id = $1",
            &[&lane.id],
        )
        .expect("read message")
    {
        o.exists = true;
        o.state = r.get(0);
        o.attempts = r.get(1);
        o.last_error = r.get(2);
    }
    let rows: Vec<(String, Option<String>)> = c
        .query(
            "SELECT kind, effect_key_sent FROM outbox.attempts WHERE message_id = $1 ORDER BY attempt_id",
            &[&lane.id],
        )
        .expect("read attempts")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    o.send_rows = rows.iter().filter(|r| r.0 == "send").count();
    o.recovery_rows = rows.iter().filter(|r| r.0 == "recovery").count();
    o.lookup_rows = rows.iter().filter(|r| r.0 == "reconcile").count();
    o.ledger = c
        .query(
            "SELECT recorded_by FROM outbox.ledger WHERE effect_key = $1",
            &[&lane.key],
        )
        .expect("read ledger")
        .iter()
        .map(|r| r.get(0))
        .collect();
    o.work_queue_reason = c
        .query_opt(
            "SELECT reason FROM outbox.work_queue WHERE id = $1",
            &[&lane.id],
        )
        .expect("read work_queue")
        .and_then(|r| r.get(0));

    let sends = sim.sends(&lane.ch);
    let lookups: Vec<Received> = sim
        .requests(&lane.ch)
        .into_iter()
        .filter(|r| r.kind == "lookup")
        .collect();
    o.sends = sends.len();
    o.stored = sim.stored(&lane.ch).len();
    o.lookups = lookups.len();
    o.outcomes = sends.iter().map(|r| r.outcome.clone()).collect();
    let row_keys_ok = !rows.is_empty()
        && rows
            .iter()
            .all(|(_, k)| k.as_deref() == Some(lane.key.as_str()));
    let sent_keys: Vec<Option<String>> = sends.iter().map(|r| provider_key(lane.kind, r)).collect();
    let sent_ok = sent_keys
        .iter()
        .all(|k| k.as_deref() == Some(lane.key.as_str()));
    let lookups_ok = lookups
        .iter()
        .all(|r| r.key.as_deref() == Some(lane.key.as_str()));
    o.key_same = row_keys_ok && sent_ok && lookups_ok;
    o.key_detail = format!(
        "attempt rows {:?}, provider keys {:?}, lookup keys {:?}",
        rows.iter().map(|r| r.1.clone()).collect::<Vec<_>>(),
        sent_keys,
        lookups.iter().map(|r| r.key.clone()).collect::<Vec<_>>()
    );
    o
}

/// What a lane must show at the end of a scenario.
#[derive(Debug, Clone)]
struct Expect {
    state: &'static str,
    stored: usize,
    sends: usize,
    send_rows: usize,
    recovery_rows: usize,
    lookups: usize,
    ledger_by: Option<&'static str>,
    outcomes: Option<Vec<&'static str>>,
}

fn delivered(
    sends: usize,
    send_rows: usize,
    recovery_rows: usize,
    lookups: usize,
    ledger_by: &'static str,
) -> Expect {
    Expect {
        state: "delivered",
        stored: 1,
        sends,
        send_rows,
        recovery_rows,
        lookups,
        ledger_by: Some(ledger_by),
        outcomes: None,
    }
}

fn uncertain(stored: usize, sends: usize, send_rows: usize, recovery_rows: usize) -> Expect {
    Expect {
        state: "uncertain",
        stored,
        sends,
        send_rows,
        recovery_rows,
        lookups: 0,
        ledger_by: None,
        outcomes: None,
    }
}

impl Expect {
    fn outcomes(mut self, o: &[&'static str]) -> Expect {
        self.outcomes = Some(o.to_vec());
        self
    }
}

fn judge(o: &Obs, e: &Expect) -> Vec<String> {
    let mut bad = Vec::new();
    let mut check = |what: &str, got: String, want: String| {
        if got != want {
            bad.push(format!("{what} {got}, expected {want}"));
        }
    };
    check("state", o.state.clone(), e.state.to_string());
    // The counts; a lookup row is recorded for each lookup the provider answered.
    for (what, got, want) in [
        ("provider stored", o.stored, e.stored),
        ("provider sends", o.sends, e.sends),
        ("send rows", o.send_rows, e.send_rows),
        ("recovery rows", o.recovery_rows, e.recovery_rows),
        ("provider lookups", o.lookups, e.lookups),
        ("lookup rows", o.lookup_rows, e.lookups),
    ] {
        check(what, got.to_string(), want.to_string());
    }
    check(
        "ledger",
        format!("{:?}", o.ledger),
        format!("{:?}", e.ledger_by.into_iter().collect::<Vec<_>>()),
    );
    if let Some(want) = &e.outcomes {
        check(
            "provider outcomes",
            format!("{:?}", o.outcomes),
            format!("{want:?}"),
        );
    }
    if !o.key_same {
        bad.push(format!(
            "key not identical on every attempt: {}",
            o.key_detail
        ));
    }
    let in_queue = matches!(e.state, "uncertain" | "exhausted" | "failed");
    match (&o.work_queue_reason, in_queue) {
        (Some(r), true) if !r.is_empty() => {}
        (None, false) => {}
        (r, _) => bad.push(format!("work_queue reason {r:?} for a {} message", o.state)),
    }
    bad
}

#[derive(Debug, Clone)]
struct Row {
    scenario: String,
    kind: String,
    provider: String,
    local: String,
    attempts: String,
    same_key: String,
    verdict: String,
    pass: bool,
}

fn provider_cell(o: &Obs) -> String {
    let mut s = format!("{} stored / {} sends", o.stored, o.sends);
    if o.lookups > 0 {
        s.push_str(&format!(" / {} lookups", o.lookups));
    }
    s
}

fn local_cell(o: &Obs) -> String {
    if !o.exists {
        return "no message".into();
    }
    match o.state.as_str() {
        "delivered" => format!("delivered (ledger: {})", o.ledger.join(",")),
        s @ ("uncertain" | "exhausted" | "failed") => format!("{s} (in work_queue)"),
        s => s.to_string(),
    }
}

fn attempts_cell(o: &Obs) -> String {
    format!(
        "{} ({} send, {} recovery, {} lookup)",
        o.attempts, o.send_rows, o.recovery_rows, o.lookup_rows
    )
}

fn row_for(scenario: &str, lane: &Lane, o: &Obs, e: &Expect, mut bad: Vec<String>) -> Row {
    bad.extend(judge(o, e));
    let pass = bad.is_empty();
    let verdict = if !pass {
        format!("FAIL: {}", bad.join("; "))
    } else {
        match e.state {
            "delivered" => "PASS: delivered, provider holds one".to_string(),
            "uncertain" if lane.kind == Kind::Neither => {
                "PASS (limit): uncertain in work_queue, never resent; an operator decides"
                    .to_string()
            }
            "uncertain" => "PASS (limit): uncertain in work_queue".to_string(),
            "exhausted" => {
                "PASS: exhausted, kept in work_queue with its reason; nothing stored".to_string()
            }
            s => format!("PASS: {s}"),
        }
    };
    Row {
        scenario: scenario.to_string(),
        kind: lane.kind.label().to_string(),
        provider: provider_cell(o),
        local: local_cell(o),
        attempts: attempts_cell(o),
        same_key: if o.key_same { "yes" } else { "no" }.to_string(),
        verdict,
        pass,
    }
}

/// Waits for each lane's expected state, watches a quiet period (nothing more may happen),
/// then observes and judges every lane.
fn settle_and_judge(
    cluster: &Cluster,
    sim: &Simulator,
    scenario: &str,
    lanes: &[Lane],
    expect: &dyn Fn(Kind) -> Expect,
    extra: &dyn Fn(&Lane, &Obs) -> Vec<String>,
) -> Vec<Row> {
    for lane in lanes {
        let want = expect(lane.kind).state;
        poll(cluster, CRASH_SETTLE, |c| {
            Ok(state_attempts(c, lane.id)?.filter(|(s, _)| s == want))
        });
    }
    std::thread::sleep(QUIET);
    lanes
        .iter()
        .map(|lane| {
            let o = observe(cluster, sim, lane);
            let e = expect(lane.kind);
            let bad = extra(lane, &o);
            row_for(scenario, lane, &o, &e, bad)
        })
        .collect()
}

fn no_extra(_: &Lane, _: &Obs) -> Vec<String> {
    Vec::new()
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

fn table(rows: &[Row]) -> String {
    let mut t = String::from(
        "| scenario | channel kind | provider: stored / sends | local state | attempts (rows: send, recovery, lookup) | key identical on every attempt | verdict |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        t.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            cell(&r.scenario),
            cell(&r.kind),
            cell(&r.provider),
            cell(&r.local),
            cell(&r.attempts),
            cell(&r.same_key),
            cell(&r.verdict)
        ));
    }
    t
}

fn print_row(r: &Row) {
    println!(
        "| {} | {} | {} | {} | {} | {} | {} |",
        r.scenario, r.kind, r.provider, r.local, r.attempts, r.same_key, r.verdict
    );
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into())
}

/// Runs one scenario; a panic (a timeout, a broken precondition) becomes a FAIL row, so the
/// other scenarios still run and the table shows what failed.
fn run(rows: &mut Vec<Row>, scenario: &str, f: impl FnOnce(&str) -> Vec<Row>) {
    let started = Instant::now();
    match catch_unwind(AssertUnwindSafe(|| f(scenario))) {
        Ok(rs) => {
            for r in &rs {
                print_row(r);
            }
            rows.extend(rs);
        }
        Err(p) => {
            let r = Row {
                scenario: scenario.to_string(),
                kind: "all".into(),
                provider: "-".into(),
                local: "-".into(),
                attempts: "-".into(),
                same_key: "-".into(),
                verdict: format!("FAIL: {}", panic_text(p.as_ref())),
                pass: false,
            };
            print_row(&r);
            rows.push(r);
        }
    }
    eprintln!(
        "[crash_matrix] {scenario}: {:.1} s",
        started.elapsed().as_secs_f64()
    );
}
