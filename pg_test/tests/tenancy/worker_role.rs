//! Sections 7 and 9: the worker runs as the restricted `outbox.role`, and stops (saying so
//! once) when that role is a superuser or missing.

use super::*;

// ---------------------------------------------------------------------------------------
// 7. the worker's role
// ---------------------------------------------------------------------------------------

const PROBE_TRIGGER: &str = "e2e_tenants_worker_probe";
const PROBE_FUNCTION: &str = "public.e2e_tenants_worker_probe()";

/// Removes the probe trigger, its function, its table and a role it may have created;
/// when dropped too, so that a failing test leaves nothing behind.
struct ProbeGuard<'a> {
    cluster: &'a Cluster,
    table: String,
    evil_role: String,
}

fn drop_probe_trigger(c: &mut Client) -> Result<(), postgres::Error> {
    c.batch_execute(&format!(
        "DROP TRIGGER IF EXISTS {PROBE_TRIGGER} ON outbox._messages; DROP FUNCTION IF EXISTS {PROBE_FUNCTION};"
    ))
}

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        let Ok(mut c) = Client::connect(&self.cluster.conninfo(), NoTls) else {
            eprintln!(
                "cleanup: cannot connect; the trigger {PROBE_TRIGGER} on outbox._messages may be left"
            );
            return;
        };
        if let Err(e) = drop_probe_trigger(&mut c) {
            eprintln!(
                "cleanup: could not drop the probe trigger: {}",
                describe(&e)
            );
        }
        let _ = c.batch_execute(&format!(
            "DROP TABLE IF EXISTS public.{}; DROP ROLE IF EXISTS {};",
            ident(&self.table),
            ident(&self.evil_role)
        ));
    }
}

