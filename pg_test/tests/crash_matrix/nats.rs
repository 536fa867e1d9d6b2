//! The restart points on the `nats` channel kind (NATS JetStream, a real nats-server with
//! file storage): (1) the client dies before its COMMIT, (2) the worker dies after claiming
//! and before publishing, (3) after publishing and before reading the acknowledgement,
//! (4) after reading it and before its local record commits — and (3) again with the
//! republish held past the stream's duplicate window. Each on a subject that names the
//! effect key (the stream can be asked, and stores a subject's first message only) and on a
//! fixed subject (the duplicate window is the only barrier).
//!
//! For every row: the stream holds the key at most once, and nothing is `delivered` without
//! an acknowledgement or a lookup naming the stream's copy.

use super::page::{record_doc_region, run_header, Claim};
use super::*;
use outbox_e2e::cluster::wait_until;
use outbox_e2e::helpers::attempts;
use outbox_e2e::nats::NatsServer;

#[derive(Clone, Copy, PartialEq)]
enum Subject {
    NamesKey,
    Fixed,
}

impl Subject {
    fn label(self) -> &'static str {
        match self {
            Subject::NamesKey => "nats, subject names the key",
            Subject::Fixed => "nats, fixed subject",
        }
    }
}

/// What a row's message came to.
struct Seen {
    copies: usize,
    state: Option<String>,
    external_id: Option<String>,
    first_sequence: Option<u64>,
    attempt_kinds: Vec<String>,
    same_key: bool,
}

fn seen(c: &mut Client, nats: &NatsServer, stream: &str, id: Option<i64>, key: &str) -> Seen {
    let stored: Vec<_> = nats
        .messages(stream)
        .into_iter()
        .filter(|m| m.msg_id.as_deref() == Some(key))
        .collect();
    let (state, external_id) = match id {
        Some(id) => c
            .query_opt(
                "SELECT state::text, external_id FROM outbox.messages WHERE id = $1",
                &[&id],
            )
            .unwrap()
            .map(|r| (Some(r.get(0)), r.get(1)))
            .unwrap_or((None, None)),
        None => (None, None),
    };
    let a = id.map(|id| attempts(c, id)).unwrap_or_default();
    Seen {
        copies: stored.len(),
        first_sequence: stored.first().map(|m| m.sequence),
        state,
        external_id,
        same_key: a
            .iter()
            .filter(|a| a.kind == "send")
            .all(|a| a.effect_key_sent.as_deref().is_none_or(|k| k == key)),
        attempt_kinds: a
            .iter()
            .map(|a| format!("{} {}", a.kind, a.outcome.as_deref().unwrap_or("-")))
            .collect(),
    }
}

/// A channel on a stream of its own with `window`.
fn nats_channel(
    c: &mut Client,
    nats: &NatsServer,
    subject: Subject,
    window: Duration,
) -> (String, String) {
    let channel = unique("nats-crash");
    let prefix = channel.replace(['-', '.'], "_");
    let stream = prefix.to_uppercase();
    nats.create_stream(&stream, &[&format!("{prefix}.>")], window);
    let subject = match subject {
        Subject::NamesKey => format!("{prefix}.{{effect_key}}"),
        Subject::Fixed => format!("{prefix}.created"),
    };
    create_channel(
        c,
        &channel,
        &nats.url(),
        &format!(
            r#"{{"kind": "nats", "subject": "{subject}", "stream": "{stream}", "timeout_ms": 2000, "connect_timeout_ms": 1000, "retry": {FAST_RETRY}}}"#
        ),
    );
    (channel, stream)
}

fn key_of(c: &mut Client, id: i64) -> String {
    one(
        c,
        "SELECT outbox._provider_key(tenant, effect_key) FROM outbox.messages WHERE id = $1",
        &[&id],
    )
}

/// Waits until message `id` is in one of `states`; an uncertain message on a channel that
/// can be asked is looked up first (after the channel's settle time).
fn wait_settled(cluster: &Cluster, id: i64, states: &[&str]) {
    let _ = poll(cluster, CRASH_SETTLE, |c| {
        let s: Option<String> = c
            .query_opt(
                "SELECT state::text FROM outbox.messages WHERE id = $1",
                &[&id],
            )?
            .map(|r| r.get(0));
        Ok(s.filter(|s| states.contains(&s.as_str())).map(|_| ()))
    });
}

/// Point 1: the client's transaction enqueues, then its backend is killed before COMMIT.
fn client_dies_before_commit(cluster: &Cluster, nats: &NatsServer, subject: Subject) -> Row {
    let mut c = cluster.connect();
    let (channel, stream) = nats_channel(&mut c, nats, subject, Duration::from_secs(120));
    let mut app = cluster.connect();
    let pid: i32 = one(&mut app, "SELECT pg_backend_pid()", &[]);
    app.batch_execute("BEGIN").unwrap();
    let key = format!("{channel}-1");
    try_enqueue(&mut app, &channel, &key).unwrap();
    c.execute("SELECT pg_terminate_backend($1)", &[&pid])
        .unwrap();
    std::thread::sleep(QUIET);
    let rows = count(
        &mut c,
        "SELECT count(*) FROM outbox.messages WHERE channel = $1",
        &[&channel],
    );
    let stored = nats.messages(&stream).len();
    let pass = rows == 0 && stored == 0;
    Row {
        scenario: "1. client dies before COMMIT (pg_terminate_backend)".into(),
        kind: subject.label().into(),
        provider: format!("{stored} in the stream"),
        local: format!("{rows} messages"),
        attempts: "none".into(),
        same_key: "n/a".into(),
        verdict: verdict(
            pass,
            "nothing exists, nothing published",
            &format!("{rows} rows, {stored} stored"),
        ),
        pass,
    }
}

