//! End-to-end tests of the foundation: a message exists if and only if its transaction
//! commits, the unique effect key under concurrency, DROP/CREATE EXTENSION, pg_dump and
//! pg_restore, a cluster without the preload, and the wake at COMMIT.
//!
//! Every test drives the real cluster of `scripts/cluster.sh` (`OUTBOX_BASE`,
//! `OUTBOX_PGPORT`) over normal client connections, with its own channel and its own
//! provider simulator. Run with `--test-threads=1`.

use outbox_e2e::cluster::{state_of, unique, wait_for_state, wait_until, Cluster};
use outbox_e2e::helpers::{count, create_channel, enqueue, try_enqueue};
use outbox_e2e::sim::Simulator;
use postgres::error::DbError;
use postgres::{Client, Config, GenericClient, NoTls};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

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

// ---------------------------------------------------------------------------------------
// 1. rollback
// ---------------------------------------------------------------------------------------

#[test]
fn enqueue_in_rolled_back_transaction_leaves_nothing() {
    let cluster = Cluster::from_env();
    let sim = Simulator::start();
    let ch = unique("fnd_rollback");
    let mut c = cluster.connect();
    create_channel(&mut c, &ch, &sim.send_url(&ch), OPTIONS);

    let key = unique("rolled_back");
    let mut tx = c.transaction().unwrap();
    let id = enqueue(&mut tx, &ch, &key);
    assert!(id > 0, "enqueue returned {id}");
    assert_eq!(
        messages_with_key(&mut tx, &key),
        1,
        "the enqueuing transaction sees its own message"
    );
    tx.rollback().unwrap();

    assert_eq!(
        messages_with_key(&mut c, &key),
        0,
        "message row after ROLLBACK"
    );
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.messages WHERE id = $1",
            &[&id]
        ),
        0
    );
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.messages WHERE channel = $1",
            &[&ch]
        ),
        0
    );
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.attempts WHERE message_id = $1",
            &[&id]
        ),
        0,
        "attempts of a rolled-back message"
    );
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.ledger WHERE effect_key = $1",
            &[&key]
        ),
        0,
        "ledger entry of a rolled-back message"
    );
    assert_eq!(
        status(&mut c, id),
        None,
        "status() of an id that never committed"
    );

    assert!(
        !sim.wait_for_sends(&ch, 1, Duration::from_secs(2)),
        "the provider received a rolled-back message: {:?}",
        sim.sends(&ch)
    );
    assert_eq!(sim.send_count(&ch), 0);

    // The control: a committed message on the same channel is delivered, and it alone.
    let key2 = unique("committed");
    let id2 = enqueue(&mut c, &ch, &key2);
    assert_ne!(id2, id);
    assert!(
        wait_for_state(&cluster, id2, "delivered", DELIVERY),
        "committed control message not delivered: {:?}",
        state_of(&cluster, id2)
    );
    assert_eq!(stored_keys(&sim, &ch), vec![Some(key2.clone())]);
    assert!(!sim.wait_for_sends(&ch, 2, Duration::from_millis(500)));
    assert_eq!(sent_keys(&sim, &ch), vec![Some(key2)]);
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.attempts WHERE message_id = $1",
            &[&id]
        ),
        0
    );
    assert_eq!(status(&mut c, id), None);
}

// ---------------------------------------------------------------------------------------
// 2. visibility before COMMIT
// ---------------------------------------------------------------------------------------

