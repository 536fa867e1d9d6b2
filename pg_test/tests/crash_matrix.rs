//! "Prove it": the crash matrix and the soak, end to end against the real cluster
//! (`scripts/cluster.sh`, located by `OUTBOX_BASE` / `OUTBOX_PGPORT`, two delivery workers)
//! and the provider simulator.
//!
//! Run: `cargo test -p outbox_e2e --release --test crash_matrix -- --test-threads=1 --nocapture`
//! (also part of the README's `cargo test -p outbox_e2e --release -- --test-threads=1`).
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
use outbox_e2e::helpers::{arm_fault, create_channel, try_enqueue, QUIET};
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
    check(
        "provider stored",
        o.stored.to_string(),
        e.stored.to_string(),
    );
    check("provider sends", o.sends.to_string(), e.sends.to_string());
    check(
        "send rows",
        o.send_rows.to_string(),
        e.send_rows.to_string(),
    );
    check(
        "recovery rows",
        o.recovery_rows.to_string(),
        e.recovery_rows.to_string(),
    );
    check(
        "provider lookups",
        o.lookups.to_string(),
        e.lookups.to_string(),
    );
    check(
        "lookup rows",
        o.lookup_rows.to_string(),
        e.lookups.to_string(),
    );
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

/// Set to `1` to rewrite docs/reliability.md from this run (`scripts/reliability_doc.sh`);
/// otherwise a run compares its tables with the committed ones and leaves the file alone.
const WRITE_DOC_VAR: &str = "OUTBOX_WRITE_RELIABILITY";

fn doc_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/reliability.md")
}

/// What a table row asserts, as opposed to what it measured on this run.
#[derive(Clone, Copy)]
enum Claim {
    /// Scenario, channel kind, "key identical" and verdict, word for word (the crash matrix:
    /// every figure in these columns is fixed by the scenario).
    Exact,
    /// The same columns with every number masked (the soak: how many kills, restarts and
    /// ambiguous jobs a random run gets varies; the verdict's words do not).
    FiguresMasked,
}

/// Splits a Markdown table row into its cells (`\|` inside a cell is not a separator).
fn table_cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    let mut cells = vec![String::new()];
    let mut chars = inner.chars().peekable();
    while let Some(ch) = chars.next() {
        match ch {
            '\\' if chars.peek() == Some(&'|') => {
                cells.last_mut().unwrap().push_str("\\|");
                chars.next();
            }
            '|' => cells.push(String::new()),
            _ => cells.last_mut().unwrap().push(ch),
        }
    }
    cells.into_iter().map(|c| c.trim().to_string()).collect()
}

fn mask_figures(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut in_number = false;
    for ch in s.chars() {
        if ch.is_ascii_digit() {
            if !in_number {
                out.push('N');
            }
            in_number = true;
        } else {
            out.push(ch);
            in_number = false;
        }
    }
    out
}

/// The claims of every row of the tables in `text`: scenario, channel kind, key identical,
/// verdict (header and separator rows skipped).
fn claims(text: &str, how: Claim) -> Vec<String> {
    text.lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---") && !l.starts_with("| scenario |"))
        .map(|l| {
            let cells = table_cells(l);
            let pick = |i: usize| cells.get(i).cloned().unwrap_or_default();
            let claim = format!("{} | {} | {} | {}", pick(0), pick(1), pick(5), pick(6));
            match how {
                Claim::Exact => claim,
                Claim::FiguresMasked => mask_figures(&claim),
            }
        })
        .collect()
}

/// The text between `<!-- NAME:begin -->` and `<!-- NAME:end -->` in `doc`.
fn doc_region<'a>(doc: &'a str, name: &str) -> Option<&'a str> {
    let begin = format!("<!-- {name}:begin -->");
    let end = format!("<!-- {name}:end -->");
    let b = doc.find(&begin)? + begin.len();
    let e = doc[b..].find(&end)? + b;
    Some(&doc[b..e])
}

/// The differences between the rows docs/reliability.md claims and the rows of this run,
/// one `- doc` / `+ run` pair per differing row; empty when they claim the same.
fn claim_diff(documented: &[String], measured: &[String]) -> Vec<String> {
    let mut diff = Vec::new();
    for i in 0..documented.len().max(measured.len()) {
        let (d, m) = (documented.get(i), measured.get(i));
        if d != m {
            diff.push(format!(
                "row {}:\n  - doc: {}\n  + run: {}",
                i + 1,
                d.map_or("(no row)", String::as_str),
                m.map_or("(no row)", String::as_str)
            ));
        }
    }
    diff
}

/// With `OUTBOX_WRITE_RELIABILITY=1`, replaces the text between `<!-- NAME:begin -->` and
/// `<!-- NAME:end -->` in docs/reliability.md (appends the section when the markers are
/// missing). Otherwise compares what the rows of `content` claim with the rows of that region
/// and returns the differences as an error: the page must keep telling what a run shows.
fn record_doc_region(name: &str, content: &str, how: Claim) -> Result<(), String> {
    let path = doc_path();
    let old = std::fs::read_to_string(&path).unwrap_or_default();
    if std::env::var(WRITE_DOC_VAR).as_deref() == Ok("1") {
        let begin = format!("<!-- {name}:begin -->");
        let end = format!("<!-- {name}:end -->");
        let block = format!("{begin}\n{content}{end}");
        let new = match (old.find(&begin), old.find(&end)) {
            (Some(b), Some(e)) if b < e => {
                format!("{}{}{}", &old[..b], block, &old[e + end.len()..])
            }
            _ => format!("{old}\n{block}\n"),
        };
        if let Err(e) = std::fs::write(&path, new) {
            eprintln!("note: could not write {}: {e}", path.display());
        }
        return Ok(());
    }
    let Some(documented) = doc_region(&old, name) else {
        return Err(format!(
            "{} has no `{name}` section; write it with scripts/reliability_doc.sh",
            path.display()
        ));
    };
    let diff = claim_diff(&claims(documented, how), &claims(content, how));
    if diff.is_empty() {
        return Ok(());
    }
    Err(format!(
        "the `{name}` table of {} no longer says what this run shows \
         (scenario | channel kind | key identical | verdict):\n{}\n\
         If the change is meant, rewrite the page with scripts/reliability_doc.sh \
         ({WRITE_DOC_VAR}=1) and commit it.",
        path.display(),
        diff.join("\n")
    ))
}

