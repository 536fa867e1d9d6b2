//! Sections 4 and 5: `worker_status()` against `pg_stat_activity`, and what `pg_monitor`
//! reads.

use super::*;

// ---------------------------------------------------------------------------------------
// 4. worker_status()
// ---------------------------------------------------------------------------------------

#[derive(Debug)]
#[allow(dead_code)]
struct WorkerRow {
    worker: i32,
    pid: Option<i32>,
    database: String,
    state: String,
    last_loop_age_s: Option<f64>,
    in_flight: i32,
    claimed_total: i64,
    delivered_total: i64,
}

fn worker_rows(c: &mut Client) -> Vec<WorkerRow> {
    c.query(
        "SELECT worker, pid, database, state,
                extract(epoch FROM clock_timestamp() - last_loop_at)::float8,
                in_flight, claimed_total, delivered_total
           FROM outbox.worker_status() ORDER BY worker",
        &[],
    )
    .expect("worker_status()")
    .iter()
    .map(|r| WorkerRow {
        worker: r.get(0),
        pid: r.get(1),
        database: r.get(2),
        state: r.get(3),
        last_loop_age_s: r.get(4),
        in_flight: r.get(5),
        claimed_total: r.get(6),
        delivered_total: r.get(7),
    })
    .collect()
}

#[test]
fn worker_status_matches_pg_stat_activity_and_counts_deliveries() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let pids = wait_for_workers(&cluster, &[]);
    let mut c = cluster.connect();

    let rows = worker_rows(&mut c);
    assert_eq!(rows.len(), 2, "one row per configured worker: {rows:#?}");
    assert_eq!(
        rows.iter().map(|r| r.worker).collect::<Vec<_>>(),
        vec![0, 1]
    );
    let mut status_pids: Vec<i32> = rows
        .iter()
        .map(|r| r.pid.expect("a running worker has a pid"))
        .collect();
    status_pids.sort_unstable();
    assert_eq!(status_pids, pids, "the same PIDs as pg_stat_activity");
    let activity = c
        .query(
            "SELECT pid, datname::text FROM pg_stat_activity
              WHERE backend_type = 'outbox_delivery worker' ORDER BY pid",
            &[],
        )
        .unwrap();
    assert_eq!(activity.len(), 2);
    for r in &activity {
        assert_eq!(r.get::<_, Option<String>>(1).as_deref(), Some("outbox"));
    }
    for r in &rows {
        assert_eq!(r.database, "outbox", "{r:?}");
        assert!(
            ["idle", "claiming", "sending", "recording"].contains(&r.state.as_str()),
            "{r:?}"
        );
        let age = r.last_loop_age_s.expect("last_loop_at is set");
        assert!(
            (-0.5..5.0).contains(&age),
            "last loop within the last few seconds: {r:?}"
        );
        assert!(r.in_flight >= 0, "{r:?}");
    }
    let delivered_before: i64 = rows.iter().map(|r| r.delivered_total).sum();
    let claimed_before: i64 = rows.iter().map(|r| r.claimed_total).sum();

    // Five deliveries.
    let sim = Simulator::start();
    let ch = sim_channel(&mut c, &sim, "obs_ws", "{}");
    let ids: Vec<i64> = (0..5)
        .map(|_| enqueue(&mut c, &ch, &unique("obs_ws_k")))
        .collect();
    for &id in &ids {
        wait_state(&cluster, id, "delivered");
    }
    // The slot is updated right after the record transaction commits.
    let mut rows = Vec::new();
    let grew = wait_until(Duration::from_secs(5), || {
        rows = worker_rows(&mut c);
        rows.iter().map(|r| r.delivered_total).sum::<i64>() >= delivered_before + 5
    });
    assert!(grew, "delivered_total did not grow by 5: {rows:#?}");
    let delivered_after: i64 = rows.iter().map(|r| r.delivered_total).sum();
    let claimed_after: i64 = rows.iter().map(|r| r.claimed_total).sum();
    assert_eq!(
        delivered_after,
        delivered_before + 5,
        "exactly the five deliveries: {rows:#?}"
    );
    assert!(claimed_after >= claimed_before + 5, "{rows:#?}");
    assert_eq!(sim.stored(&ch).len(), 5);
    // Same PIDs still (nothing restarted), and they still loop.
    let mut again: Vec<i32> = rows.iter().filter_map(|r| r.pid).collect();
    again.sort_unstable();
    assert_eq!(again, pids);
}

