//! Business operations: one effect key per effect, and exactly-once effects inside this
//! database through a `sql` channel — the function's writes commit with the ledger entry or
//! not at all.

use outbox_e2e::cluster::{unique, wait_for_state, wait_until, Cluster};
use outbox_e2e::helpers::{
    arm_fault, cluster_and_sim, effect_key_of, external_id_of, ledger_recorded_by, one,
};
use outbox_e2e::sim::{Action, Simulator};
use postgres::Client;
use std::time::Duration;

const T: Duration = Duration::from_secs(40);

/// The application's side: a task table, an effect function that creates a task, a
/// least-privilege role it runs as, and a flaky function for retries.
fn app_schema(c: &mut Client) -> String {
    let s = unique("app");
    let role = format!("{s}_effects");
    c.batch_execute(&format!(
        r#"
        CREATE SCHEMA {s};
        CREATE TABLE {s}.tasks (id bigserial PRIMARY KEY, effect_key text NOT NULL, title text NOT NULL,
                                CONSTRAINT title_not_bad CHECK (title <> 'bad'));
        CREATE SEQUENCE {s}.flaky_calls;
        CREATE ROLE {role} NOLOGIN;
        GRANT USAGE ON SCHEMA {s} TO {role};
        GRANT INSERT, SELECT ON {s}.tasks TO {role};
        GRANT USAGE ON SEQUENCE {s}.tasks_id_seq TO {role};
        GRANT USAGE ON SEQUENCE {s}.flaky_calls TO {role};
        CREATE FUNCTION {s}.create_task(payload jsonb, effect_key text) RETURNS text LANGUAGE sql AS $$
            INSERT INTO {s}.tasks (effect_key, title) VALUES (effect_key, payload ->> 'title') RETURNING 'task-' || id
        $$;
        CREATE FUNCTION {s}.flaky_task(payload jsonb, effect_key text) RETURNS text LANGUAGE plpgsql AS $$
        BEGIN
            -- The insert is part of the effect: it must vanish whenever the call fails.
            INSERT INTO {s}.tasks (effect_key, title) VALUES (effect_key, 'flaky');
            -- nextval is not transactional: it counts calls, failed ones included.
            IF nextval('{s}.flaky_calls') <= (payload ->> 'failures')::int THEN
                RAISE EXCEPTION 'deadlock detected (simulated)' USING ERRCODE = '40P01';
            END IF;
            RETURN 'ok-' || effect_key;
        END $$;
        CREATE FUNCTION {s}.whoami(payload jsonb, effect_key text) RETURNS text LANGUAGE sql AS $$ SELECT current_user::text $$;
        GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {s} TO {role};
        "#
    ))
    .expect("app schema");
    s
}

fn sql_channel(c: &mut Client, name: &str, function: &str, role: &str) {
    let options = format!(
        r#"{{"kind": "sql", "function": "{function}", "run_as": "{role}", "retry": {{"base_ms": 100, "jitter": "none", "max_attempts": 5}}, "tenants": ["*"]}}"#
    );
    c.execute(
        "SELECT outbox.create_channel($1, 'sql', $2::text::jsonb)",
        &[&name, &options],
    )
    .expect("create sql channel");
}

fn http_channel(c: &mut Client, sim: &Simulator, name: &str) {
    sim.set_dedupe(name, "Idempotency-Key");
    c.execute(
        "SELECT outbox.create_channel($1, $2, '{\"idempotency_header\": \"Idempotency-Key\", \"external_id\": \"/id\", \"retry\": {\"base_ms\": 100}}'::jsonb)",
        &[&name, &sim.send_url(name)],
    )
    .expect("create http channel");
}

fn tasks(c: &mut Client, s: &str, key: &str) -> i64 {
    c.query_one(
        &format!("SELECT count(*) FROM {s}.tasks WHERE effect_key = $1"),
        &[&key],
    )
    .unwrap()
    .get(0)
}