fn run_header(cluster: &Cluster) -> String {
    let mut c = cluster.connect();
    let (when, version): (String, String) = c
        .query_one(
            "SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI \"UTC\"'), current_setting('server_version')",
            &[],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap_or_else(|_| ("?".into(), "?".into()));
    format!("{when}, PostgreSQL {version}, 2 delivery workers")
}

/// The page comparison needs no cluster: check it on its own.
#[test]
fn the_reliability_page_is_held_to_its_verdicts_not_to_the_figures_of_a_random_run() {
    let header = "| scenario | channel kind | provider: stored / sends | local state | attempts (rows: send, recovery, lookup) | key identical on every attempt | verdict |\n|---|---|---|---|---|---|---|\n";
    let page = format!(
        "{header}| soak: 1000 messages, 6 × kill -9 | neither | 333 stored | a \\| b | 359 send | yes | PASS: 0 lost; 12 ambiguous jobs wait |\n"
    );
    let other_run = format!(
        "{header}| soak: 1000 messages, 7 × kill -9 | neither | 330 stored | c | 350 send | yes | PASS: 0 lost; 9 ambiguous jobs wait |\n"
    );
    let failed_run = format!(
        "{header}| soak: 1000 messages, 7 × kill -9 | neither | 330 stored | c | 350 send | yes | FAIL: 1 effect keys stored more than once |\n"
    );
    assert_eq!(
        table_cells("| a \\| b | c |"),
        vec!["a \\| b".to_string(), "c".to_string()]
    );
    let masked = |t: &str| claims(t, Claim::FiguresMasked);
    assert_eq!(masked(&page).len(), 1, "the header rows are no claims");
    assert!(claim_diff(&masked(&page), &masked(&other_run)).is_empty());
    let diff = claim_diff(&masked(&page), &masked(&failed_run));
    assert_eq!(diff.len(), 1, "{diff:?}");
    assert!(diff[0].contains("- doc:") && diff[0].contains("+ run:") && diff[0].contains("FAIL"));
    let exact = |t: &str| claims(t, Claim::Exact);
    assert_eq!(
        claim_diff(&exact(&page), &exact(&other_run)).len(),
        1,
        "a figure in a crash-matrix claim is part of the claim"
    );
    assert_eq!(
        claim_diff(&exact(&page), &exact(header)),
        vec!["row 1:\n  - doc: soak: 1000 messages, 6 × kill -9 | neither | yes | PASS: 0 lost; 12 ambiguous jobs wait\n  + run: (no row)".to_string()]
    );
    let doc = "intro\n<!-- soak:begin -->\nbody\n<!-- soak:end -->\n";
    assert_eq!(doc_region(doc, "soak"), Some("\nbody\n"));
    assert_eq!(doc_region(doc, "crash-matrix"), None);
}

// ---------------------------------------------------------------------------------------
// (1) The client dies before its COMMIT
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum ClientKill {
    /// `outbox.fault_injection = crash_after_claim` armed (it would fire on any claim of
    /// these messages), then `pg_terminate_backend` of the client's backend.
    FaultArmedTerminate,
    /// `kill -9` of the client's backend process (the postmaster crash-restarts).
    Kill9Backend,
    /// `pg_ctl stop -m immediate` while the transaction is open, then start.
    ImmediateStop,
}

fn client_dies(scenario: &str, how: ClientKill) -> Vec<Row> {
    let cluster = Cluster::from_env();
    let before = wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let mut c = cluster.connect();
    let chans = make_channels(&mut c, &sim, "p1", FAST_RETRY, &json!({}), &|ch| {
        sim.send_url(ch)
    });
    let keys: Vec<String> = chans
        .iter()
        .map(|(k, _)| unique(&format!("p1_{}", k.short())))
        .collect();
    let mark = cluster.log_mark();
    let guard =
        (how == ClientKill::FaultArmedTerminate).then(|| arm_fault(&cluster, "crash_after_claim"));

    // The application's transaction: enqueue on every channel, no COMMIT.
    let mut app = cluster.connect();
    app.batch_execute("BEGIN").unwrap();
    let backend: i32 = app
        .query_one("SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    let ids: Vec<i64> = chans
        .iter()
        .zip(&keys)
        .map(|((_, ch), key)| {
            try_enqueue(&mut app, ch, key).expect("enqueue in the open transaction")
        })
        .collect();
    // Three poll intervals: a worker that could see the rows would have claimed them.
    std::thread::sleep(Duration::from_millis(1500));
    let visible: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox._messages WHERE effect_key = ANY($1)",
            &[&keys],
        )
        .unwrap()
        .get(0);
    let mut pre = Vec::new();
    if visible != 0 {
        pre.push(format!(
            "{visible} uncommitted message(s) visible to others"
        ));
    }
    let sent_early: usize = chans.iter().map(|(_, ch)| sim.send_count(ch)).sum();
    if sent_early != 0 {
        pre.push(format!("{sent_early} send(s) before the COMMIT"));
    }

    match how {
        ClientKill::FaultArmedTerminate => {
            let ok: bool = c
                .query_one("SELECT pg_terminate_backend($1)", &[&backend])
                .unwrap()
                .get(0);
            assert!(ok, "pg_terminate_backend({backend})");
        }
        ClientKill::Kill9Backend => {
            drop(c);
            assert!(kill_9(backend), "kill -9 {backend}");
        }
        ClientKill::ImmediateStop => {
            drop(c);
            cluster.crash_restart();
        }
    }
    assert!(
        app.batch_execute("COMMIT").is_err(),
        "the client's COMMIT must fail: its backend is gone"
    );
    drop(app);
    if how == ClientKill::FaultArmedTerminate {
        wait_for_workers(&cluster, &[]);
    } else {
        wait_for_workers(&cluster, &before);
    }
    std::thread::sleep(QUIET);

    // Nothing exists, nothing was sent, nothing was claimed.
    let mut c = cluster.connect();
    let rows: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox._messages WHERE effect_key = ANY($1)",
            &[&keys],
        )
        .unwrap()
        .get(0);
    let ledger: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.ledger WHERE effect_key = ANY($1)",
            &[&keys],
        )
        .unwrap()
        .get(0);
    if rows != 0 || ledger != 0 {
        pre.push(format!(
            "after the kill: {rows} message row(s), {ledger} ledger row(s)"
        ));
    }
    let sent: usize = chans.iter().map(|(_, ch)| sim.send_count(ch)).sum();
    if sent != 0 {
        pre.push(format!("after the kill: {sent} send(s)"));
    }
    let fired = fault_fired_for(&cluster.log_since(mark), "crash_after_claim");
    if ids.iter().any(|id| fired.contains(id)) {
        pre.push(format!("a worker claimed an uncommitted message: {ids:?}"));
    }
    drop(guard);

    // The application runs the turn again: same effect keys, committed this time.
    let lanes = enqueue_all(&mut c, &chans, Some(&keys));
    drop(c);
    let mut rows_out = settle_and_judge(
        &cluster,
        &sim,
        scenario,
        &lanes,
        &|_| delivered(1, 1, 0, 0, "worker").outcomes(&["accepted"]),
        &|_, _| pre.clone(),
    );
    for r in &mut rows_out {
        r.local = format!("after the kill: no message, 0 sent; re-run: {}", r.local);
    }
    rows_out
}