#[test]
fn a_trigger_on_the_message_table_runs_as_the_restricted_worker_role() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let mut su = cluster.connect();
    check_extension_roles(&mut su);
    // A previous run that failed may have left its trigger.
    drop_probe_trigger(&mut su).expect("drop a leftover probe trigger");
    let worker_role: String = one(
        &mut su,
        "SELECT coalesce(nullif(current_setting('outbox.role', true), ''), 'outbox_worker')",
        &[],
    );
    let guard = ProbeGuard {
        cluster: &cluster,
        table: format!("{}_probe", unique("e2e")),
        evil_role: unique("e2e_evil"),
    };
    let probe = format!("public.{}", ident(&guard.table));
    let key = unique("ten_probe_key");
    su.batch_execute(&format!(
        "CREATE TABLE {probe} (who text, su text, rolsuper text, tried text, outcome text, user_after text);
         GRANT INSERT ON {probe} TO {worker};",
        worker = ident(&worker_role)
    ))
    .expect("create the probe table");

    // Each attempt in its own block; the outcome is 'ok' or the SQLSTATE.
    let attempts: [(&str, String); 7] = [
        ("SET ROLE postgres", "SET LOCAL ROLE postgres".into()),
        (
            "SET SESSION AUTHORIZATION postgres",
            "SET LOCAL SESSION AUTHORIZATION postgres".into(),
        ),
        (
            "CREATE ROLE ... SUPERUSER",
            format!("CREATE ROLE {} SUPERUSER", ident(&guard.evil_role)),
        ),
        (
            "COPY ... TO PROGRAM",
            "COPY (SELECT 1) TO PROGRAM 'true'".into(),
        ),
        (
            "CREATE TEMP TABLE",
            format!(
                "CREATE TEMP TABLE {} (i int) ON COMMIT DROP",
                ident(&format!("{}_tmp", guard.table))
            ),
        ),
        (
            "pg_read_file",
            "SELECT pg_catalog.pg_read_file('PG_VERSION')".into(),
        ),
        (
            "SET session_replication_role",
            "SET LOCAL session_replication_role = replica".into(),
        ),
    ];
    let mut body = String::new();
    for (label, stmt) in &attempts {
        body.push_str(&format!(
            "    BEGIN
        EXECUTE {stmt};
        v_outcome := 'ok';
    EXCEPTION WHEN others THEN
        v_outcome := SQLSTATE;
    END;
    INSERT INTO {probe} VALUES (v_who, v_su, v_rolsuper, {label}, v_outcome, current_user::text);
",
            stmt = literal(stmt),
            label = literal(label),
        ));
    }
    let function = format!(
        "CREATE FUNCTION {PROBE_FUNCTION} RETURNS trigger
LANGUAGE plpgsql SECURITY INVOKER
AS $probe$
DECLARE
    v_who      text := current_user::text;
    v_su       text := current_setting('is_superuser');
    v_rolsuper text := (SELECT r.rolsuper::text FROM pg_catalog.pg_roles r WHERE r.rolname = current_user);
    v_outcome  text;
BEGIN
    IF (CASE TG_OP WHEN 'DELETE' THEN OLD.effect_key ELSE NEW.effect_key END) IS DISTINCT FROM {key} THEN
        RETURN NULL;
    END IF;
{body}    RETURN NULL;
END
$probe$;
GRANT EXECUTE ON FUNCTION {PROBE_FUNCTION} TO {worker};
CREATE TRIGGER {PROBE_TRIGGER} AFTER UPDATE OR DELETE ON outbox._messages
    FOR EACH ROW EXECUTE FUNCTION {PROBE_FUNCTION};",
        key = literal(&key),
        worker = ident(&worker_role),
    );
    su.batch_execute(&function)
        .unwrap_or_else(|e| panic!("create the probe trigger: {}\n{function}", describe(&e)));

    let sim = Simulator::start();
    let ch = unique("ten_probe");
    create_channel(&mut su, &ch, &sim.send_url(&ch), OPTIONS);
    let mark = cluster.log_mark();
    let id: i64 = one(
        &mut su,
        "SELECT outbox.enqueue($1::text, '{\"probe\": true}'::jsonb, $2::text)",
        &[&ch, &key],
    );
    if !wait_for_state(&cluster, id, "delivered", SETTLE) {
        let log: Vec<String> = cluster
            .log_since(mark)
            .lines()
            .filter(|l| l.contains("ERROR") || l.contains(&guard.table))
            .map(str::to_string)
            .collect();
        panic!(
            "message {id} with a probe trigger on outbox._messages was not delivered within {SETTLE:?} (last state {:?}); the trigger must not stop the worker. Errors in the server log since the enqueue:\n{}",
            state_of(&cluster, id),
            log.join("\n")
        );
    }
    drop_probe_trigger(&mut su).expect("drop the probe trigger");

    let rows: Vec<(String, String, String, String, String, String)> = su
        .query(
            &format!("SELECT who, su, rolsuper, tried, outcome, user_after FROM {probe}"),
            &[],
        )
        .expect("probe rows")
        .iter()
        .map(|r| {
            let g = |i: usize| {
                r.get::<_, Option<String>>(i)
                    .unwrap_or_else(|| "NULL".into())
            };
            (g(0), g(1), g(2), g(3), g(4), g(5))
        })
        .collect();
    assert!(
        !rows.is_empty(),
        "the probe trigger never fired while the worker delivered message {id}; a trigger on outbox._messages runs (as {worker_role}) when the worker updates or moves a message"
    );
    let table: String = rows
        .iter()
        .map(|r| format!("{r:?}"))
        .collect::<Vec<_>>()
        .join("\n  ");
    let mut problems = Vec::new();
    for (who, su_setting, rolsuper, tried, outcome, after) in &rows {
        if who != &worker_role {
            problems.push(format!(
                "the trigger ran as current_user = {who}; expected {worker_role}"
            ));
        }
        if rolsuper != "false" {
            problems.push(format!(
                "the trigger's current_user {who} has rolsuper = {rolsuper}"
            ));
        }
        if outcome == "ok" {
            problems.push(format!(
                "inside the worker's transaction, a planted trigger could {tried} (current_user afterwards: {after})"
            ));
        }
        if su_setting != "off" {
            problems.push(format!(
                "current_setting('is_superuser') = {su_setting} inside the trigger (current_user {who}, rolsuper {rolsuper}); the worker's role switch should leave is_superuser off, as SET ROLE does"
            ));
        }
    }
    problems.sort();
    problems.dedup();
    let evil_exists = count(
        &mut su,
        "SELECT count(*) FROM pg_roles WHERE rolname = $1",
        &[&guard.evil_role],
    );
    if evil_exists != 0 {
        problems.push(format!(
            "the trigger created the superuser role {}",
            guard.evil_role
        ));
    }
    assert_no_problems(
        &problems,
        &format!("the worker's role, as a trigger sees it; probe rows (who, is_superuser, rolsuper, tried, outcome, current_user after):\n  {table}\n"),
    );
}

