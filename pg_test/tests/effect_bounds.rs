//! The bound around a `sql` effect (docs/security.md, findings #2 and #13 of issue 68): a
//! tenant's function runs in a delivery worker's process, and must not hold it.
//!
//! 1. An effect is cancelled at its channel's `timeout_ms` whatever it does (sleeps, loops,
//!    waits on a lock), its subtransaction is rolled back, and it is retried under the
//!    channel's backoff, never at once; another tenant's message is delivered meanwhile.
//! 2. `pg_terminate_backend` of the worker and a fast shutdown end a running effect at once.
//! 3. Nothing of the call stays with the worker: a session-level advisory lock is released
//!    after it, and a trigger it deferred is refused (PostgreSQL's rule for a
//!    security-restricted operation) rather than fired at the worker's commit.
//!
//! Run: `cargo test -p outbox_e2e --release --test effect_bounds -- --test-threads=1`.

use outbox_e2e::cluster::{poll, state_of, unique, wait_for_state, wait_for_workers, Cluster};
use outbox_e2e::helpers::{attempts, create_channel, one, serial};
use postgres::Client;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(40);

/// An application schema with a role its effects run as, and its tenant.
struct App {
    s: String,
    role: String,
    tenant: String,
}

impl App {
    fn new(c: &mut Client) -> App {
        let s = unique("fxbd");
        let role = format!("{s}_fx");
        c.batch_execute(&format!(
            "CREATE SCHEMA {s};
             CREATE ROLE {role} NOLOGIN IN ROLE outbox_writer;
             GRANT USAGE ON SCHEMA {s} TO {role};"
        ))
        .expect("app schema");
        App {
            tenant: unique("t"),
            s,
            role,
        }
    }

    /// A function `s.name(payload, key)` with `body` (PL/pgSQL), executable by the role.
    fn function(&self, c: &mut Client, name: &str, body: &str) -> String {
        let f = format!("{}.{name}", self.s);
        self.replace(c, &f, body);
        c.batch_execute(&format!(
            "GRANT EXECUTE ON FUNCTION {f}(jsonb, text) TO {}",
            self.role
        ))
        .expect("grant");
        f
    }

    /// Gives `function` a new body.
    fn replace(&self, c: &mut Client, function: &str, body: &str) {
        c.batch_execute(&format!(
            "CREATE OR REPLACE FUNCTION {function}(payload jsonb, effect_key text) RETURNS text
             LANGUAGE plpgsql AS $fn$ BEGIN {body} END $fn$;"
        ))
        .expect("effect function");
    }

    /// A sql channel of the app's tenant calling `function` as the role.
    fn channel(&self, c: &mut Client, function: &str, timeout_ms: u64, retry: &str) -> String {
        let ch = unique("fxbd_ch");
        let options = format!(
            r#"{{"kind": "sql", "function": "{function}", "run_as": "{}", "tenants": ["{}"],
                "timeout_ms": {timeout_ms}, "connect_timeout_ms": {}, "retry": {retry}}}"#,
            self.role,
            self.tenant,
            timeout_ms.min(3000)
        );
        create_channel(c, &ch, "sql", &options);
        ch
    }

    fn enqueue(&self, c: &mut Client, channel: &str) -> i64 {
        enqueue_for(c, &self.tenant, channel)
    }
}

/// Enqueues on `channel` for `tenant`; returns the id.
fn enqueue_for(c: &mut Client, tenant: &str, channel: &str) -> i64 {
    let mut tx = c.transaction().expect("tx");
    tx.execute("SELECT set_config('outbox.tenant', $1, true)", &[&tenant])
        .expect("tenant");
    let id: i64 = one(
        &mut tx,
        "SELECT outbox.enqueue($1, '{}'::jsonb, $2)",
        &[&channel, &unique("fxbd_key")],
    );
    tx.commit().expect("commit");
    id
}

