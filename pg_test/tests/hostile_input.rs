//! End-to-end tests of hostile input against the real cluster (`scripts/cluster.sh`, located
//! by `OUTBOX_BASE` / `OUTBOX_PGPORT`), the real delivery workers and the provider
//! simulator (docs/security.md, "Limits"; the contract: "Bad input raises an ERROR with a
//! precise SQLSTATE ... never panics, never crashes the backend, never half-writes"):
//!
//! 1. injection strings (quotes, dollar quotes, comments, format specifiers, URL template
//!    placeholders, control characters, RTL overrides, 100,000-character Unicode, path
//!    traversal, CRLF) in every text argument of every public function, called by the roles
//!    an application would use (writer, operator, admin): each call succeeds and stores the
//!    value verbatim, or fails with a clean SQLSTATE (where docs/security.md fixes the
//!    outcome, exactly that one); afterwards the schema is intact, the hostile messages
//!    settle, the Prometheus exposition still parses and a normal message is delivered;
//! 2. a deterministic fuzz of every public function with random arguments (NULLs, empty,
//!    huge, extreme ids, random and malformed JSON, random channel options, infinite
//!    timestamps), as the superuser and as a role with `outbox_writer` alone: no internal
//!    error, no lost connection, no crash in the server log, the workers keep running and
//!    still deliver. `OUTBOX_FUZZ_SEED` replays a run, `OUTBOX_FUZZ_ITERATIONS` sizes it.
//!
//! Run: `cargo test -p outbox_e2e --release --test hostile_input -- --nocapture` (the fuzz
//! prints its seed and a histogram of SQLSTATEs).
//!
//! Every channel these tests create is named with a per-run tag and points at a simulator
//! or at a closed port on 127.0.0.1; when a test ends (also when it fails) its channels are
//! paused and removed with their messages, so that hostile channel names do not reach the
//! next test's metrics, and its roles and bindings are dropped.

use openmetrics_parser::prometheus::parse_prometheus;
use outbox_e2e::cluster::{poll, unique, wait_for_workers, Cluster};
use outbox_e2e::helpers::{
    closed_port, code_of, count, create_channel, describe, ident, serial, set_role, short,
    CONTRACT_VIEWS,
};
use outbox_e2e::sim::Simulator;
use postgres::types::ToSql;
use postgres::{Client, GenericClient, NoTls};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

/// How long a message may take to reach a state it is expected to reach (longer than the
/// shared SETTLE: the queue may hold the whole fuzz run).
const HOSTILE_SETTLE: Duration = Duration::from_secs(60);
/// Default number of fuzz calls (superuser and writer together).
const FUZZ_ITERATIONS: u64 = 3000;
/// Words whose presence in the server log means a backend crashed or was killed.
const CRASH_WORDS: [&str; 5] = [
    "PANIC",
    "server process",
    "terminated by signal",
    "was terminated",
    "TRAP",
];

// ---------------------------------------------------------------------------------------
// Helpers (local to this file)
// ---------------------------------------------------------------------------------------

/// SQLSTATEs no bad input may produce: internal errors, system errors, a RAISE without an
/// error code, a statement that ran into the timeout, a lost backend, resource exhaustion.
fn unclean(code: &str) -> bool {
    code.starts_with("XX")
        || code.starts_with("58")
        || code.starts_with("53")
        || code.starts_with("57P")
        || code == "57014"
        || code == "P0001"
        || code.starts_with("<no SQLSTATE")
}

/// An HTTP token (RFC 9110 `tchar`s): what a header name may be.
fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn has_ascii_control(s: &str) -> bool {
    s.chars().any(|c| c.is_ascii_control())
}

/// A C1 control (U+0080 to U+009F): a control character outside ASCII.
fn has_c1_control(s: &str) -> bool {
    s.chars().any(|c| c.is_control() && !c.is_ascii())
}

/// Lines of the server log that say a backend crashed or was killed.
fn crash_lines(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| CRASH_WORDS.iter().any(|w| l.contains(w)))
        .map(str::to_string)
        .collect()
}

/// Everything a test creates, removed when it ends (also when it fails): bindings, then
/// the channels named with `tag` (paused, then removed with their messages, attempts and
/// ledger entries), then roles.
struct Cleanup<'a> {
    cluster: &'a Cluster,
    tag: String,
    roles: Vec<String>,
    bindings: Vec<(String, String)>,
}

impl<'a> Cleanup<'a> {
    fn new(cluster: &'a Cluster, tag: &str) -> Self {
        Cleanup {
            cluster,
            tag: tag.to_string(),
            roles: Vec::new(),
            bindings: Vec::new(),
        }
    }

    fn create_role(&mut self, c: &mut Client, label: &str, grant: Option<&str>) -> String {
        let name = format!("{}_{label}", self.tag);
        c.batch_execute(&format!("CREATE ROLE {} NOLOGIN", ident(&name)))
            .unwrap_or_else(|e| panic!("CREATE ROLE {name}: {}", describe(&e)));
        self.roles.push(name.clone());
        if let Some(g) = grant {
            c.batch_execute(&format!("GRANT {} TO {}", ident(g), ident(&name)))
                .unwrap_or_else(|e| panic!("GRANT {g} TO {name}: {}", describe(&e)));
        }
        name
    }

    fn bind(&mut self, c: &mut Client, role: &str, tenant: &str) {
        self.bindings.push((role.to_string(), tenant.to_string()));
        c.execute(
            "SELECT outbox.bind_tenant($1::text::name, $2::text)",
            &[&role, &tenant],
        )
        .unwrap_or_else(|e| panic!("bind_tenant({role}, {tenant}): {}", describe(&e)));
    }
}

/// Pauses every channel whose name starts with `tag` (directly: no operator log rows).
fn pause_tagged(c: &mut Client, tag: &str) -> Result<u64, postgres::Error> {
    c.execute(
        "UPDATE outbox._channels SET paused = true WHERE starts_with(name, $1)",
        &[&tag],
    )
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        let Ok(mut c) = Client::connect(&self.cluster.conninfo(), NoTls) else {
            eprintln!("cleanup: cannot connect; channels {}* are left", self.tag);
            return;
        };
        for (role, tenant) in &self.bindings {
            let _ = c.execute(
                "SELECT outbox.unbind_tenant($1::text::name, $2::text)",
                &[role, tenant],
            );
        }
        if let Err(e) = pause_tagged(&mut c, &self.tag) {
            eprintln!(
                "cleanup: could not pause channels {}*: {}",
                self.tag,
                describe(&e)
            );
        }
        // Nothing may be in flight when its rows go.
        let tag = self.tag.clone();
        let idle = poll(self.cluster, Duration::from_secs(30), |c| {
            let n: i64 = c
                .query_one(
                    "SELECT count(*) FROM outbox._messages m JOIN outbox._channels ch ON ch.id = m.channel_id
                      WHERE starts_with(ch.name, $1) AND m.state = 'sending'",
                    &[&tag],
                )?
                .get(0);
            Ok((n == 0).then_some(()))
        });
        if idle.is_none() {
            eprintln!(
                "cleanup: messages of channels {}* stayed in sending for 30 s",
                self.tag
            );
        }
        // Children first: attempts and ledger entries, then messages, then the channels.
        const PURGE: [&str; 6] = [
            "DELETE FROM outbox._attempts WHERE message_id IN (
                 SELECT m.id FROM outbox._messages m JOIN outbox._channels ch ON ch.id = m.channel_id
                  WHERE starts_with(ch.name, $1))",
            "DELETE FROM outbox._ledger WHERE message_id IN (
                 SELECT m.id FROM outbox._messages m JOIN outbox._channels ch ON ch.id = m.channel_id
                  WHERE starts_with(ch.name, $1))",
            "DELETE FROM outbox._messages WHERE channel_id IN (
                 SELECT id FROM outbox._channels WHERE starts_with(name, $1))",
            "DELETE FROM outbox._channel_stats WHERE channel_id IN (
                 SELECT id FROM outbox._channels WHERE starts_with(name, $1))",
            "DELETE FROM outbox._channel_minutes WHERE channel_id IN (
                 SELECT id FROM outbox._channels WHERE starts_with(name, $1))",
            "DELETE FROM outbox._channels WHERE starts_with(name, $1)",
        ];
        let result = c.transaction().and_then(|mut tx| {
            for stmt in PURGE {
                tx.execute(stmt, &[&self.tag])?;
            }
            tx.commit()
        });
        if let Err(e) = result {
            eprintln!(
                "cleanup: could not remove channels {}* and their messages: {}",
                self.tag,
                describe(&e)
            );
        }
        for role in self.roles.iter().rev() {
            if let Err(e) = c.batch_execute(&format!("DROP ROLE IF EXISTS {}", ident(role))) {
                eprintln!("cleanup: could not drop role {role}: {}", describe(&e));
            }
        }
    }
}

/// A connection acting as `role` (`SET ROLE` on a superuser connection), or as the
/// superuser itself when `role` is None.
fn session(cluster: &Cluster, role: Option<&str>) -> Client {
    let mut c = cluster.connect();
    c.batch_execute("SET statement_timeout = '60s'")
        .expect("statement_timeout");
    if let Some(r) = role {
        set_role(&mut c, r);
    }
    c
}

// ---------------------------------------------------------------------------------------
// 1. injection strings
// ---------------------------------------------------------------------------------------

