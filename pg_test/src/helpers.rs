//! What the end-to-end tests share besides the cluster itself: enqueueing, counting and
//! waiting for a state, error text, acting as a role, server-wide settings and fault points
//! that are reset when a test ends (also when it fails), and the lock that runs a file's
//! tests one at a time.

use crate::cluster::{poll, state_of, wait_for_state, wait_until, Cluster};
use crate::sim::Simulator;
use postgres::types::{FromSqlOwned, ToSql};
use postgres::{Client, GenericClient, NoTls};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Query parameters, as `postgres` takes them.
pub type Params<'a> = [&'a (dyn ToSql + Sync)];

/// How long a message may take to reach a state it is expected to reach.
pub const SETTLE: Duration = Duration::from_secs(30);
/// How long a negative check ("nothing more is sent") watches.
pub const QUIET: Duration = Duration::from_millis(1500);

/// The views of the contract, in schema `outbox`.
pub const CONTRACT_VIEWS: [&str; 8] = [
    "channels",
    "messages",
    "attempts",
    "ledger",
    "work_queue",
    "operator_log",
    "metrics",
    "alerts",
];

/// One test at a time within a test binary, for tests that change what the others rely on
/// (server-wide settings, stopped workers, triggers on the message table, the server log).
/// A test that failed while holding it does not poison it for the next.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------------------
// Errors and SQL text
// ---------------------------------------------------------------------------------------

/// An error as the server reported it: severity, SQLSTATE, message, detail and hint (each
/// long value cut by [`short`]).
pub fn describe(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => format!(
            "{} {}: {}{}{}",
            d.severity(),
            d.code().code(),
            short(d.message()),
            d.detail()
                .map(|x| format!(" (detail: {})", short(x)))
                .unwrap_or_default(),
            d.hint()
                .map(|x| format!(" (hint: {})", short(x)))
                .unwrap_or_default()
        ),
        None => format!("not a server error (connection lost?): {e}"),
    }
}

/// A value for a failure message: debug-quoted, cut after 80 characters, with its size.
pub fn short(s: &str) -> String {
    let chars = s.chars().count();
    if chars <= 80 {
        format!("{s:?}")
    } else {
        let head: String = s.chars().take(80).collect();
        format!("{head:?}… ({chars} characters, {} bytes)", s.len())
    }
}

/// The SQLSTATE of an error, or a note that the server sent none (a lost connection).
pub fn code_of(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => d.code().code().to_string(),
        None => format!("<no SQLSTATE: {e}>"),
    }
}

/// The message of a server error, without SQLSTATE, detail or hint (empty for a lost
/// connection).
pub fn error_message(e: &postgres::Error) -> String {
    e.as_db_error()
        .map(|d| d.message().to_string())
        .unwrap_or_default()
}

/// A quoted SQL identifier.
pub fn ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// A loopback port nothing listens on (bound and released): a connection to it is refused.
pub fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(9)
}

// ---------------------------------------------------------------------------------------
// The cluster, the provider, channels and messages
// ---------------------------------------------------------------------------------------

/// What most tests start from: the cluster, a connection to it and a provider simulator of
/// the test's own.
pub fn cluster_and_sim() -> (Cluster, Client, Simulator) {
    let cluster = Cluster::from_env();
    let c = cluster.connect();
    (cluster, c, Simulator::start())
}

/// A channel of the test's own (a unique name from `prefix`) that sends to `sim`; options
/// are JSON text.
pub fn sim_channel(
    c: &mut impl GenericClient,
    sim: &Simulator,
    prefix: &str,
    options: &str,
) -> String {
    let ch = crate::cluster::unique(prefix);
    create_channel(c, &ch, &sim.send_url(&ch), options);
    ch
}

/// `outbox.create_channel(name, endpoint, options)`; options are JSON text.
pub fn create_channel(c: &mut impl GenericClient, name: &str, endpoint: &str, options: &str) {
    c.execute(
        "SELECT outbox.create_channel($1::text, $2::text, $3::text::jsonb)",
        &[&name, &endpoint, &options],
    )
    .unwrap_or_else(|e| panic!("create_channel({name}, {endpoint}, {options}): {e}"));
}