// ---------------------------------------------------------------------------------------
// 9. outbox.role
// ---------------------------------------------------------------------------------------

/// ALTER SYSTEM RESET outbox.role + reload when dropped, also while a panic unwinds.
struct RoleSettingGuard<'a>(&'a Cluster);

impl Drop for RoleSettingGuard<'_> {
    fn drop(&mut self) {
        for _ in 0..50 {
            let ok = Client::connect(&self.0.conninfo(), NoTls).and_then(|mut c| {
                c.batch_execute("ALTER SYSTEM RESET outbox.role")?;
                c.batch_execute("SELECT pg_reload_conf()")
            });
            if ok.is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        std::thread::sleep(Duration::from_millis(700));
    }
}

/// Lines of the server log that speak of `outbox.role`, other than the postmaster's
/// "parameter changed" lines.
fn role_complaints(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains("outbox.role"))
        .filter(|l| !l.contains("changed to") && !l.contains("removed from configuration file"))
        .map(str::to_string)
        .collect()
}

#[test]
fn a_superuser_or_missing_outbox_role_stops_the_worker_and_says_so_once() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let workers = wait_for_workers(&cluster, &[]).len();
    let mut su = cluster.connect();
    let sim = Simulator::start();
    let ch = unique("ten_role");
    create_channel(&mut su, &ch, &sim.send_url(&ch), OPTIONS);
    let _guard = RoleSettingGuard(&cluster);
    let mut held = Vec::new();

    for (what, value) in [
        ("a superuser", "postgres".to_string()),
        ("a role that does not exist", unique("no_such_worker_role")),
    ] {
        let mark = cluster.log_mark();
        su.batch_execute(&format!(
            "ALTER SYSTEM SET outbox.role = {}",
            literal(&value)
        ))
        .unwrap_or_else(|e| panic!("ALTER SYSTEM SET outbox.role = {value}: {}", describe(&e)));
        su.batch_execute("SELECT pg_reload_conf()").unwrap();
        // The workers reload at their next loop.
        std::thread::sleep(Duration::from_millis(1500));
        let id: i64 = one(
            &mut su,
            "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text)",
            &[&ch, &unique("ten_role_key")],
        );
        held.push(id);
        std::thread::sleep(LONG_QUIET);
        let state = state_of(&cluster, id);
        assert_eq!(
            state.as_deref(),
            Some("queued"),
            "with outbox.role = {value} ({what}) the worker must do nothing, but message {id} is {state:?} after {LONG_QUIET:?}"
        );
        assert_eq!(
            sim.send_count(&ch),
            0,
            "with outbox.role = {value} ({what}) the worker sent something"
        );
        let complaints = role_complaints(&cluster.log_since(mark));
        assert!(
            !complaints.is_empty() && complaints.len() <= workers,
            "with outbox.role = {value} ({what}) each of the {workers} workers should say so in the server log once (a line naming outbox.role) and not repeat it every loop; found {} lines:\n{}",
            complaints.len(),
            complaints.join("\n")
        );
    }

    su.batch_execute("ALTER SYSTEM RESET outbox.role").unwrap();
    su.batch_execute("SELECT pg_reload_conf()").unwrap();
    for id in held {
        wait_state(&cluster, id, "delivered");
    }
}