/// One assistant turn with three effects, each keyed by effect_key(turn, operation).
fn run_turn(c: &mut Client, turn: &str, reply: &str, task: &str, email: &str) -> [i64; 3] {
    let mut tx = c.transaction().unwrap();
    let mut ids = [0i64; 3];
    for (i, (channel, op, payload)) in [
        (reply, "send_reply", r#"{"text": "Your task is created"}"#),
        (
            task,
            "create_task",
            r#"{"title": "Call the customer back"}"#,
        ),
        (
            email,
            "send_email",
            r#"{"to": "user@example.org", "subject": "Task created"}"#,
        ),
    ]
    .iter()
    .enumerate()
    {
        ids[i] = tx
            .query_one(
                "SELECT outbox.enqueue($1, $2::text::jsonb, outbox.effect_key($3, $4))",
                &[channel, payload, &turn, op],
            )
            .unwrap()
            .get(0);
    }
    tx.commit().unwrap();
    ids
}

#[test]
fn effect_runs_as_its_least_privilege_role() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let s = app_schema(&mut c);
    let ch = unique("fx_who");
    sql_channel(&mut c, &ch, &format!("{s}.whoami"), &format!("{s}_effects"));
    let id: i64 = one(
        &mut c,
        "SELECT outbox.enqueue($1, '{}'::jsonb, $2)",
        &[&ch, &unique("k")],
    );
    assert!(wait_for_state(&cluster, id, "delivered", T));
    let ext = external_id_of(&mut c, id);
    assert_eq!(
        ext,
        Some(format!("{s}_effects")),
        "the function ran as run_as, not as a superuser"
    );
    let by = ledger_recorded_by(&mut c, id);
    assert_eq!(by, "worker");
}

/// A function declared `RETURNS SETOF text` that returns no row has run: its message is
/// delivered without an external id, as after a NULL, with its write committed once.
/// Before, reading the missing row failed the message with XX000.
#[test]
fn an_effect_that_returns_no_row_is_delivered_without_an_external_id() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let s = app_schema(&mut c);
    c.batch_execute(&format!(
        r#"
        CREATE FUNCTION {s}.file_quietly(payload jsonb, effect_key text) RETURNS SETOF text LANGUAGE sql AS $$
            INSERT INTO {s}.tasks (effect_key, title) VALUES (effect_key, 'quiet');
            SELECT NULL::text WHERE false;
        $$;
        GRANT EXECUTE ON FUNCTION {s}.file_quietly(jsonb, text) TO {s}_effects;
        "#
    ))
    .expect("function");
    let ch = unique("fx_no_row");
    sql_channel(
        &mut c,
        &ch,
        &format!("{s}.file_quietly"),
        &format!("{s}_effects"),
    );
    let key = unique("k");
    let id: i64 = one(
        &mut c,
        "SELECT outbox.enqueue($1, '{}'::jsonb, $2)",
        &[&ch, &key],
    );
    assert!(
        wait_for_state(&cluster, id, "delivered", T),
        "{:?}",
        c.query_one(
            "SELECT state::text, last_error FROM outbox.messages WHERE id = $1",
            &[&id]
        )
        .map(|r| (r.get::<_, String>(0), r.get::<_, Option<String>>(1)))
    );
    assert_eq!(external_id_of(&mut c, id), None);
    assert_eq!(tasks(&mut c, &s, &key), 1, "the function's write, once");
    assert_eq!(ledger_recorded_by(&mut c, id), "worker");
}

/// Puts the server's `synchronous_commit` back when the test ends, however it ends.
struct ServerCommitLevel<'a>(&'a Cluster);

impl Drop for ServerCommitLevel<'_> {
    fn drop(&mut self) {
        let mut c = self.0.connect();
        let _ = c.batch_execute("ALTER SYSTEM RESET synchronous_commit");
        let _ = c.batch_execute("SELECT pg_reload_conf()");
    }
}