#[test]
fn uncommitted_message_is_invisible_and_unsent_until_commit() {
    let cluster = Cluster::from_env();
    let sim = Simulator::start();
    let ch = unique("fnd_visibility");
    let mut a = cluster.connect();
    let mut b = cluster.connect();
    create_channel(&mut a, &ch, &sim.send_url(&ch), OPTIONS);

    let key = unique("uncommitted");
    let mut tx = a.transaction().unwrap();
    let id = enqueue(&mut tx, &ch, &key);
    assert_eq!(messages_with_key(&mut tx, &key), 1);

    assert_eq!(
        messages_with_key(&mut b, &key),
        0,
        "another session sees an uncommitted message"
    );
    assert_eq!(status(&mut b, id), None);
    // Three poll intervals of the worker: it looked and found nothing it may send.
    assert!(
        !sim.wait_for_sends(&ch, 1, Duration::from_millis(1500)),
        "sent before COMMIT: {:?}",
        sim.sends(&ch)
    );
    assert_eq!(messages_with_key(&mut b, &key), 0);
    assert_eq!(
        count(
            &mut b,
            "SELECT count(*) FROM outbox.attempts WHERE message_id = $1",
            &[&id]
        ),
        0
    );

    tx.commit().unwrap();
    assert_eq!(
        messages_with_key(&mut b, &key),
        1,
        "another session sees the committed message"
    );
    assert!(
        wait_for_state(&cluster, id, "delivered", DELIVERY),
        "not delivered after COMMIT: {:?}",
        state_of(&cluster, id)
    );
    assert!(sim.wait_for_stored(&ch, 1, Duration::from_secs(5)));
    assert_eq!(stored_keys(&sim, &ch), vec![Some(key.clone())]);
    assert_eq!(sim.send_count(&ch), 1);
    assert_eq!(
        count(
            &mut b,
            "SELECT count(*) FROM outbox.ledger WHERE effect_key = $1 AND message_id = $2",
            &[&key, &id]
        ),
        1
    );
}

// ---------------------------------------------------------------------------------------
// 3. the same effect key from two sessions at once
// ---------------------------------------------------------------------------------------

/// What the second session got: its enqueue's result, its COMMIT's result, its notices.
struct SecondSession {
    enqueue: Result<i64, String>,
    commit: Result<(), String>,
    notices: Vec<DbError>,
}

/// Session A enqueues `key` and keeps its transaction open; session B (another thread)
/// enqueues the same key and must block on the unique index until A ends. `a_commits`
/// decides how A ends. Returns (A's id, what B got).
fn race_same_key(cluster: &Cluster, ch: &str, key: &str, a_commits: bool) -> (i64, SecondSession) {
    let mut a = cluster.connect();
    let mut watcher = cluster.connect();
    let (mut b, b_notices) = connect_collecting(&cluster.conninfo());
    let a_pid: i32 = a.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    let b_pid: i32 = b.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);

    let mut tx = a.transaction().unwrap();
    let id_a = enqueue(&mut tx, ch, key);

    let (ch_b, key_b) = (ch.to_string(), key.to_string());
    let second = thread::spawn(move || {
        let mut tx = b.transaction().expect("BEGIN in session B");
        let enqueue = try_enqueue(&mut tx, &ch_b, &key_b).map_err(|e| e.to_string());
        let commit = if enqueue.is_ok() {
            tx.commit().map_err(|e| e.to_string())
        } else {
            let _ = tx.rollback();
            Err("not committed: enqueue failed".to_string())
        };
        SecondSession {
            enqueue,
            commit,
            notices: take_notices(&b_notices),
        }
    });

    // B must be waiting for A's transaction (the unique index), not finished.
    let blocked = wait_until(Duration::from_secs(20), || {
        watcher
            .query_one(
                "SELECT $1::int4 = ANY (pg_blocking_pids($2::int4))",
                &[&a_pid, &b_pid],
            )
            .map(|r| r.get::<_, bool>(0))
            .unwrap_or(false)
    });
    assert!(
        blocked,
        "session B's enqueue of the same key did not block on session A's open transaction (finished: {})",
        second.is_finished()
    );
    let wait_event: Option<String> = watcher
        .query_one(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1",
            &[&b_pid],
        )
        .unwrap()
        .get(0);
    assert_eq!(wait_event.as_deref(), Some("Lock"));
    assert!(
        !second.is_finished(),
        "session B did not wait for session A"
    );
    // While A is open, nobody else sees a row with this key.
    assert_eq!(messages_with_key(&mut watcher, key), 0);

    if a_commits {
        tx.commit().expect("COMMIT in session A");
    } else {
        tx.rollback().expect("ROLLBACK in session A");
    }
    let got = second.join().expect("session B thread panicked");
    (id_a, got)
}