/// The payload of a message whose test does not care what it says: it names its effect key,
/// so that a request on a channel without a key header still shows which message it is.
pub fn key_payload(key: &str) -> String {
    serde_json::json!({"to": "user-7", "key": key}).to_string()
}

/// `outbox.enqueue(channel, payload, key)`.
pub fn try_enqueue_payload(
    c: &mut impl GenericClient,
    channel: &str,
    payload: &str,
    key: &str,
) -> Result<i64, postgres::Error> {
    c.query_one(
        "SELECT outbox.enqueue($1::text, $2::text::jsonb, $3::text)",
        &[&channel, &payload, &key],
    )
    .map(|r| r.get(0))
}

/// `outbox.enqueue(channel, payload, key)`; panics with the server's error.
pub fn enqueue_payload(c: &mut impl GenericClient, channel: &str, payload: &str, key: &str) -> i64 {
    try_enqueue_payload(c, channel, payload, key)
        .unwrap_or_else(|e| panic!("enqueue on {channel} with key {key}: {}", describe(&e)))
}

/// `outbox.enqueue` of a [`key_payload`] message.
pub fn try_enqueue(
    c: &mut impl GenericClient,
    channel: &str,
    key: &str,
) -> Result<i64, postgres::Error> {
    try_enqueue_payload(c, channel, &key_payload(key), key)
}

/// `outbox.enqueue` of a [`key_payload`] message; panics with the server's error.
pub fn enqueue(c: &mut impl GenericClient, channel: &str, key: &str) -> i64 {
    enqueue_payload(c, channel, &key_payload(key), key)
}

/// `outbox.enqueue` with an ordering key and headers; panics with the server's error.
pub fn enqueue_with(
    c: &mut impl GenericClient,
    channel: &str,
    payload: &str,
    key: &str,
    ordering_key: Option<&str>,
    headers: Option<&str>,
) -> i64 {
    c.query_one(
        "SELECT outbox.enqueue($1::text, $2::text::jsonb, $3::text, $4::text, NULL::timestamptz, $5::text::jsonb)",
        &[&channel, &payload, &key, &ordering_key, &headers],
    )
    .unwrap_or_else(|e| panic!("enqueue on {channel} with key {key}: {}", describe(&e)))
    .get(0)
}

/// The single value a query returns; panics with the query and the error.
pub fn one<T: FromSqlOwned>(c: &mut impl GenericClient, sql: &str, params: &Params<'_>) -> T {
    c.query_one(sql, params)
        .unwrap_or_else(|e| panic!("{sql}: {}", describe(&e)))
        .get(0)
}

/// The single `int8` a query returns (a `count(*)`); panics with the query and the error.
pub fn count(c: &mut impl GenericClient, sql: &str, params: &Params<'_>) -> i64 {
    one(c, sql, params)
}

/// Polls (see [`poll`]) until the `count(*)` a query returns satisfies `done`; false when
/// `timeout` passed first.
pub fn wait_for_count(
    cluster: &Cluster,
    timeout: Duration,
    sql: &str,
    params: &Params<'_>,
    done: impl Fn(i64) -> bool,
) -> bool {
    poll(cluster, timeout, |c| {
        let n: i64 = c.query_one(sql, params)?.get(0);
        Ok(done(n).then_some(()))
    })
    .is_some()
}

/// The effect key of message `id`.
pub fn effect_key_of(c: &mut impl GenericClient, id: i64) -> String {
    one(
        c,
        "SELECT effect_key FROM outbox.messages WHERE id = $1",
        &[&id],
    )
}

/// The provider's id of message `id` (`outbox.messages.external_id`), if one was read.
pub fn external_id_of(c: &mut impl GenericClient, id: i64) -> Option<String> {
    one(
        c,
        "SELECT external_id FROM outbox.messages WHERE id = $1",
        &[&id],
    )
}