// ---------------------------------------------------------------------------------------
// (2)-(4) with the fault-injection points
// ---------------------------------------------------------------------------------------

/// Expectations after a crash at point (2): nothing reached the provider.
fn after_claim(kind: Kind) -> Expect {
    match kind {
        // Recovery → same-key retry → delivered; the provider got one send.
        Kind::Dedupe => delivered(1, 2, 1, 0, "worker").outcomes(&["accepted"]),
        // Recovery → uncertain → lookup: not found → requeued, same key → delivered.
        Kind::Reconcile => delivered(1, 2, 1, 1, "worker").outcomes(&["accepted"]),
        // Recovery → uncertain; nothing sent, nothing resent.
        Kind::Neither => uncertain(0, 0, 1, 1),
    }
}

/// Expectations after a crash at points (3)/(4): the provider stored the message.
fn after_provider_has_it(first_outcome: &'static str) -> impl Fn(Kind) -> Expect {
    move |kind| match kind {
        // Recovery → same-key retry → the provider answers from its dedupe store.
        Kind::Dedupe => delivered(2, 2, 1, 0, "worker").outcomes(&[first_outcome, "deduped"]),
        // Recovery → uncertain → lookup: found → delivered, 0 resends.
        Kind::Reconcile => delivered(1, 1, 1, 1, "reconcile").outcomes(&[first_outcome]),
        // Recovery → uncertain; the provider holds it; never resent.
        Kind::Neither => uncertain(1, 1, 1, 1).outcomes(&[first_outcome]),
    }
}

fn fault_point(scenario: &str, point: &str, expect: &dyn Fn(Kind) -> Expect) -> Vec<Row> {
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let mut c = cluster.connect();
    let chans = make_channels(&mut c, &sim, "fp", FAST_RETRY, &json!({}), &|ch| {
        sim.send_url(ch)
    });
    let mark = cluster.log_mark();
    let guard = arm_fault(&cluster, point);
    let lanes = enqueue_all(&mut c, &chans, None);
    drop(c);
    // Claimed, the worker died at the point, and the restarted worker recovered the lease.
    let recovered = poll(&cluster, CRASH_SETTLE, |c| {
        for lane in &lanes {
            match state_attempts(c, lane.id)? {
                Some((s, n)) if n >= 1 && s != "sending" => {}
                _ => return Ok(None),
            }
        }
        Ok(Some(()))
    });
    drop(guard);
    assert!(
        recovered.is_some(),
        "{point}: the messages were not claimed and recovered within {CRASH_SETTLE:?}; see {}",
        cluster.log_path().display()
    );
    let fired = fault_fired_for(&cluster.log_since(mark), point);
    settle_and_judge(&cluster, &sim, scenario, &lanes, expect, &|lane, _| {
        if fired.contains(&lane.id) {
            Vec::new()
        } else {
            vec![format!(
                "the fault {point} did not fire with message {} in flight",
                lane.id
            )]
        }
    })
}

// ---------------------------------------------------------------------------------------
// (2) real kill: the worker is stuck in connect() (the request cannot be written) → kill -9
// ---------------------------------------------------------------------------------------

/// A loopback listener whose accept queue is full and is never accepted from: the kernel
/// drops further SYNs, so a client's connect() hangs and it can never write a request.
struct Blackhole {
    addr: SocketAddr,
    _listener: TcpListener,
    _fillers: Vec<TcpStream>,
}

impl Blackhole {
    fn new() -> Blackhole {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind blackhole");
        let addr = listener.local_addr().unwrap();
        let mut fillers = Vec::new();
        while let Ok(s) = TcpStream::connect_timeout(&addr, Duration::from_millis(300)) {
            fillers.push(s);
            assert!(fillers.len() < 5000, "the accept queue never filled");
        }
        let hole = Blackhole {
            addr,
            _listener: listener,
            _fillers: fillers,
        };
        assert!(!hole.reachable(), "the blackhole accepts connections");
        hole
    }

    fn reachable(&self) -> bool {
        TcpStream::connect_timeout(&self.addr, Duration::from_millis(300)).is_ok()
    }

    fn url(&self, ch: &str) -> String {
        format!("http://{}/ch/{ch}", self.addr)
    }
}

fn after_claim_kill9(scenario: &str) -> Vec<Row> {
    let cluster = Cluster::from_env();
    let before = wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let hole = Blackhole::new();
    let mut c = cluster.connect();
    let chans = make_channels(
        &mut c,
        &sim,
        "p2k",
        FAST_RETRY,
        &json!({"connect_timeout_ms": 60000, "timeout_ms": 60000}),
        &|ch| hole.url(ch),
    );
    let lanes = enqueue_all(&mut c, &chans, None);
    let ids: Vec<i64> = lanes.iter().map(|l| l.id).collect();
    // Claimed: state sending, attempt row written; the worker now hangs in connect().
    let claimed = poll(&cluster, CRASH_SETTLE, |c| {
        for id in &ids {
            if state_attempts(c, *id)?.map(|(s, _)| s) != Some("sending".into()) {
                return Ok(None);
            }
        }
        Ok(Some(()))
    });
    assert!(claimed.is_some(), "the messages were not claimed");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!hole.reachable(), "the endpoint became reachable");
    let owners = attempt_owners(&mut c, &ids);
    assert!(
        owners.iter().all(|p| before.contains(p)) && !owners.is_empty(),
        "attempt owners {owners:?} are not the workers {before:?}"
    );
    // Move the channels to the simulator for what comes after the crash; the stuck attempt
    // keeps the endpoint it was claimed with.
    for lane in &lanes {
        alter_channel(
            &mut c,
            &lane.ch,
            &json!({"endpoint": sim.send_url(&lane.ch)}),
        );
    }
    let still: Vec<Option<(String, i32)>> = ids
        .iter()
        .map(|id| state_attempts(&mut c, *id).unwrap())
        .collect();
    assert!(
        still
            .iter()
            .all(|s| s.as_ref().map(|(s, _)| s.as_str()) == Some("sending")),
        "left the window before the kill: {still:?}"
    );
    drop(c);
    assert!(kill_9(owners[0]), "kill -9 {}", owners[0]);
    wait_for_workers(&cluster, &before);
    let rows = settle_and_judge(&cluster, &sim, scenario, &lanes, &after_claim, &no_extra);
    drop(hole);
    rows
}

// ---------------------------------------------------------------------------------------
// (3) real kill: the provider holds the request (Hang, stored) → kill -9 of the owner
// ---------------------------------------------------------------------------------------