#[test]
fn concurrent_enqueue_of_same_key_first_commits_both_get_same_id() {
    let cluster = Cluster::from_env();
    let sim = Simulator::start();
    let ch = unique("fnd_race_commit");
    let mut c = cluster.connect();
    create_channel(&mut c, &ch, &sim.send_url(&ch), OPTIONS);
    let key = unique("race_commit");

    let (id_a, b) = race_same_key(&cluster, &ch, &key, true);
    let id_b = b.enqueue.clone().expect("session B's enqueue failed");
    assert_eq!(b.commit, Ok(()), "session B's COMMIT");
    assert_eq!(id_b, id_a, "both sessions must get the same message id");
    assert!(
        b.notices.is_empty(),
        "session B got notices for an identical payload: {:?}",
        describe_notices(&b.notices)
    );

    assert_eq!(
        messages_with_key(&mut c, &key),
        1,
        "exactly one row for the key"
    );
    let row_id: i64 = c
        .query_one(
            "SELECT id FROM outbox.messages WHERE effect_key = $1",
            &[&key],
        )
        .unwrap()
        .get(0);
    assert_eq!(row_id, id_a);

    assert!(
        wait_for_state(&cluster, id_a, "delivered", DELIVERY),
        "not delivered: {:?}",
        state_of(&cluster, id_a)
    );
    assert!(!sim.wait_for_sends(&ch, 2, Duration::from_secs(1)));
    assert_eq!(sent_keys(&sim, &ch), vec![Some(key.clone())]);
    assert_eq!(stored_keys(&sim, &ch), vec![Some(key.clone())]);
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.ledger WHERE effect_key = $1",
            &[&key]
        ),
        1
    );
}

#[test]
fn concurrent_enqueue_of_same_key_first_rolls_back_second_gets_fresh_id() {
    let cluster = Cluster::from_env();
    let sim = Simulator::start();
    let ch = unique("fnd_race_rollback");
    let mut c = cluster.connect();
    create_channel(&mut c, &ch, &sim.send_url(&ch), OPTIONS);
    let key = unique("race_rollback");

    let (id_a, b) = race_same_key(&cluster, &ch, &key, false);
    let id_b = b.enqueue.clone().expect("session B's enqueue failed");
    assert_eq!(b.commit, Ok(()), "session B's COMMIT");
    assert_ne!(
        id_b, id_a,
        "session B must get a fresh id after A rolled back"
    );
    assert!(
        b.notices.is_empty(),
        "session B got notices: {:?}",
        describe_notices(&b.notices)
    );

    assert_eq!(
        messages_with_key(&mut c, &key),
        1,
        "exactly one row for the key"
    );
    let row_id: i64 = c
        .query_one(
            "SELECT id FROM outbox.messages WHERE effect_key = $1",
            &[&key],
        )
        .unwrap()
        .get(0);
    assert_eq!(row_id, id_b);
    assert_eq!(
        status(&mut c, id_a),
        None,
        "A's rolled-back id never existed"
    );

    assert!(
        wait_for_state(&cluster, id_b, "delivered", DELIVERY),
        "not delivered: {:?}",
        state_of(&cluster, id_b)
    );
    assert!(!sim.wait_for_sends(&ch, 2, Duration::from_secs(1)));
    assert_eq!(sent_keys(&sim, &ch), vec![Some(key.clone())]);
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.ledger WHERE effect_key = $1 AND message_id = $2",
            &[&key, &id_b]
        ),
        1
    );
}

// ---------------------------------------------------------------------------------------
// 4. DROP EXTENSION / CREATE EXTENSION
// ---------------------------------------------------------------------------------------

/// Whatever happens, the extension is there again at the end.
struct ExtensionBack<'a>(&'a Cluster);

impl Drop for ExtensionBack<'_> {
    fn drop(&mut self) {
        let mut c = self.0.connect();
        if let Err(e) = c.batch_execute("CREATE EXTENSION IF NOT EXISTS outbox_delivery") {
            eprintln!("could not recreate the extension: {e}");
        }
    }
}

