//! An on-demand lookup (`outbox.reconcile(id)`, `outbox.reconcile()`, `outbox.retry(id)` of
//! an uncertain message) can be interrupted: a cancel, a terminate or `statement_timeout`
//! ends the call within a second, however long the provider takes, and nothing of the
//! lookup is recorded.
//!
//! The provider here is a socket that accepts connections (the kernel completes them into
//! its backlog) and never answers, and the channel's `timeout_ms` is 30 s.
//!
//! Run: `cargo test -p outbox_e2e --release --test interrupts`.

use outbox_e2e::cluster::{unique, Cluster};
use outbox_e2e::helpers::{code_of, create_channel, one};
use postgres::Client;
use std::net::TcpListener;
use std::time::{Duration, Instant};

/// How long an interrupted call may still take.
const PROMPT: Duration = Duration::from_secs(1);

/// A paused channel whose lookups go to a provider that never answers, and one message on
/// it set `uncertain` with its next lookup an hour away (the worker leaves it alone).
struct Stuck {
    _provider: TcpListener,
    id: i64,
}

impl Stuck {
    fn new(c: &mut Client) -> Stuck {
        let provider = TcpListener::bind("127.0.0.1:0").expect("listen");
        let port = provider.local_addr().expect("addr").port();
        let ch = unique("intr");
        let options = format!(
            r#"{{"timeout_ms": 30000, "reconcile": {{"url": "http://127.0.0.1:{port}/m/{{effect_key}}"}}}}"#
        );
        create_channel(c, &ch, &format!("http://127.0.0.1:{port}/send"), &options);
        c.execute("SELECT outbox.pause_channel($1, 'interrupts test')", &[&ch])
            .expect("pause");
        let id: i64 = one(
            c,
            "SELECT outbox.enqueue($1, '{}'::jsonb, $2)",
            &[&ch, &unique("intr_key")],
        );
        c.execute(
            "UPDATE outbox._messages SET state = 'uncertain', attempts = 1,
                    next_attempt_at = now() + interval '1 hour' WHERE id = $1",
            &[&id],
        )
        .expect("uncertain");
        Stuck {
            _provider: provider,
            id,
        }
    }

    /// The message's state, lookups so far and reconcile attempts recorded.
    fn record(&self, c: &mut Client) -> (String, i32, i64) {
        let row = c
            .query_one(
                "SELECT m.state::text, m.reconcile_attempts,
                        (SELECT count(*) FROM outbox._attempts a WHERE a.message_id = m.id AND a.kind = 'reconcile')
                   FROM outbox._messages m WHERE m.id = $1",
                &[&self.id],
            )
            .expect("record");
        (row.get(0), row.get(1), row.get(2))
    }
}

/// Runs `sql` (with the message id as `$1` when `id` is given) on a connection of its own;
/// returns the connection's pid at once and, through the handle, the SQLSTATE the call
/// ended with and when it ended.
fn call_in_background(
    cluster: &Cluster,
    sql: &'static str,
    id: Option<i64>,
) -> (i32, std::thread::JoinHandle<(String, Instant)>) {
    let mut c = cluster.connect();
    let pid: i32 = c
        .query_one("SELECT pg_backend_pid()", &[])
        .expect("pid")
        .get(0);
    let handle = std::thread::spawn(move || {
        let result = match id {
            Some(id) => c.query_one(sql, &[&id]),
            None => c.query_one(sql, &[]),
        };
        let code = match result {
            Ok(_) => "ok".to_string(),
            Err(e) => code_of(&e),
        };
        (code, Instant::now())
    });
    (pid, handle)
}

#[test]
fn statement_timeout_ends_an_on_demand_lookup() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let stuck = Stuck::new(&mut c);
    let before = stuck.record(&mut c);
    c.batch_execute("SET statement_timeout = '1s'")
        .expect("timeout");
    for sql in [
        "SELECT outbox.reconcile($1::int8)",
        "SELECT outbox.retry($1::int8, 'interrupts test')::text",
    ] {
        let started = Instant::now();
        let e = c
            .query_one(sql, &[&stuck.id])
            .expect_err("the call is cut short");
        let took = started.elapsed();
        assert_eq!(code_of(&e), "57014", "{sql}: {e:?}");
        assert!(
            took < Duration::from_secs(1) + PROMPT,
            "{sql} with statement_timeout = 1s took {took:?}"
        );
    }
    c.batch_execute("RESET statement_timeout").expect("reset");
    assert_eq!(
        stuck.record(&mut c),
        before,
        "the interrupted lookups recorded something"
    );
}

#[test]
fn a_cancel_ends_an_on_demand_lookup() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let stuck = Stuck::new(&mut c);
    let before = stuck.record(&mut c);
    let (pid, call) = call_in_background(
        &cluster,
        "SELECT outbox.reconcile($1::int8)",
        Some(stuck.id),
    );
    std::thread::sleep(Duration::from_millis(500));
    let cancelled_at = Instant::now();
    c.execute("SELECT pg_cancel_backend($1)", &[&pid])
        .expect("cancel");
    let (code, ended_at) = call.join().expect("the call's thread");
    assert_eq!(code, "57014");
    let took = ended_at.duration_since(cancelled_at);
    assert!(took < PROMPT, "the cancel took {took:?} to end the call");
    assert_eq!(
        stuck.record(&mut c),
        before,
        "the cancelled lookup recorded something"
    );
}

#[test]
fn a_terminate_ends_an_on_demand_lookup() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let stuck = Stuck::new(&mut c);
    let before = stuck.record(&mut c);
    let (pid, call) = call_in_background(&cluster, "SELECT * FROM outbox.reconcile()", None);
    std::thread::sleep(Duration::from_millis(500));
    let terminated_at = Instant::now();
    c.execute("SELECT pg_terminate_backend($1)", &[&pid])
        .expect("terminate");
    let (code, ended_at) = call.join().expect("the call's thread");
    assert_ne!(code, "ok", "the terminated call returned");
    let took = ended_at.duration_since(terminated_at);
    assert!(
        took < PROMPT,
        "the terminate took {took:?} to end the call ({code})"
    );
    assert_eq!(
        stuck.record(&mut c),
        before,
        "the terminated lookup recorded something"
    );
}