fn after_send_kill9(scenario: &str) -> Vec<Row> {
    let cluster = Cluster::from_env();
    let before = wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let mut c = cluster.connect();
    let chans = make_channels(&mut c, &sim, "p3k", FAST_RETRY, &json!({}), &|ch| {
        sim.send_url(ch)
    });
    for (_, ch) in &chans {
        sim.set_default(ch, Action::Hang { store: true });
    }
    let lanes = enqueue_all(&mut c, &chans, None);
    for lane in &lanes {
        assert!(
            sim.wait_for_stored(&lane.ch, 1, CRASH_SETTLE),
            "the provider did not get message {}",
            lane.id
        );
    }
    let ids: Vec<i64> = lanes.iter().map(|l| l.id).collect();
    for id in &ids {
        let s = state_attempts(&mut c, *id).unwrap();
        assert_eq!(
            s.as_ref().map(|s| s.0.as_str()),
            Some("sending"),
            "message {id} must be in flight: {s:?}"
        );
    }
    let owners = attempt_owners(&mut c, &ids);
    assert!(!owners.is_empty() && owners.iter().all(|p| before.contains(p)));
    drop(c);
    for lane in &lanes {
        sim.set_default(&lane.ch, Action::Accept);
    }
    assert!(kill_9(owners[0]), "kill -9 {}", owners[0]);
    wait_for_workers(&cluster, &before);
    settle_and_judge(
        &cluster,
        &sim,
        scenario,
        &lanes,
        &after_provider_has_it("hang"),
        &no_extra,
    )
}

// ---------------------------------------------------------------------------------------
// (4) real kill: the answer was read, the record waits on a row lock → pg_ctl stop -m immediate
// ---------------------------------------------------------------------------------------

fn before_commit_immediate_stop(scenario: &str) -> Vec<Row> {
    let cluster = Cluster::from_env();
    let before = wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let mut c = cluster.connect();
    let chans = make_channels(&mut c, &sim, "p4k", FAST_RETRY, &json!({}), &|ch| {
        sim.send_url(ch)
    });
    for (_, ch) in &chans {
        sim.set_default(ch, Action::AcceptAfter(Duration::from_millis(2500)));
    }
    let lanes = enqueue_all(&mut c, &chans, None);
    let ids: Vec<i64> = lanes.iter().map(|l| l.id).collect();
    let claimed = poll(&cluster, CRASH_SETTLE, |c| {
        for id in &ids {
            if state_attempts(c, *id)?.map(|(s, _)| s) != Some("sending".into()) {
                return Ok(None);
            }
        }
        Ok(Some(()))
    });
    assert!(claimed.is_some(), "the messages were not claimed");
    // Hold the message rows: the worker's record transaction (which must update them) will
    // wait for this lock after it has read the answer.
    let mut locker = cluster.connect();
    locker.batch_execute("BEGIN").unwrap();
    let locked = locker
        .query(
            "SELECT id FROM outbox._messages WHERE id = ANY($1) AND state = 'sending' FOR UPDATE",
            &[&ids],
        )
        .unwrap()
        .len();
    assert_eq!(locked, 3, "all three rows locked while in flight");
    for lane in &lanes {
        let o = sim.sends(&lane.ch);
        assert!(
            o.len() == 1 && o[0].outcome == "delayed",
            "the provider answered before the lock was taken: {:?}",
            o.iter().map(|r| &r.outcome).collect::<Vec<_>>()
        );
    }
    // The provider answers (stored, 200) ...
    let answered = poll(&cluster, CRASH_SETTLE, |_| {
        Ok(lanes
            .iter()
            .all(|l| sim.sends(&l.ch).iter().any(|r| r.status == Some(200)))
            .then_some(()))
    });
    assert!(answered.is_some(), "the provider never answered");
    // ... and every worker that owns one of the attempts has read it and waits on our lock
    // inside its record transaction.
    let owners = attempt_owners(&mut c, &ids);
    let waiting = poll(&cluster, Duration::from_secs(20), |c| {
        let n: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1) AND wait_event_type = 'Lock'",
                &[&owners],
            )?
            .get(0);
        Ok((n as usize == owners.len()).then_some(()))
    });
    assert!(
        waiting.is_some(),
        "the workers {owners:?} did not block in their record transaction"
    );
    let mut probe = cluster.connect();
    let ledger: i64 = probe
        .query_one(
            "SELECT count(*) FROM outbox.ledger WHERE message_id = ANY($1)",
            &[&ids],
        )
        .unwrap()
        .get(0);
    assert_eq!(ledger, 0, "nothing recorded yet");
    drop(probe);
    drop(c);
    for lane in &lanes {
        sim.set_default(&lane.ch, Action::Accept);
    }
    cluster.crash_restart();
    drop(locker);
    wait_for_workers(&cluster, &before);
    settle_and_judge(
        &cluster,
        &sim,
        scenario,
        &lanes,
        &after_provider_has_it("accepted"),
        &no_extra,
    )
}

// ---------------------------------------------------------------------------------------
// Network cut in the middle of a send
// ---------------------------------------------------------------------------------------