/// The hostile strings, each with a label for messages. None contains NUL (tested apart)
/// and none contains a word `CRASH_WORDS` looks for.
fn hostile_strings() -> Vec<(&'static str, String)> {
    let controls: String = (1u8..=0x1f).map(char::from).collect();
    vec![
        ("SQL comment", "'; DROP TABLE outbox._messages; --".into()),
        ("single quote", "'".into()),
        (
            "quoted identifier",
            "\"; DROP TABLE outbox._messages; --".into(),
        ),
        (
            "terminate",
            "'); SELECT pg_terminate_backend(pg_backend_pid()); --".into(),
        ),
        ("dollar quote", "$$".into()),
        ("named dollar quote", "$fn$ SELECT 1 $fn$".into()),
        ("backslash", "\\".into()),
        ("backslash quote", "\\'; SELECT pg_sleep(10); --".into()),
        ("format specifiers", "%s%n%x%%%1$s".into()),
        ("placeholder", "{effect_key}".into()),
        ("placeholders", "{external_id}{payload}{".into()),
        ("escaped NUL text", "\\u0000".into()),
        ("control characters", controls),
        ("CRLF header injection", "x\r\nX-Injected: 1".into()),
        ("DEL and C1 controls", "a\u{7f}b\u{85}c\u{9f}".into()),
        ("RTL override", "\u{202e}gnp.exe\u{202c}".into()),
        ("zero-width and BOM", "\u{feff}a\u{200b}\u{200d}b".into()),
        ("combining marks", "e\u{301}\u{301}\u{301}".into()),
        ("emoji", "😀🚀👩‍👩‍👧".into()),
        ("path traversal", "../../etc/passwd".into()),
        ("percent escapes", "%2e%2e%2f%00%0d%0a".into()),
        ("JSON text", "{\"a\": [1, {\"b\": null}]}".into()),
        ("array literal", "{a,b}".into()),
        ("psql meta-command", "\\! rm -rf /".into()),
        ("markup", "<script>alert(1)</script>".into()),
        ("public", "public".into()),
        ("1000 characters", "r".repeat(1000)),
        ("1001 characters", "r".repeat(1001)),
        ("100,000 é", "é".repeat(100_000)),
        ("50,000 emoji", "😀".repeat(50_000)),
    ]
}

/// What a call must do.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// Succeed (docs/security.md or the contract say the value is valid).
    Ok,
    /// Fail with exactly this SQLSTATE.
    Code(&'static str),
    /// Fail with one of these.
    OneOf(&'static [&'static str]),
    /// Succeed, or fail with any clean SQLSTATE.
    Clean,
}

/// Collects the problems of many calls.
#[derive(Default)]
struct Checker {
    problems: Vec<String>,
    calls: u64,
    successes: u64,
}

impl Checker {
    /// Judges one call; returns its value when it succeeded. A lost connection ends the
    /// test at once.
    fn call<T>(&mut self, what: &str, expect: Expect, r: Result<T, postgres::Error>) -> Option<T> {
        self.calls += 1;
        match r {
            Ok(v) => {
                self.successes += 1;
                match expect {
                    Expect::Code(c) => self
                        .problems
                        .push(format!("{what}: expected SQLSTATE {c}, but it succeeded")),
                    Expect::OneOf(cs) => self.problems.push(format!(
                        "{what}: expected one of SQLSTATE {cs:?}, but it succeeded"
                    )),
                    Expect::Ok | Expect::Clean => {}
                }
                Some(v)
            }
            Err(e) => {
                if e.as_db_error().is_none() {
                    panic!(
                        "{what}: the connection broke: {e}\nproblems so far:\n  - {}",
                        self.problems.join("\n  - ")
                    );
                }
                let code = code_of(&e);
                if unclean(&code) {
                    self.problems.push(format!(
                        "{what}: an unclean error (internal, system, RAISE without ERRCODE, timeout or resource): {}",
                        describe(&e)
                    ));
                    return None;
                }
                match expect {
                    Expect::Ok => self
                        .problems
                        .push(format!("{what}: expected success, got {}", describe(&e))),
                    Expect::Code(c) if code != c => self.problems.push(format!(
                        "{what}: expected SQLSTATE {c}, got {}",
                        describe(&e)
                    )),
                    Expect::OneOf(cs) if !cs.contains(&code.as_str()) => {
                        self.problems.push(format!(
                            "{what}: expected one of SQLSTATE {cs:?}, got {}",
                            describe(&e)
                        ))
                    }
                    _ => {}
                }
                None
            }
        }
    }

    /// Records a failed verbatim read-back.
    fn verbatim(&mut self, what: &str, stored: Option<String>, expected: &str) {
        if stored.as_deref() != Some(expected) {
            self.problems.push(format!(
                "{what}: accepted, but not stored verbatim: expected {}, read back {}",
                short(expected),
                stored
                    .as_deref()
                    .map(short)
                    .unwrap_or_else(|| "nothing".into())
            ));
        }
    }

    fn check(&mut self, ok: bool, problem: impl FnOnce() -> String) {
        if !ok {
            self.problems.push(problem());
        }
    }
}

/// The outcome for a reason or owner of an operator action: at most 1000 characters.
fn reason_expectation(s: &str) -> Expect {
    if s.chars().count() > 1000 {
        Expect::Code("22023")
    } else if has_ascii_control(s) || has_c1_control(s) {
        Expect::Clean
    } else {
        Expect::Ok
    }
}

/// The outcome for an effect key or ordering key: 1 to 255 bytes.
fn key_expectation(s: &str) -> Expect {
    if s.is_empty() || s.len() > 255 {
        Expect::Code("22023")
    } else if has_ascii_control(s) || has_c1_control(s) {
        Expect::Clean
    } else {
        Expect::Ok
    }
}

/// The outcome for a tenant name: 1 to 128 bytes without control characters; `*` is a
/// binding, not a tenant.
fn tenant_expectation(s: &str) -> Expect {
    if s.is_empty() || s.len() > 128 || has_ascii_control(s) {
        Expect::Code("22023")
    } else if has_c1_control(s) {
        // Whether a C1 control counts as a control character is not fixed; clean either way.
        Expect::Clean
    } else {
        Expect::Ok
    }
}

/// The outcome for a message header value: at most 8192 bytes, no control characters.
fn header_value_expectation(s: &str) -> Expect {
    if s.len() > 8192 || has_ascii_control(s) {
        Expect::Code("22023")
    } else if has_c1_control(s) {
        Expect::Clean
    } else {
        Expect::Ok
    }
}

/// The outcome for a message header name: an HTTP token of at most 256 bytes.
fn header_name_expectation(s: &str) -> Expect {
    if is_token(s) && s.len() <= 256 {
        Expect::Ok
    } else {
        Expect::Code("22023")
    }
}

/// The environment of the injection test.
struct Hostile<'a> {
    cluster: &'a Cluster,
    sim: &'a Simulator,
    tag: String,
    su: Client,
    writer: Client,
    operator: Client,
    admin: Client,
    bindee: String,
    /// The channel hostile messages are delivered on (its simulator channel is `base_sim`).
    base: String,
    base_sim: String,
    /// A paused channel: the operator actions' messages stay queued there.
    held: String,
    /// A channel for alter_channel with hostile options.
    alt: String,
    /// A channel for pause_channel with hostile reasons.
    pz: String,
    /// Messages enqueued with hostile content, with their payloads.
    sent: Vec<(i64, Value)>,
    /// `outbox.max_payload_bytes`.
    max_payload: usize,
}

impl Hostile<'_> {
    fn enqueue(
        &mut self,
        ck: &mut Checker,
        what: &str,
        expect: Expect,
        args: (&str, &str, &str, Option<&str>, Option<&str>),
    ) -> Option<i64> {
        let (channel, payload, key, ordering_key, headers) = args;
        let r = self
            .writer
            .query_one(
                "SELECT outbox.enqueue($1::text, $2::text::jsonb, $3::text, $4::text, NULL::timestamptz, $5::text::jsonb)",
                &[&channel, &payload, &key, &ordering_key, &headers],
            )
            .map(|r| r.get::<_, i64>(0));
        ck.call(what, expect, r)
    }

    /// A column of a message, read as the superuser.
    fn message_text(&mut self, id: i64, expr: &str) -> Option<String> {
        self.su
            .query_opt(
                &format!("SELECT ({expr})::text FROM outbox._messages WHERE id = $1"),
                &[&id],
            )
            .unwrap_or_else(|e| panic!("read back {expr} of message {id}: {}", describe(&e)))
            .and_then(|r| r.get(0))
    }

    /// A text at `path` in a channel's options, read as the superuser.
    fn option_text(&mut self, channel: &str, path: &[&str]) -> Option<String> {
        let path: Vec<String> = path.iter().map(|s| s.to_string()).collect();
        self.su
            .query_opt(
                "SELECT options #>> $2::text[] FROM outbox._channels WHERE name = $1",
                &[&channel, &path],
            )
            .unwrap_or_else(|e| panic!("read back options of {channel}: {}", describe(&e)))
            .and_then(|r| r.get(0))
    }

    /// A fresh message of the writer on the paused channel, for the operator actions.
    fn held_message(&mut self, key: &str) -> i64 {
        self.writer
            .query_one(
                "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text)",
                &[&self.held, &key],
            )
            .unwrap_or_else(|e| panic!("writer enqueue on the paused channel: {}", describe(&e)))
            .get(0)
    }

    fn log_reasons(&mut self, id: i64, reason: &str) -> i64 {
        count(
            &mut self.su,
            "SELECT count(*) FROM outbox.operator_log WHERE message_id = $1 AND reason = $2",
            &[&id, &reason],
        )
    }
}