/// How many ledger entries message `id` has (0 or 1).
pub fn ledger_entries(c: &mut impl GenericClient, id: i64) -> i64 {
    count(
        c,
        "SELECT count(*) FROM outbox.ledger WHERE message_id = $1",
        &[&id],
    )
}

/// Who recorded message `id`'s ledger entry (`worker`, `operator`, ...); panics when it
/// has none.
pub fn ledger_recorded_by(c: &mut impl GenericClient, id: i64) -> String {
    one(
        c,
        "SELECT recorded_by FROM outbox.ledger WHERE message_id = $1",
        &[&id],
    )
}

/// Waits until message `id` is in `state`; panics with the last state seen.
pub fn wait_state(cluster: &Cluster, id: i64, state: &str) {
    if !wait_for_state(cluster, id, state, SETTLE) {
        panic!(
            "message {id} did not become {state} within {SETTLE:?}; last seen: {:?}; see {}",
            state_of(cluster, id),
            cluster.log_path().display()
        );
    }
}

// ---------------------------------------------------------------------------------------
// Attempts
// ---------------------------------------------------------------------------------------

/// One row of `outbox.attempts`.
#[derive(Debug, Clone)]
pub struct Attempt {
    pub attempt: i32,
    pub kind: String,
    pub outcome: Option<String>,
    pub error_class: Option<String>,
    pub http_status: Option<i32>,
    pub error: Option<String>,
    pub external_id: Option<String>,
    pub effect_key_sent: Option<String>,
    pub retry_after_ms: Option<i64>,
    pub worker_pid: Option<i32>,
    /// `started_at` in unix milliseconds.
    pub started_ms: f64,
    /// `finished_at` in unix milliseconds.
    pub finished_ms: Option<f64>,
    /// `started_at` in unix microseconds.
    pub started_at_us: i64,
}

/// The attempts of message `id`, in the order they were made.
pub fn attempts(c: &mut impl GenericClient, id: i64) -> Vec<Attempt> {
    c.query(
        "SELECT attempt, kind, outcome, error_class::text, http_status, error, external_id,
                effect_key_sent, retry_after_ms, worker_pid,
                (extract(epoch FROM started_at) * 1000)::float8,
                (extract(epoch FROM finished_at) * 1000)::float8,
                (extract(epoch FROM started_at) * 1000000)::int8
           FROM outbox.attempts WHERE message_id = $1 ORDER BY attempt_id",
        &[&id],
    )
    .unwrap_or_else(|e| panic!("read the attempts of message {id}: {}", describe(&e)))
    .iter()
    .map(|r| Attempt {
        attempt: r.get(0),
        kind: r.get(1),
        outcome: r.get(2),
        error_class: r.get(3),
        http_status: r.get(4),
        error: r.get(5),
        external_id: r.get(6),
        effect_key_sent: r.get(7),
        retry_after_ms: r.get(8),
        worker_pid: r.get(9),
        started_ms: r.get(10),
        finished_ms: r.get(11),
        started_at_us: r.get(12),
    })
    .collect()
}

// ---------------------------------------------------------------------------------------
// Roles
// ---------------------------------------------------------------------------------------

/// `SET ROLE role` on `c` (a superuser connection); panics with the server's error.
pub fn set_role(c: &mut Client, role: &str) {
    c.batch_execute(&format!("SET ROLE {}", ident(role)))
        .unwrap_or_else(|e| panic!("SET ROLE {role}: {}", describe(&e)));
}

/// A connection acting as `role` (`SET ROLE` on a superuser connection: the test roles are
/// NOLOGIN).
pub fn session_as(cluster: &Cluster, role: &str) -> Client {
    let mut c = cluster.connect();
    set_role(&mut c, role);
    c
}

// ---------------------------------------------------------------------------------------
// Server-wide settings and fault points
// ---------------------------------------------------------------------------------------