/// Creates a channel, enqueues one message and waits until the provider has it.
fn deliver_one(cluster: &Cluster, sim: &Simulator, prefix: &str) -> i64 {
    let mut c = cluster.connect();
    let ch = unique(prefix);
    create_channel(&mut c, &ch, &sim.send_url(&ch), OPTIONS);
    let key = unique("drop_create");
    let id = enqueue(&mut c, &ch, &key);
    assert!(
        wait_for_state(cluster, id, "delivered", DELIVERY),
        "message {id} on {ch} not delivered: {:?}; see {}",
        state_of(cluster, id),
        cluster.log_path().display()
    );
    assert_eq!(stored_keys(sim, &ch), vec![Some(key)]);
    id
}

fn extension_installed(c: &mut Client) -> bool {
    count(
        c,
        "SELECT count(*) FROM pg_extension WHERE extname = 'outbox_delivery'",
        &[],
    ) == 1
}

#[test]
fn drop_and_create_extension_again_then_worker_delivers_again() {
    let cluster = Cluster::from_env();
    let _back = ExtensionBack(&cluster);
    let sim = Simulator::start();
    let mut c = cluster.connect();

    let before = deliver_one(&cluster, &sim, "fnd_before_drop");

    // Round 1: drop, let the worker notice (it waits for the extension), create again.
    let mark = cluster.log_mark();
    c.batch_execute("DROP EXTENSION outbox_delivery")
        .expect("DROP EXTENSION");
    assert!(!extension_installed(&mut c));
    let leftovers: (Option<String>, Option<String>) = {
        let r = c
            .query_one(
                "SELECT to_regclass('outbox._messages')::text, \
                        to_regprocedure('outbox.enqueue(text,jsonb,text,text,timestamptz,jsonb)')::text",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(leftovers, (None, None), "objects left after DROP EXTENSION");
    assert!(
        wait_until(Duration::from_secs(30), || cluster
            .log_since(mark)
            .contains("is not created in")),
        "no worker reported waiting for the extension after DROP EXTENSION; log:\n{}",
        cluster.log_since(mark)
    );

    c.batch_execute("CREATE EXTENSION outbox_delivery")
        .expect("CREATE EXTENSION after DROP");
    assert!(extension_installed(&mut c));
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM outbox.messages", &[]),
        0,
        "a recreated extension starts empty"
    );
    assert_eq!(status(&mut c, before), None);
    cluster.wait_for_worker();
    deliver_one(&cluster, &sim, "fnd_after_create");

    // Round 2: drop and create back to back, before the worker can notice.
    c.batch_execute("DROP EXTENSION outbox_delivery")
        .expect("second DROP EXTENSION");
    c.batch_execute("CREATE EXTENSION outbox_delivery")
        .expect("second CREATE EXTENSION");
    assert!(extension_installed(&mut c));
    deliver_one(&cluster, &sim, "fnd_after_quick_recreate");
    cluster.wait_for_worker();
}

// ---------------------------------------------------------------------------------------
// 5. pg_dump / pg_restore
// ---------------------------------------------------------------------------------------

/// Drops the restored database and removes the dump file, whatever happens.
struct RestoredDb<'a> {
    cluster: &'a Cluster,
    db: String,
    file: PathBuf,
}

impl Drop for RestoredDb<'_> {
    fn drop(&mut self) {
        let mut c = self.cluster.connect();
        if let Err(e) =
            c.batch_execute(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.db))
        {
            eprintln!("could not drop database {}: {e}", self.db);
        }
        let _ = std::fs::remove_file(&self.file);
    }
}

fn runuser_postgres(bin: &str) -> Command {
    let mut cmd = Command::new("runuser");
    cmd.args(["-u", "postgres", "--"])
        .arg(Path::new(PGBIN).join(bin));
    cmd
}