/// Every hostile string in every text argument. `i` numbers the string (for unique keys).
fn injection_round(h: &mut Hostile<'_>, ck: &mut Checker, i: usize, label: &str, s: &str) {
    let tag = h.tag.clone();
    let k = |suffix: &str| format!("{tag}_{i}_{suffix}");
    let w = |what: &str| format!("[{label}] {what}");

    // effect_key(): any non-empty part.
    for (what, source, operation) in [("source", s, "op"), ("operation", "src", s)] {
        let r = h
            .writer
            .query_one(
                "SELECT outbox.effect_key($1::text, $2::text)",
                &[&source, &operation],
            )
            .map(|r| r.get::<_, String>(0));
        if let Some(key) = ck.call(&w(&format!("effect_key with it as {what}")), Expect::Ok, r) {
            ck.check(
                key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit()),
                || {
                    w(&format!(
                        "effect_key with it as {what} returned {key:?}, not 64 hex digits"
                    ))
                },
            );
        }
    }

    // enqueue(): channel, payload, effect key, ordering key, header value and name.
    let r = h
        .writer
        .query_one(
            "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text)",
            &[&s, &k("chan")],
        )
        .map(|r| r.get::<_, i64>(0));
    ck.call(&w("enqueue with it as channel"), Expect::Code("42704"), r);

    let payload = json!({"s": s, s: [s, {"n": s}]});
    let text = payload.to_string();
    let base = h.base.clone();
    // jsonb's text adds a space after ':' and ','; near the limit either outcome is right.
    let payload_expect = if text.len() + 64 < h.max_payload {
        Expect::Ok
    } else if text.len() > h.max_payload {
        Expect::Code("54000")
    } else {
        Expect::Clean
    };
    if let Some(id) = h.enqueue(
        ck,
        &w("enqueue with it in the payload"),
        payload_expect,
        (&base, &text, &k("payload"), None, None),
    ) {
        let same: bool =
            h.su.query_one(
                "SELECT payload = $2::text::jsonb FROM outbox._messages WHERE id = $1",
                &[&id, &text],
            )
            .map(|r| r.get(0))
            .unwrap_or(false);
        ck.check(same, || {
            w(&format!(
                "message {id}: the payload was not stored verbatim"
            ))
        });
        h.sent.push((id, payload));
    }
    let string_payload = Value::String(s.to_string()).to_string();
    if let Some(id) = h.enqueue(
        ck,
        &w("enqueue with it as the whole payload (a JSON string)"),
        Expect::Clean,
        (&base, &string_payload, &k("strpayload"), None, None),
    ) {
        let stored = h.message_text(id, "payload #>> '{}'");
        ck.verbatim(&w("payload string"), stored, s);
        h.sent.push((id, Value::String(s.to_string())));
    }
    let key = format!("{}_{s}", k("key"));
    if let Some(id) = h.enqueue(
        ck,
        &w("enqueue with it in the effect key"),
        key_expectation(&key),
        (&base, "{}", &key, None, None),
    ) {
        let stored = h.message_text(id, "effect_key");
        ck.verbatim(&w("effect key"), stored, &key);
        h.sent.push((id, json!({})));
    }
    let ordering = format!("{}_{s}", k("ord"));
    if let Some(id) = h.enqueue(
        ck,
        &w("enqueue with it in the ordering key"),
        key_expectation(&ordering),
        (&base, "{}", &k("ordkey"), Some(&ordering), None),
    ) {
        let stored = h.message_text(id, "ordering_key");
        ck.verbatim(&w("ordering key"), stored, &ordering);
        h.sent.push((id, json!({})));
    }
    let headers = json!({"X-Probe": s}).to_string();
    if let Some(id) = h.enqueue(
        ck,
        &w("enqueue with it as a header value"),
        header_value_expectation(s),
        (&base, "{}", &k("hval"), None, Some(&headers)),
    ) {
        let stored = h.message_text(id, "headers ->> 'X-Probe'");
        ck.verbatim(&w("header value"), stored, s);
        h.sent.push((id, json!({})));
    }
    let headers = json!({ s: "v" }).to_string();
    if let Some(id) = h.enqueue(
        ck,
        &w("enqueue with it as a header name"),
        header_name_expectation(s),
        (&base, "{}", &k("hname"), None, Some(&headers)),
    ) {
        let present = h.message_text(id, &format!("headers ? {}", sql_literal(s)));
        ck.check(present.as_deref() == Some("true"), || {
            w(&format!(
                "message {id}: header name accepted but not stored verbatim"
            ))
        });
        h.sent.push((id, json!({})));
    }
    h.enqueue(
        ck,
        &w("enqueue with it as the headers JSON text"),
        Expect::Clean,
        (&base, "{}", &k("hraw"), None, Some(s)),
    );

    // Operator actions on a queued message of the operator's tenant.
    let m = h.held_message(&k("held"));
    let r = h
        .operator
        .execute("SELECT outbox.assign($1::int8, $2::text)", &[&m, &s]);
    if ck
        .call(&w("assign with it as owner"), reason_expectation(s), r)
        .is_some()
    {
        let stored = h.message_text(m, "owner");
        ck.verbatim(&w("owner"), stored, s);
    }
    let r = h.operator.execute(
        "SELECT outbox.resolve($1::int8, $2::text, 'hostile input test')",
        &[&m, &s],
    );
    ck.call(&w("resolve with it as outcome"), Expect::Code("22023"), r);
    let r = h.operator.execute(
        "SELECT outbox.resolve($1::int8, 'failed', $2::text)",
        &[&m, &s],
    );
    if ck
        .call(&w("resolve with it as reason"), reason_expectation(s), r)
        .is_some()
    {
        let n = h.log_reasons(m, s);
        ck.check(n >= 1, || {
            w(&format!(
                "resolve of {m}: the reason is not in outbox.operator_log verbatim"
            ))
        });
    }
    let r = h.operator.execute(
        "SELECT outbox.resolve($1::int8, 'failed', 'hostile input test', $2::text)",
        &[&m, &s],
    );
    if ck
        .call(&w("resolve with it as external_id"), Expect::Clean, r)
        .is_some()
    {
        let stored = h.message_text(m, "external_id");
        ck.verbatim(&w("external_id"), stored, s);
    }
    // failed → queued (on the paused channel it stays queued).
    let r = h
        .operator
        .execute("SELECT outbox.retry($1::int8, $2::text)", &[&m, &s]);
    if ck
        .call(&w("retry with it as reason"), reason_expectation(s), r)
        .is_some()
    {
        let n = h.log_reasons(m, s);
        ck.check(n >= 1, || {
            w(&format!(
                "retry of {m}: the reason is not in outbox.operator_log verbatim"
            ))
        });
    }
    let r = h
        .operator
        .execute("SELECT outbox.cancel($1::int8, $2::text)", &[&m, &s]);
    if ck
        .call(&w("cancel with it as reason"), reason_expectation(s), r)
        .is_some()
    {
        let state = h.message_text(m, "state");
        ck.check(state.as_deref() == Some("cancelled"), || {
            w(&format!(
                "cancel of {m} succeeded but the message is {state:?}"
            ))
        });
        let n = h.log_reasons(m, s);
        ck.check(n >= 1, || {
            w(&format!(
                "cancel of {m}: the reason is not in outbox.operator_log verbatim"
            ))
        });
    }

    // Channels, as an outbox_admin: name, endpoint, options, pause reason.
    let name = format!("{}_{s}", k("ch"));
    let url = h.sim.send_url(&h.base_sim);
    let r = h.admin.execute(
        "SELECT outbox.create_channel($1::text, $2::text, '{}'::jsonb)",
        &[&name, &url],
    );
    if ck
        .call(&w("create_channel with it in the name"), Expect::Clean, r)
        .is_some()
    {
        let n = count(
            &mut h.su,
            "SELECT count(*) FROM outbox._channels WHERE name = $1",
            &[&name],
        );
        ck.check(n == 1, || {
            w("channel name accepted but not stored verbatim")
        });
        let r = h.admin.execute(
            "SELECT outbox.pause_channel($1::text, 'hostile name')",
            &[&name],
        );
        ck.call(&w("pause_channel of the channel so named"), Expect::Ok, r);
        let r = h.admin.execute(
            "SELECT outbox.alter_channel($1::text, '{\"max_in_flight\": 3}'::jsonb)",
            &[&name],
        );
        ck.call(&w("alter_channel of the channel so named"), Expect::Ok, r);
        let r = h
            .admin
            .execute("SELECT outbox.resume_channel($1::text)", &[&name]);
        ck.call(&w("resume_channel of the channel so named"), Expect::Ok, r);
        if let Some(id) = h.enqueue(
            ck,
            &w("enqueue on the channel so named"),
            Expect::Ok,
            (&name, "{\"hostile_channel\": true}", &k("onch"), None, None),
        ) {
            h.sent.push((id, json!({"hostile_channel": true})));
        }
    }
    let r = h.admin.execute(
        "SELECT outbox.create_channel($1::text, $2::text, '{}'::jsonb)",
        &[&k("ep"), &s],
    );
    if ck
        .call(&w("create_channel with it as endpoint"), Expect::Clean, r)
        .is_some()
    {
        let stored: Option<String> =
            h.su.query_opt(
                "SELECT endpoint FROM outbox._channels WHERE name = $1",
                &[&k("ep")],
            )
            .expect("endpoint")
            .map(|r| r.get(0));
        ck.verbatim(&w("endpoint"), stored, s);
    }
    let in_url = format!("{url}/{s}");
    let r = h.admin.execute(
        "SELECT outbox.create_channel($1::text, $2::text, '{}'::jsonb)",
        &[&k("ep2"), &in_url],
    );
    if ck
        .call(
            &w("create_channel with it in the endpoint's path"),
            Expect::Clean,
            r,
        )
        .is_some()
    {
        let stored: Option<String> =
            h.su.query_opt(
                "SELECT endpoint FROM outbox._channels WHERE name = $1",
                &[&k("ep2")],
            )
            .expect("endpoint")
            .map(|r| r.get(0));
        ck.verbatim(&w("endpoint with it in the path"), stored, &in_url);
    }

    // Options: (label, options, expectation, where the value is kept if accepted).
    let lookup = format!(
        "{}/by-key/{{effect_key}}?q={s}",
        h.sim.send_url(&h.base_sim)
    );
    let not_found: &[&str] = &["22023", "42883", "42704"];
    let options: Vec<(&str, Value, Expect, Option<Vec<&str>>)> = vec![
        (
            "header value",
            json!({"headers": {"X-H": s}}),
            if has_ascii_control(s) {
                Expect::Code("22023")
            } else {
                Expect::Clean
            },
            Some(vec!["headers", "X-H"]),
        ),
        (
            "header name",
            json!({"headers": {s: "v"}}),
            if is_token(s) {
                Expect::Clean
            } else {
                Expect::Code("22023")
            },
            Some(vec!["headers", s]),
        ),
        ("method", json!({"method": s}), Expect::Code("22023"), None),
        ("kind", json!({"kind": s}), Expect::Code("22023"), None),
        (
            "idempotency_header",
            json!({"idempotency_header": s}),
            if is_token(s) {
                Expect::Clean
            } else {
                Expect::Code("22023")
            },
            Some(vec!["idempotency_header"]),
        ),
        (
            "external_id",
            json!({"external_id": s}),
            if s.starts_with('/') || s.starts_with("header:") {
                Expect::Clean
            } else {
                Expect::Code("22023")
            },
            Some(vec!["external_id"]),
        ),
        (
            "external_id pointer",
            json!({"external_id": format!("/{s}")}),
            Expect::Clean,
            None,
        ),
        (
            "reconcile.url",
            json!({"reconcile": {"url": s}}),
            Expect::Code("22023"),
            None,
        ),
        (
            "reconcile.url query",
            json!({"reconcile": {"url": lookup}}),
            Expect::Clean,
            Some(vec!["reconcile", "url"]),
        ),
        (
            "reconcile.found",
            json!({"reconcile": {"url": h.sim.lookup_url_by_key(&h.base_sim), "found": format!("/{s}")}}),
            Expect::Clean,
            None,
        ),
        (
            "classify status",
            json!({"classify": {s: "transient"}}),
            Expect::Code("22023"),
            None,
        ),
        (
            "classify class",
            json!({"classify": {"409": s}}),
            Expect::Code("22023"),
            None,
        ),
        (
            "retry.jitter",
            json!({"retry": {"jitter": s}}),
            Expect::Code("22023"),
            None,
        ),
        ("unknown key", json!({ s: 1 }), Expect::Code("22023"), None),
        (
            "sql function and run_as",
            json!({"kind": "sql", "function": s, "run_as": s}),
            Expect::OneOf(not_found),
            None,
        ),
    ];
    for (j, (what, opts, expect, path)) in options.iter().enumerate() {
        let text = opts.to_string();
        let ch = k(&format!("o{j}"));
        let r = h.admin.execute(
            "SELECT outbox.create_channel($1::text, $2::text, $3::text::jsonb)",
            &[&ch, &url, &text],
        );
        let created = ck.call(
            &w(&format!("create_channel with it in option {what}")),
            *expect,
            r,
        );
        if created.is_some() {
            if let Some(path) = path {
                let stored = h.option_text(&ch, path);
                if let Some(Value::String(expected)) = opts.pointer(&json_pointer(path)) {
                    ck.verbatim(&w(&format!("option {what}")), stored, expected);
                }
            }
        }
        if *what == "unknown key" && s.len() <= 100 && !has_ascii_control(s) {
            if let Err(e) = h.admin.execute(
                "SELECT outbox.create_channel($1::text, $2::text, $3::text::jsonb)",
                &[&k("unk"), &url, &text],
            ) {
                if let Some(d) = e.as_db_error() {
                    let said = format!(
                        "{} {} {}",
                        d.message(),
                        d.detail().unwrap_or(""),
                        d.hint().unwrap_or("")
                    );
                    ck.check(said.contains(s), || {
                        w(&format!(
                            "an unknown option key must be named in the error; it said: {}",
                            short(&said)
                        ))
                    });
                }
            }
        }
        let alt = h.alt.clone();
        let r = h.admin.execute(
            "SELECT outbox.alter_channel($1::text, $2::text::jsonb)",
            &[&alt, &text],
        );
        if ck
            .call(
                &w(&format!("alter_channel with it in option {what}")),
                *expect,
                r,
            )
            .is_some()
        {
            if let Some(path) = path {
                let stored = h.option_text(&alt, path);
                if let Some(Value::String(expected)) = opts.pointer(&json_pointer(path)) {
                    ck.verbatim(&w(&format!("altered option {what}")), stored, expected);
                }
            }
        }
    }
    let r = h.admin.execute(
        "SELECT outbox.alter_channel($1::text, '{\"max_in_flight\": 2}'::jsonb)",
        &[&s],
    );
    ck.call(
        &w("alter_channel with it as name"),
        Expect::Code("42704"),
        r,
    );
    let endpoint_change = json!({"endpoint": s}).to_string();
    let alt = h.alt.clone();
    let r = h.admin.execute(
        "SELECT outbox.alter_channel($1::text, $2::text::jsonb)",
        &[&alt, &endpoint_change],
    );
    ck.call(
        &w("alter_channel with it as the new endpoint"),
        Expect::Code("22023"),
        r,
    );
    let pz = h.pz.clone();
    let r = h.admin.execute(
        "SELECT outbox.pause_channel($1::text, $2::text)",
        &[&pz, &s],
    );
    let pause_expect = if s.chars().count() > 1000 || has_ascii_control(s) || has_c1_control(s) {
        Expect::Clean
    } else {
        Expect::Ok
    };
    if ck
        .call(&w("pause_channel with it as reason"), pause_expect, r)
        .is_some()
    {
        let stored: Option<String> =
            h.su.query_opt(
                "SELECT paused_reason FROM outbox.channels WHERE name = $1",
                &[&pz],
            )
            .expect("paused_reason")
            .and_then(|r| r.get(0));
        ck.verbatim(&w("pause reason"), stored, s);
        let r = h
            .admin
            .execute("SELECT outbox.resume_channel($1::text)", &[&pz]);
        ck.call(&w("resume_channel after the hostile pause"), Expect::Ok, r);
    }
    let r = h.admin.execute(
        "SELECT outbox.pause_channel($1::text, 'hostile input test')",
        &[&s],
    );
    ck.call(
        &w("pause_channel with it as name"),
        Expect::Code("42704"),
        r,
    );
    let r = h
        .admin
        .execute("SELECT outbox.resume_channel($1::text)", &[&s]);
    ck.call(
        &w("resume_channel with it as name"),
        Expect::Code("42704"),
        r,
    );

    // Tenants, as an outbox_admin: the tenant of a binding, a role name.
    let bindee = h.bindee.clone();
    let r = h.admin.execute(
        "SELECT outbox.bind_tenant($1::text::name, $2::text)",
        &[&bindee, &s],
    );
    if ck
        .call(
            &w("bind_tenant with it as tenant"),
            tenant_expectation(s),
            r,
        )
        .is_some()
    {
        // The role, bound to this tenant alone, enqueues for it.
        let mut b = session(h.cluster, Some(&bindee));
        let r = b
            .query_one(
                "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text)",
                &[&base, &k("tenant")],
            )
            .map(|r| r.get::<_, i64>(0));
        if let Some(id) = ck.call(&w("enqueue by a role bound to it as tenant"), Expect::Ok, r) {
            let stored = h.message_text(id, "tenant");
            ck.verbatim(&w("tenant of a binding"), stored, s);
            h.sent.push((id, json!({})));
        }
        let r = h.admin.execute(
            "SELECT outbox.unbind_tenant($1::text::name, $2::text)",
            &[&bindee, &s],
        );
        ck.call(&w("unbind_tenant with it as tenant"), Expect::Ok, r);
    }
    let r = h.admin.execute(
        "SELECT outbox.bind_tenant($1::text::name, 'hostile_input_tenant')",
        &[&s],
    );
    ck.call(
        &w("bind_tenant with it as role"),
        Expect::OneOf(&["42704", "22023"]),
        r,
    );
    let r = h.admin.execute(
        "SELECT outbox.unbind_tenant($1::text::name, 'hostile_input_tenant')",
        &[&s],
    );
    ck.call(&w("unbind_tenant with it as role"), Expect::Clean, r);

    // outbox.tenant of the superuser: a valid name is a tenant like any other.
    let set = h.su.execute(
        "SELECT pg_catalog.set_config('outbox.tenant', $1::text, false)",
        &[&s],
    );
    let expect = tenant_expectation(s);
    if ck
        .call(
            &w("SET outbox.tenant to it (superuser)"),
            Expect::Clean,
            set,
        )
        .is_some()
    {
        let r =
            h.su.query_one(
                "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text)",
                &[&base, &k("sutenant")],
            )
            .map(|r| r.get::<_, i64>(0));
        if let Some(id) = ck.call(&w("superuser enqueue with it as outbox.tenant"), expect, r) {
            let stored = h.message_text(id, "tenant");
            ck.verbatim(&w("tenant named by outbox.tenant"), stored, s);
            h.sent.push((id, json!({})));
        }
    }
    let _ = h.su.batch_execute("RESET outbox.tenant");
}

