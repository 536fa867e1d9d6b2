//! End-to-end tests of the foundation: a message exists if and only if its transaction
//! commits, the unique effect key under concurrency, DROP/CREATE EXTENSION, pg_dump and
//! pg_restore, a cluster without the preload, and the wake at COMMIT.
//!
//! Every test drives the real cluster of `scripts/cluster.sh` (`OUTBOX_BASE`,
//! `OUTBOX_PGPORT`) over normal client connections, with its own channel and its own
//! provider simulator. Run with `--test-threads=1`.

use outbox_e2e::cluster::{state_of, unique, wait_for_state, wait_until, Cluster};
use outbox_e2e::helpers::{
    cluster_and_sim, count, create_channel, enqueue, one, sim_channel, try_enqueue,
};
use outbox_e2e::sim::Simulator;
use postgres::error::DbError;
use postgres::{Client, Config, GenericClient, NoTls};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

// The tests, by area (numbered as in the sections).
mod extension;
mod transactions;
mod wake;

const PGBIN: &str = "/usr/lib/postgresql/15/bin";
/// Generous timeout for a delivery that should take milliseconds.
const DELIVERY: Duration = Duration::from_secs(30);
/// The options of the channels of this file: the provider gets the effect key and answers
/// the external id in its body.
const OPTIONS: &str = r#"{"idempotency_header": "Idempotency-Key", "external_id": "/id"}"#;
// ---------------------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------------------

fn messages_with_key(c: &mut impl GenericClient, key: &str) -> i64 {
    count(
        c,
        "SELECT count(*) FROM outbox.messages WHERE effect_key = $1",
        &[&key],
    )
}

fn status(c: &mut impl GenericClient, id: i64) -> Option<String> {
    c.query_one("SELECT outbox.status($1)::text", &[&id])
        .expect("outbox.status")
        .get(0)
}

/// The keys of the messages the provider stored on `channel`, in storing order.
fn stored_keys(sim: &Simulator, channel: &str) -> Vec<Option<String>> {
    sim.stored(channel).into_iter().map(|s| s.key).collect()
}

/// The keys of the sends the provider received on `channel`, in order.
fn sent_keys(sim: &Simulator, channel: &str) -> Vec<Option<String>> {
    sim.sends(channel).into_iter().map(|s| s.key).collect()
}

/// Connection string of `cluster` with another database.
fn conninfo_for(cluster: &Cluster, db: &str) -> String {
    format!(
        "host={} port={} user=postgres dbname={db} connect_timeout=5 application_name=outbox_e2e",
        cluster.base.join("sock").display(),
        cluster.port
    )
}

type Notices = Arc<Mutex<Vec<DbError>>>;

/// A connection that keeps every notice (NOTICE, WARNING, ...) the server sends it.
fn connect_collecting(conninfo: &str) -> (Client, Notices) {
    let notices: Notices = Arc::new(Mutex::new(Vec::new()));
    let sink = notices.clone();
    let mut config: Config = conninfo.parse().expect("conninfo");
    config.notice_callback(move |n| sink.lock().unwrap().push(n));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match config.connect(NoTls) {
            Ok(c) => return (c, notices),
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("cannot connect ({conninfo}): {e}"),
        }
    }
}

fn take_notices(n: &Notices) -> Vec<DbError> {
    std::mem::take(&mut *n.lock().unwrap())
}

fn describe_notices(notices: &[DbError]) -> Vec<String> {
    notices
        .iter()
        .map(|n| format!("{}: {} (hint: {:?})", n.severity(), n.message(), n.hint()))
        .collect()
}

/// Runs a command, panicking with its output when it fails; returns stdout + stderr.
fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{text}",
        out.status
    );
    text
}

/// `last_loop_at` of every worker, as exact text: it changes whenever a worker runs a cycle.
fn worker_loops(c: &mut Client) -> Vec<Option<String>> {
    c.query(
        "SELECT last_loop_at::text FROM outbox.worker_status() ORDER BY worker",
        &[],
    )
    .expect("worker_status")
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// Waits until no worker has run a cycle for `quiet`; returns the loop marks then.
fn wait_for_quiet_workers(c: &mut Client, quiet: Duration) -> Vec<Option<String>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = worker_loops(c);
    let mut since = Instant::now();
    loop {
        thread::sleep(Duration::from_millis(100));
        let now = worker_loops(c);
        if now != last {
            last = now;
            since = Instant::now();
        } else if since.elapsed() >= quiet {
            return last;
        }
        assert!(
            Instant::now() < deadline,
            "the workers kept running cycles for 30 s with outbox.poll_interval_ms = 60000: {last:?}"
        );
    }
}