#[test]
fn pg_dump_and_restore_keep_channels_messages_and_ledger() {
    let cluster = Cluster::from_env();
    let sim = Simulator::start();
    let ch = unique("fnd_dump");
    let mut c = cluster.connect();
    let options = r#"{"headers": {"Authorization": "Bearer s3cret-token"},
                      "idempotency_header": "Idempotency-Key",
                      "idempotency_window_ms": 3600000,
                      "external_id": "/id",
                      "timeout_ms": 4000,
                      "retry": {"max_attempts": 3, "base_ms": 250}}"#;
    create_channel(&mut c, &ch, &sim.send_url(&ch), options);
    let key = unique("dumped");
    let id = enqueue(&mut c, &ch, &key);
    assert!(
        wait_for_state(&cluster, id, "delivered", DELIVERY),
        "not delivered: {:?}",
        state_of(&cluster, id)
    );
    let external_id = sim.stored(&ch)[0].external_id.clone();

    // What the source database holds.
    let channel_sql = "SELECT id, endpoint, options::text, paused, \
                              options -> 'retry' ->> 'max_attempts', options ->> 'timeout_ms', \
                              options ->> 'idempotency_header' \
                         FROM outbox.channels WHERE name = $1";
    let raw_options_sql = "SELECT options::text, options -> 'headers' ->> 'Authorization' \
                             FROM outbox._channels WHERE name = $1";
    let message_sql =
        "SELECT channel, state::text, effect_key, external_id, attempts, payload::text \
                         FROM outbox.messages WHERE id = $1";
    let ledger_sql = "SELECT effect_key, external_id, recorded_by, tenant \
                        FROM outbox.ledger WHERE message_id = $1";
    type ChannelRow = (
        i32,
        String,
        String,
        bool,
        Option<String>,
        Option<String>,
        Option<String>,
    );
    type MessageRow = (String, String, String, Option<String>, i32, String);
    type LedgerRow = (String, Option<String>, String, String);
    let read_channel = |c: &mut Client| -> ChannelRow {
        let r = c.query_one(channel_sql, &[&ch]).expect("channel row");
        (
            r.get(0),
            r.get(1),
            r.get(2),
            r.get(3),
            r.get(4),
            r.get(5),
            r.get(6),
        )
    };
    let read_raw_options = |c: &mut Client| -> (String, Option<String>) {
        let r = c
            .query_one(raw_options_sql, &[&ch])
            .expect("raw channel row");
        (r.get(0), r.get(1))
    };
    let read_message = |c: &mut Client| -> MessageRow {
        let r = c.query_one(message_sql, &[&id]).expect("message row");
        (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5))
    };
    let read_ledger = |c: &mut Client| -> Vec<LedgerRow> {
        c.query(ledger_sql, &[&id])
            .expect("ledger rows")
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
            .collect()
    };
    let attempts_sql = "SELECT count(*) FROM outbox.attempts WHERE message_id = $1";

    let channel = read_channel(&mut c);
    assert_eq!(channel.4.as_deref(), Some("3"));
    assert_eq!(channel.5.as_deref(), Some("4000"));
    assert_eq!(channel.6.as_deref(), Some("Idempotency-Key"));
    let raw_options = read_raw_options(&mut c);
    assert_eq!(raw_options.1.as_deref(), Some("Bearer s3cret-token"));
    let message = read_message(&mut c);
    assert_eq!(message.0, ch);
    assert_eq!(message.1, "delivered");
    assert_eq!(message.2, key);
    assert_eq!(message.3.as_deref(), Some(external_id.as_str()));
    let ledger = read_ledger(&mut c);
    assert_eq!(
        ledger,
        vec![(
            key.clone(),
            Some(external_id.clone()),
            "worker".to_string(),
            "default".to_string()
        )]
    );
    let attempts = count(&mut c, attempts_sql, &[&id]);
    assert_eq!(attempts, 1);

    // Dump, create a database, restore into it.
    let db = unique("fnd_restore");
    let guard = RestoredDb {
        cluster: &cluster,
        db: db.clone(),
        file: cluster.base.join(format!("{db}.dump")),
    };
    let sock = cluster.base.join("sock");
    let port = cluster.port.to_string();
    run(runuser_postgres("pg_dump")
        .arg("-h")
        .arg(&sock)
        .args(["-p", &port, "-d", &cluster.db, "-Fc", "-f"])
        .arg(&guard.file));
    assert!(
        std::fs::metadata(&guard.file).map(|m| m.len()).unwrap_or(0) > 0,
        "empty dump"
    );
    c.batch_execute(&format!("CREATE DATABASE {db}"))
        .expect("CREATE DATABASE");
    let restore_out = run(runuser_postgres("pg_restore")
        .arg("-h")
        .arg(&sock)
        .args(["-p", &port, "-d", &db, "--exit-on-error"])
        .arg(&guard.file));
    assert!(
        !restore_out.contains("error"),
        "pg_restore reported errors:\n{restore_out}"
    );

    let mut r =
        Client::connect(&conninfo_for(&cluster, &db), NoTls).expect("connect to restored db");
    assert!(extension_installed(&mut r), "extension not restored");
    assert_eq!(read_channel(&mut r), channel, "channel after restore");
    assert_eq!(
        read_raw_options(&mut r),
        raw_options,
        "channel options (with secrets) after restore"
    );
    assert_eq!(read_message(&mut r), message, "message after restore");
    assert_eq!(read_ledger(&mut r), ledger, "ledger after restore");
    assert_eq!(
        count(&mut r, attempts_sql, &[&id]),
        attempts,
        "attempts after restore"
    );
    assert_eq!(status(&mut r, id).as_deref(), Some("delivered"));
    // The sequences came along: a new message does not collide with a restored id.
    let new_id = enqueue(&mut r, &ch, &unique("after_restore"));
    assert!(
        new_id > id,
        "new id {new_id} after restore is not above restored id {id}"
    );
    // The same key is still the same message there.
    assert_eq!(enqueue(&mut r, &ch, &key), id);
    drop(r);
    drop(guard);

    let mut c = cluster.connect();
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM pg_database WHERE datname = $1",
            &[&db]
        ),
        0,
        "restored database not dropped"
    );
    // The worker serves the source database only: the restored copy sent nothing again.
    assert_eq!(sim.send_count(&ch), 1);
}