/// A claim is on disk before its request leaves, whatever the configuration says: with the
/// server's `synchronous_commit` off, the worker commits with it on; a level that flushes,
/// `local`, is kept. Seen by an effect's function, which runs in the worker's session.
#[test]
fn the_worker_commits_durably_when_the_server_turns_synchronous_commit_off() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let s = app_schema(&mut c);
    c.batch_execute(&format!(
        "CREATE FUNCTION {s}.commit_level(payload jsonb, effect_key text) RETURNS text LANGUAGE sql
             AS $$ SELECT current_setting('synchronous_commit') $$;
         GRANT EXECUTE ON FUNCTION {s}.commit_level(jsonb, text) TO {s}_effects;"
    ))
    .unwrap();
    let ch = unique("fx_durable");
    sql_channel(
        &mut c,
        &ch,
        &format!("{s}.commit_level"),
        &format!("{s}_effects"),
    );
    let workers = cluster.worker_pids(&mut c).len();
    let _restore = ServerCommitLevel(&cluster);
    let mut level_seen = |level: &str| -> Option<String> {
        let mark = cluster.log_mark();
        // Each its own statement: ALTER SYSTEM runs outside a transaction block.
        c.batch_execute(&format!("ALTER SYSTEM SET synchronous_commit = {level}"))
            .unwrap();
        c.batch_execute("SELECT pg_reload_conf()").unwrap();
        // Every worker has read the configuration again (it logs its settings).
        assert!(
            wait_until(T, || cluster
                .log_since(mark)
                .matches(" settings: database=")
                .count()
                >= workers),
            "the {workers} workers reloaded their configuration"
        );
        let id: i64 = one(
            &mut c,
            "SELECT outbox.enqueue($1, '{}'::jsonb, $2)",
            &[&ch, &unique("k")],
        );
        assert!(wait_for_state(&cluster, id, "delivered", T));
        external_id_of(&mut c, id)
    };
    assert_eq!(
        level_seen("off").as_deref(),
        Some("on"),
        "off is raised to on"
    );
    assert_eq!(
        level_seen("local").as_deref(),
        Some("local"),
        "local is kept"
    );
    assert_eq!(
        level_seen("off").as_deref(),
        Some("on"),
        "and raised again after it"
    );
}

#[test]
fn three_effect_turn_survives_every_crash_point_exactly_once() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let s = app_schema(&mut c);
    let role = format!("{s}_effects");
    for point in [
        "crash_after_claim",
        "crash_after_send",
        "crash_after_response",
        "crash_before_commit",
    ] {
        let reply = unique("fx_reply");
        let task = unique("fx_task");
        let email = unique("fx_email");
        http_channel(&mut c, &sim, &reply);
        sql_channel(&mut c, &task, &format!("{s}.create_task"), &role);
        http_channel(&mut c, &sim, &email);
        let turn = unique("turn");
        let guard = arm_fault(&cluster, point);
        let ids = run_turn(&mut c, &turn, &reply, &task, &email);
        // The turn is re-run after the crash (the application retries its own step): the
        // same keys yield the same messages.
        assert!(
            wait_until(T, || ids.iter().all(|id| outbox_e2e::cluster::state_of(
                &cluster, *id
            )
            .as_deref()
                != Some("sending"))),
            "{point}: still sending"
        );
        drop(guard);
        let mut c2 = cluster.connect();
        let again = run_turn(&mut c2, &turn, &reply, &task, &email);
        assert_eq!(
            again, ids,
            "{point}: re-running the turn enqueues nothing new"
        );
        for id in ids {
            assert!(
                wait_for_state(&cluster, id, "delivered", T),
                "{point}: message {id} not delivered"
            );
        }
        let task_key: String = c2
            .query_one("SELECT outbox.effect_key($1, 'create_task')", &[&turn])
            .unwrap()
            .get(0);
        assert_eq!(
            sim.stored(&reply).len(),
            1,
            "{point}: the reply provider holds one message"
        );
        assert_eq!(
            tasks(&mut c2, &s, &task_key),
            1,
            "{point}: the task table holds one row"
        );
        assert_eq!(
            sim.stored(&email).len(),
            1,
            "{point}: the email provider holds one message"
        );
        c = c2;
    }
}

#[test]
fn crash_before_commit_rolls_the_effect_back_with_its_ledger_entry() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let s = app_schema(&mut c);
    let ch = unique("fx_commit");
    sql_channel(
        &mut c,
        &ch,
        &format!("{s}.create_task"),
        &format!("{s}_effects"),
    );
    let key = unique("k");
    let mark = cluster.log_mark();
    let guard = arm_fault(&cluster, "crash_before_commit");
    let id: i64 = one(
        &mut c,
        "SELECT outbox.enqueue($1, '{\"title\": \"once\"}'::jsonb, $2)",
        &[&ch, &key],
    );
    assert!(
        wait_until(T, || cluster
            .log_since(mark)
            .contains("crash_before_commit")),
        "the fault fired"
    );
    drop(guard);
    assert!(wait_for_state(&cluster, id, "delivered", T));
    let mut c = cluster.connect();
    assert_eq!(
        tasks(&mut c, &s, &key),
        1,
        "the effect happened exactly once"
    );
    let kinds: Vec<String> = c
        .query("SELECT kind || ':' || coalesce(outcome, '') FROM outbox.attempts WHERE message_id = $1 ORDER BY attempt_id", &[&id])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        kinds
            .iter()
            .any(|k| k.starts_with("recovery:recovered: queued")),
        "{kinds:?}"
    );
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("send:delivered"),
        "{kinds:?}"
    );
}

