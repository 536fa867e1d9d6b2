//! Section 6: cheap at scale: index-only plans at a backlog of 200k, statistics for autovacuum.

use super::*;

// ---------------------------------------------------------------------------------------
// 6. Cheap at scale
// ---------------------------------------------------------------------------------------

struct DeleteBacklog<'a> {
    cluster: &'a Cluster,
    channel_id: i32,
}

impl Drop for DeleteBacklog<'_> {
    fn drop(&mut self) {
        let mut c = self.cluster.connect();
        if let Err(e) = c.execute(
            "DELETE FROM outbox._messages WHERE channel_id = $1",
            &[&self.channel_id],
        ) {
            eprintln!("could not delete the backlog: {e}");
        }
        let _ = c.batch_execute("VACUUM ANALYZE outbox._messages");
    }
}

/// Every plan node that reads `relation`: (node type, index name, filter).
type Scan = (String, Option<String>, Option<String>);

fn scans_of(plan: &serde_json::Value, relation: &str, out: &mut Vec<Scan>) {
    match plan {
        serde_json::Value::Object(o) => {
            if o.get("Relation Name").and_then(|v| v.as_str()) == Some(relation) {
                out.push((
                    o["Node Type"].as_str().unwrap_or("?").to_string(),
                    o.get("Index Name")
                        .and_then(|v| v.as_str())
                        .map(String::from),
                    o.get("Filter").and_then(|v| v.as_str()).map(String::from),
                ));
            }
            for v in o.values() {
                scans_of(v, relation, out);
            }
        }
        serde_json::Value::Array(a) => {
            for v in a {
                scans_of(v, relation, out);
            }
        }
        _ => {}
    }
}

fn explain(c: &mut Client, query: &str) -> serde_json::Value {
    explain_in(c, query)
}

fn explain_in(c: &mut impl postgres::GenericClient, query: &str) -> serde_json::Value {
    let msgs = c
        .simple_query(&format!("EXPLAIN (FORMAT JSON) {query}"))
        .expect("EXPLAIN");
    let text = msgs
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(r) => r.get(0).map(String::from),
            _ => None,
        })
        .expect("a plan");
    serde_json::from_str(&text).expect("JSON plan")
}

/// Creates a paused channel holding 200,000 due queued messages (one `INSERT ... SELECT`,
/// due for an hour), runs `VACUUM ANALYZE outbox._messages`, checks the figures and that
/// the paused channel raises no `queue_age` alert, and returns every `_messages` scan of
/// `EXPLAIN (FORMAT JSON) SELECT * FROM outbox.metrics`.
fn backlog_scans(c: &mut Client, ch: &str, channel_id: i32) -> Vec<Scan> {
    let n = c
        .execute(
            "INSERT INTO outbox._messages (channel_id, effect_key, payload, next_attempt_at)
             SELECT $1, $2::text || '-' || g, '{}'::jsonb, now() - interval '1 hour' + g * interval '1 ms'
               FROM generate_series(1, 200000) g",
            &[&channel_id, &ch],
        )
        .expect("insert the backlog");
    assert_eq!(n, 200_000);
    c.batch_execute("VACUUM ANALYZE outbox._messages").unwrap();

    // The figures at that backlog; a paused channel raises no queue_age alert even though
    // its head is far over the default threshold (300 s).
    let m = metrics_of(c, ch);
    assert_eq!(m.queued, 200_000, "{m:?}");
    assert!(m.paused, "{m:?}");
    let age = m.oldest_queued_age_s.expect("a due head");
    assert!((3599.0..3700.0).contains(&age), "{m:?}");
    let rows = alerts_of(c, ch);
    assert!(
        rows.is_empty(),
        "a paused channel raises no queue_age alert: {rows:?}"
    );
    let total_queued: i64 = one(
        c,
        "SELECT queued FROM outbox.metrics WHERE scope = 'total'",
        &[],
    );
    assert!(total_queued >= 200_000);

    // The view reads the messages through outbox._state_counts() (its plan shows the
    // function, not what it reads): that function's query is planned as it runs, under its
    // own settings.
    let mut scans = Vec::new();
    let plan = explain(c, "SELECT * FROM outbox.metrics");
    scans_of(&plan, "_messages", &mut scans);
    let body: String = one(
        c,
        "SELECT prosrc FROM pg_proc WHERE oid = 'outbox._state_counts'::regproc",
        &[],
    );
    let mut tx = c.transaction().unwrap();
    tx.batch_execute("SET LOCAL enable_seqscan = off; SET LOCAL jit = off")
        .unwrap();
    let counts = explain_in(&mut tx, &body);
    tx.rollback().unwrap();
    scans_of(&counts, "_messages", &mut scans);
    assert!(!scans.is_empty(), "the plan reads _messages: {counts:#}");
    scans
}

fn paused_channel(c: &mut Client, ch: &str) -> i32 {
    create_channel(c, ch, "http://127.0.0.1:9/ch/scale", "{}");
    c.execute(
        "SELECT outbox.pause_channel($1, 'obs test: backlog for EXPLAIN')",
        &[&ch],
    )
    .unwrap();
    c.query_one("SELECT id FROM outbox._channels WHERE name = $1", &[&ch])
        .unwrap()
        .get(0)
}

/// Drops a scratch database, whatever happens.
struct DropDb<'a>(&'a Cluster, String);