/// The JSON pointer of a path of object keys.
fn json_pointer(path: &[&str]) -> String {
    path.iter()
        .map(|p| format!("/{}", p.replace('~', "~0").replace('/', "~1")))
        .collect()
}

/// A SQL string literal (for a read-back expression built by the test itself).
fn sql_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[test]
fn injection_strings_are_stored_verbatim_or_refused_cleanly() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let pids = wait_for_workers(&cluster, &[]);
    let mark = cluster.log_mark();
    let tag = unique("e2ehx");
    let mut cleanup = Cleanup::new(&cluster, &tag);
    let mut su = session(&cluster, None);
    let sim = Simulator::start();

    let writer = cleanup.create_role(&mut su, "writer", Some("outbox_writer"));
    let operator = cleanup.create_role(&mut su, "operator", Some("outbox_operator"));
    let admin = cleanup.create_role(&mut su, "admin", Some("outbox_admin"));
    let bindee = cleanup.create_role(&mut su, "bindee", Some("outbox_writer"));
    let tenant = format!("{tag}_tenant");
    cleanup.bind(&mut su, &writer, &tenant);
    cleanup.bind(&mut su, &operator, &tenant);

    let base_sim = format!("{tag}_base");
    let base = base_sim.clone();
    create_channel(
        &mut su,
        &base,
        &sim.send_url(&base_sim),
        r#"{"idempotency_header": "Idempotency-Key", "external_id": "/id",
            "retry": {"max_attempts": 2, "base_ms": 100, "jitter": "none"}}"#,
    );
    let held = format!("{tag}_held");
    let alt = format!("{tag}_alt");
    let pz = format!("{tag}_pz");
    for ch in [&held, &alt, &pz] {
        create_channel(&mut su, ch, &sim.send_url(&base_sim), "{}");
    }
    su.execute(
        "SELECT outbox.pause_channel($1, 'hostile input test: hold')",
        &[&held],
    )
    .expect("pause the held channel");
    let max_payload: i64 = su
        .query_one(
            "SELECT coalesce(current_setting('outbox.max_payload_bytes', true)::int8, 1048576)",
            &[],
        )
        .expect("outbox.max_payload_bytes")
        .get(0);
    let max_payload = max_payload as usize;
    cleanup.bindings.extend(
        hostile_strings()
            .into_iter()
            .map(|(_, s)| (bindee.clone(), s)),
    );

    let mut h = Hostile {
        cluster: &cluster,
        sim: &sim,
        tag: tag.clone(),
        writer: session(&cluster, Some(&writer)),
        operator: session(&cluster, Some(&operator)),
        admin: session(&cluster, Some(&admin)),
        su,
        bindee,
        base: base.clone(),
        base_sim: base_sim.clone(),
        held,
        alt,
        pz,
        sent: Vec::new(),
        max_payload,
    };

    // Baselines: with ordinary values every role's calls succeed; otherwise the hostile
    // calls below would be refused for the wrong reason.
    let baseline = h.held_message(&format!("{tag}_baseline"));
    h.operator
        .execute(
            "SELECT outbox.assign($1::int8, 'baseline owner')",
            &[&baseline],
        )
        .unwrap_or_else(|e| {
            panic!(
                "baseline: the operator could not assign its tenant's message: {}",
                describe(&e)
            )
        });
    let admin_ch = format!("{tag}_admin");
    h.admin
        .execute(
            "SELECT outbox.create_channel($1::text, $2::text, '{}'::jsonb)",
            &[&admin_ch, &sim.send_url(&base_sim)],
        )
        .unwrap_or_else(|e| {
            panic!(
                "baseline: outbox_admin could not create a channel: {}",
                describe(&e)
            )
        });

    let mut ck = Checker::default();
    for (i, (label, s)) in hostile_strings().iter().enumerate() {
        injection_round(&mut h, &mut ck, i, label, s);
    }

    // NUL: refused by the server's input functions, cleanly.
    let with_nul = format!("{tag}_a\0b");
    let r = h
        .writer
        .query_one(
            "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text)",
            &[&base, &with_nul],
        )
        .map(|r| r.get::<_, i64>(0));
    ck.call(
        "[NUL] enqueue with NUL in the effect key",
        Expect::Code("22021"),
        r,
    );
    let r = h
        .writer
        .query_one(
            "SELECT outbox.enqueue($1::text, '{\"s\": \"\\u0000\"}'::text::jsonb, $2::text)",
            &[&base, &format!("{tag}_nul_json")],
        )
        .map(|r| r.get::<_, i64>(0));
    ck.call(
        "[NUL] enqueue with \\u0000 in the payload",
        Expect::Code("22P05"),
        r,
    );
    let bindee = h.bindee.clone();
    let r = h.admin.execute(
        "SELECT outbox.bind_tenant($1::text::name, $2::text)",
        &[&bindee, &"a\0b"],
    );
    ck.call(
        "[NUL] bind_tenant with NUL in the tenant",
        Expect::Code("22021"),
        r,
    );

    // The schema is intact.
    let private = [
        "_channels",
        "_messages",
        "_attempts",
        "_ledger",
        "_operator_log",
    ];
    for rel in private.into_iter().chain(CONTRACT_VIEWS) {
        let exists: bool =
            h.su.query_one("SELECT to_regclass('outbox.' || $1) IS NOT NULL", &[&rel])
                .expect("to_regclass")
                .get(0);
        ck.check(exists, || format!("outbox.{rel} no longer exists"));
    }
    let _ = count(&mut h.su, "SELECT count(*) FROM outbox._messages", &[]);

    // The hostile messages settle: none stays queued or in flight on a running channel.
    let tagc = tag.clone();
    let mut last = Vec::new();
    let settled = poll(&cluster, HOSTILE_SETTLE, |c| {
        last = c
            .query(
                "SELECT m.id, m.state::text, coalesce(m.last_error, '') FROM outbox._messages m
                   JOIN outbox._channels ch ON ch.id = m.channel_id
                  WHERE starts_with(ch.name, $1) AND NOT ch.paused AND m.state IN ('queued', 'sending')",
                &[&tagc],
            )?
            .iter()
            .map(|r| (r.get::<_, i64>(0), r.get::<_, String>(1), r.get::<_, String>(2)))
            .collect();
        Ok(last.is_empty().then_some(()))
    });
    ck.check(settled.is_some(), || {
        format!("hostile messages still queued or sending after {HOSTILE_SETTLE:?}: {last:?}")
    });
    // What the provider got for each delivered hostile payload is that payload.
    let bodies: Vec<Value> = sim
        .sends(&base_sim)
        .iter()
        .filter_map(|r| serde_json::from_slice(&r.body).ok())
        .collect();
    let mut states: BTreeMap<String, u64> = BTreeMap::new();
    for (id, payload) in &h.sent.clone() {
        let state = h
            .message_text(*id, "state")
            .unwrap_or_else(|| "gone".into());
        *states.entry(state.clone()).or_default() += 1;
        if state == "delivered" && !bodies.contains(payload) {
            ck.problems.push(format!(
                "message {id} is delivered but the provider received no body equal to its payload {}",
                short(&payload.to_string())
            ));
        }
    }
    println!("hostile messages by final state: {states:?}");

    // The Prometheus exposition still parses with the hostile channel names in it.
    match h.su.query_one("SELECT outbox.prometheus()", &[]) {
        Ok(row) => {
            // The text format allows a raw CR inside a label value (only \\, \" and \n
            // are escaped), but this parser's grammar ends a line at CR: show it as ␍.
            let text = row.get::<_, String>(0).replace('\r', "\u{240d}");
            if let Err(e) = parse_prometheus(&text) {
                let lines: Vec<&str> = text.lines().filter(|l| l.contains(&tag)).take(5).collect();
                ck.problems.push(format!(
                    "outbox.prometheus() is not valid Prometheus text once channels have hostile names: {e:?}; lines of this test's channels: {lines:?}"
                ));
            }
        }
        Err(e) => ck.problems.push(format!(
            "outbox.prometheus() failed with hostile channel names present: {}",
            describe(&e)
        )),
    }

    // A normal message is still delivered.
    let fresh = format!("{tag}_fresh");
    create_channel(&mut h.su, &fresh, &sim.send_url(&fresh), "{}");
    let id: i64 = h
        .writer
        .query_one(
            "SELECT outbox.enqueue($1::text, '{\"after\": \"hostile input\"}'::jsonb, $2::text)",
            &[&fresh, &format!("{tag}_fresh_key")],
        )
        .unwrap_or_else(|e| panic!("a normal enqueue after the hostile input: {}", describe(&e)))
        .get(0);
    ck.check(sim.wait_for_stored(&fresh, 1, HOSTILE_SETTLE), || {
        format!("a normal message ({id}) enqueued after the hostile input was not delivered within {HOSTILE_SETTLE:?}")
    });

    let after = wait_for_workers(&cluster, &[]);
    ck.check(after == pids, || {
        format!("the delivery workers restarted during the hostile input (PIDs {pids:?} before, {after:?} after); see {}", cluster.log_path().display())
    });
    let crashes = crash_lines(&cluster.log_since(mark));
    ck.check(crashes.is_empty(), || {
        format!(
            "the server log shows a crash during the hostile input:\n{}",
            crashes.join("\n")
        )
    });
    println!(
        "hostile input: {} calls, {} succeeded, {} problems",
        ck.calls,
        ck.successes,
        ck.problems.len()
    );
    drop(h);
    drop(cleanup);
    assert!(
        ck.problems.is_empty(),
        "{} problem(s) with hostile input:\n  - {}",
        ck.problems.len(),
        ck.problems.join("\n  - ")
    );
}