/// Sets a sighup setting server-wide and reloads. Two statements: ALTER SYSTEM refuses to
/// run in the implicit transaction block of a multi-statement simple query.
pub fn set_setting(c: &mut Client, name: &str, value: &str) {
    c.batch_execute(&format!("ALTER SYSTEM SET {name} = '{value}'"))
        .unwrap_or_else(|e| panic!("ALTER SYSTEM SET {name} = {value}: {e:?}"));
    c.batch_execute("SELECT pg_reload_conf()")
        .unwrap_or_else(|e| panic!("pg_reload_conf(): {e:?}"));
}

/// [`set_setting`], then waits until this connection sees `value` (for settings shown as
/// they are written, without a unit).
pub fn set_setting_seen(c: &mut Client, name: &str, value: &str) {
    set_setting(c, name, value);
    let seen = wait_until(Duration::from_secs(10), || {
        c.query_one("SELECT current_setting($1)", &[&name])
            .map(|r| r.get::<_, String>(0) == value)
            .unwrap_or(false)
    });
    assert!(seen, "{name} = {value} not visible after pg_reload_conf()");
}

/// ALTER SYSTEM RESET + reload, two statements (see [`set_setting`]), on a connection of
/// its own (the test's may be broken).
pub fn reset_setting(cluster: &Cluster, name: &str) -> Result<(), postgres::Error> {
    let mut c = Client::connect(&cluster.conninfo(), NoTls)?;
    c.batch_execute(&format!("ALTER SYSTEM RESET {name}"))?;
    c.batch_execute("SELECT pg_reload_conf()")
}

/// Resets server-wide settings when dropped, so that a failing test does not leave the
/// shared cluster changed, then lets every backend and the workers reload. Errors are only
/// reported: it may run while a panic unwinds (and while the server restarts).
pub struct SettingsGuard<'a> {
    cluster: &'a Cluster,
    names: Vec<&'static str>,
}

impl<'a> SettingsGuard<'a> {
    pub fn new(cluster: &'a Cluster, names: &[&'static str]) -> Self {
        SettingsGuard {
            cluster,
            names: names.to_vec(),
        }
    }
}

impl Drop for SettingsGuard<'_> {
    fn drop(&mut self) {
        for name in &self.names {
            let done = (0..100).any(|_| {
                let ok = reset_setting(self.cluster, name).is_ok();
                if !ok {
                    std::thread::sleep(Duration::from_millis(200));
                }
                ok
            });
            if !done {
                eprintln!("could not reset {name}");
            }
        }
        // The workers reload at their next loop.
        std::thread::sleep(Duration::from_millis(700));
    }
}

/// An armed `outbox.fault_injection` point; reset when dropped (also while a panic unwinds,
/// and while the server restarts after the fault fired).
pub struct FaultGuard<'a> {
    _reset: SettingsGuard<'a>,
}

/// Arms the fault-injection point `point` server-wide and waits until the workers have
/// reloaded (one poll interval).
pub fn arm_fault<'a>(cluster: &'a Cluster, point: &str) -> FaultGuard<'a> {
    let guard = FaultGuard {
        _reset: SettingsGuard::new(cluster, &["outbox.fault_injection"]),
    };
    set_setting(&mut cluster.connect(), "outbox.fault_injection", point);
    std::thread::sleep(Duration::from_millis(700));
    guard
}

/// The string literals of the list constant `name` in `file` (under the repository's root):
/// the lists the extension checks options against, which tests read from the source rather
/// than copy.
pub fn source_list(file: &str, name: &str) -> Vec<String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let source = std::fs::read_to_string(root.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
    let start = source
        .find(&format!("const {name}"))
        .unwrap_or_else(|| panic!("no const {name} in {file}"));
    let list = &source[start..start + source[start..].find("];").expect("the list's end")];
    // Past the type (`[&str; 8]` or `&[&str]`) to the list's own bracket.
    let body = &list[list.find('[').map_or(0, |i| i + 1)..];
    let body = &body[body.find('[').map_or(0, |i| i + 1)..];
    let items: Vec<String> = body
        .split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect();
    assert!(items.len() > 4, "{name} in {file}: {items:?}");
    items
}
