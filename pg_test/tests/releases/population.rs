//! A database with something in every state, and what must hold of it after an upgrade or
//! a restore: channels (one with a secret header), a tenant binding, messages `delivered`,
//! `queued` (also for another tenant), `cancelled`, `sending` (left by `kill -9` of the
//! worker mid-send), `uncertain`, `exhausted` and `failed`, their attempts, ledger entries
//! (one whose message retention has removed), and operator log rows.
//!
//! Only the SQL API of the oldest release is used, so that the same population is built on
//! every version. The worker is held at the end (`outbox.role` names a role that does not
//! exist, so it waits and sends nothing) so that the queued and the sending message stay as
//! they are until the cluster is upgraded or dumped.

use super::*;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// The private tables: every row of them must survive an upgrade and a dump.
pub const TABLES: [&str; 14] = [
    "_channels",
    "_tenant_bindings",
    "_messages",
    "_claims",
    "_attempts",
    "_ledger",
    "_ledger_0",
    "_ledger_1",
    "_ledger_2",
    "_ledger_generations",
    "_operator_log",
    "_channel_stats",
    "_channel_minutes",
    "_channel_flow",
];

/// A role that does not exist: while `outbox.role` names it, the worker waits.
const HOLD_ROLE: &str = "outbox_release_hold";
pub const SECRET: &str = "Bearer rel-s3cret";
/// The options of a channel whose provider dedupes by the effect key (without braces).
const DEDUPING: &str = r#""idempotency_header": "Idempotency-Key",
    "idempotency_window_ms": 3600000, "external_id": "/id",
    "retry": {"base_ms": 200, "max_ms": 1000, "jitter": "none"}"#;

pub struct Population {
    pub sim: Simulator,
    pub delivered: i64,
    /// Delivered, then removed as retention does: only its ledger entry is left.
    pub purged: (i64, String),
    pub sending: (i64, String),
    pub uncertain: i64,
    pub exhausted: i64,
    pub failed: i64,
    /// Queued while the worker is held: (id, effect key); the second one for tenant `acme`.
    pub queued: Vec<(i64, String)>,
    pub cancelled: (i64, String),
}

/// Every row of every private table as JSON objects, per table, sorted. A table that an
/// older release does not have yet (one an upgrade adds) is left out: the rows an upgrade
/// moves into it are compared through the table they came from (the generations of the
/// ledger through `_ledger`).
pub type Rows = BTreeMap<&'static str, Vec<Map<String, Value>>>;

pub fn rows(c: &mut impl postgres::GenericClient) -> Rows {
    TABLES
        .iter()
        .filter_map(|t| {
            let exists: bool = c
                .query_one("SELECT to_regclass('outbox.' || $1) IS NOT NULL", &[t])
                .unwrap_or_else(|e| panic!("does outbox.{t} exist: {}", describe(&e)))
                .get(0);
            if !exists {
                return None;
            }
            let sql = format!("SELECT to_jsonb(t)::text FROM outbox.{t} t ORDER BY 1");
            let mut list: Vec<Map<String, Value>> = c
                .query(&sql, &[])
                .unwrap_or_else(|e| panic!("{sql}: {}", describe(&e)))
                .iter()
                .map(|r| match serde_json::from_str(r.get::<_, &str>(0)) {
                    Ok(Value::Object(m)) => m,
                    other => panic!("row of {t} is not an object: {other:?}"),
                })
                .collect();
            list.sort_by_key(|m| Value::Object(m.clone()).to_string());
            Some((*t, list))
        })
        .collect()
}

/// Asserts that every row of `before` is in `after` with the same values, and no row is
/// added or lost; columns added by an upgrade are left out of the comparison.
pub fn assert_rows_kept(before: &Rows, after: &Rows, what: &str) {
    for (table, old) in before {
        let new = &after[table];
        let mut projected: Vec<Map<String, Value>> = new
            .iter()
            .map(|row| {
                row.iter()
                    .filter(|(k, _)| old.first().is_none_or(|o| o.contains_key(*k)))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            })
            .collect();
        projected.sort_by_key(|m| Value::Object(m.clone()).to_string());
        assert_eq!(old.len(), new.len(), "{what}: rows of outbox.{table}");
        assert_eq!(
            old, &projected,
            "{what}: the rows of outbox.{table} changed"
        );
    }
}