// ---------------------------------------------------------------------------------------
// 6. a cluster without the preload
// ---------------------------------------------------------------------------------------

const NOPRELOAD_BASE: &str = "/tmp/outbox_h1_nopreload";
const NOPRELOAD_PORT: u16 = 54831;

fn nopreload_script(cluster: &Cluster, action: &str) -> String {
    run(Command::new("bash")
        .arg(&cluster.script)
        .arg(action)
        .env("OUTBOX_BASE", NOPRELOAD_BASE)
        .env("OUTBOX_PGPORT", NOPRELOAD_PORT.to_string())
        .env("OUTBOX_DB", &cluster.db)
        .env("OUTBOX_EXTRA_CONF", "shared_preload_libraries = ''"))
}

/// Destroys the throwaway cluster, whatever happens.
struct Destroy<'a>(&'a Cluster);

impl Drop for Destroy<'_> {
    fn drop(&mut self) {
        let status = Command::new("bash")
            .arg(&self.0.script)
            .arg("destroy")
            .env("OUTBOX_BASE", NOPRELOAD_BASE)
            .env("OUTBOX_PGPORT", NOPRELOAD_PORT.to_string())
            .output()
            .map(|o| o.status);
        if !matches!(status, Ok(s) if s.success()) {
            eprintln!("could not destroy the cluster at {NOPRELOAD_BASE}: {status:?}");
        }
    }
}

fn not_preloaded_warnings(notices: &[DbError]) -> Vec<&DbError> {
    notices
        .iter()
        .filter(|n| n.severity() == "WARNING" && n.message().contains("no worker will deliver"))
        .collect()
}