impl Drop for DropDb<'_> {
    fn drop(&mut self) {
        let mut c = self.0.connect();
        if let Err(e) = c.batch_execute(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.1))
        {
            eprintln!("could not drop database {}: {e}", self.1);
        }
    }
}

/// At a backlog of 200,000 queued messages `outbox.metrics` reads `_messages` through its
/// indexes only (index, index-only or bitmap scans), never a `Seq Scan`: checked in the test database (whatever else it holds;
/// the plan there depends on what ANALYZE samples of the other channels) and in a scratch
/// database shaped like a small install (three channels, all messages on the paused one),
/// where the outcome does not depend on sampling.
#[test]
fn metrics_use_indexes_only_at_a_backlog_of_200k() {
    let _serial = serial();
    let cluster = Cluster::from_env();

    // The test database, as the other tests left it.
    let mut c = cluster.connect();
    let ch = unique("obs_scale");
    let channel_id = paused_channel(&mut c, &ch);
    let main_scans = {
        let _cleanup = DeleteBacklog {
            cluster: &cluster,
            channel_id,
        };
        backlog_scans(&mut c, &ch, channel_id)
    };

    // A small install: three channels, only the paused one holds messages (the backlog).
    // The planner's estimate per channel is then the whole table, whatever ANALYZE samples.
    let db = unique("obs_scale_db");
    c.batch_execute(&format!("CREATE DATABASE {db}"))
        .expect("create a scratch database");
    let _drop_db = DropDb(&cluster, db.clone());
    let mut s = Client::connect(
        &cluster
            .conninfo()
            .replace(&format!("dbname={}", cluster.db), &format!("dbname={db}")),
        NoTls,
    )
    .expect("connect to the scratch database");
    s.batch_execute("CREATE EXTENSION outbox_delivery")
        .expect("CREATE EXTENSION in the scratch database");
    for other in ["mail", "sms"] {
        create_channel(&mut s, other, "http://127.0.0.1:9/ch/other", "{}");
    }
    let backlog_id = paused_channel(&mut s, "backlog");
    let small_scans = backlog_scans(&mut s, "backlog", backlog_id);
    drop(s);

    for (where_, scans) in [
        ("test database", &main_scans),
        ("small install", &small_scans),
    ] {
        for (node, index, filter) in scans {
            assert!(
                // A bitmap heap scan is driven by one of the table's indexes too.
                ["Index Scan", "Index Only Scan", "Bitmap Heap Scan"].contains(&node.as_str()),
                "{where_}: outbox.metrics reads _messages with a {node} (index {index:?}, filter \
                 {filter:?}) at a backlog of 200,000 queued messages, not an index scan; every \
                 _messages scan: {scans:?}"
            );
        }
    }
}

/// The worker's own writes reach the statistics autovacuum reads. A background worker
/// must report them itself; before it did, `_attempts` and `_ledger` (written only by the
/// worker) showed no rows at all in `pg_stat_user_tables`, autovacuum never processed them,
/// and under a steady load with retention both grew without bound.
#[test]
fn worker_writes_reach_the_statistics_autovacuum_reads() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let mut c = cluster.connect();
    let counts = |c: &mut Client| -> HashMap<String, (i64, i64)> {
        // The ledger's rows are its generations' (its partitions; the parent has none).
        c.query(
            "SELECT CASE WHEN relname IN ('_ledger_0', '_ledger_1', '_ledger_2') THEN '_ledger' ELSE relname::text END,
                    sum(n_tup_ins)::int8, sum(n_tup_upd)::int8
               FROM pg_stat_user_tables
              WHERE schemaname = 'outbox'
                AND relname IN ('_messages', '_attempts', '_ledger_0', '_ledger_1', '_ledger_2', '_channel_stats')
              GROUP BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect()
    };
    let before = counts(&mut c);

    let sim = Simulator::start();
    let ch = sim_channel(
        &mut c,
        &sim,
        "obs_stats",
        r#"{"retry": {"base_ms": 20, "jitter": "none"}}"#,
    );
    const N: i64 = 40;
    // A delivering send writes no attempt row (its delivered message stands for it): the
    // first N requests are refused, so that N attempt rows are written.
    sim.set_plan(&ch, vec![Action::Status(503); N as usize]);
    let last = (0..N)
        .map(|i| enqueue(&mut c, &ch, &format!("{ch}-{i}")))
        .last()
        .unwrap();
    wait_state(&cluster, last, "delivered");
    assert!(
        sim.wait_for_sends(&ch, 2 * N as usize, SETTLE),
        "the provider did not receive {N} messages"
    );

    // Unforced reports flush at most once a second; the worker forces one before it idles.
    let mut now = HashMap::new();
    let reported = wait_until(Duration::from_secs(15), || {
        now = counts(&mut c);
        let grew =
            |t: &str, f: fn(&(i64, i64)) -> i64| f(&now[t]) - before.get(t).map(f).unwrap_or(0);
        // Each message: the record of its refused send updates it (a claim writes a row of
        // outbox._claims, not the message) and writes its attempt row, its delivery its
        // ledger entry (enqueue's inserts are a client's, reported anyway).
        grew("_attempts", |x| x.0) >= N
            && grew("_messages", |x| x.1) >= N
            && grew("_ledger", |x| x.0) >= N
            && grew("_channel_stats", |x| x.0 + x.1) >= 1
    });
    assert!(
        reported,
        "the worker delivered {N} messages but pg_stat_user_tables does not show its writes \
         (inserts, updates): before {before:?}, now {now:?}"
    );
}