/// Waits until a delivery worker waits on `wait_event` (an effect sleeping, waiting on a
/// lock); returns its pid.
fn worker_waiting_on(cluster: &Cluster, wait_event: &str) -> i32 {
    poll(cluster, T, |c| {
        Ok(c.query_opt(
            "SELECT pid FROM pg_stat_activity
              WHERE backend_type = 'outbox_delivery worker' AND wait_event = $1 LIMIT 1",
            &[&wait_event],
        )?
        .map(|r| r.get::<_, i32>(0)))
    })
    .unwrap_or_else(|| panic!("no worker came to wait on {wait_event} within {T:?}"))
}

/// The attempts of `id` that have finished.
fn finished(c: &mut Client, id: i64) -> Vec<outbox_e2e::helpers::Attempt> {
    attempts(c, id)
        .into_iter()
        .filter(|a| a.finished_ms.is_some())
        .collect()
}

/// Waits until `id` has `n` finished attempts; returns them.
fn wait_for_attempts(
    cluster: &Cluster,
    id: i64,
    n: usize,
    within: Duration,
) -> Vec<outbox_e2e::helpers::Attempt> {
    let mut c = cluster.connect();
    let deadline = Instant::now() + within;
    loop {
        let done = finished(&mut c, id);
        if done.len() >= n {
            return done;
        }
        assert!(
            Instant::now() < deadline,
            "message {id} has {} finished attempts after {within:?} ({:?}): {done:?}",
            done.len(),
            state_of(cluster, id)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Asserts that attempt `a` was an effect cancelled at its channel's `timeout_ms` (the
/// worker says so only when the call lasted that long: see `sql_effect::explain_cancel`).
fn assert_timed_out(a: &outbox_e2e::helpers::Attempt) {
    let error = a.error.clone().unwrap_or_default();
    assert!(
        error.contains("57014") && error.contains("ran past the channel's timeout_ms"),
        "the effect was not cancelled at its timeout: {a:?}"
    );
}

#[test]
fn an_effect_past_its_timeout_is_retried_with_backoff_while_another_tenant_is_served() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    wait_for_workers(&cluster, &[]);
    let app = App::new(&mut c);
    let sleeper = app.function(&mut c, "sleeper", "PERFORM pg_sleep(60); RETURN 'slept';");
    let ch = app.channel(
        &mut c,
        &sleeper,
        1000,
        r#"{"base_ms": 3000, "max_attempts": 3}"#,
    );
    // Two sleepers: enough to hold both workers of the database.
    let enqueued = Instant::now();
    let ids = [app.enqueue(&mut c, &ch), app.enqueue(&mut c, &ch)];
    worker_waiting_on(&cluster, "PgSleep");

    // Another tenant, another channel: its message goes out meanwhile.
    let other = App::new(&mut c);
    let quick = other.function(&mut c, "quick", "RETURN 'done';");
    let other_ch = other.channel(&mut c, &quick, 1000, r#"{"base_ms": 100}"#);
    let quick_enqueued = Instant::now();
    let quick_id = other.enqueue(&mut c, &other_ch);
    assert!(
        wait_for_state(&cluster, quick_id, "delivered", T),
        "the other tenant's message: {:?}",
        state_of(&cluster, quick_id)
    );
    let waited = quick_enqueued.elapsed();
    assert!(
        waited < Duration::from_secs(2),
        "the other tenant's message was delivered {waited:?} after its enqueue"
    );

    // Each sleeper ended at its timeout of 1 s: one after the other in one worker's batch
    // at the latest.
    for id in ids {
        let left = Duration::from_millis(3500).saturating_sub(enqueued.elapsed());
        wait_for_attempts(&cluster, id, 1, left);
    }
    for id in ids {
        let done = wait_for_attempts(&cluster, id, 2, Duration::from_secs(30));
        assert_timed_out(&done[0]);
        assert_timed_out(&done[1]);
        // Equal jitter at least: half the ceiling of 3000 ms.
        let gap = done[1].started_ms - done[0].finished_ms.unwrap_or_default();
        assert!(
            gap >= 1400.0,
            "the effect was retried {gap:.0} ms after its timeout: {done:?}"
        );
    }
    app.replace(&mut c, &sleeper, "RETURN 'done';");
    // The third attempt calls the new body.
    for id in ids {
        assert!(
            wait_for_state(&cluster, id, "delivered", T),
            "{:?}",
            state_of(&cluster, id)
        );
    }
}

#[test]
fn an_effect_that_loops_or_waits_on_a_lock_ends_at_its_timeout() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    wait_for_workers(&cluster, &[]);
    let app = App::new(&mut c);
    c.batch_execute(&format!(
        "CREATE TABLE {s}.locked (x int); GRANT SELECT ON {s}.locked TO {role};",
        s = app.s,
        role = app.role
    ))
    .expect("locked table");
    let looper = app.function(&mut c, "looper", "LOOP PERFORM 1; END LOOP;");
    let waiter = app.function(
        &mut c,
        "waiter",
        &format!("PERFORM count(*) FROM {}.locked; RETURN 'read';", app.s),
    );
    let once = r#"{"max_attempts": 1}"#;
    let loop_ch = app.channel(&mut c, &looper, 1000, once);
    let wait_ch = app.channel(&mut c, &waiter, 1000, once);

    // The test holds the lock the effect waits for until the end.
    let mut holder = cluster.connect();
    let mut lock = holder.transaction().expect("tx");
    lock.batch_execute(&format!(
        "LOCK TABLE {}.locked IN ACCESS EXCLUSIVE MODE",
        app.s
    ))
    .expect("lock");

    let enqueued = Instant::now();
    let looping = app.enqueue(&mut c, &loop_ch);
    let waiting = app.enqueue(&mut c, &wait_ch);
    for (what, id) in [("loop", looping), ("lock wait", waiting)] {
        // Both at 1 s, one after the other in one worker's batch at the latest.
        let left = Duration::from_millis(3500).saturating_sub(enqueued.elapsed());
        let done = wait_for_attempts(&cluster, id, 1, left);
        assert_timed_out(&done[0]);
        assert_eq!(
            state_of(&cluster, id).as_deref(),
            Some("exhausted"),
            "the {what}: {done:?}"
        );
    }
    lock.rollback().expect("release the lock");
}

#[test]
fn an_effects_session_advisory_lock_does_not_outlive_its_call() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    wait_for_workers(&cluster, &[]);
    let app = App::new(&mut c);
    let key: i64 = one(&mut c, "SELECT (random() * 1e12)::int8", &[]);
    let keeper = app.function(
        &mut c,
        "keeper",
        &format!("PERFORM pg_advisory_lock({key}); RETURN 'locked';"),
    );
    let failing = app.function(
        &mut c,
        "failing",
        &format!(
            "PERFORM pg_advisory_lock({}); RAISE EXCEPTION 'after locking';",
            key + 1
        ),
    );
    let once = r#"{"max_attempts": 1}"#;
    let keeper_ch = app.channel(&mut c, &keeper, 5000, once);
    let failing_ch = app.channel(&mut c, &failing, 5000, once);
    let kept = app.enqueue(&mut c, &keeper_ch);
    let failed = app.enqueue(&mut c, &failing_ch);
    assert!(
        wait_for_state(&cluster, kept, "delivered", T),
        "{:?}",
        state_of(&cluster, kept)
    );
    assert!(
        wait_for_state(&cluster, failed, "failed", T),
        "{:?}",
        state_of(&cluster, failed)
    );

    let held: Vec<(i32, i64)> = c
        .query(
            "SELECT l.pid, (l.classid::int8 << 32) | l.objid::int8
               FROM pg_locks l JOIN pg_stat_activity a USING (pid)
              WHERE l.locktype = 'advisory' AND a.backend_type = 'outbox_delivery worker'",
            &[],
        )
        .expect("pg_locks")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(
        held.is_empty(),
        "advisory locks held by the workers after the effects returned: {held:?} (keys {key}, {})",
        key + 1
    );
    for k in [key, key + 1] {
        let got: bool = one(&mut c, "SELECT pg_try_advisory_lock($1)", &[&k]);
        assert!(got, "advisory lock {k} is still held");
        let _: bool = one(&mut c, "SELECT pg_advisory_unlock($1)", &[&k]);
    }
}

#[test]
fn an_effects_deferred_trigger_never_fires_at_the_workers_commit() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    wait_for_workers(&cluster, &[]);
    let app = App::new(&mut c);
    let s = &app.s;
    // A deferred constraint trigger that records who runs it. Anyone may write the record:
    // a trigger fired at the worker's commit would run as the worker's role, unbounded.
    c.batch_execute(&format!(
        "CREATE TABLE {s}.rows (x int);
         CREATE TABLE {s}.fired (who text);
         GRANT USAGE ON SCHEMA {s} TO PUBLIC;
         GRANT INSERT ON {s}.rows TO {role};
         GRANT INSERT ON {s}.fired TO PUBLIC;
         CREATE FUNCTION {s}.later() RETURNS trigger LANGUAGE plpgsql AS $fn$
         BEGIN INSERT INTO {s}.fired VALUES (current_user); RETURN NULL; END $fn$;
         GRANT EXECUTE ON FUNCTION {s}.later() TO PUBLIC;
         CREATE CONSTRAINT TRIGGER later AFTER INSERT ON {s}.rows
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {s}.later();",
        role = app.role
    ))
    .expect("deferred trigger");
    let inserter = app.function(
        &mut c,
        "inserter",
        &format!("INSERT INTO {s}.rows VALUES (1); RETURN 'inserted';"),
    );
    let ch = app.channel(&mut c, &inserter, 5000, r#"{"max_attempts": 1}"#);
    let id = app.enqueue(&mut c, &ch);
    assert!(
        wait_for_state(&cluster, id, "failed", T),
        "{:?}: {:?}",
        state_of(&cluster, id),
        attempts(&mut c, id)
    );
    let error = attempts(&mut c, id)[0].error.clone().unwrap_or_default();
    assert!(
        error.contains("42501") && error.contains("deferred"),
        "{error}"
    );
    let who: Vec<String> = c
        .query(&format!("SELECT who FROM {s}.fired"), &[])
        .expect("fired")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(who.is_empty(), "the deferred trigger ran as {who:?}");
    let rows = one::<i64>(&mut c, &format!("SELECT count(*) FROM {s}.rows"), &[]);
    assert_eq!(rows, 0, "the effect's write was rolled back");
}

/// An effect that sleeps far longer than anything the test waits for, with a timeout that
/// does not end it first; returns the app, its function and the message.
fn sleeping_effect(cluster: &Cluster, c: &mut Client, seconds: u32) -> (App, String, i64) {
    wait_for_workers(cluster, &[]);
    let app = App::new(c);
    let sleeper = app.function(
        c,
        "long_sleeper",
        &format!("PERFORM pg_sleep({seconds}); RETURN 'slept';"),
    );
    let ch = app.channel(
        c,
        &sleeper,
        600_000,
        r#"{"base_ms": 1000, "max_attempts": 3}"#,
    );
    let id = app.enqueue(c, &ch);
    (app, sleeper, id)
}

#[test]
fn pg_terminate_backend_ends_a_worker_in_a_sleeping_effect_within_a_second() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let (app, sleeper, id) = sleeping_effect(&cluster, &mut c, 120);
    let pid = worker_waiting_on(&cluster, "PgSleep");

    let asked = Instant::now();
    let _: bool = one(&mut c, "SELECT pg_terminate_backend($1)", &[&pid]);
    let gone = poll(&cluster, Duration::from_secs(30), |c| {
        let n: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )?
            .get(0);
        Ok((n == 0).then(|| asked.elapsed()))
    });
    let gone = gone.expect("the worker was still there 30 s after pg_terminate_backend");
    assert!(
        gone < Duration::from_secs(1),
        "the worker ended {gone:?} after pg_terminate_backend"
    );

    // The effect was rolled back and recorded: retried later, not lost.
    let done = finished(&mut c, id);
    let error = done
        .first()
        .and_then(|a| a.error.clone())
        .unwrap_or_default();
    assert!(
        error.contains("57014") && error.contains("asked to stop"),
        "{done:?}"
    );
    app.replace(&mut c, &sleeper, "RETURN 'done';");
    wait_for_workers(&cluster, &[pid]);
    assert!(
        wait_for_state(&cluster, id, "delivered", T),
        "{:?}",
        state_of(&cluster, id)
    );
}