#[test]
fn without_preload_create_extension_warns_and_enqueue_still_queues() {
    let main = Cluster::from_env();
    let cluster = Cluster {
        base: PathBuf::from(NOPRELOAD_BASE),
        port: NOPRELOAD_PORT,
        db: main.db.clone(),
        script: main.script.clone(),
    };
    let _destroy = Destroy(&cluster);
    nopreload_script(&cluster, "destroy");
    nopreload_script(&cluster, "start");

    let sim = Simulator::start();
    let (mut c, notices) = connect_collecting(&cluster.conninfo());
    let preload: String = c
        .query_one("SHOW shared_preload_libraries", &[])
        .unwrap()
        .get(0);
    assert_eq!(
        preload, "",
        "the throwaway cluster must run without the preload"
    );
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'outbox_delivery worker'",
            &[]
        ),
        0,
        "a worker runs without the preload"
    );

    // scripts/cluster.sh start created the extension already; do it again here, watching.
    c.batch_execute("DROP EXTENSION IF EXISTS outbox_delivery")
        .expect("DROP EXTENSION");
    take_notices(&notices);
    c.batch_execute("CREATE EXTENSION outbox_delivery")
        .expect("CREATE EXTENSION without the preload");
    assert!(extension_installed(&mut c));
    let got = take_notices(&notices);
    let warnings = not_preloaded_warnings(&got);
    assert_eq!(
        warnings.len(),
        1,
        "CREATE EXTENSION must warn once that no worker will deliver; notices: {:?}",
        describe_notices(&got)
    );
    let w = warnings[0];
    assert!(
        w.message().contains("shared_preload_libraries"),
        "the warning names the cause: {}",
        w.message()
    );
    let hint = w.hint().unwrap_or_default();
    assert!(
        hint.contains("shared_preload_libraries"),
        "the warning needs a hint on how to fix it, got {:?}",
        w.hint()
    );

    let ch = unique("fnd_nopreload");
    create_channel(&mut c, &ch, &sim.send_url(&ch), OPTIONS);
    let key = unique("nopreload");
    let mut tx = c.transaction().unwrap();
    let id = enqueue(&mut tx, &ch, &key);
    tx.commit().unwrap();
    assert!(id > 0, "enqueue returned {id}");
    assert_eq!(status(&mut c, id).as_deref(), Some("queued"));

    // A new session's enqueue says it too (once per session).
    let (mut c2, notices2) = connect_collecting(&cluster.conninfo());
    let key2 = unique("nopreload");
    let id2 = enqueue(&mut c2, &ch, &key2);
    let id2_again = enqueue(&mut c2, &ch, &unique("nopreload"));
    assert!(id2 > id && id2_again > id2);
    let got2 = take_notices(&notices2);
    assert_eq!(
        not_preloaded_warnings(&got2).len(),
        1,
        "enqueue without the preload must warn (once per session); notices: {:?}",
        describe_notices(&got2)
    );

    // Nothing delivers here: the messages stay queued and the provider gets nothing.
    assert!(!sim.wait_for_sends(&ch, 1, Duration::from_secs(2)));
    assert_eq!(sim.send_count(&ch), 0);
    let rows = c
        .query(
            "SELECT state::text, attempts FROM outbox.messages WHERE channel = $1 ORDER BY id",
            &[&ch],
        )
        .unwrap();
    let rows: Vec<(String, i32)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(rows, vec![("queued".to_string(), 0); 3]);
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.attempts a JOIN outbox.messages m ON m.id = a.message_id WHERE m.channel = $1",
            &[&ch]
        ),
        0
    );
    drop(c);
    drop(c2);
}

// ---------------------------------------------------------------------------------------
// 7. the wake at COMMIT
// ---------------------------------------------------------------------------------------

/// Resets outbox.poll_interval_ms, whatever happens.
struct PollReset<'a>(&'a Cluster);

impl Drop for PollReset<'_> {
    fn drop(&mut self) {
        let mut c = self.0.connect();
        // Two statements: ALTER SYSTEM cannot run in the implicit transaction of a batch.
        if let Err(e) = c
            .batch_execute("ALTER SYSTEM RESET outbox.poll_interval_ms")
            .and_then(|_| c.batch_execute("SELECT pg_reload_conf()"))
        {
            eprintln!("could not reset outbox.poll_interval_ms: {e}");
        }
        // Let the workers reload before the next test.
        thread::sleep(Duration::from_millis(700));
    }
}