/// Points 2–4 (and 3 past the window): one message, the worker dies at `point`.
fn worker_dies_at(
    cluster: &Cluster,
    nats: &NatsServer,
    subject: Subject,
    point: &str,
    past_window: bool,
) -> Row {
    let mut c = cluster.connect();
    let window = if past_window {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(120)
    };
    let (channel, stream) = nats_channel(&mut c, nats, subject, window);
    wait_for_workers(cluster, &[]);
    let id;
    {
        let _fault = arm_fault(cluster, point);
        let mark = cluster.log_mark();
        id = try_enqueue(&mut c, &channel, &format!("{channel}-1")).unwrap();
        let died = wait_until(CRASH_SETTLE, || {
            cluster
                .log_since(mark)
                .contains(&format!("fault injection {point}"))
        });
        assert!(died, "the worker did not die at {point}");
        if past_window {
            // The republish waits until the stream's window has closed.
            c.execute(
                "SELECT outbox.pause_channel($1, 'held for the test')",
                &[&channel],
            )
            .unwrap();
        }
    }
    wait_for_workers(cluster, &[]);
    if past_window {
        std::thread::sleep(Duration::from_millis(2500));
        c.execute("SELECT outbox.resume_channel($1)", &[&channel])
            .unwrap();
    }
    match subject {
        Subject::NamesKey => wait_settled(cluster, id, &["delivered", "failed", "exhausted"]),
        Subject::Fixed => wait_settled(
            cluster,
            id,
            &["delivered", "uncertain", "failed", "exhausted"],
        ),
    }
    let key = key_of(&mut c, id);
    let s = seen(&mut c, nats, &stream, Some(id), &key);
    let state = s.state.clone().unwrap_or_default();
    let acked_copy = s.first_sequence.map(|q| format!("{stream}:{q}"));
    let (pass, expect) = match (point, subject, past_window) {
        // Nothing was published before the crash, or the stream must hold it once.
        (_, Subject::Fixed, true) => (
            s.copies == 1
                && (state == "uncertain" || (state == "delivered" && s.external_id == acked_copy)),
            "stored once; not republished past the window: uncertain for an operator",
        ),
        _ => (
            s.copies == 1 && state == "delivered" && s.external_id == acked_copy,
            "stored once; delivered as the stream's first copy",
        ),
    };
    let pass = pass && s.same_key;
    Row {
        scenario: match (point, past_window) {
            ("crash_after_claim", _) => "2. worker dies after claim, before publish (fault point)".into(),
            ("crash_after_send", false) => "3. worker dies after publish, before the acknowledgement (fault point)".into(),
            ("crash_after_send", true) => "3b. as 3, the republish held past the stream's 1 s duplicate window (channel paused)".into(),
            _ => "4. worker dies after the acknowledgement, before the local record commits (fault point)".into(),
        },
        kind: subject.label().into(),
        provider: format!("{} in the stream with the key", s.copies),
        local: format!("{state}, external id {}", s.external_id.as_deref().unwrap_or("-")),
        attempts: s.attempt_kinds.join("; "),
        same_key: if s.same_key { "yes".into() } else { "NO".into() },
        verdict: verdict(pass, expect, &format!("{} copies, {state}", s.copies)),
        pass,
    }
}

fn verdict(pass: bool, expect: &str, got: &str) -> String {
    match pass {
        true => format!("PASS: {expect}"),
        false => format!("FAIL: expected {expect}; got {got}"),
    }
}

#[test]
fn the_restart_points_on_a_nats_channel() {
    let cluster = Cluster::from_env();
    let nats = NatsServer::start(None);
    let mut rows = Vec::new();
    for subject in [Subject::NamesKey, Subject::Fixed] {
        let row = client_dies_before_commit(&cluster, &nats, subject);
        print_row(&row);
        rows.push(row);
        for (point, past) in [
            ("crash_after_claim", false),
            ("crash_after_send", false),
            ("crash_after_send", true),
            ("crash_before_commit", false),
        ] {
            let row = worker_dies_at(&cluster, &nats, subject, point, past);
            print_row(&row);
            rows.push(row);
        }
    }
    let doc = record_doc_region(
        "nats",
        &format!(
            "Produced by `{RUN_COMMAND}` (test `the_restart_points_on_a_nats_channel`), {}, nats-server {}.\n\n{}\n",
            run_header(&cluster),
            nats_version(),
            table(&rows)
        ),
        Claim::FiguresMasked,
    );
    let failed: Vec<&Row> = rows.iter().filter(|r| !r.pass).collect();
    assert!(
        failed.is_empty(),
        "{}",
        failed
            .iter()
            .map(|r| format!("{} / {}: {}", r.scenario, r.kind, r.verdict))
            .collect::<Vec<_>>()
            .join("\n")
    );
    if let Err(diff) = doc {
        panic!("{diff}");
    }
}

fn nats_version() -> String {
    Command::new("nats-server")
        .arg("--version")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .trim_start_matches("nats-server: ")
                .to_string()
        })
        .unwrap_or_else(|_| "?".into())
}