#[test]
fn a_fast_shutdown_during_a_sleeping_effect_completes_promptly() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let (app, sleeper, id) = sleeping_effect(&cluster, &mut c, 25);
    worker_waiting_on(&cluster, "PgSleep");
    drop(c);

    let asked = Instant::now();
    cluster.script(&["stop", "fast"]);
    let took = asked.elapsed();
    cluster.script(&["start"]);
    let mut c = cluster.connect();
    app.replace(&mut c, &sleeper, "RETURN 'done';");
    wait_for_workers(&cluster, &[]);
    assert!(
        took < Duration::from_secs(5),
        "pg_ctl stop -m fast took {took:?} during a sleeping effect"
    );
    assert!(
        wait_for_state(&cluster, id, "delivered", T),
        "{:?}",
        state_of(&cluster, id)
    );
}

#[test]
fn an_effect_that_catches_its_cancel_ends_its_worker_and_others_are_served() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    wait_for_workers(&cluster, &[]);
    let app = App::new(&mut c);
    let stubborn = app.function(
        &mut c,
        "stubborn",
        "LOOP BEGIN PERFORM pg_sleep(10); EXCEPTION WHEN query_canceled THEN NULL; END; END LOOP;",
    );
    let ch = app.channel(
        &mut c,
        &stubborn,
        1000,
        r#"{"base_ms": 1000, "max_attempts": 5}"#,
    );
    let id = app.enqueue(&mut c, &ch);
    let pid = worker_waiting_on(&cluster, "PgSleep");
    let waiting = Instant::now();

    // Another tenant's message is delivered meanwhile.
    let other = App::new(&mut c);
    let quick = other.function(&mut c, "quick", "RETURN 'done';");
    let other_ch = other.channel(&mut c, &quick, 1000, r#"{"base_ms": 100}"#);
    let quick_enqueued = Instant::now();
    let quick_id = other.enqueue(&mut c, &other_ch);
    assert!(
        wait_for_state(&cluster, quick_id, "delivered", T),
        "{:?}",
        state_of(&cluster, quick_id)
    );
    let waited = quick_enqueued.elapsed();
    assert!(
        waited < Duration::from_secs(2),
        "the other tenant's message was delivered {waited:?} after its enqueue"
    );

    // The timeout of 1 s, then half a second of cancels it ignores: the process ends.
    let gone = poll(&cluster, Duration::from_secs(30), |c| {
        let n: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )?
            .get(0);
        Ok((n == 0).then(|| waiting.elapsed()))
    })
    .expect("the worker of the effect that catches its cancels was still there after 30 s");
    assert!(
        gone < Duration::from_secs(3),
        "the worker ended {gone:?} after the effect began"
    );
    app.replace(&mut c, &stubborn, "RETURN 'done';");
    wait_for_workers(&cluster, &[pid]);
    assert!(
        wait_for_state(&cluster, id, "delivered", Duration::from_secs(90)),
        "{:?}",
        state_of(&cluster, id)
    );
}