#[test]
fn transient_sql_errors_retry_and_permanent_ones_fail_with_their_sqlstate() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let s = app_schema(&mut c);
    let role = format!("{s}_effects");
    let flaky = unique("fx_flaky");
    sql_channel(&mut c, &flaky, &format!("{s}.flaky_task"), &role);
    let id: i64 = one(
        &mut c,
        "SELECT outbox.enqueue($1, '{\"failures\": 2}'::jsonb, $2)",
        &[&flaky, &unique("k")],
    );
    assert!(wait_for_state(&cluster, id, "delivered", T));
    let rows: Vec<(i32, Option<String>, Option<String>)> = c
        .query("SELECT attempt, error_class::text, error FROM outbox.attempts WHERE message_id = $1 AND kind = 'send' ORDER BY attempt", &[&id])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(rows.len(), 3, "delivered on attempt 3: {rows:?}");
    for row in &rows[..2] {
        assert_eq!(row.1.as_deref(), Some("transient"));
        assert!(row.2.as_deref().unwrap_or("").contains("40P01"), "{row:?}");
    }
    let calls: i64 = c
        .query_one(&format!("SELECT last_value FROM {s}.flaky_calls"), &[])
        .unwrap()
        .get(0);
    assert_eq!(calls, 3, "three calls");
    let key = effect_key_of(&mut c, id);
    assert_eq!(
        tasks(&mut c, &s, &key),
        1,
        "the failed calls' writes were rolled back with them"
    );

    let tasks_ch = unique("fx_check");
    sql_channel(&mut c, &tasks_ch, &format!("{s}.create_task"), &role);
    let bad: i64 = one(
        &mut c,
        "SELECT outbox.enqueue($1, '{\"title\": \"bad\"}'::jsonb, $2)",
        &[&tasks_ch, &unique("k")],
    );
    let good: i64 = one(
        &mut c,
        "SELECT outbox.enqueue($1, '{\"title\": \"good\"}'::jsonb, $2)",
        &[&tasks_ch, &unique("k")],
    );
    assert!(wait_for_state(&cluster, bad, "failed", T));
    assert!(
        wait_for_state(&cluster, good, "delivered", T),
        "a failing effect does not poison its batch"
    );
    let (class, error): (Option<String>, Option<String>) = c
        .query_one(
            "SELECT last_error_class::text, last_error FROM outbox.messages WHERE id = $1",
            &[&bad],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(class.as_deref(), Some("permanent"));
    assert!(
        error.as_deref().unwrap_or("").contains("23514"),
        "{error:?}"
    );
    let attempts: i32 = one(
        &mut c,
        "SELECT attempts FROM outbox.messages WHERE id = $1",
        &[&bad],
    );
    assert_eq!(attempts, 1);
}

/// Enqueues on a new, paused `sql` channel of the application schema `s`, runs `change`
/// (what makes its effect unavailable), resumes the channel and waits until the message
/// failed; then runs `undo`, whatever the wait came to. Asserts that the message failed and
/// that no worker restarted meanwhile; returns its last error.
fn last_error_once_failed_after(
    cluster: &Cluster,
    c: &mut Client,
    s: &str,
    channel: &str,
    change: &str,
    undo: &str,
) -> Option<String> {
    sql_channel(
        c,
        channel,
        &format!("{s}.create_task"),
        &format!("{s}_effects"),
    );
    c.execute(
        "SELECT outbox.pause_channel($1, 'making the effect unavailable')",
        &[&channel],
    )
    .unwrap();
    let id: i64 = one(
        c,
        "SELECT outbox.enqueue($1, '{\"title\": \"t\"}'::jsonb, $2)",
        &[&channel, &unique("k")],
    );
    c.batch_execute(change).unwrap();
    let pids = cluster.worker_pids(c);
    c.execute("SELECT outbox.resume_channel($1)", &[&channel])
        .unwrap();
    let failed = wait_for_state(cluster, id, "failed", T);
    c.batch_execute(undo).unwrap();
    assert!(failed, "the message failed");
    assert_eq!(cluster.worker_pids(c), pids, "the worker did not crash");
    one(
        c,
        "SELECT last_error FROM outbox.messages WHERE id = $1",
        &[&id],
    )
}