// ---------------------------------------------------------------------------------------
// 5. pg_monitor
// ---------------------------------------------------------------------------------------

struct DropRole<'a>(&'a Cluster, &'static str);

impl Drop for DropRole<'_> {
    fn drop(&mut self) {
        let mut c = self.0.connect();
        // Close its sessions first (a direct login below), then drop it.
        let _ = c.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1",
            &[&self.1],
        );
        if let Err(e) = c.batch_execute(&format!("DROP ROLE IF EXISTS {}", self.1)) {
            eprintln!("could not drop role {}: {e}", self.1);
        }
    }
}

fn check_monitor_reads(c: &mut Client, who: &str) {
    let me: String = c
        .query_one("SELECT current_user::text", &[])
        .unwrap()
        .get(0);
    assert_eq!(me, "obs_mon", "{who}");
    let metric_rows: i64 = c
        .query_one("SELECT count(*) FROM outbox.metrics", &[])
        .unwrap_or_else(|e| panic!("{who}: SELECT FROM outbox.metrics: {e:?}"))
        .get(0);
    assert!(metric_rows >= 2, "{who}: a total row and channel rows");
    let total = count(
        c,
        "SELECT count(*) FROM outbox.metrics WHERE scope = 'total'",
        &[],
    );
    assert_eq!(total, 1, "{who}");
    c.query(&format!("SELECT {ALERT_COLUMNS} FROM outbox.alerts"), &[])
        .unwrap_or_else(|e| panic!("{who}: SELECT FROM outbox.alerts: {e:?}"));
    let text = c
        .query_one("SELECT outbox.prometheus()", &[])
        .unwrap_or_else(|e| panic!("{who}: SELECT outbox.prometheus(): {e:?}"))
        .get::<_, String>(0);
    let e = parse(&text);
    assert_eq!(samples(&e, "outbox_worker_up")[0].1, 2.0, "{who}");
    let err = c
        .query("SELECT * FROM outbox._messages LIMIT 1", &[])
        .expect_err("pg_monitor must not read the private message table");
    assert_eq!(
        err.code(),
        Some(&postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
        "{who}: {err:?}"
    );
}

#[test]
fn pg_monitor_reads_metrics_alerts_and_prometheus_but_not_messages() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let mut admin = cluster.connect();
    admin
        .batch_execute("DROP ROLE IF EXISTS obs_mon")
        .expect("drop a leftover obs_mon");
    let _role = DropRole(&cluster, "obs_mon");
    admin
        .batch_execute("CREATE ROLE obs_mon LOGIN IN ROLE pg_monitor")
        .expect("create obs_mon");
    // One channel at least, so that the metrics have channel rows.
    create_channel(
        &mut admin,
        &unique("obs_mon_ch"),
        "http://127.0.0.1:9/ch/none",
        "{}",
    );
    let channels_as_admin = count(
        &mut admin,
        "SELECT count(*) FROM outbox.metrics WHERE scope = 'channel'",
        &[],
    );

    // SET ROLE on a superuser's connection.
    let mut c = cluster.connect();
    c.batch_execute("SET ROLE obs_mon").unwrap();
    check_monitor_reads(&mut c, "SET ROLE obs_mon");
    let channels_as_monitor = count(
        &mut c,
        "SELECT count(*) FROM outbox.metrics WHERE scope = 'channel'",
        &[],
    );
    assert_eq!(
        channels_as_monitor, channels_as_admin,
        "pg_monitor sees every channel's figures"
    );
    drop(c);

    // A session that logs in as obs_mon.
    let conninfo = cluster.conninfo().replace("user=postgres", "user=obs_mon");
    let mut m = Client::connect(&conninfo, NoTls).expect("log in as obs_mon");
    check_monitor_reads(&mut m, "login obs_mon");
    drop(m);
}