/// The largest id of a table (0 when empty).
pub fn max_id(c: &mut Client, table: &str) -> i64 {
    count(
        c,
        &format!("SELECT coalesce(max(id), 0)::int8 FROM outbox.{table}"),
        &[],
    )
}

/// Enqueues the message `label` on `ch` (its effect key is `ch-label`) and waits for `state`.
fn enqueue_and_wait(
    cluster: &Cluster,
    c: &mut Client,
    (ch, label): (&str, &str),
    state: &str,
) -> (i64, String) {
    let key = format!("{ch}-{label}");
    let id = enqueue(c, ch, &key);
    wait_for_message_state(cluster, id, state, SETTLE);
    (id, key)
}

/// Builds the population in `rc`'s database `app` (served by its worker), and leaves the
/// worker held.
pub fn populate(rc: &ReleaseCluster) -> Population {
    let cluster = &rc.cluster;
    cluster.wait_for_worker();
    let sim = Simulator::start();
    let mut c = cluster.connect();
    c.batch_execute(
        "CREATE ROLE rel_app NOLOGIN; GRANT outbox_writer TO rel_app;
         SELECT outbox.bind_tenant('rel_app', 'acme');",
    )
    .unwrap_or_else(|e| panic!("tenant binding: {}", describe(&e)));

    let ok_options = format!(r#"{{"headers": {{"Authorization": "{SECRET}"}}, {DEDUPING}}}"#);
    create_channel(&mut c, "ok", &sim.send_url("ok"), &ok_options);
    sim.set_dedupe("ok", "Idempotency-Key");
    let hang_options = format!(r#"{{"timeout_ms": 10000, {DEDUPING}}}"#);
    create_channel(&mut c, "hang", &sim.send_url("hang"), &hang_options);
    sim.set_dedupe("hang", "Idempotency-Key");
    sim.set_default("hang", Action::Hang { store: true });
    create_channel(&mut c, "plain", &sim.send_url("plain"), "{}");
    sim.set_default("plain", Action::DropAfterRead { store: false });
    create_channel(&mut c, "fail", &sim.send_url("fail"), "{}");
    sim.set_default("fail", Action::Status(400));
    create_channel(
        &mut c,
        "exhaust",
        &sim.send_url("exhaust"),
        r#"{"retry": {"max_attempts": 1}}"#,
    );
    sim.set_default("exhaust", Action::Status(503));

    let (delivered, _) = enqueue_and_wait(cluster, &mut c, ("ok", "delivered"), "delivered");
    let purged = enqueue_and_wait(cluster, &mut c, ("ok", "purged"), "delivered");
    // What retention does to a delivered message once outbox.retention has passed.
    c.batch_execute(&format!(
        "DELETE FROM outbox._attempts WHERE message_id = {0};
         DELETE FROM outbox._messages WHERE id = {0};",
        purged.0
    ))
    .expect("purge a delivered message");
    let (uncertain, _) = enqueue_and_wait(cluster, &mut c, ("plain", "uncertain"), "uncertain");
    let (exhausted, _) = enqueue_and_wait(cluster, &mut c, ("exhaust", "exhausted"), "exhausted");
    let (failed, _) = enqueue_and_wait(cluster, &mut c, ("fail", "failed"), "failed");
    c.execute("SELECT outbox.assign($1, 'ops-team')", &[&failed])
        .expect("assign");

    let sending = leave_sending(rc, &sim, &mut c);
    let mut c = cluster.connect();
    let queued = vec![
        (enqueue(&mut c, "ok", "ok-queued"), "ok-queued".to_string()),
        enqueue_as_tenant(&mut c, "ok", "ok-queued-acme"),
    ];
    let cancelled_key = "ok-cancelled".to_string();
    let cancelled = enqueue(&mut c, "ok", &cancelled_key);
    c.execute(
        "SELECT outbox.cancel($1, 'not needed after all')",
        &[&cancelled],
    )
    .expect("cancel");
    std::thread::sleep(Duration::from_millis(1500));
    for (id, _) in &queued {
        assert_eq!(state(&mut c, *id), "queued", "a held worker sends nothing");
    }
    assert_eq!(state(&mut c, sending.0), "sending");
    Population {
        sim,
        delivered,
        purged,
        sending,
        uncertain,
        exhausted,
        failed,
        queued,
        cancelled: (cancelled, cancelled_key),
    }
}

fn enqueue_as_tenant(c: &mut Client, ch: &str, key: &str) -> (i64, String) {
    c.batch_execute("SET ROLE rel_app").expect("SET ROLE");
    let id = enqueue(c, ch, key);
    c.batch_execute("RESET ROLE").expect("RESET ROLE");
    (id, key.to_string())
}

pub fn state(c: &mut Client, id: i64) -> String {
    c.query_one("SELECT outbox.status($1)::text", &[&id])
        .expect("status")
        .get(0)
}

/// A message left `sending` by `kill -9` of the worker while the provider holds the request;
/// the worker that the postmaster starts next is held (see [`HOLD_ROLE`]).
fn leave_sending(rc: &ReleaseCluster, sim: &Simulator, c: &mut Client) -> (i64, String) {
    let cluster = &rc.cluster;
    let key = "hang-sending".to_string();
    let id = enqueue(c, "hang", &key);
    assert!(
        sim.wait_for_stored("hang", 1, SETTLE),
        "the provider got no request"
    );
    assert_eq!(state(c, id), "sending");
    // Read at the next start of a worker: the one that replaces the killed one waits.
    set_setting(c, "outbox.role", HOLD_ROLE);
    let pid: i32 = c
        .query_one(
            "SELECT DISTINCT worker_pid FROM outbox.attempts WHERE message_id = $1",
            &[&id],
        )
        .expect("the sending worker")
        .get(0);
    cluster.kill_worker(pid);
    sim.set_default("hang", Action::Accept);
    let held = poll(cluster, Duration::from_secs(60), |c| {
        let n: i64 = c
            .query_one(
                "SELECT count(*) FROM outbox.worker_status() WHERE state = 'waiting for outbox.role'",
                &[],
            )?
            .get(0);
        Ok((n == 1).then_some(()))
    });
    assert!(
        held.is_some(),
        "the restarted worker is not held; see {}",
        cluster.log_path().display()
    );
    (id, key)
}

/// Lets the worker act again from the next start of the server on.
pub fn release_hold(c: &mut Client) {
    c.batch_execute("ALTER SYSTEM RESET outbox.role")
        .expect("ALTER SYSTEM RESET");
}

/// The ids of everything before the change, to check that new ones do not collide.
pub struct Maxima {
    messages: i64,
    attempts: i64,
    operator_log: i64,
}

pub fn maxima(c: &mut Client) -> Maxima {
    Maxima {
        messages: max_id(c, "_messages"),
        attempts: max_id(c, "_attempts"),
        operator_log: max_id(c, "_operator_log"),
    }
}

/// What must hold once the worker serves the upgraded or restored database.
pub fn assert_delivers_as_promised(cluster: &Cluster, p: &Population, before: &Maxima) {
    let sim = &p.sim;
    let mut c = cluster.connect();
    // Every queued message is delivered once, with its effect key unchanged.
    for (id, key) in &p.queued {
        wait_for_message_state(cluster, *id, "delivered", SETTLE);
        let (effect_key, sent): (String, String) = {
            let r = c
                .query_one(
                    "SELECT m.effect_key, a.effect_key_sent FROM outbox.messages m
                       JOIN outbox.attempts a ON a.message_id = m.id AND a.kind = 'send'
                      WHERE m.id = $1",
                    &[id],
                )
                .unwrap_or_else(|e| panic!("message {id}: {}", describe(&e)));
            (r.get(0), r.get(1))
        };
        assert_eq!(&effect_key, key, "message {id} keeps its effect key");
        let stored = sim
            .stored("ok")
            .iter()
            .filter(|s| s.key.as_deref() == Some(sent.as_str()))
            .count();
        assert_eq!(stored, 1, "message {id} (key sent {sent}) stored once");
    }
    // The interrupted send takes the ambiguous path: recovered, resent with the same key
    // inside the provider's window, stored once.
    wait_for_message_state(cluster, p.sending.0, "delivered", Duration::from_secs(60));
    let recovery: i64 = count(
        &mut c,
        "SELECT count(*) FROM outbox.attempts WHERE message_id = $1 AND kind = 'recovery' AND error_class = 'ambiguous'",
        &[&p.sending.0],
    );
    assert_eq!(recovery, 1, "one recovery attempt, classified ambiguous");
    // The send open when the worker was killed has one row, closed by recovery (a release
    // that wrote it at the claim), and the resend one of its own: every attempt one row.
    let (sends, attempts, open): (i64, i64, i64) = {
        let r = c
            .query_one(
                "SELECT count(*), count(DISTINCT attempt), count(*) FILTER (WHERE finished_at IS NULL)
                   FROM outbox.attempts WHERE message_id = $1 AND kind = 'send'",
                &[&p.sending.0],
            )
            .unwrap_or_else(|e| panic!("attempts of the interrupted send: {}", describe(&e)));
        (r.get(0), r.get(1), r.get(2))
    };
    assert_eq!(
        (sends, attempts, open),
        (2, 2, 0),
        "the interrupted send and its resend: one closed row each"
    );
    let outcomes: Vec<String> = sim.sends("hang").into_iter().map(|s| s.outcome).collect();
    assert_eq!(
        outcomes,
        vec!["hang", "deduped"],
        "the same key, stored once"
    );
    assert_eq!(sim.stored("hang").len(), 1);

    // The ledger still answers for a recorded effect whose message was removed: enqueued
    // again, the effect names that message, and nothing is sent.
    assert_eq!(
        state(&mut c, p.purged.0),
        "delivered",
        "the ledger answers for a removed message"
    );
    let again = enqueue(&mut c, "ok", &p.purged.1);
    assert_eq!(again, p.purged.0, "the recorded effect names its message");
    assert_eq!(state(&mut c, again), "delivered");
    std::thread::sleep(Duration::from_millis(1500));
    let purged_sends = sim
        .sends("ok")
        .iter()
        .filter(|s| s.key.as_deref() == Some(p.purged.1.as_str()))
        .count();
    assert_eq!(purged_sends, 1, "the recorded effect was not sent again");

    // Ids continue.
    let fresh = enqueue(&mut c, "ok", "ok-after");
    assert!(
        fresh > before.messages,
        "message id {fresh} after {}",
        before.messages
    );
    wait_for_message_state(cluster, fresh, "delivered", SETTLE);
    assert!(max_id(&mut c, "_attempts") > before.attempts);
    c.execute("SELECT outbox.assign($1, 'ops-team-2')", &[&p.failed])
        .expect("assign");
    assert!(max_id(&mut c, "_operator_log") > before.operator_log);

    // Terminal and operator states stay as they were.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        state(&mut c, p.uncertain),
        "uncertain",
        "uncertain stays uncertain"
    );
    assert_eq!(state(&mut c, p.exhausted), "exhausted");
    assert_eq!(state(&mut c, p.failed), "failed");
    assert_eq!(state(&mut c, p.delivered), "delivered");
    assert_eq!(state(&mut c, p.cancelled.0), "cancelled");
    assert_eq!(
        sim.sends("plain").len(),
        1,
        "nothing resent on the uncertain channel"
    );
    let cancelled_sends = sim
        .sends("ok")
        .iter()
        .filter(|s| s.key.as_deref() == Some(p.cancelled.1.as_str()))
        .count();
    assert_eq!(cancelled_sends, 0, "a cancelled message is never sent");
}