#[test]
fn a_dropped_function_fails_readably_and_the_worker_goes_on() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let s = app_schema(&mut c);
    let error = last_error_once_failed_after(
        &cluster,
        &mut c,
        &s,
        &unique("fx_dropped"),
        &format!("DROP FUNCTION {s}.create_task(jsonb, text)"),
        "",
    );
    assert!(
        error.as_deref().unwrap_or("").contains("does not exist"),
        "{error:?}"
    );
}

/// A `run_as` role that has become a superuser (or is gone) is found so at the call: the
/// message fails with a readable error, and the worker, with the record of everything else
/// it had in that transaction, goes on. Before, the empty lookup of the role ended the
/// record's transaction with an error, and the worker restarted.
#[test]
fn a_run_as_role_that_became_a_superuser_fails_readably_and_the_worker_goes_on() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let s = app_schema(&mut c);
    let error = last_error_once_failed_after(
        &cluster,
        &mut c,
        &s,
        &unique("fx_super"),
        &format!("ALTER ROLE {s}_effects SUPERUSER"),
        &format!("ALTER ROLE {s}_effects NOSUPERUSER"),
    );
    assert!(
        error
            .as_deref()
            .unwrap_or("")
            .contains("has become a superuser"),
        "{error:?}"
    );
    let ran: i64 = one(&mut c, &format!("SELECT count(*) FROM {s}.tasks"), &[]);
    assert_eq!(ran, 0, "the function never ran");
}

/// An effect whose message's counter was set by hand to its limit runs once and is
/// recorded: the lock of the effects' messages counts the attempt under way as the claim
/// does, saturated, instead of failing the record's transaction with 22003.
#[test]
fn an_effect_whose_counter_is_at_its_limit_runs_once() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let s = app_schema(&mut c);
    let ch = unique("fx_limit");
    sql_channel(
        &mut c,
        &ch,
        &format!("{s}.create_task"),
        &format!("{s}_effects"),
    );
    let key = unique("k");
    let id = {
        let mut tx = c.transaction().unwrap();
        let id: i64 = one(
            &mut tx,
            "SELECT outbox.enqueue($1, '{\"title\": \"at the limit\"}'::jsonb, $2)",
            &[&ch, &key],
        );
        tx.execute(
            "UPDATE outbox._messages SET attempts = 2147483647 WHERE id = $1",
            &[&id],
        )
        .unwrap();
        tx.commit().unwrap();
        id
    };
    let pids = cluster.worker_pids(&mut c);
    assert!(wait_for_state(&cluster, id, "delivered", T));
    assert_eq!(tasks(&mut c, &s, &key), 1, "the effect ran once");
    let attempts: i32 = one(
        &mut c,
        "SELECT attempts FROM outbox.messages WHERE id = $1",
        &[&id],
    );
    assert_eq!(attempts, i32::MAX);
    assert_eq!(
        cluster.worker_pids(&mut c),
        pids,
        "the worker did not crash"
    );
}

#[test]
fn a_new_command_is_a_new_effect_and_a_rerun_is_not() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let s = app_schema(&mut c);
    let reply = unique("fx_r");
    let task = unique("fx_t");
    let email = unique("fx_e");
    http_channel(&mut c, &sim, &reply);
    sql_channel(
        &mut c,
        &task,
        &format!("{s}.create_task"),
        &format!("{s}_effects"),
    );
    http_channel(&mut c, &sim, &email);
    sim.set_plan(&reply, vec![Action::Accept]);
    let first = run_turn(&mut c, &unique("turn"), &reply, &task, &email);
    let second = run_turn(&mut c, &unique("turn"), &reply, &task, &email);
    for id in first.iter().chain(second.iter()) {
        assert!(wait_for_state(&cluster, *id, "delivered", T));
    }
    assert_ne!(first, second, "a new turn id is a new, legitimate effect");
    assert_eq!(sim.stored(&reply).len(), 2);
    assert_eq!(sim.stored(&email).len(), 2);
    let rows: i64 = c
        .query_one(&format!("SELECT count(*) FROM {s}.tasks"), &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 2);
}