fn network_cut(scenario: &str) -> Vec<Row> {
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    // When the provider confirmed (a 200 written, or a lookup that found it), per channel:
    // taken before the answer is written, so before the worker can have read it.
    let confirmed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let conf = confirmed.clone();
    sim.set_observer(move |r| {
        if (r.kind == "send" && r.status == Some(200)) || r.outcome == "lookup:found" {
            conf.lock()
                .unwrap()
                .entry(r.channel.clone())
                .or_insert_with(Instant::now);
        }
    });
    let mut c = cluster.connect();
    let retry = r#"{"base_ms": 1000, "max_ms": 2000, "jitter": "none"}"#;
    let chans = make_channels(&mut c, &sim, "cut", retry, &json!({}), &|ch| {
        sim.send_url(ch)
    });
    for (_, ch) in &chans {
        sim.set_plan(ch, vec![Action::DropAfterRead { store: true }]);
    }
    let lanes = enqueue_all(&mut c, &chans, None);
    drop(c);

    // Poll outbox.status() of every message; keep every value seen with the instant the
    // query returned.
    let stop = Arc::new(AtomicBool::new(false));
    let ids: Vec<i64> = lanes.iter().map(|l| l.id).collect();
    let poller = {
        let stop = stop.clone();
        let conninfo = cluster.conninfo();
        let ids = ids.clone();
        std::thread::spawn(move || {
            let mut seen: HashMap<i64, Vec<(String, Instant)>> = HashMap::new();
            let mut client: Option<Client> = None;
            while !stop.load(Ordering::Relaxed) {
                if client.as_ref().is_none_or(|c| c.is_closed()) {
                    client = Client::connect(&conninfo, NoTls).ok();
                }
                if let Some(c) = client.as_mut() {
                    match c.query(
                        "SELECT id, coalesce(outbox.status(id)::text, 'NULL') FROM unnest($1::int8[]) id",
                        &[&ids],
                    ) {
                        Ok(rows) => {
                            let at = Instant::now();
                            for r in rows {
                                let v = seen.entry(r.get(0)).or_default();
                                let s: String = r.get(1);
                                if v.last().map(|l| &l.0) != Some(&s) {
                                    v.push((s, at));
                                }
                            }
                        }
                        Err(_) => client = None,
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            seen
        })
    };
    let expect = |kind: Kind| match kind {
        Kind::Dedupe => delivered(2, 2, 0, 0, "worker").outcomes(&["dropped", "deduped"]),
        Kind::Reconcile => delivered(1, 1, 0, 1, "reconcile").outcomes(&["dropped"]),
        Kind::Neither => uncertain(1, 1, 1, 0).outcomes(&["dropped"]),
    };
    let mut rows = settle_and_judge(&cluster, &sim, scenario, &lanes, &expect, &no_extra);
    stop.store(true, Ordering::Relaxed);
    let seen = poller.join().expect("status poller");
    let confirmed = confirmed.lock().unwrap().clone();
    for (row, lane) in rows.iter_mut().zip(&lanes) {
        let values = seen.get(&lane.id).cloned().unwrap_or_default();
        let path: Vec<&str> = values.iter().map(|v| v.0.as_str()).collect();
        let mut bad = Vec::new();
        if let Some((_, at)) = values.iter().find(|v| v.0 == "delivered") {
            match confirmed.get(&lane.ch) {
                Some(c) if c < at => {}
                other => bad.push(format!(
                    "status() said delivered before the provider confirmed ({other:?})"
                )),
            }
        }
        if lane.kind == Kind::Neither && path.contains(&"delivered") {
            bad.push("status() said delivered on the neither-channel".into());
        }
        // The first value the poller sees is an intermediate state: queued or sending, or
        // already uncertain when the worker settled the cut before the poller's first query.
        if !matches!(
            path.first(),
            Some(&"queued") | Some(&"sending") | Some(&"uncertain")
        ) {
            bad.push(format!("first status seen {:?}", path.first()));
        }
        row.local = format!("{}; status() seen: {}", row.local, path.join(" → "));
        if !bad.is_empty() {
            row.pass = false;
            row.verdict = format!(
                "FAIL: {}{}",
                bad.join("; "),
                row.verdict
                    .strip_prefix("FAIL:")
                    .map(|r| format!(";{r}"))
                    .unwrap_or_default()
            );
        }
    }
    rows
}

// ---------------------------------------------------------------------------------------
// Postgres crash-restart during backoff
// ---------------------------------------------------------------------------------------

fn restart_during_backoff(scenario: &str) -> Vec<Row> {
    let cluster = Cluster::from_env();
    let before = wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let mut c = cluster.connect();
    let retry = r#"{"base_ms": 5000, "max_ms": 5000, "jitter": "none"}"#;
    let chans = make_channels(&mut c, &sim, "bo", retry, &json!({}), &|ch| {
        sim.send_url(ch)
    });
    for (_, ch) in &chans {
        sim.set_plan(ch, vec![Action::Status(503)]);
    }
    let lanes = enqueue_all(&mut c, &chans, None);
    let ids: Vec<i64> = lanes.iter().map(|l| l.id).collect();
    let schedule = |c: &mut Client| -> Result<Vec<(String, i32, f64, String)>, postgres::Error> {
        Ok(c.query(
            "SELECT state::text, attempts, (extract(epoch FROM next_attempt_at) * 1000)::float8, effect_key
               FROM outbox._messages WHERE id = ANY($1) ORDER BY id",
            &[&ids],
        )?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect())
    };
    let in_backoff = poll(&cluster, CRASH_SETTLE, |c| {
        let s = schedule(c)?;
        Ok((s.len() == 3 && s.iter().all(|m| m.0 == "queued" && m.1 == 1)).then_some(s))
    })
    .expect("the messages did not reach backoff after their first 503");
    drop(c);
    cluster.crash_restart();
    let mut c = cluster.connect();
    let restarted_ms: f64 = c
        .query_one(
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::float8",
            &[],
        )
        .unwrap()
        .get(0);
    let after = schedule(&mut c).unwrap();
    drop(c);
    let mut pre = Vec::new();
    for (b, a) in in_backoff.iter().zip(&after) {
        if a.2 != b.2 || a.3 != b.3 {
            pre.push(format!(
                "schedule or key changed across the restart: {b:?} → {a:?}"
            ));
        }
        if restarted_ms + 200.0 < b.2 && (a.0 != "queued" || a.1 != 1) {
            pre.push(format!("retried before its time: {a:?}"));
        }
    }
    wait_for_workers(&cluster, &before);
    let due: HashMap<i64, f64> = ids
        .iter()
        .copied()
        .zip(in_backoff.iter().map(|m| m.2))
        .collect();
    let mut rows = settle_and_judge(
        &cluster,
        &sim,
        scenario,
        &lanes,
        &|_| delivered(2, 2, 0, 0, "worker").outcomes(&["status:503", "accepted"]),
        &|lane, _| {
            let mut bad = pre.clone();
            let sends = sim.sends(&lane.ch);
            if let Some(second) = sends.get(1) {
                let at = second
                    .received_at
                    .duration_since(UNIX_EPOCH)
                    .unwrap()
                    .as_secs_f64()
                    * 1000.0;
                if at + 1.0 < due[&lane.id] {
                    bad.push(format!(
                        "retried {:.0} ms before next_attempt_at",
                        due[&lane.id] - at
                    ));
                }
            }
            bad
        },
    );
    for r in &mut rows {
        r.local = format!(
            "{}; next_attempt_at and key unchanged by the restart",
            r.local
        );
    }
    rows
}

// ---------------------------------------------------------------------------------------
// Retry budget exhausted
// ---------------------------------------------------------------------------------------

fn budget_exhausted(scenario: &str) -> Vec<Row> {
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let mut c = cluster.connect();
    let retry = r#"{"max_attempts": 3, "base_ms": 100, "jitter": "none"}"#;
    let chans = make_channels(&mut c, &sim, "ex", retry, &json!({}), &|ch| {
        sim.send_url(ch)
    });
    for (_, ch) in &chans {
        sim.set_default(ch, Action::Status(503));
    }
    let lanes = enqueue_all(&mut c, &chans, None);
    drop(c);
    let expect = |_| Expect {
        state: "exhausted",
        stored: 0,
        sends: 3,
        send_rows: 3,
        recovery_rows: 0,
        lookups: 0,
        ledger_by: None,
        outcomes: Some(vec!["status:503"; 3]),
    };
    let mut rows = settle_and_judge(&cluster, &sim, scenario, &lanes, &expect, &|_, o| {
        let mut bad = Vec::new();
        let reason = o.work_queue_reason.clone().unwrap_or_default();
        if !reason.contains("retry budget spent") {
            bad.push(format!("work_queue reason {reason:?}"));
        }
        let e = o.last_error.clone().unwrap_or_default();
        if !(e.contains("HTTP 503") && e.contains("3 of 3 attempts")) {
            bad.push(format!("last_error {e:?}"));
        }
        bad
    });
    for (r, lane) in rows.iter_mut().zip(&lanes) {
        let o = observe(&cluster, &sim, lane);
        r.local = format!(
            "{}: \"{}\"",
            r.local,
            o.work_queue_reason.unwrap_or_default()
        );
    }
    rows
}

// ---------------------------------------------------------------------------------------
// The matrix
// ---------------------------------------------------------------------------------------

#[test]
fn crash_matrix() {
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let started = Instant::now();
    let mut rows = Vec::new();
    println!(
        "| scenario | channel kind | provider: stored / sends | local state | attempts | same key | verdict |"
    );
    run(
        &mut rows,
        "(1) client dies before COMMIT — fault: crash_after_claim armed + pg_terminate_backend",
        |s| client_dies(s, ClientKill::FaultArmedTerminate),
    );
    run(
        &mut rows,
        "(1) client dies before COMMIT — real: kill -9 of the client backend",
        |s| client_dies(s, ClientKill::Kill9Backend),
    );
    run(
        &mut rows,
        "(1) client dies before COMMIT — real: pg_ctl stop -m immediate",
        |s| client_dies(s, ClientKill::ImmediateStop),
    );
    run(
        &mut rows,
        "(2) after claim, before send — fault: crash_after_claim",
        |s| fault_point(s, "crash_after_claim", &after_claim),
    );
    run(
        &mut rows,
        "(2) after claim, before send — real: kill -9 while the worker hangs in connect()",
        after_claim_kill9,
    );
    run(
        &mut rows,
        "(3) provider accepted, answer not read — fault: crash_after_send",
        |s| fault_point(s, "crash_after_send", &after_provider_has_it("accepted")),
    );
    run(
        &mut rows,
        "(3) provider accepted, answer not read — real: kill -9 while the provider holds the request",
        after_send_kill9,
    );
    run(
        &mut rows,
        "(4) answer read, record not committed — fault: crash_after_response",
        |s| {
            fault_point(
                s,
                "crash_after_response",
                &after_provider_has_it("accepted"),
            )
        },
    );
    run(
        &mut rows,
        "(4) answer read, record not committed — fault: crash_before_commit",
        |s| fault_point(s, "crash_before_commit", &after_provider_has_it("accepted")),
    );
    run(
        &mut rows,
        "(4) answer read, record not committed — real: pg_ctl stop -m immediate while the record waits on a row lock",
        before_commit_immediate_stop,
    );
    run(
        &mut rows,
        "network cut mid-send (read, stored, connection reset)",
        network_cut,
    );
    run(
        &mut rows,
        "Postgres crash-restart during backoff",
        restart_during_backoff,
    );
    run(
        &mut rows,
        "retry budget exhausted (503 on every attempt, max_attempts 3)",
        budget_exhausted,
    );

    let passed = rows.iter().filter(|r| r.pass).count();
    let summary = format!(
        "crash matrix: {passed} of {} rows pass ({:.0} s)",
        rows.len(),
        started.elapsed().as_secs_f64()
    );
    println!("\n{}\n{summary}", table(&rows));
    let doc = record_doc_region(
        "crash-matrix",
        &format!(
            "Produced by `{RUN_COMMAND}` (test `crash_matrix`), {}. {summary}.\n\n{}",
            run_header(&cluster),
            table(&rows)
        ),
        Claim::Exact,
    );
    let failed: Vec<String> = rows
        .iter()
        .filter(|r| !r.pass)
        .map(|r| format!("{} [{}]: {}", r.scenario, r.kind, r.verdict))
        .collect();
    assert!(failed.is_empty(), "failed rows:\n{}", failed.join("\n"));
    if let Err(diff) = doc {
        panic!("{diff}");
    }
}

// ---------------------------------------------------------------------------------------
// The soak
// ---------------------------------------------------------------------------------------

/// Enqueues `plan` in batches from its own thread, surviving server crashes: a batch whose
/// COMMIT failed is re-run with the same effect keys (enqueue of an existing key returns the
/// existing message), so every batch ends committed exactly once. Returns the committed keys
/// and how many batch runs had to be repeated.
fn spawn_enqueuer(
    conninfo: String,
    plan: Vec<(String, String)>,
    batch: usize,
    pause: Duration,
    done: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(Vec<String>, usize)> {
    std::thread::spawn(move || {
        let mut committed = Vec::with_capacity(plan.len());
        let mut repeats = 0;
        let mut client: Option<Client> = None;
        for chunk in plan.chunks(batch) {
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                if client.as_ref().is_none_or(|c| c.is_closed()) {
                    client = Client::connect(&conninfo, NoTls).ok();
                }
                let ok = match client.as_mut() {
                    Some(c) => (|| -> Result<(), postgres::Error> {
                        let mut tx = c.transaction()?;
                        for (ch, key) in chunk {
                            try_enqueue(&mut tx, ch, key)?;
                        }
                        tx.commit()
                    })()
                    .is_ok(),
                    None => false,
                };
                if ok {
                    break;
                }
                if client.is_some() {
                    repeats += 1;
                }
                client = None;
                assert!(
                    Instant::now() < deadline,
                    "a batch could not be committed within 120 s"
                );
                std::thread::sleep(Duration::from_millis(200));
            }
            committed.extend(chunk.iter().map(|(_, k)| k.clone()));
            std::thread::sleep(pause);
        }
        done.store(true, Ordering::Relaxed);
        (committed, repeats)
    })
}

#[derive(Debug, Default, Clone)]
struct SoakLane {
    committed: usize,
    delivered: usize,
    uncertain: usize,
    exhausted: usize,
    failed: usize,
    other: usize,
    missing: usize,
    no_reason: usize,
    sends: usize,
    stored: usize,
    duplicates: usize,
    delivered_not_held: usize,
    /// Uncertain messages the provider does hold (the rest it never received).
    uncertain_held: usize,
    key_mismatch_rows: i64,
    key_mismatch_provider: usize,
    send_rows: i64,
    recovery_rows: i64,
    lookup_rows: i64,
    ledger: i64,
}

#[test]
fn soak() {
    let full = std::env::var("OUTBOX_SOAK_FULL").as_deref() == Ok("1");
    let n: usize = if full { 10_000 } else { 1_000 };
    let (batch, pause) = if full {
        (125, Duration::from_millis(300))
    } else {
        (25, Duration::from_millis(400))
    };
    let cluster = Cluster::from_env();
    let mut workers = wait_for_workers(&cluster, &[]);
    let started = Instant::now();
    let sim = Simulator::start();
    let mut c = cluster.connect();
    let retry = r#"{"base_ms": 150, "max_ms": 2000, "max_attempts": 10}"#;
    let chans = make_channels(&mut c, &sim, "soak", retry, &json!({}), &|ch| {
        sim.send_url(ch)
    });
    let seed = 0x5eed_0000
        + (SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs()
            % 1000);
    for (i, (_, ch)) in chans.iter().enumerate() {
        sim.set_default(
            ch,
            Action::Random(RandomFaults {
                drop_after_read_store: 0.05,
                status_503: 0.05,
                status_429: 0.02,
                retry_after_s: 1,
                seed: seed + i as u64,
            }),
        );
    }
    drop(c);
    let tag = unique("soak");
    let plan: Vec<(String, String)> = (0..n)
        .map(|i| (chans[i % 3].1.clone(), format!("{tag}-{i}")))
        .collect();
    let kind_of_key: HashMap<String, Kind> = (0..n)
        .map(|i| (plan[i].1.clone(), chans[i % 3].0))
        .collect();

    // Chaos while the enqueuer runs and until the backlog is nearly drained: kill -9 of a
    // worker every few seconds (at least six; a worker with messages in flight when there is
    // one), and two immediate restarts (after the 2nd and the 5th kill).
    let names: Vec<String> = chans.iter().map(|(_, ch)| ch.clone()).collect();
    let backlog = |c: &mut Client| -> Result<i64, postgres::Error> {
        Ok(c.query_one(
            "SELECT count(*) FROM outbox.messages WHERE channel = ANY($1) AND state IN ('queued', 'sending')",
            &[&names],
        )?
        .get(0))
    };
    let done = Arc::new(AtomicBool::new(false));
    let enqueuer = spawn_enqueuer(cluster.conninfo(), plan.clone(), batch, pause, done.clone());
    let (mut kills, mut restarts, mut busy_kills) = (0usize, 0usize, 0usize);
    let chaos_cap = Duration::from_secs(if full { 300 } else { 120 });
    loop {
        std::thread::sleep(Duration::from_millis(2000));
        let finished = done.load(Ordering::Relaxed) || enqueuer.is_finished();
        let left = if finished {
            poll(&cluster, Duration::from_secs(30), |c| backlog(c).map(Some)).unwrap_or(0)
        } else {
            i64::MAX
        };
        let enough = kills >= 6 && restarts >= 2;
        if finished && enough && (left as usize <= n / 20 || started.elapsed() > chaos_cap) {
            break;
        }
        if (kills == 2 && restarts == 0) || (kills == 5 && restarts == 1) {
            cluster.crash_restart();
            restarts += 1;
        } else {
            let busy = poll(&cluster, Duration::from_millis(1500), |c| {
                Ok(c.query_opt(
                    "SELECT pid FROM outbox.worker_status() WHERE in_flight > 0 ORDER BY random() LIMIT 1",
                    &[],
                )?
                .and_then(|r| r.get::<_, Option<i32>>(0)))
            });
            let victim = busy.unwrap_or(workers[kills % workers.len()]);
            if kill_9(victim) {
                kills += 1;
                busy_kills += usize::from(busy.is_some());
            }
        }
        workers = wait_for_workers(&cluster, &workers);
    }
    let (committed, repeats) = enqueuer.join().expect("enqueuer");
    let chaos_s = started.elapsed().as_secs_f64();

    // Quiescence: nothing queued or in flight, no reconcile-channel message waiting for its
    // lookup; then one reconcile() pass, and quiescence again.
    let rc_name = chans[1].1.clone();
    let pending = |c: &mut Client| -> Result<i64, postgres::Error> {
        Ok(c.query_one(
            "SELECT count(*) FROM outbox.messages
              WHERE channel = ANY($1) AND (state IN ('queued', 'sending') OR (state = 'uncertain' AND channel = $2))",
            &[&names, &rc_name],
        )?
        .get(0))
    };
    let quiet_for = |secs: u64| {
        let mut zero_since: Option<Instant> = None;
        poll(
            &cluster,
            Duration::from_secs(if full { 600 } else { 180 }),
            |c| {
                if pending(c)? == 0 {
                    let z = *zero_since.get_or_insert_with(Instant::now);
                    Ok((z.elapsed() >= Duration::from_secs(secs)).then_some(()))
                } else {
                    zero_since = None;
                    Ok(None)
                }
            },
        )
        .is_some()
    };
    let quiet1 = quiet_for(3);
    let mut c = cluster.connect();
    let rec = c
        .query_one(
            "SELECT checked, delivered, not_found, unavailable FROM outbox.reconcile()",
            &[],
        )
        .expect("outbox.reconcile()");
    let reconcile_counts: (i32, i32, i32, i32) = (rec.get(0), rec.get(1), rec.get(2), rec.get(3));
    let quiet2 = quiet_for(2);
    let total_s = started.elapsed().as_secs_f64();

    // The local view.
    let committed_set: HashSet<String> = committed.iter().cloned().collect();
    let mut table_keys: HashMap<String, (String, Option<String>)> = HashMap::new();
    for r in c
        .query(
            "SELECT m.effect_key, m.state::text, w.reason FROM outbox.messages m
               LEFT JOIN outbox.work_queue w ON w.id = m.id WHERE m.channel = ANY($1)",
            &[&names],
        )
        .unwrap()
    {
        table_keys.insert(r.get(0), (r.get(1), r.get(2)));
    }
    let mut lanes: BTreeMap<Kind, SoakLane> =
        KINDS.iter().map(|k| (*k, SoakLane::default())).collect();
    let mut extra_rows = 0usize;
    for key in table_keys.keys() {
        if !committed_set.contains(key) {
            extra_rows += 1;
        }
    }
    for key in &committed_set {
        let l = lanes.get_mut(&kind_of_key[key]).unwrap();
        l.committed += 1;
        match table_keys.get(key) {
            None => l.missing += 1,
            Some((state, reason)) => {
                match state.as_str() {
                    "delivered" => l.delivered += 1,
                    "uncertain" => l.uncertain += 1,
                    "exhausted" => l.exhausted += 1,
                    "failed" => l.failed += 1,
                    _ => l.other += 1,
                }
                if state != "delivered" && reason.as_deref().is_none_or(str::is_empty) {
                    l.no_reason += 1;
                }
            }
        }
    }
    for r in c
        .query(
            "SELECT m.channel, a.kind, count(*),
                    count(*) FILTER (WHERE a.effect_key_sent IS DISTINCT FROM m.effect_key)
               FROM outbox.attempts a JOIN outbox.messages m ON m.id = a.message_id
              WHERE m.channel = ANY($1) GROUP BY 1, 2",
            &[&names],
        )
        .unwrap()
    {
        let ch: String = r.get(0);
        let kind = chans.iter().find(|(_, c)| *c == ch).unwrap().0;
        let l = lanes.get_mut(&kind).unwrap();
        let (k, n, bad): (String, i64, i64) = (r.get(1), r.get(2), r.get(3));
        match k.as_str() {
            "send" => l.send_rows += n,
            "recovery" => l.recovery_rows += n,
            _ => l.lookup_rows += n,
        }
        l.key_mismatch_rows += bad;
    }
    for r in c
        .query(
            "SELECT m.channel, count(*) FROM outbox.ledger l JOIN outbox.messages m ON m.id = l.message_id
              WHERE m.channel = ANY($1) GROUP BY 1",
            &[&names],
        )
        .unwrap()
    {
        let ch: String = r.get(0);
        let kind = chans.iter().find(|(_, c)| *c == ch).unwrap().0;
        lanes.get_mut(&kind).unwrap().ledger = r.get(1);
    }

    // The provider's view.
    for (kind, ch) in &chans {
        let l = lanes.get_mut(kind).unwrap();
        let sends = sim.sends(ch);
        l.sends = sends.len();
        l.key_mismatch_provider = sends
            .iter()
            .filter(|r| {
                let k = provider_key(*kind, r);
                k.is_none()
                    || k != body_key(&r.body)
                    || !committed_set.contains(k.as_deref().unwrap_or(""))
            })
            .count();
        let stored = sim.stored(ch);
        l.stored = stored.len();
        let mut per_key: HashMap<String, usize> = HashMap::new();
        for s in &stored {
            let k = match kind {
                Kind::Neither => body_key(&s.body),
                _ => s.key.clone(),
            }
            .unwrap_or_default();
            *per_key.entry(k).or_default() += 1;
        }
        l.duplicates = per_key.values().filter(|n| **n > 1).count();
        l.uncertain_held = table_keys
            .iter()
            .filter(|(k, (s, _))| s == "uncertain" && kind_of_key.get(*k) == Some(kind))
            .filter(|(k, _)| per_key.get(*k).copied().unwrap_or(0) == 1)
            .count();
        l.delivered_not_held = table_keys
            .iter()
            .filter(|(k, (s, _))| s == "delivered" && kind_of_key.get(*k) == Some(kind))
            .filter(|(k, _)| per_key.get(*k).copied().unwrap_or(0) != 1)
            .count();
    }

    // Report.
    let scenario = format!(
        "soak: {n} messages, random faults (5% drop after store, 5% 503, 2% 429), {kills} × kill -9, {restarts} × pg_ctl stop -m immediate"
    );
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for (kind, l) in &lanes {
        let mut bad = Vec::new();
        if l.missing > 0 || l.other > 0 || l.no_reason > 0 {
            bad.push(format!(
                "lost: {} missing, {} not settled, {} without a work_queue reason",
                l.missing, l.other, l.no_reason
            ));
        }
        if l.duplicates > 0 {
            bad.push(format!(
                "{} effect keys stored more than once",
                l.duplicates
            ));
        }
        if l.delivered_not_held > 0 {
            bad.push(format!(
                "{} delivered messages the provider does not hold exactly once",
                l.delivered_not_held
            ));
        }
        if l.key_mismatch_rows > 0 || l.key_mismatch_provider > 0 {
            bad.push(format!(
                "key mismatches: {} attempt rows, {} provider requests",
                l.key_mismatch_rows, l.key_mismatch_provider
            ));
        }
        if l.ledger != l.delivered as i64 {
            bad.push(format!(
                "{} ledger entries for {} delivered",
                l.ledger, l.delivered
            ));
        }
        let pass = bad.is_empty();
        let verdict = if pass {
            match kind {
                Kind::Neither => format!(
                    "PASS: 0 lost, 0 duplicates; {} ambiguous jobs wait in uncertain (limit: never resent, an operator decides)",
                    l.uncertain
                ),
                _ => "PASS: 0 lost, 0 duplicates".to_string(),
            }
        } else {
            failures.push(format!("{}: {}", kind.label(), bad.join("; ")));
            format!("FAIL: {}", bad.join("; "))
        };
        rows.push(Row {
            scenario: scenario.clone(),
            kind: kind.label().to_string(),
            provider: format!(
                "{} stored / {} sends; {} keys stored twice",
                l.stored, l.sends, l.duplicates
            ),
            local: format!(
                "{} committed: {} delivered, {} uncertain ({} of them held by the provider), {} exhausted, {} failed, {} missing",
                l.committed, l.delivered, l.uncertain, l.uncertain_held, l.exhausted, l.failed, l.missing
            ),
            attempts: format!(
                "{} send, {} recovery, {} lookup rows",
                l.send_rows, l.recovery_rows, l.lookup_rows
            ),
            same_key: if l.key_mismatch_rows == 0 && l.key_mismatch_provider == 0 {
                "yes"
            } else {
                "no"
            }
            .into(),
            verdict,
            pass,
        });
    }
    if extra_rows > 0 {
        failures.push(format!("{extra_rows} messages nobody committed"));
    }
    if !(quiet1 && quiet2) {
        failures.push("the run did not become quiet".into());
    }
    if kills < 6 || restarts != 2 {
        failures.push(format!(
            "chaos too small: {kills} kills, {restarts} restarts"
        ));
    }
    let figures = format!(
        "soak: {n} messages in {} batches ({repeats} batch runs repeated after a crash), {kills} × kill -9 of a worker ({busy_kills} of them with messages in flight), {restarts} × pg_ctl stop -m immediate; \
         chaos {chaos_s:.0} s, total {total_s:.0} s; reconcile() once: checked {}, delivered {}, not_found {}, unavailable {}; \
         simulator counters {:?}",
        n.div_ceil(batch),
        reconcile_counts.0,
        reconcile_counts.1,
        reconcile_counts.2,
        reconcile_counts.3,
        sim.counters()
    );
    println!("\n{}\n{figures}", table(&rows));
    for (kind, l) in &lanes {
        println!("soak {}: {l:?}", kind.label());
    }
    let doc = record_doc_region(
        "soak",
        &format!(
            "Produced by `{}{RUN_COMMAND}` (test `soak`; `OUTBOX_SOAK_FULL=1` for 10,000 messages), {}.\n\n{}\n{figures}\n\n",
            if full { "OUTBOX_SOAK_FULL=1 " } else { "" },
            run_header(&cluster),
            table(&rows)
        ),
        Claim::FiguresMasked,
    );
    assert!(failures.is_empty(), "soak failed:\n{}", failures.join("\n"));
    if let Err(diff) = doc {
        panic!("{diff}");
    }
}
