//! Several databases served by one server (`outbox.database = 'a, b, c'`): each gets its
//! own workers, delivers its own messages only, and `worker_status()` answers for the
//! database it is called in. A listed database is waited for until it has the extension;
//! `DROP EXTENSION` and `DROP DATABASE` stop its workers cleanly (one log line each, no
//! restart loop, no crash), and a database re-created under the same name is served again.
//!
//! Each test starts a cluster of its own under `OUTBOX_DATABASES_BASE`
//! (`/tmp/outbox_databases`) on `OUTBOX_DATABASES_PGPORT` (54871) plus an offset.

use outbox_e2e::cluster::{unique, wait_until, Cluster, OwnCluster};
use outbox_e2e::helpers::{count, create_channel, describe, enqueue};
use outbox_e2e::sim::Simulator;
use postgres::Client;
use std::path::PathBuf;
use std::time::Duration;

const WORKERS: u32 = 2;
/// What every line a worker writes starts with.
const WORKER_LINE: &str = "LOG:  outbox_delivery worker ";

fn own_cluster(name: &str, offset: u16, databases: &str, extra_conf: &str) -> OwnCluster {
    let base =
        std::env::var("OUTBOX_DATABASES_BASE").unwrap_or_else(|_| "/tmp/outbox_databases".into());
    let port: u16 = outbox_e2e::cluster::env_port("OUTBOX_DATABASES_PGPORT", 54871);
    let conf = format!("outbox.poll_interval_ms = 200\n{extra_conf}");
    OwnCluster::fresh(
        PathBuf::from(base).join(name),
        port + offset,
        databases,
        WORKERS,
        &conf,
    )
}

/// The delivery workers connected to `db`, from `pg_stat_activity`.
fn workers_in(c: &mut Client, db: &str) -> Vec<i32> {
    c.query(
        "SELECT pid FROM pg_stat_activity
          WHERE backend_type = 'outbox_delivery worker' AND datname = $1 ORDER BY pid",
        &[&db],
    )
    .map(|rows| rows.iter().map(|r| r.get(0)).collect())
    .unwrap_or_default()
}

/// Waits until every worker of `db` runs and finished its start (`worker_status()` there).
fn wait_for_workers_of(cluster: &Cluster, db: &str) {
    let mut c = cluster.connect_to(db);
    let ok = wait_until(Duration::from_secs(60), || {
        count(
            &mut c,
            "SELECT count(*) FROM outbox.worker_status()
              WHERE pid IS NOT NULL AND state NOT IN ('starting', 'stopped')",
            &[],
        ) == WORKERS as i64
    });
    assert!(
        ok,
        "the workers of {db} did not come up; see {}",
        cluster.log_path().display()
    );
}

/// A channel named `name` in the connected database that sends to `sim`'s channel `path`.
fn channel_to(c: &mut Client, sim: &Simulator, name: &str, path: &str) {
    create_channel(
        c,
        name,
        &sim.send_url(path),
        r#"{"idempotency_header": "Idempotency-Key", "external_id": "/id"}"#,
    );
}

fn delivered(c: &mut Client, channel: &str) -> i64 {
    count(
        c,
        "SELECT count(*) FROM outbox.messages WHERE channel = $1 AND state = 'delivered'",
        &[&channel],
    )
}

/// The body keys the simulator received on `path`, sorted.
fn keys_received(sim: &Simulator, path: &str) -> Vec<String> {
    let mut keys: Vec<String> = sim
        .sends(path)
        .iter()
        .filter_map(|r| {
            let v: serde_json::Value = serde_json::from_slice(&r.body).ok()?;
            Some(v.get("key")?.as_str()?.to_string())
        })
        .collect();
    keys.sort();
    keys
}

