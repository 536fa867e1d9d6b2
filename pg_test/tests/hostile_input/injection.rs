//! Section 1: every hostile string in every text argument is stored verbatim or refused
//! cleanly.

use super::injection_areas::{
    channel_actions_by_name, channel_names_and_endpoints, channel_options, effect_keys_and_enqueue,
    operator_actions, tenants, Round,
};
use super::*;

// ---------------------------------------------------------------------------------------
// 1. injection strings
// ---------------------------------------------------------------------------------------

/// The hostile strings, each with a label for messages. None contains NUL (tested apart)
/// and none contains a word `CRASH_WORDS` looks for.
pub(super) fn hostile_strings() -> Vec<(&'static str, String)> {
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
pub(super) enum Expect {
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
pub(super) struct Checker {
    pub(super) problems: Vec<String>,
    pub(super) calls: u64,
    pub(super) successes: u64,
}

impl Checker {
    /// Judges one call; returns its value when it succeeded. A lost connection ends the
    /// test at once.
    pub(super) fn call<T>(
        &mut self,
        what: &str,
        expect: Expect,
        r: Result<T, postgres::Error>,
    ) -> Option<T> {
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
    pub(super) fn verbatim(&mut self, what: &str, stored: Option<String>, expected: &str) {
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

    pub(super) fn check(&mut self, ok: bool, problem: impl FnOnce() -> String) {
        if !ok {
            self.problems.push(problem());
        }
    }
}

/// The outcome for a reason or owner of an operator action: at most 1000 characters.
pub(super) fn reason_expectation(s: &str) -> Expect {
    if s.chars().count() > 1000 {
        Expect::Code("22023")
    } else if has_ascii_control(s) || has_c1_control(s) {
        Expect::Clean
    } else {
        Expect::Ok
    }
}

/// The outcome for an effect key or ordering key: 1 to 255 bytes.
pub(super) fn key_expectation(s: &str) -> Expect {
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
pub(super) fn tenant_expectation(s: &str) -> Expect {
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
pub(super) fn header_value_expectation(s: &str) -> Expect {
    if s.len() > 8192 || has_ascii_control(s) {
        Expect::Code("22023")
    } else if has_c1_control(s) {
        Expect::Clean
    } else {
        Expect::Ok
    }
}

/// The outcome for a message header name: an HTTP token of at most 256 bytes.
pub(super) fn header_name_expectation(s: &str) -> Expect {
    if is_token(s) && s.len() <= 256 {
        Expect::Ok
    } else {
        Expect::Code("22023")
    }
}

/// The environment of the injection test.
pub(super) struct Hostile<'a> {
    pub(super) cluster: &'a Cluster,
    pub(super) sim: &'a Simulator,
    pub(super) tag: String,
    pub(super) su: Client,
    pub(super) writer: Client,
    pub(super) operator: Client,
    pub(super) admin: Client,
    pub(super) bindee: String,
    /// The channel hostile messages are delivered on (its simulator channel is `base_sim`).
    pub(super) base: String,
    pub(super) base_sim: String,
    /// A paused channel: the operator actions' messages stay queued there.
    pub(super) held: String,
    /// A channel for alter_channel with hostile options.
    pub(super) alt: String,
    /// A channel for pause_channel with hostile reasons.
    pub(super) pz: String,
    /// Messages enqueued with hostile content, with their payloads.
    pub(super) sent: Vec<(i64, Value)>,
    /// `outbox.max_payload_bytes`.
    pub(super) max_payload: usize,
}

impl Hostile<'_> {
    pub(super) fn enqueue(
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
    pub(super) fn message_text(&mut self, id: i64, expr: &str) -> Option<String> {
        self.su
            .query_opt(
                &format!("SELECT ({expr})::text FROM outbox.messages WHERE id = $1"),
                &[&id],
            )
            .unwrap_or_else(|e| panic!("read back {expr} of message {id}: {}", describe(&e)))
            .and_then(|r| r.get(0))
    }

    /// A text at `path` in a channel's options, read as the superuser.
    pub(super) fn option_text(&mut self, channel: &str, path: &[&str]) -> Option<String> {
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
    pub(super) fn held_message(&mut self, key: &str) -> i64 {
        self.writer
            .query_one(
                "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text)",
                &[&self.held, &key],
            )
            .unwrap_or_else(|e| panic!("writer enqueue on the paused channel: {}", describe(&e)))
            .get(0)
    }

    pub(super) fn log_reasons(&mut self, id: i64, reason: &str) -> i64 {
        count(
            &mut self.su,
            "SELECT count(*) FROM outbox.operator_log WHERE message_id = $1 AND reason = $2",
            &[&id, &reason],
        )
    }
}

/// The JSON pointer of a path of object keys.
pub(super) fn json_pointer(path: &[&str]) -> String {
    path.iter()
        .map(|p| format!("/{}", p.replace('~', "~0").replace('/', "~1")))
        .collect()
}

/// A SQL string literal (for a read-back expression built by the test itself).
pub(super) fn sql_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// Sets up roles of every kind and channels for hostile input, runs `area` with them, then
/// checks what must hold after any hostile input: the schema is intact, the hostile messages
/// settle and the provider received each delivered one as it was written, the Prometheus
/// exposition still parses, a normal message is still delivered, no worker restarted and no
/// backend crashed. Fails with every problem found.
fn with_hostile_input(what: &str, area: impl FnOnce(&mut Hostile<'_>, &mut Checker)) {
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
    let max_payload: i64 = one(
        &mut su,
        "SELECT coalesce(current_setting('outbox.max_payload_bytes', true)::int8, 1048576)",
        &[],
    );
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
    area(&mut h, &mut ck);

    check_after_hostile_input(&mut h, &mut ck, &pids, mark);
    println!(
        "hostile input ({what}): {} calls, {} succeeded, {} problems",
        ck.calls,
        ck.successes,
        ck.problems.len()
    );
    drop(h);
    drop(cleanup);
    assert!(
        ck.problems.is_empty(),
        "{} problem(s) with hostile input ({what}):\n  - {}",
        ck.problems.len(),
        ck.problems.join("\n  - ")
    );
}

/// What must hold after any hostile input, added to `ck` where it does not: the schema is
/// intact, the hostile messages settle and the provider received each delivered one as it
/// was written, the Prometheus exposition still parses, a normal message is still
/// delivered, the workers kept their PIDs (`pids`) and the server log shows no crash since
/// `mark`.
fn check_after_hostile_input(h: &mut Hostile<'_>, ck: &mut Checker, pids: &[i32], mark: u64) {
    let (cluster, sim) = (h.cluster, h.sim);
    let tag = h.tag.clone();
    let base_sim = h.base_sim.clone();
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
    let settled = poll(cluster, HOSTILE_SETTLE, |c| {
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

    let after = wait_for_workers(cluster, &[]);
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
}

/// Runs `area` with every hostile string in turn.
fn each_hostile_string(
    h: &mut Hostile<'_>,
    ck: &mut Checker,
    area: fn(&mut Hostile<'_>, &mut Checker, &Round<'_>),
) {
    for (i, (label, s)) in hostile_strings().iter().enumerate() {
        let round = Round {
            tag: h.tag.clone(),
            i,
            label,
            s,
        };
        area(h, ck, &round);
    }
}

#[test]
fn hostile_strings_in_effect_keys_and_enqueue_arguments_are_stored_verbatim_or_refused_cleanly() {
    with_hostile_input("effect keys and enqueue", |h, ck| {
        each_hostile_string(h, ck, effect_keys_and_enqueue)
    });
}

#[test]
fn hostile_strings_as_owner_or_reason_of_operator_actions_are_stored_verbatim_or_refused_cleanly() {
    with_hostile_input("operator actions", |h, ck| {
        each_hostile_string(h, ck, operator_actions)
    });
}

#[test]
fn hostile_strings_in_any_channel_argument_are_stored_verbatim_or_refused_cleanly() {
    with_hostile_input("channels", |h, ck| {
        each_hostile_string(h, ck, |h, ck, r| {
            channel_names_and_endpoints(h, ck, r);
            channel_options(h, ck, r);
            channel_actions_by_name(h, ck, r);
        })
    });
}

#[test]
fn hostile_strings_as_tenants_and_role_names_are_bound_verbatim_or_refused_cleanly() {
    with_hostile_input("tenants", |h, ck| each_hostile_string(h, ck, tenants));
}

/// NUL: refused by the server's input functions, cleanly.
#[test]
fn nul_in_an_effect_key_a_payload_or_a_tenant_is_refused_cleanly() {
    with_hostile_input("NUL", |h, ck| {
        let tag = h.tag.clone();
        let base = h.base.clone();
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
    });
}