// ---------------------------------------------------------------------------------------
// 2. fuzz
// ---------------------------------------------------------------------------------------

/// xorshift64: small, deterministic, seedable.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(if seed == 0 {
            0x9e37_79b9_7f4a_7c15
        } else {
            seed
        })
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len() as u64) as usize]
    }
}

/// One argument of a fuzz call.
#[derive(Debug, Clone)]
enum Arg {
    Text(Option<String>),
    Int(Option<i64>),
}

impl Arg {
    fn as_sql(&self) -> &(dyn ToSql + Sync) {
        match self {
            Arg::Text(t) => t,
            Arg::Int(i) => i,
        }
    }

    fn summary(&self) -> String {
        match self {
            Arg::Text(None) | Arg::Int(None) => "NULL".into(),
            Arg::Text(Some(t)) => short(t),
            Arg::Int(Some(i)) => i.to_string(),
        }
    }
}

/// What a successful call adds to the pools.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Effect {
    None,
    Channel,
    Message,
    Binding,
}

struct Call {
    function: &'static str,
    sql: &'static str,
    args: Vec<Arg>,
    effect: Effect,
}

impl Call {
    fn describe(&self) -> String {
        format!(
            "{}({})",
            self.function,
            self.args
                .iter()
                .map(Arg::summary)
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
}

/// What the fuzz draws from besides random values.
struct Pools {
    tag: String,
    serial: u64,
    channels: Vec<String>,
    ids: Vec<i64>,
    roles: Vec<String>,
    tenants: Vec<String>,
    endpoints: Vec<String>,
    lookups: Vec<String>,
    hostile: Vec<String>,
    /// Every role of the cluster that is not the fuzz's own: never bound by the fuzz.
    foreign_roles: HashSet<String>,
    /// Ids the fuzz must not touch: higher than every message that existed before it.
    unknown_base: i64,
}

const KNOWN_OPTION_KEYS: [&str; 18] = [
    "kind",
    "method",
    "headers",
    "timeout_ms",
    "connect_timeout_ms",
    "idempotency_header",
    "idempotency_window_ms",
    "reference_header",
    "external_id",
    "reconcile",
    "retry",
    "classify",
    "max_in_flight",
    "function",
    "run_as",
    "endpoint",
    "tenants",
    "max_response_bytes",
];

const MALFORMED_JSON: [&str; 14] = [
    "",
    "{",
    "[1,]",
    "{\"a\" 1}",
    "nul",
    "'{}'",
    "\"\\ud800\"",
    "\"\\u0000\"",
    "{\"a\": \"\\u0000\"}",
    "1e1000000",
    "-1e-1000000",
    "{\"a\": NaN}",
    "[\"\\x41\"]",
    "\u{feff}{}",
];

const TIMESTAMPS: [&str; 12] = [
    "infinity",
    "-infinity",
    "now",
    "epoch",
    "2999-12-31 23:59:59+00",
    "294276-12-31 23:59:59+00",
    "4713-01-01 00:00:00+00 BC",
    "1999-13-45",
    "not a time",
    "2000-01-01T00:00:00Z",
    "allballs",
    "",
];

/// Characters from the ranges hostile text is made of: ASCII, controls, Latin-1, RTL and
/// zero-width marks, combining marks, CJK, emoji, private use, the last code point.
fn random_char(rng: &mut Rng) -> char {
    let ranges: [(u32, u32); 11] = [
        (0x20, 0x7e),
        (0x20, 0x7e),
        (0x01, 0x1f),
        (0x7f, 0x9f),
        (0xa0, 0xff),
        (0x200b, 0x200f),
        (0x202a, 0x202e),
        (0x0300, 0x036f),
        (0x4e00, 0x9fff),
        (0x1f600, 0x1f64f),
        (0xe000, 0xe0ff),
    ];
    if rng.chance(1) {
        return '\u{10ffff}';
    }
    let (lo, hi) = *rng.pick(&ranges);
    char::from_u32(lo + rng.below(u64::from(hi - lo + 1)) as u32).unwrap_or('?')
}

/// True when `s` holds a word the crash check looks for in the server log (error messages
/// quote their input).
fn looks_like_a_crash(s: &str) -> bool {
    let upper = s.to_uppercase();
    ["PANIC", "TRAP", "SERVER PROCESS", "TERMINATED"]
        .iter()
        .any(|w| upper.contains(w))
}

impl Pools {
    fn next_serial(&mut self) -> u64 {
        self.serial += 1;
        self.serial
    }

    /// A random text, NULL included.
    fn text(&mut self, rng: &mut Rng) -> Option<String> {
        let s = match rng.below(100) {
            0..=9 => return None,
            10..=17 => String::new(),
            18..=37 => rng.pick(&self.hostile).clone(),
            38..=54 => (0..1 + rng.below(40))
                .map(|_| char::from(0x20 + rng.below(0x5f) as u8))
                .collect(),
            55..=71 => (0..1 + rng.below(60)).map(|_| random_char(rng)).collect(),
            72..=73 => {
                let c = random_char(rng);
                std::iter::repeat_n(c, 10_000 + rng.below(90_000) as usize).collect()
            }
            74..=76 => rng.pick(&[" ", "\t", "\n", "\r\n", " \u{a0} "]).to_string(),
            77 => format!("nul\0{}", rng.below(10)),
            _ => {
                let n = self.next_serial();
                format!("{}_{n}", self.tag)
            }
        };
        if looks_like_a_crash(&s) {
            Some("x".into())
        } else {
            Some(s)
        }
    }

    fn json_value(&mut self, rng: &mut Rng, depth: u32) -> Value {
        let kinds = if depth >= 4 { 6 } else { 9 };
        match rng.below(kinds) {
            0 => Value::Null,
            1 => Value::Bool(rng.chance(50)),
            2 => json!(*rng.pick(&[0i64, -1, 1, i64::MIN, i64::MAX, 1 << 53, -(1 << 53) - 1])),
            3 => json!(*rng.pick(&[0.5f64, -0.0, 1e308, -1e308, 5e-324, 3.141_592_653_589_793])),
            4 | 5 => Value::String(
                self.text(rng)
                    .unwrap_or_default()
                    .replace('\0', "")
                    .chars()
                    .take(20_000)
                    .collect(),
            ),
            6 => Value::Array(
                (0..rng.below(5))
                    .map(|_| self.json_value(rng, depth + 1))
                    .collect(),
            ),
            _ => {
                let mut m = Map::new();
                for _ in 0..rng.below(5) {
                    let k = self.text(rng).unwrap_or_default().replace('\0', "");
                    let v = self.json_value(rng, depth + 1);
                    m.insert(k, v);
                }
                Value::Object(m)
            }
        }
    }

    /// Random JSON text: mostly valid, sometimes deep, huge, escaped or malformed.
    fn json(&mut self, rng: &mut Rng) -> Option<String> {
        Some(match rng.below(100) {
            0..=4 => return None,
            5..=9 => rng.pick(&MALFORMED_JSON).to_string(),
            10..=12 => {
                let n = *rng.pick(&[100usize, 1000, 5000]);
                if rng.chance(50) {
                    format!("{}{}", "[".repeat(n), "]".repeat(n))
                } else {
                    format!("{}1{}", "{\"a\":".repeat(n), "}".repeat(n))
                }
            }
            13..=15 => rng
                .pick(&[
                    "1e400",
                    "-1e-400",
                    "123456789012345678901234567890123456789012345678901234567890",
                    "{\"n\": 1e308, \"m\": -9223372036854775809}",
                    "\"\\ud83d\\ude00 \\u202e \\u00e9\"",
                    "{\"\\u202e\": \"\\ufeff\"}",
                    "[[], {}, [[]], {\"\": {}}]",
                ])
                .to_string(),
            _ => {
                let text = self.json_value(rng, 0).to_string();
                // Rare nests of long strings: keep a call's size near the payload limit.
                if text.len() > 1_500_000 {
                    format!("{{\"big\": \"{}\"}}", "x".repeat(1_100_000))
                } else {
                    text
                }
            }
        })
    }

    /// Message headers: names a message may set, framing, routing, signing and key headers
    /// it may not, and hostile names.
    fn message_headers(&mut self, rng: &mut Rng) -> String {
        let mut m = Map::new();
        for _ in 0..=rng.below(3) {
            let name = match rng.below(3) {
                0 => self.text(rng).unwrap_or_default().replace('\0', ""),
                _ => rng
                    .pick(&[
                        "X-Request-Id",
                        "Host",
                        "content-length",
                        "Transfer-Encoding",
                        "X-Forwarded-For",
                        "Proxy-Authorization",
                        "Forwarded",
                        "webhook-signature",
                        "Idempotency-Key",
                        "X-Effect-Key",
                    ])
                    .to_string(),
            };
            m.insert(name, json!(rng.pick(&["3", "", "v\r\nX-Injected: 1"])));
        }
        Value::Object(m).to_string()
    }

    /// A value for a channel option `key`: the right type or deliberately the wrong one.
    fn option_value(&mut self, rng: &mut Rng, key: &str) -> Value {
        if rng.chance(30) {
            return self.json_value(rng, 2);
        }
        let int = |rng: &mut Rng| -> Value {
            json!(*rng.pick(&[0i64, -1, 1, 100, 3_600_000, 3_600_001, i64::MAX, i64::MIN]))
        };
        match key {
            "kind" => json!(rng.pick(&["http", "sql", "smtp", "", "HTTP"])),
            "method" => json!(rng.pick(&["POST", "get", "DELETE", "TRACE", "", "P OST"])),
            "headers" => {
                let mut m = Map::new();
                for _ in 0..rng.below(4) {
                    let name = if rng.chance(50) {
                        rng.pick(&["X-A", "Authorization", "Content-Type", "X Bad"])
                            .to_string()
                    } else {
                        self.text(rng).unwrap_or_default().replace('\0', "")
                    };
                    let value = self.text(rng).unwrap_or_default().replace('\0', "");
                    m.insert(name, json!(value));
                }
                Value::Object(m)
            }
            "tenants" => match rng.below(7) {
                0 => json!(["*"]),
                1 => json!(["default"]),
                2 => json!([]),
                3 => json!(["*", "default"]),
                4 => json!("default"),
                5 => json!([1, null]),
                _ => json!([self.text(rng).unwrap_or_default()]),
            },
            "timeout_ms"
            | "connect_timeout_ms"
            | "max_in_flight"
            | "idempotency_window_ms"
            | "max_response_bytes" => {
                if rng.chance(20) {
                    json!(rng.pick(&["100", "1.5", "-0"]))
                } else {
                    int(rng)
                }
            }
            "idempotency_header" | "reference_header" => {
                json!(rng.pick(&["Idempotency-Key", "X-Effect-Key", "X Bad", "", "é"]))
            }
            "external_id" => {
                json!(rng.pick(&["/id", "header:X-Message-Id", "header:", "id", "/", "~"]))
            }
            "reconcile" => {
                let mut m = Map::new();
                if rng.chance(90) {
                    m.insert("url".into(), json!(rng.pick(&self.lookups).clone()));
                }
                for k in ["method", "found", "external_id", "settle_ms", "nope"] {
                    if rng.chance(25) {
                        let v = match k {
                            "method" => json!(rng.pick(&["GET", "HEAD", "POST", "PUT", ""])),
                            "found" | "external_id" => json!(rng.pick(&["/found", "/id", "x", ""])),
                            "settle_ms" => int(rng),
                            _ => self.json_value(rng, 3),
                        };
                        m.insert(k.into(), v);
                    }
                }
                Value::Object(m)
            }
            "retry" => {
                let mut m = Map::new();
                for k in [
                    "max_attempts",
                    "base_ms",
                    "max_ms",
                    "multiplier",
                    "jitter",
                    "max_age_ms",
                    "respect_retry_after",
                    "max_retry_after_ms",
                    "nope",
                ] {
                    if rng.chance(30) {
                        let v = match k {
                            "multiplier" => json!(*rng.pick(&[0.0f64, 1.0, 2.0, 1e308, -1.0])),
                            "jitter" => json!(rng.pick(&["full", "equal", "none", "some"])),
                            "respect_retry_after" => json!(rng.chance(50)),
                            "nope" => self.json_value(rng, 3),
                            _ => int(rng),
                        };
                        m.insert(k.into(), v);
                    }
                }
                Value::Object(m)
            }
            "classify" => {
                let mut m = Map::new();
                for _ in 0..rng.below(3) {
                    let status = rng
                        .pick(&["409", "404", "200", "999", "4xx", "abc", "-1"])
                        .to_string();
                    m.insert(
                        status,
                        json!(rng.pick(&[
                            "transient",
                            "permanent",
                            "ambiguous",
                            "delivered",
                            "nope"
                        ])),
                    );
                }
                Value::Object(m)
            }
            "function" => json!(rng.pick(&[
                "public.e2e_nope",
                "pg_catalog.now",
                "outbox.enqueue",
                "x",
                ""
            ])),
            "run_as" => json!(rng.pick(&["postgres", "outbox_worker", "no_such_role", ""])),
            "endpoint" => json!(rng.pick(&self.endpoints).clone()),
            _ => self.json_value(rng, 2),
        }
    }

    /// A random option object (or, sometimes, any JSON at all).
    fn options(&mut self, rng: &mut Rng) -> Option<String> {
        if rng.chance(10) {
            return self.json(rng);
        }
        let mut m = Map::new();
        for _ in 0..rng.below(5) {
            let key = if rng.chance(85) {
                rng.pick(&KNOWN_OPTION_KEYS).to_string()
            } else {
                self.text(rng).unwrap_or_default().replace('\0', "")
            };
            let value = self.option_value(rng, &key);
            m.insert(key, value);
        }
        Some(Value::Object(m).to_string())
    }

    /// A channel name to use: mostly one the fuzz created.
    fn channel(&mut self, rng: &mut Rng) -> Option<String> {
        if !self.channels.is_empty() && rng.chance(75) {
            Some(rng.pick(&self.channels).clone())
        } else {
            self.text(rng)
        }
    }

    /// A name for a new channel: always starts with the run's tag (so the cleanup finds
    /// it), unless NULL or empty.
    fn new_channel(&mut self, rng: &mut Rng) -> Option<String> {
        match rng.below(100) {
            0..=4 => None,
            5..=9 => Some(String::new()),
            _ => {
                let n = self.next_serial();
                let suffix = if rng.chance(50) {
                    self.text(rng).unwrap_or_default()
                } else {
                    String::new()
                };
                Some(format!("{}_c{n}{suffix}", self.tag))
            }
        }
    }

    fn endpoint(&mut self, rng: &mut Rng) -> Option<String> {
        if rng.chance(70) {
            Some(rng.pick(&self.endpoints).clone())
        } else {
            // Never an http(s) URL with a host: at worst a refused endpoint.
            self.text(rng).map(|t| t.replace("//", "/"))
        }
    }

    /// An id: a message of the fuzz, an extreme, or one that does not exist. Never a small
    /// positive id, which may belong to another test's message.
    fn id(&mut self, rng: &mut Rng) -> Option<i64> {
        match rng.below(100) {
            0..=4 => None,
            5..=24 => Some(*rng.pick(&[
                i64::MIN,
                i64::MIN + 1,
                -1,
                0,
                i64::MAX,
                i64::MAX - 1,
                -(1 << 31),
                1 << 31,
                1 << 32,
            ])),
            25..=79 if !self.ids.is_empty() => Some(*rng.pick(&self.ids)),
            _ => Some(self.unknown_base + rng.below(1_000_000) as i64),
        }
    }

    fn role(&mut self, rng: &mut Rng) -> Option<String> {
        let r = if rng.chance(50) {
            Some(rng.pick(&self.roles).clone())
        } else {
            self.text(rng)
        };
        // Never bind a role the fuzz does not own (another test's, or outbox_writer itself).
        match r {
            Some(name) if self.foreign_roles.contains(&name) => Some(self.roles[0].clone()),
            other => other,
        }
    }

    fn tenant(&mut self, rng: &mut Rng) -> Option<String> {
        if rng.chance(40) {
            Some(rng.pick(&self.tenants).clone())
        } else if rng.chance(5) {
            Some("*".into())
        } else {
            self.text(rng)
        }
    }

    fn timestamp(&mut self, rng: &mut Rng) -> Option<String> {
        if rng.chance(40) {
            None
        } else if rng.chance(80) {
            Some(rng.pick(&TIMESTAMPS).to_string())
        } else {
            self.text(rng)
        }
    }

    fn payload(&mut self, rng: &mut Rng) -> Option<String> {
        if rng.chance(50) {
            Some(json!({"fuzz": self.next_serial(), "text": self.text(rng).map(|t| t.replace('\0', ""))}).to_string())
        } else {
            self.json(rng)
        }
    }

    fn effect_key(&mut self, rng: &mut Rng) -> Option<String> {
        if rng.chance(50) {
            let n = self.next_serial();
            Some(format!("{}_k{n}", self.tag))
        } else {
            self.text(rng)
        }
    }

    /// The next call, drawn with fixed weights over every public function.
    fn call(&mut self, rng: &mut Rng) -> Call {
        use Arg::{Int, Text};
        let r = rng.below(1000);
        match r {
            0..=79 => Call {
                function: "effect_key",
                sql: "SELECT outbox.effect_key($1::text, $2::text)",
                args: vec![Text(self.text(rng)), Text(self.text(rng))],
                effect: Effect::None,
            },
            80..=159 => Call {
                function: "create_channel",
                sql: "SELECT outbox.create_channel($1::text, $2::text, $3::text::jsonb)",
                args: vec![
                    Text(self.new_channel(rng)),
                    Text(self.endpoint(rng)),
                    Text(if rng.chance(40) { Some("{}".into()) } else { self.options(rng) }),
                ],
                effect: Effect::Channel,
            },
            160..=179 => Call {
                function: "create_channel/2",
                sql: "SELECT outbox.create_channel($1::text, $2::text)",
                args: vec![Text(self.new_channel(rng)), Text(self.endpoint(rng))],
                effect: Effect::Channel,
            },
            180..=239 => Call {
                function: "alter_channel",
                sql: "SELECT outbox.alter_channel($1::text, $2::text::jsonb)",
                args: vec![Text(self.channel(rng)), Text(self.options(rng))],
                effect: Effect::None,
            },
            240..=264 => Call {
                function: "pause_channel",
                sql: "SELECT outbox.pause_channel($1::text, $2::text)",
                args: vec![Text(self.channel(rng)), Text(self.text(rng))],
                effect: Effect::None,
            },
            265..=284 => Call {
                function: "resume_channel",
                sql: "SELECT outbox.resume_channel($1::text)",
                args: vec![Text(self.channel(rng))],
                effect: Effect::None,
            },
            285..=429 => Call {
                function: "enqueue",
                sql: "SELECT outbox.enqueue($1::text, $2::text::jsonb, $3::text, $4::text, $5::text::timestamptz, $6::text::jsonb)",
                args: vec![
                    Text(self.channel(rng)),
                    Text(self.payload(rng)),
                    Text(self.effect_key(rng)),
                    Text(if rng.chance(60) { None } else { self.text(rng) }),
                    Text(self.timestamp(rng)),
                    Text(match rng.below(4) {
                        0 | 1 => None,
                        2 => self.json(rng),
                        _ => Some(self.message_headers(rng)),
                    }),
                ],
                effect: Effect::Message,
            },
            430..=479 => Call {
                function: "enqueue/3",
                sql: "SELECT outbox.enqueue($1::text, $2::text::jsonb, $3::text)",
                args: vec![
                    Text(self.channel(rng)),
                    Text(self.payload(rng)),
                    Text(self.effect_key(rng)),
                ],
                effect: Effect::Message,
            },
            480..=529 => Call {
                function: "status",
                sql: "SELECT outbox.status($1::int8)::text",
                args: vec![Int(self.id(rng))],
                effect: Effect::None,
            },
            530..=569 => Call {
                function: "reconcile(id)",
                sql: "SELECT outbox.reconcile($1::int8)",
                args: vec![Int(self.id(rng))],
                effect: Effect::None,
            },
            570..=572 => Call {
                function: "reconcile()",
                sql: "SELECT * FROM outbox.reconcile()",
                args: vec![],
                effect: Effect::None,
            },
            573..=619 => Call {
                function: "retry",
                sql: "SELECT outbox.retry($1::int8, $2::text)::text",
                args: vec![Int(self.id(rng)), Text(self.text(rng))],
                effect: Effect::None,
            },
            620..=669 => Call {
                function: "resolve",
                sql: "SELECT outbox.resolve($1::int8, $2::text, $3::text, $4::text)::text",
                args: vec![
                    Int(self.id(rng)),
                    Text(if rng.chance(60) {
                        Some(rng.pick(&["delivered", "failed", "cancelled"]).to_string())
                    } else {
                        self.text(rng)
                    }),
                    Text(self.text(rng)),
                    Text(if rng.chance(50) { None } else { self.text(rng) }),
                ],
                effect: Effect::None,
            },
            670..=709 => Call {
                function: "cancel",
                sql: "SELECT outbox.cancel($1::int8, $2::text)::text",
                args: vec![Int(self.id(rng)), Text(self.text(rng))],
                effect: Effect::None,
            },
            710..=749 => Call {
                function: "assign",
                sql: "SELECT outbox.assign($1::int8, $2::text)",
                args: vec![Int(self.id(rng)), Text(self.text(rng))],
                effect: Effect::None,
            },
            750..=799 => Call {
                function: "bind_tenant",
                sql: "SELECT outbox.bind_tenant($1::text::name, $2::text)",
                args: vec![Text(self.role(rng)), Text(self.tenant(rng))],
                effect: Effect::Binding,
            },
            800..=829 => Call {
                function: "unbind_tenant",
                sql: "SELECT outbox.unbind_tenant($1::text::name, $2::text)",
                args: vec![Text(self.role(rng)), Text(self.tenant(rng))],
                effect: Effect::None,
            },
            830..=849 => Call {
                function: "prometheus",
                sql: "SELECT length(outbox.prometheus())",
                args: vec![],
                effect: Effect::None,
            },
            850..=869 => Call {
                function: "worker_status",
                sql: "SELECT * FROM outbox.worker_status()",
                args: vec![],
                effect: Effect::None,
            },
            870..=919 => Call {
                function: "set outbox.tenant",
                sql: "SELECT pg_catalog.set_config('outbox.tenant', $1::text, false)",
                args: vec![Text(self.tenant(rng))],
                effect: Effect::None,
            },
            _ => {
                let (function, sql): (&'static str, &'static str) = *rng.pick(&[
                    ("read messages", "SELECT count(*) FROM outbox.messages WHERE effect_key = $1::text OR channel = $1::text"),
                    ("read attempts", "SELECT count(*) FROM outbox.attempts WHERE error = $1::text OR true"),
                    ("read ledger", "SELECT count(*) FROM outbox.ledger WHERE effect_key = $1::text"),
                    ("read work_queue", "SELECT count(*) FROM outbox.work_queue WHERE owner = $1::text OR true"),
                    ("read operator_log", "SELECT count(*) FROM outbox.operator_log WHERE reason = $1::text"),
                    ("read channels", "SELECT count(*) FROM outbox.channels WHERE name = $1::text"),
                    ("read metrics", "SELECT count(*) FROM outbox.metrics WHERE channel = $1::text OR true"),
                    ("read alerts", "SELECT count(*) FROM outbox.alerts WHERE channel = $1::text OR true"),
                ]);
                Call {
                    function,
                    sql,
                    args: vec![Text(self.text(rng))],
                    effect: Effect::None,
                }
            }
        }
    }
}

/// The fuzz's record: SQLSTATEs per role and function, and the calls that failed it.
#[derive(Default)]
struct FuzzLog {
    histogram: BTreeMap<String, BTreeMap<String, u64>>,
    failures: Vec<String>,
    successes: u64,
}

impl FuzzLog {
    fn record(&mut self, who: &str, function: &str, outcome: &str) {
        *self
            .histogram
            .entry(format!("{who} {function}"))
            .or_default()
            .entry(outcome.to_string())
            .or_default() += 1;
    }

    fn print(&self) {
        println!("SQLSTATEs seen (role function: outcome × count):");
        for (k, v) in &self.histogram {
            let outcomes: Vec<String> = v.iter().map(|(o, n)| format!("{o}×{n}")).collect();
            println!("  {k}: {}", outcomes.join(" "));
        }
    }
}

/// Runs one call on `c` and records it; panics when the connection broke.
#[allow(clippy::too_many_arguments)]
fn fuzz_one(
    c: &mut impl GenericClient,
    who: &str,
    call: &Call,
    pools: &mut Pools,
    log: &mut FuzzLog,
    seed: u64,
    iteration: u64,
    bindings: &mut Vec<(String, String)>,
) -> bool {
    let params: Vec<&(dyn ToSql + Sync)> = call.args.iter().map(Arg::as_sql).collect();
    let started = Instant::now();
    match c.query(call.sql, &params) {
        Ok(rows) => {
            log.successes += 1;
            log.record(who, call.function, "ok");
            match call.effect {
                Effect::Channel => {
                    if let Arg::Text(Some(name)) = &call.args[0] {
                        pools.channels.push(name.clone());
                    }
                }
                Effect::Message => {
                    if let Some(id) = rows.first().and_then(|r| r.try_get::<_, i64>(0).ok()) {
                        pools.ids.push(id);
                    }
                }
                Effect::Binding => {
                    if let (Arg::Text(Some(role)), Arg::Text(Some(tenant))) =
                        (&call.args[0], &call.args[1])
                    {
                        bindings.push((role.clone(), tenant.clone()));
                    }
                }
                Effect::None => {}
            }
            true
        }
        Err(e) => {
            let code = code_of(&e);
            log.record(who, call.function, &code);
            if e.as_db_error().is_none() {
                log.print();
                panic!(
                    "fuzz (seed {seed}, iteration {iteration}): the connection of {who} broke on {}: {e}",
                    call.describe()
                );
            }
            if code.starts_with("XX")
                || code.starts_with("58")
                || code.starts_with("53")
                || code.starts_with("57P")
                || code == "57014"
            {
                log.failures.push(format!(
                    "seed {seed}, iteration {iteration}, as {who}, after {:?}: {} → {}",
                    started.elapsed(),
                    call.describe(),
                    describe(&e)
                ));
            }
            false
        }
    }
}

#[test]
fn fuzzing_every_public_function_never_breaks_the_server() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let seed: u64 = std::env::var("OUTBOX_FUZZ_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    let iterations: u64 = std::env::var("OUTBOX_FUZZ_ITERATIONS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(FUZZ_ITERATIONS);
    println!("fuzz seed: {seed} (replay with OUTBOX_FUZZ_SEED={seed}), {iterations} calls");
    let pids = wait_for_workers(&cluster, &[]);
    let mark = cluster.log_mark();
    let tag = unique("e2efz");
    let mut cleanup = Cleanup::new(&cluster, &tag);
    let mut su = session(&cluster, None);
    let sim = Simulator::start();

    let writer = cleanup.create_role(&mut su, "writer", Some("outbox_writer"));
    let victim = cleanup.create_role(&mut su, "victim", Some("outbox_writer"));
    let tenant = format!("{tag}_tenant");
    cleanup.bind(&mut su, &writer, &tenant);

    let closed = closed_port();
    let sim_ch = format!("{tag}_sim");
    let closed_ch = format!("{tag}_closed");
    create_channel(&mut su, &sim_ch, &sim.send_url(&sim_ch), "{}");
    create_channel(
        &mut su,
        &closed_ch,
        &format!("http://127.0.0.1:{closed}/nothing"),
        r#"{"retry": {"max_attempts": 2, "base_ms": 100}}"#,
    );
    su.execute(
        "SELECT outbox.pause_channel($1, 'fuzz: closed port')",
        &[&closed_ch],
    )
    .expect("pause the closed-port channel");
    let foreign_roles: HashSet<String> = su
        .query("SELECT rolname::text FROM pg_roles", &[])
        .expect("roles")
        .iter()
        .map(|r| r.get::<_, String>(0))
        .filter(|r| r != &writer && r != &victim)
        .collect();
    let unknown_base: i64 = su
        .query_one(
            "SELECT coalesce(max(id), 0) + 1000000000 FROM outbox._messages",
            &[],
        )
        .expect("max id")
        .get(0);
    let mut ids = Vec::new();
    for n in 0..3 {
        let id: i64 = su
            .query_one(
                "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text)",
                &[&sim_ch, &format!("{tag}_seed{n}")],
            )
            .expect("seed message")
            .get(0);
        ids.push(id);
    }
    let mut pools = Pools {
        tag: tag.clone(),
        serial: 0,
        channels: vec![sim_ch.clone(), closed_ch.clone()],
        ids,
        roles: vec![writer.clone(), victim.clone()],
        tenants: vec![tenant.clone(), "default".into(), format!("{tag}_other")],
        endpoints: vec![
            sim.send_url(&sim_ch),
            sim.send_url(&format!("{tag}_x")),
            format!("http://127.0.0.1:{closed}/"),
            format!("https://127.0.0.1:{closed}/tls"),
            "ftp://127.0.0.1/".into(),
            "http://".into(),
            "127.0.0.1".into(),
            "sql".into(),
        ],
        lookups: vec![
            sim.lookup_url_by_key(&sim_ch),
            sim.lookup_url_by_id(&sim_ch),
            format!("http://127.0.0.1:{closed}/{{effect_key}}"),
            format!("http://127.0.0.1:{closed}/{{external_id}}/{{nope}}"),
            format!("http://127.0.0.1:{closed}/{{"),
            "{effect_key}".into(),
            "ftp://127.0.0.1/{effect_key}".into(),
        ],
        hostile: hostile_strings()
            .into_iter()
            .map(|(_, s)| s)
            .filter(|s| s.len() < 10_000)
            .collect(),
        foreign_roles,
        unknown_base,
    };

    let mut rng = Rng::new(seed);
    let mut log = FuzzLog::default();
    let mut bindings: Vec<(String, String)> = Vec::new();
    let mut writer_c = session(&cluster, Some(&writer));
    let started = Instant::now();
    let mut i = 0u64;
    while i < iterations {
        let as_writer = rng.chance(40);
        let (c, who) = if as_writer {
            (&mut writer_c, "writer")
        } else {
            (&mut su, "superuser")
        };
        if rng.chance(10) {
            // A few calls in one transaction, each in its own savepoint.
            let n = 1 + rng.below(6);
            let mut tx = c.transaction().unwrap_or_else(|e| {
                panic!("fuzz (seed {seed}, iteration {i}): BEGIN as {who}: {e}")
            });
            for _ in 0..n {
                let call = pools.call(&mut rng);
                let mut sp = tx.transaction().unwrap_or_else(|e| {
                    panic!("fuzz (seed {seed}, iteration {i}): SAVEPOINT as {who}: {e}")
                });
                let succeeded = fuzz_one(
                    &mut sp,
                    who,
                    &call,
                    &mut pools,
                    &mut log,
                    seed,
                    i,
                    &mut bindings,
                );
                // A savepoint whose statement failed can only be rolled back to.
                let end = if succeeded && rng.chance(80) {
                    sp.commit()
                } else {
                    sp.rollback()
                };
                if let Err(e) = end {
                    log.record(who, "RELEASE/ROLLBACK TO", &code_of(&e));
                    if e.as_db_error().is_none() {
                        panic!("fuzz (seed {seed}, iteration {i}): the connection of {who} broke ending a savepoint: {e}");
                    }
                }
                i += 1;
            }
            let end = if rng.chance(70) {
                tx.commit()
            } else {
                tx.rollback()
            };
            if let Err(e) = end {
                let code = code_of(&e);
                log.record(who, "COMMIT/ROLLBACK", &code);
                if e.as_db_error().is_none() {
                    panic!("fuzz (seed {seed}, iteration {i}): the connection of {who} broke at COMMIT: {e}");
                }
                if unclean(&code) {
                    log.failures.push(format!(
                        "seed {seed}, iteration {i}, as {who}: COMMIT → {}",
                        describe(&e)
                    ));
                }
            }
        } else {
            let call = pools.call(&mut rng);
            fuzz_one(c, who, &call, &mut pools, &mut log, seed, i, &mut bindings);
            i += 1;
        }
    }
    println!(
        "fuzz: {iterations} calls in {:?}, {} succeeded, {} channels and {} messages created",
        started.elapsed(),
        log.successes,
        pools.channels.len(),
        pools.ids.len()
    );
    log.print();
    cleanup.bindings.extend(bindings);

    let mut problems = log.failures.clone();
    // Nothing of the fuzz keeps the workers busy while the rest is checked.
    let mut fresh = cluster.connect();
    if let Err(e) = pause_tagged(&mut fresh, &tag) {
        problems.push(format!("pausing the fuzz channels: {}", describe(&e)));
    }
    if log.successes == 0 {
        problems.push("not one fuzz call succeeded; the fuzz tested nothing".into());
    }
    for (who, c) in [("superuser", &mut su), ("writer", &mut writer_c)] {
        if let Err(e) = c.query_one("SELECT 1", &[]) {
            problems.push(format!(
                "the {who}'s connection no longer answers SELECT 1: {e}"
            ));
        }
    }
    // The workers kept running: same processes, and they still deliver.
    let after = wait_for_workers(&cluster, &[]);
    if after != pids {
        problems.push(format!(
            "the delivery workers restarted during the fuzz (PIDs {pids:?} before, {after:?} after; seed {seed}); see {}",
            cluster.log_path().display()
        ));
    }
    let final_ch = format!("{tag}_final");
    create_channel(&mut fresh, &final_ch, &sim.send_url(&final_ch), "{}");
    let id: i64 = fresh
        .query_one(
            "SELECT outbox.enqueue($1::text, '{\"after\": \"fuzz\"}'::jsonb, $2::text)",
            &[&final_ch, &format!("{tag}_final_key")],
        )
        .unwrap_or_else(|e| panic!("a normal enqueue after the fuzz: {}", describe(&e)))
        .get(0);
    if !sim.wait_for_stored(&final_ch, 1, HOSTILE_SETTLE) {
        problems.push(format!(
            "a normal message ({id}) enqueued after the fuzz was not delivered within {HOSTILE_SETTLE:?}"
        ));
    }
    let crashes = crash_lines(&cluster.log_since(mark));
    if !crashes.is_empty() {
        problems.push(format!(
            "the server log since the fuzz began shows a crash (seed {seed}):\n{}",
            crashes.join("\n")
        ));
    }
    drop(writer_c);
    drop(su);
    drop(cleanup);
    assert!(
        problems.is_empty(),
        "fuzz (seed {seed}, replay with OUTBOX_FUZZ_SEED={seed}): {} problem(s):\n  - {}",
        problems.len(),
        problems.join("\n  - ")
    );
}