#[test]
fn three_databases_deliver_at_once_each_message_in_its_own() {
    const N: usize = 300;
    let dbs = ["dba", "dbb", "dbc"];
    let cluster = own_cluster("three", 0, " dba, dbb ,dbc ", "");
    let sim = Simulator::start();
    let mut clients: Vec<Client> = dbs.iter().map(|db| cluster.connect_to(db)).collect();
    for (db, c) in dbs.iter().zip(clients.iter_mut()) {
        wait_for_workers_of(&cluster, db);
        // The same channel name and the same effect keys in every database.
        channel_to(c, &sim, "mail", &format!("{db}_mail"));
    }
    let keys: Vec<String> = (0..N).map(|i| format!("order-{i}")).collect();
    // Interleaved, so that the three databases deliver at the same time.
    for key in &keys {
        for c in clients.iter_mut() {
            enqueue(c, "mail", key);
        }
    }
    for (db, c) in dbs.iter().zip(clients.iter_mut()) {
        let ok = wait_until(Duration::from_secs(60), || delivered(c, "mail") == N as i64);
        assert!(ok, "{db}: {} of {N} delivered", delivered(c, "mail"));
    }
    for (db, c) in dbs.iter().zip(clients.iter_mut()) {
        let mut expected = keys.clone();
        expected.sort();
        assert_eq!(
            keys_received(&sim, &format!("{db}_mail")),
            expected,
            "{db}: each of its messages is sent once, to its own channel"
        );
        let rows = c
            .query(
                "SELECT database, count(*), sum(delivered_total)::int8, count(pid)
                   FROM outbox.worker_status() GROUP BY database",
                &[],
            )
            .expect("worker_status()");
        assert_eq!(
            rows.len(),
            1,
            "{db}: worker_status() answers for this database only"
        );
        let (shown, workers, delivered_total, running): (String, i64, i64, i64) = (
            rows[0].get(0),
            rows[0].get(1),
            rows[0].get(2),
            rows[0].get(3),
        );
        assert_eq!(shown, *db);
        assert_eq!(
            (workers, running),
            (WORKERS as i64, WORKERS as i64),
            "{db}: its own workers"
        );
        assert_eq!(
            delivered_total, N as i64,
            "{db}: the figures of its own deliveries"
        );
        let connected = workers_in(c, db);
        assert_eq!(
            connected.len(),
            WORKERS as usize,
            "{db}: workers connected to it"
        );
        for pid in connected {
            // One thread by default (`outbox.http_threads`).
            assert_sends_on(pid, 1, db);
        }
    }
    sim.shutdown();
}

/// Worker `pid` (of `db`) runs its sends on `threads` threads, and at most the runtime's two
/// threads for blocking calls beside them (they carry the same name).
fn assert_sends_on(pid: i32, threads: usize, db: &str) {
    let named = http_threads_of(pid);
    assert!(
        (threads..=threads + 2).contains(&named),
        "{db}: worker {pid} runs its sends on {threads} thread(s), not {named}"
    );
}

/// Threads of process `pid` named as a worker's runtime names them (`outbox-http`).
fn http_threads_of(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|name| name.trim() == "outbox-http")
                .count()
        })
        .unwrap_or(0)
}

#[test]
fn a_worker_sends_on_as_many_threads_as_outbox_http_threads_says() {
    const N: usize = 100;
    let cluster = own_cluster("http_threads", 2, "threads", "outbox.http_threads = 4");
    let sim = Simulator::start();
    wait_for_workers_of(&cluster, "threads");
    let mut c = cluster.connect_to("threads");
    let shown: String = c
        .query_one("SHOW outbox.http_threads", &[])
        .expect("SHOW outbox.http_threads")
        .get(0);
    assert_eq!(shown, "4");
    channel_to(&mut c, &sim, "mail", "threads_mail");
    let keys: Vec<String> = (0..N).map(|i| format!("order-{i}")).collect();
    for key in &keys {
        enqueue(&mut c, "mail", key);
    }
    let ok = wait_until(Duration::from_secs(60), || {
        delivered(&mut c, "mail") == N as i64
    });
    assert!(ok, "{} of {N} delivered", delivered(&mut c, "mail"));
    let mut expected = keys.clone();
    expected.sort();
    assert_eq!(
        keys_received(&sim, "threads_mail"),
        expected,
        "each message is sent once"
    );
    let workers = workers_in(&mut c, "threads");
    assert_eq!(workers.len(), WORKERS as usize);
    for pid in workers {
        assert_sends_on(pid, 4, "threads");
    }
    sim.shutdown();
}