#[test]
fn worker_is_woken_at_commit_not_before_and_not_on_rollback() {
    let cluster = Cluster::from_env();
    let sim = Simulator::start();
    let ch = unique("fnd_wake");
    let mut c = cluster.connect();
    let mut watcher = cluster.connect();
    create_channel(&mut c, &ch, &sim.send_url(&ch), OPTIONS);
    cluster.wait_for_worker();
    let workers = cluster.worker_pids(&mut c).len();
    assert!(workers >= 1, "no delivery worker runs");

    let _reset = PollReset(&cluster);
    let mark = cluster.log_mark();
    c.batch_execute("ALTER SYSTEM SET outbox.poll_interval_ms = 60000")
        .expect("raise poll interval");
    c.batch_execute("SELECT pg_reload_conf()").expect("reload");
    assert!(
        wait_until(Duration::from_secs(20), || cluster
            .log_since(mark)
            .matches("poll_interval_ms=60000")
            .count()
            >= workers),
        "the workers did not reload poll_interval_ms = 60000; log:\n{}",
        cluster.log_since(mark)
    );
    // Nothing else may wake the workers during the windows below: no queued message of
    // an unpaused channel is due soon.
    let due_soon =
        "SELECT count(*) FROM outbox._messages m JOIN outbox._channels c ON c.id = m.channel_id \
                     WHERE m.state = 'queued' AND NOT c.paused \
                       AND m.next_attempt_at < now() + interval '30 seconds'";
    assert!(
        wait_until(Duration::from_secs(30), || count(
            &mut watcher,
            due_soon,
            &[]
        ) == 0),
        "queued messages of other channels keep coming due; the wake cannot be observed alone"
    );

    // Not before COMMIT: an open transaction with an enqueue wakes nobody.
    let quiet = wait_for_quiet_workers(&mut watcher, Duration::from_secs(1));
    let key_commit = unique("wake_commit");
    let mut tx = c.transaction().unwrap();
    let id = enqueue(&mut tx, &ch, &key_commit);
    thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        worker_loops(&mut watcher),
        quiet,
        "a worker ran a cycle while the enqueuing transaction was still open"
    );
    assert_eq!(sim.send_count(&ch), 0, "sent before COMMIT");

    // At COMMIT: delivered within 2 s, far below the 60 s poll.
    let committed_at = Instant::now();
    tx.commit().unwrap();
    assert!(
        sim.wait_for_stored(&ch, 1, Duration::from_secs(2)),
        "not delivered within 2 s of COMMIT with a 60 s poll: the commit did not wake the worker (state {:?})",
        state_of(&cluster, id)
    );
    let took = committed_at.elapsed();
    assert_eq!(stored_keys(&sim, &ch), vec![Some(key_commit.clone())]);
    assert_ne!(
        worker_loops(&mut watcher),
        quiet,
        "no worker cycle after COMMIT"
    );
    assert!(
        wait_for_state(&cluster, id, "delivered", Duration::from_secs(5)),
        "state {:?} after the provider stored it ({took:?} after COMMIT)",
        state_of(&cluster, id)
    );

    // Not on ROLLBACK: the rolled-back enqueue wakes nobody and is never sent.
    let quiet = wait_for_quiet_workers(&mut watcher, Duration::from_secs(1));
    let key_rollback = unique("wake_rollback");
    let mut tx = c.transaction().unwrap();
    let rolled_back_id = enqueue(&mut tx, &ch, &key_rollback);
    tx.rollback().unwrap();
    thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        worker_loops(&mut watcher),
        quiet,
        "a worker ran a cycle after a ROLLBACK"
    );
    assert_eq!(messages_with_key(&mut c, &key_rollback), 0);
    assert_eq!(status(&mut c, rolled_back_id), None);

    // A later commit wakes the worker; it sends that message and not the rolled-back one.
    let key_after = unique("wake_after");
    let committed_at = Instant::now();
    let id_after = enqueue(&mut c, &ch, &key_after);
    assert!(
        sim.wait_for_stored(&ch, 2, Duration::from_secs(2)),
        "second committed message not delivered within 2 s ({:?})",
        committed_at.elapsed()
    );
    assert!(wait_for_state(
        &cluster,
        id_after,
        "delivered",
        Duration::from_secs(5)
    ));
    assert!(!sim.wait_for_sends(&ch, 3, Duration::from_secs(1)));
    assert_eq!(
        sent_keys(&sim, &ch),
        vec![Some(key_commit), Some(key_after)],
        "the provider received exactly the committed messages"
    );
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.attempts WHERE message_id = $1",
            &[&rolled_back_id]
        ),
        0
    );
}
