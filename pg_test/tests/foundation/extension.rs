//! Sections 4-6: DROP / CREATE EXTENSION, pg_dump / pg_restore, a cluster without the preload.

use super::*;

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
            .contains("was dropped from database")),
        "no worker reported that the extension was dropped (and that it waits for it); log:\n{}",
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
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = unique("fnd_dump");
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
        env: Vec::new(),
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

    let ch = sim_channel(&mut c, &sim, "fnd_nopreload", OPTIONS);
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