/// Lines of the server log since `mark` that contain `needle`.
fn lines_with(cluster: &Cluster, mark: u64, needle: &str) -> usize {
    cluster
        .log_since(mark)
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

/// Enqueues one message on `channel` of `db` and waits for its delivery.
fn delivers(cluster: &Cluster, db: &str, channel: &str) -> bool {
    let mut c = cluster.connect_to(db);
    let id = enqueue(&mut c, channel, &unique("k"));
    wait_until(Duration::from_secs(20), || {
        count(
            &mut c,
            "SELECT count(*) FROM outbox.messages WHERE id = $1 AND state = 'delivered'",
            &[&id],
        ) == 1
    })
}

/// The workers' processes connected to `db` stay the same for `for_how_long`: no restart.
fn stable_workers(cluster: &Cluster, db: &str, for_how_long: Duration) -> Vec<i32> {
    let mut c = cluster.connect_to("postgres");
    let first = workers_in(&mut c, db);
    std::thread::sleep(for_how_long);
    let then = workers_in(&mut c, db);
    assert_eq!(first, then, "the workers of {db} restarted");
    then
}

#[test]
fn a_database_is_waited_for_and_left_when_its_extension_or_itself_is_dropped() {
    // `late` is listed but has no extension; `steady` is served throughout.
    let cluster = own_cluster(
        "come_and_go",
        1,
        "steady",
        "outbox.database = 'steady, late'",
    );
    let sim = Simulator::start();
    wait_for_workers_of(&cluster, "steady");
    channel_to(
        &mut cluster.connect_to("steady"),
        &sim,
        "mail",
        "steady_mail",
    );
    let mut admin = cluster.connect_to("postgres");

    // Not created: the workers wait bound to no database, once said.
    let mark = cluster.log_mark();
    admin
        .batch_execute("CREATE DATABASE late")
        .expect("CREATE DATABASE late");
    let ok = wait_until(Duration::from_secs(20), || {
        workers_in(&mut admin, "late").len() == WORKERS as usize
    });
    assert!(ok, "the workers did not connect to the new database");
    stable_workers(&cluster, "late", Duration::from_secs(3));
    assert_eq!(
        lines_with(&cluster, mark, "is not created in \"late\" yet"),
        WORKERS as usize
    );

    // CREATE EXTENSION: delivery starts, no restart.
    let mut late = cluster.connect_to("late");
    late.batch_execute("CREATE EXTENSION outbox_delivery")
        .expect("CREATE EXTENSION");
    channel_to(&mut late, &sim, "mail", "late_mail");
    assert!(
        delivers(&cluster, "late", "mail"),
        "nothing delivered after CREATE EXTENSION"
    );
    wait_for_workers_of(&cluster, "late");

    // DROP EXTENSION: one line per worker, then they wait without restarting.
    let mark = cluster.log_mark();
    late.batch_execute("DROP EXTENSION outbox_delivery")
        .expect("DROP EXTENSION");
    std::thread::sleep(Duration::from_secs(3));
    stable_workers(&cluster, "late", Duration::from_secs(4));
    assert_eq!(
        lines_with(&cluster, mark, "was dropped from database \"late\""),
        WORKERS as usize
    );
    assert_eq!(
        lines_with(&cluster, mark, WORKER_LINE),
        WORKERS as usize * 3,
        "one line about the drop and the two start lines of the one restart, per worker:\n{}",
        cluster.log_since(mark)
    );
    late.batch_execute("CREATE EXTENSION outbox_delivery")
        .expect("CREATE EXTENSION again");
    channel_to(&mut late, &sim, "mail", "late_mail");
    assert!(
        delivers(&cluster, "late", "mail"),
        "nothing delivered after the second CREATE EXTENSION"
    );
    drop(late);

    // DROP DATABASE (no FORCE): the workers leave in time for it, once said, no crash.
    let (mark, log) = drop_late(&cluster, &mut admin, "DROP DATABASE late");
    assert_eq!(
        lines_with(&cluster, mark, WORKER_LINE),
        WORKERS as usize,
        "{log}"
    );

    // Re-created under the same name: served again.
    admin
        .batch_execute("CREATE DATABASE late")
        .expect("CREATE DATABASE late again");
    let mut late = cluster.connect_to("late");
    late.batch_execute("CREATE EXTENSION outbox_delivery")
        .expect("CREATE EXTENSION");
    channel_to(&mut late, &sim, "mail", "late_mail_2");
    assert!(
        delivers(&cluster, "late", "mail"),
        "the re-created database is not served"
    );
    drop(late);

    // WITH (FORCE) while the workers are connected: they leave as for a plain DROP.
    drop_late(&cluster, &mut admin, "DROP DATABASE late WITH (FORCE)");
    sim.shutdown();
}

/// Drops the database `late` with `statement`; checks that each of its workers said once
/// that it leaves, that nothing crashed, and that `steady` still delivers. The log mark
/// before the drop and the log since.
fn drop_late(cluster: &Cluster, admin: &mut Client, statement: &str) -> (u64, String) {
    let mark = cluster.log_mark();
    admin
        .batch_execute(statement)
        .unwrap_or_else(|e| panic!("{statement}: {}", describe(&e)));
    std::thread::sleep(Duration::from_secs(3));
    let log = cluster.log_since(mark);
    assert_eq!(
        lines_with(cluster, mark, "database \"late\" is being dropped"),
        WORKERS as usize,
        "{statement}: {log}"
    );
    for crash in [
        "terminated by signal",
        "terminating any other active server processes",
        "PANIC",
    ] {
        assert!(!log.contains(crash), "{statement}, a crash: {log}");
    }
    assert!(
        delivers(cluster, "steady", "mail"),
        "{statement}: the other database stopped delivering"
    );
    (mark, log)
}
