// `#[pg_test]`s of the SQL API: every refusal with its SQLSTATE and nothing written,
// option validation and normalization, dedupe by effect key.
use pgrx::prelude::*;

const SQLSTATE_OF: &str = r#"
CREATE OR REPLACE FUNCTION pg_temp.sqlstate_of(stmt text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE stmt;
    RETURN '00000';
EXCEPTION WHEN OTHERS THEN
    RETURN SQLSTATE;
END $$"#;

/// Runs `sql` in a subtransaction; its SQLSTATE, or 00000.
fn sqlstate(sql: &str) -> String {
    Spi::run(SQLSTATE_OF).expect("helper");
    Spi::get_one_with_args::<String>("SELECT pg_temp.sqlstate_of($1)", &[sql.into()])
        .expect("spi")
        .expect("sqlstate")
}

fn count(sql: &str) -> i64 {
    Spi::get_one::<i64>(sql).expect("spi").unwrap_or(0)
}

fn channel(name: &str) {
    Spi::run(&format!(
        "SELECT outbox.create_channel('{name}', 'http://127.0.0.1:9/ch/{name}', '{{\"headers\": {{\"Authorization\": \"Bearer s3cret\"}}}}')"
    ))
    .expect("create_channel");
}

#[pg_test]
fn effect_key_vector_and_refusals() {
    let k = Spi::get_one::<String>("SELECT outbox.effect_key('turn-42', 'send_reply')").unwrap();
    assert_eq!(k.as_deref(), Some("b19a783b1ddf6318099a5f26d19af2c6961ab378d598b5248db3c16b721d07f1"));
    assert_ne!(
        Spi::get_one::<String>("SELECT outbox.effect_key('a|b', 'c')").unwrap(),
        Spi::get_one::<String>("SELECT outbox.effect_key('a', 'b|c')").unwrap()
    );
    assert_eq!(sqlstate("SELECT outbox.effect_key(NULL, 'op')"), "22023");
    assert_eq!(sqlstate("SELECT outbox.effect_key('src', NULL)"), "22023");
    assert_eq!(sqlstate("SELECT outbox.effect_key('', 'op')"), "22023");
    assert_eq!(sqlstate("SELECT outbox.effect_key('src', '')"), "22023");
}

#[pg_test]
fn create_channel_validates_every_option() {
    channel("ok");
    let bad = [
        ("'{\"colour\": 1}'", "22023"),
        ("'{\"timeout_ms\": \"10\"}'", "22023"),
        ("'{\"timeout_ms\": 0}'", "22023"),
        ("'{\"kind\": \"smtp\"}'", "22023"),
        ("'{\"method\": \"BREW\"}'", "22023"),
        ("'{\"headers\": [1]}'", "22023"),
        ("'{\"headers\": {\"X\": 1}}'", "22023"),
        ("'{\"retry\": {\"multiplier\": 0.5}}'", "22023"),
        ("'{\"retry\": {\"base_ms\": -1}}'", "22023"),
        ("'{\"retry\": {\"jitter\": \"sometimes\"}}'", "22023"),
        ("'{\"retry\": {\"base_ms\": 5000, \"max_ms\": 1000}}'", "22023"),
        ("'{\"classify\": {\"abc\": \"transient\"}}'", "22023"),
        ("'{\"external_id\": \"id\"}'", "22023"),
        ("'{\"reconcile\": {\"url\": \"http://h/no-placeholder\"}}'", "22023"),
        ("'[]'", "22023"),
    ];
    for (options, code) in bad {
        assert_eq!(
            sqlstate(&format!("SELECT outbox.create_channel('c2', 'http://127.0.0.1:9/x', {options})")),
            code,
            "options {options}"
        );
    }
    assert_eq!(sqlstate("SELECT outbox.create_channel('c2', 'ftp://x', '{}')"), "22023");
    assert_eq!(sqlstate("SELECT outbox.create_channel('c2', 'not a url', '{}')"), "22023");
    assert_eq!(sqlstate("SELECT outbox.create_channel(NULL, 'http://h/x', '{}')"), "22023");
    assert_eq!(sqlstate("SELECT outbox.create_channel('', 'http://h/x', '{}')"), "22023");
    assert_eq!(sqlstate("SELECT outbox.create_channel('ok', 'http://127.0.0.1:9/x', '{}')"), "42710");
    assert_eq!(count("SELECT count(*) FROM outbox.channels WHERE name = 'c2'"), 0);
    assert_eq!(count("SELECT count(*) FROM outbox.channels"), 1);
}

#[pg_test]
fn channel_options_are_normalized_and_secrets_masked() {
    channel("norm");
    let max_attempts = Spi::get_one::<i32>(
        "SELECT (options -> 'retry' ->> 'max_attempts')::int FROM outbox._channels WHERE name = 'norm'",
    )
    .unwrap();
    assert_eq!(max_attempts, Some(8));
    let in_flight =
        Spi::get_one::<i32>("SELECT (options ->> 'max_in_flight')::int FROM outbox.channels WHERE name = 'norm'").unwrap();
    assert_eq!(in_flight, Some(64));
    let shown = Spi::get_one::<String>("SELECT options -> 'headers' ->> 'Authorization' FROM outbox.channels WHERE name = 'norm'")
        .unwrap();
    assert_eq!(shown.as_deref(), Some("********"));
    let logged = Spi::get_one::<String>(
        "SELECT detail::text FROM outbox.operator_log WHERE action = 'create_channel' AND channel = 'norm'",
    )
    .unwrap()
    .unwrap();
    assert!(!logged.contains("s3cret"), "the operator log must not keep secrets: {logged}");
}

/// Options too deep to read (written by hand: create_channel refuses them) are shown as one
/// mask, and the view still answers; a direct call with such a value too. A NULL stays NULL.
#[pg_test]
fn options_too_deep_to_read_are_masked_whole() {
    channel("deep");
    let deep = format!("{}\"SECRET\"{}", "[".repeat(300), "]".repeat(300));
    Spi::run(&format!(
        "UPDATE outbox._channels SET options = options || jsonb_build_object('x', '{deep}'::jsonb) WHERE name = 'deep'"
    ))
    .unwrap();
    // Every column of the view, as a reader selects them.
    let shown = Spi::get_one::<String>("SELECT (c.options)::text FROM (SELECT * FROM outbox.channels) c WHERE name = 'deep'")
        .unwrap();
    assert_eq!(shown.as_deref(), Some("\"********\""));
    assert_eq!(count("SELECT count(*) FROM (SELECT row_to_json(c)::text FROM outbox.channels c WHERE name = 'deep') r"), 1);
    let direct = Spi::get_one::<String>(&format!("SELECT outbox._masked_options('{deep}'::jsonb)::text")).unwrap();
    assert_eq!(direct.as_deref(), Some("\"********\""));
    assert_eq!(count("SELECT count(*) FROM outbox._masked_options(NULL) m WHERE m IS NULL"), 1);
}

#[pg_test]
fn alter_channel_merges_and_refuses_atomically() {
    channel("alt");
    Spi::run("SELECT outbox.alter_channel('alt', '{\"retry\": {\"max_attempts\": 3}, \"max_in_flight\": 4}')").unwrap();
    let (attempts, base) = Spi::get_two::<i32, i32>(
        "SELECT (options->'retry'->>'max_attempts')::int, (options->'retry'->>'base_ms')::int FROM outbox._channels WHERE name = 'alt'",
    )
    .unwrap();
    assert_eq!((attempts, base), (Some(3), Some(1000)));
    assert_eq!(sqlstate("SELECT outbox.alter_channel('nope', '{}')"), "42704");
    assert_eq!(sqlstate("SELECT outbox.alter_channel('alt', '{\"max_in_flight\": 0}')"), "22023");
    assert_eq!(sqlstate("SELECT outbox.alter_channel('alt', '{\"endpoint\": \"gopher://x\"}')"), "22023");
    assert_eq!(sqlstate("SELECT outbox.alter_channel('alt', NULL)"), "22023");
    assert_eq!(count("SELECT (options->>'max_in_flight')::int8 FROM outbox._channels WHERE name = 'alt'"), 4);
    Spi::run("SELECT outbox.alter_channel('alt', '{\"endpoint\": \"http://127.0.0.1:10/moved\"}')").unwrap();
    assert_eq!(
        Spi::get_one::<String>("SELECT endpoint FROM outbox.channels WHERE name = 'alt'").unwrap().as_deref(),
        Some("http://127.0.0.1:10/moved")
    );
    assert_eq!(count("SELECT count(*) FROM outbox.operator_log WHERE channel = 'alt'"), 3);
}

#[pg_test]
fn enqueue_refuses_bad_input_and_writes_nothing() {
    channel("enq");
    let long = "k".repeat(256);
    let cases = [
        ("SELECT outbox.enqueue('missing', '{}', 'k1')".to_string(), "42704"),
        ("SELECT outbox.enqueue(NULL, '{}', 'k1')".to_string(), "22023"),
        ("SELECT outbox.enqueue('enq', '{}', NULL)".to_string(), "22023"),
        ("SELECT outbox.enqueue('enq', '{}', '')".to_string(), "22023"),
        (format!("SELECT outbox.enqueue('enq', '{{}}', '{long}')"), "22023"),
        (format!("SELECT outbox.enqueue('enq', '{{}}', 'k1', '{long}')"), "22023"),
        ("SELECT outbox.enqueue('enq', '{}', 'k1', '')".to_string(), "22023"),
        ("SELECT outbox.enqueue('enq', NULL, 'k1')".to_string(), "22023"),
        ("SELECT outbox.enqueue('enq', '{}', 'k1', NULL, NULL, '[1]')".to_string(), "22023"),
        ("SELECT outbox.enqueue('enq', '{}', 'k1', NULL, NULL, '{\"X-A\": 1}')".to_string(), "22023"),
        ("SELECT outbox.enqueue('enq', '{}', 'k1', NULL, NULL, '{\"bad name\": \"v\"}')".to_string(), "22023"),
        ("SELECT outbox.enqueue('enq', '{}', E'k\\n1')".to_string(), "22023"),
        ("SELECT outbox.enqueue('enq', '{}', 'k1', not_before => 'infinity')".to_string(), "22023"),
        ("SELECT outbox.enqueue('enq', '{}', 'k1', not_before => '-infinity')".to_string(), "22023"),
    ];
    for (sql, code) in cases {
        assert_eq!(sqlstate(&sql), code, "{sql}");
    }
    Spi::run("SET outbox.max_payload_bytes = 100").unwrap();
    let big = "SELECT outbox.enqueue('enq', jsonb_build_object('t', repeat('x', 200)), 'k-big')";
    assert_eq!(sqlstate(big), "54000");
    assert_eq!(count("SELECT count(*) FROM outbox.messages"), 0);
    // Exactly 255 bytes is allowed.
    let ok = "k".repeat(255);
    assert_eq!(sqlstate(&format!("SELECT outbox.enqueue('enq', '{{}}', '{ok}')")), "00000");
}

#[pg_test]
fn enqueue_dedupes_by_effect_key() {
    channel("dd");
    let a = Spi::get_one::<i64>("SELECT outbox.enqueue('dd', '{\"t\": 1}', 'same-key', 'conv-1', now() + interval '1 hour', '{\"X-Trace\": \"t1\"}')")
        .unwrap()
        .unwrap();
    let b = Spi::get_one::<i64>("SELECT outbox.enqueue('dd', '{\"t\": 1}', 'same-key')").unwrap().unwrap();
    let c = Spi::get_one::<i64>("SELECT outbox.enqueue('dd', '{\"t\": 2}', 'same-key')").unwrap().unwrap();
    assert_eq!(a, b);
    assert_eq!(a, c, "a differing payload is never a second message");
    assert_eq!(count("SELECT count(*) FROM outbox.messages"), 1);
    let (ordering, headers) = Spi::get_two::<String, String>(
        "SELECT ordering_key, headers::text FROM outbox.messages WHERE effect_key = 'same-key'",
    )
    .unwrap();
    assert_eq!(ordering.as_deref(), Some("conv-1"));
    assert_eq!(headers.as_deref(), Some("{\"X-Trace\": \"t1\"}"));
    assert_eq!(count("SELECT count(*) FROM outbox.messages WHERE next_attempt_at > now() + interval '59 minutes'"), 1);
    let other = Spi::get_one::<i64>("SELECT outbox.enqueue('dd', '{\"t\": 1}', 'other-key')").unwrap().unwrap();
    assert_ne!(a, other);
}

#[pg_test]
fn drop_channel_refuses_pending_work_and_removes_a_settled_channel() {
    channel("dr");
    let id = Spi::get_one::<i64>("SELECT outbox.enqueue('dr', '{}', 'k-dr')").unwrap().unwrap();
    assert_eq!(sqlstate("SELECT outbox.drop_channel('dr', '')"), "22023", "a reason is required");
    assert_eq!(sqlstate("SELECT outbox.drop_channel('nope', 'gone')"), "42704");
    for pending in ["queued", "uncertain"] {
        Spi::run(&format!("UPDATE outbox._messages SET state = '{pending}' WHERE id = {id}")).unwrap();
        let got = sqlstate("SELECT outbox.drop_channel('dr', 'customer left')");
        assert_eq!(got, "55006", "{pending}: {got}");
    }
    assert_eq!(count("SELECT count(*) FROM outbox.channels WHERE name = 'dr'"), 1, "refused: nothing changed");
    Spi::run(&format!("UPDATE outbox._messages SET state = 'failed' WHERE id = {id}")).unwrap();
    Spi::run("SELECT outbox.drop_channel('dr', 'customer left')").unwrap();
    assert_eq!(count("SELECT count(*) FROM outbox._channels WHERE name = 'dr'"), 0);
    assert_eq!(count(&format!("SELECT count(*) FROM outbox._messages WHERE id = {id}")), 0);
    assert_eq!(
        count("SELECT count(*) FROM outbox.operator_log WHERE action = 'drop_channel' AND channel = 'dr' AND reason = 'customer left'"),
        1
    );
    assert_eq!(sqlstate("SELECT outbox.enqueue('dr', '{}', 'k-dr-2')"), "42704", "gone: nothing can be enqueued on it");
}

#[pg_test]
fn status_pause_and_resume() {
    channel("st");
    let id = Spi::get_one::<i64>("SELECT outbox.enqueue('st', '{}', 'k-st')").unwrap().unwrap();
    assert_eq!(Spi::get_one::<String>(&format!("SELECT outbox.status({id})::text")).unwrap().as_deref(), Some("queued"));
    assert_eq!(Spi::get_one::<String>("SELECT outbox.status(-1)::text").unwrap(), None);
    assert_eq!(sqlstate("SELECT outbox.pause_channel('st', '')"), "22023");
    assert_eq!(sqlstate("SELECT outbox.pause_channel('nope', 'maintenance')"), "42704");
    assert_eq!(sqlstate("SELECT outbox.resume_channel('nope')"), "42704");
    Spi::run("SELECT outbox.pause_channel('st', 'provider maintenance')").unwrap();
    // A paused channel keeps queueing.
    Spi::run("SELECT outbox.enqueue('st', '{}', 'k-st-2')").unwrap();
    assert_eq!(count("SELECT count(*) FROM outbox.messages WHERE channel = 'st' AND state = 'queued'"), 2);
    assert_eq!(count("SELECT count(*) FROM outbox.channels WHERE name = 'st' AND paused"), 1);
    Spi::run("SELECT outbox.resume_channel('st')").unwrap();
    assert_eq!(count("SELECT count(*) FROM outbox.channels WHERE name = 'st' AND NOT paused"), 1);
    assert_eq!(
        count("SELECT count(*) FROM outbox.operator_log WHERE channel = 'st' AND action IN ('pause_channel', 'resume_channel')"),
        2
    );
}

#[pg_test]
fn views_show_budget_and_no_next_attempt_for_finished_messages() {
    channel("vw");
    Spi::run("SELECT outbox.enqueue('vw', '{}', 'k-vw')").unwrap();
    let (max_attempts, attempts) =
        Spi::get_two::<i32, i32>("SELECT max_attempts, attempts FROM outbox.messages WHERE effect_key = 'k-vw'").unwrap();
    assert_eq!((max_attempts, attempts), (Some(8), Some(0)));
    Spi::run("UPDATE outbox._messages SET state = 'delivered' WHERE effect_key = 'k-vw'").unwrap();
    assert_eq!(count("SELECT count(*) FROM outbox.messages WHERE effect_key = 'k-vw' AND next_attempt_at IS NULL"), 1);
}

#[pg_test]
fn sql_channels_name_an_existing_function_and_a_least_privilege_role() {
    Spi::run("CREATE SCHEMA app").unwrap();
    Spi::run("CREATE FUNCTION app.create_task(payload jsonb, effect_key text) RETURNS text LANGUAGE sql AS $$ SELECT effect_key $$").unwrap();
    Spi::run("CREATE FUNCTION app.wrong_return(payload jsonb, effect_key text) RETURNS int LANGUAGE sql AS $$ SELECT 1 $$").unwrap();
    Spi::run("CREATE ROLE outbox_test_effects NOLOGIN").unwrap();
    let opts = |f: &str, r: &str| format!("'{{\"kind\": \"sql\", \"function\": \"{f}\", \"run_as\": \"{r}\", \"tenants\": [\"*\"]}}'");
    assert_eq!(
        sqlstate(&format!("SELECT outbox.create_channel('tasks', 'sql', {})", opts("app.create_task", "outbox_test_effects"))),
        "00000"
    );
    assert_eq!(sqlstate(&format!("SELECT outbox.create_channel('t2', 'sql', {})", opts("app.missing", "outbox_test_effects"))), "42883");
    assert_eq!(sqlstate(&format!("SELECT outbox.create_channel('t2', 'sql', {})", opts("app.wrong_return", "outbox_test_effects"))), "42883");
    assert_eq!(sqlstate(&format!("SELECT outbox.create_channel('t2', 'sql', {})", opts("app.create_task", "no_such_role"))), "22023");
    assert_eq!(sqlstate(&format!("SELECT outbox.create_channel('t2', 'sql', {})", opts("app.create_task", "postgres"))), "22023");
    assert_eq!(sqlstate(&format!("SELECT outbox.create_channel('t2', 'http://h/x', {})", opts("app.create_task", "outbox_test_effects"))), "22023");
    assert_eq!(sqlstate("SELECT outbox.create_channel('t2', 'sql', '{\"kind\": \"sql\", \"function\": \"app.create_task(jsonb)\", \"run_as\": \"outbox_test_effects\"}')"), "22023");
    assert_eq!(sqlstate("SELECT outbox.alter_channel('tasks', '{\"function\": \"app.missing\"}')"), "42883");
    assert_eq!(count("SELECT count(*) FROM outbox.channels WHERE name = 't2'"), 0);
}

#[pg_test]
fn sql_reads_a_channels_in_flight_bound_as_its_options_say() {
    use crate::channels::options::ChannelOptions;
    let stored = [
        serde_json::json!({}),
        serde_json::json!({"max_unverifiable_in_flight": 3, "max_in_flight": 100}),
        serde_json::json!({"reference_header": "X-Ref"}),
        serde_json::json!({"idempotency_header": "Idempotency-Key", "max_in_flight": 7}),
        serde_json::json!({"reconcile": {"url": "http://127.0.0.1:1/m/{effect_key}"}}),
        serde_json::json!({"kind": "sql", "function": "app.f", "run_as": "r"}),
    ];
    for options in stored {
        let rust = ChannelOptions::from_json(&options).unwrap().in_flight_bound();
        for as_stored in [options.clone(), ChannelOptions::from_json(&options).unwrap().to_json()] {
            let (bound, reason) = Spi::get_two_with_args::<i32, String>(
                "SELECT outbox._in_flight_bound($1), outbox._in_flight_reason($1)",
                &[pgrx::JsonB(as_stored.clone()).into()],
            )
            .unwrap();
            assert_eq!(bound, Some(rust.limit() as i32), "{as_stored}");
            assert_eq!(reason.as_deref(), Some(rust.reason()), "{as_stored}");
        }
    }
    // Changed by hand into no number: the default, never an error that stops the claim.
    let bound = Spi::get_one::<i32>(
        "SELECT outbox._in_flight_bound('{\"max_unverifiable_in_flight\": \"many\", \"max_in_flight\": 1e99}')",
    )
    .unwrap();
    assert_eq!(bound, Some(crate::channels::options::DEFAULT_MAX_UNVERIFIABLE_IN_FLIGHT as i32));
    let bound = Spi::get_one::<i32>(
        "SELECT outbox._in_flight_bound('{\"idempotency_header\": \"K\", \"max_in_flight\": \"many\"}')",
    )
    .unwrap();
    assert_eq!(bound, Some(crate::channels::options::DEFAULT_MAX_IN_FLIGHT as i32));
    // A number that rounds out of the range of integer reads as none.
    for (stored, read) in [
        ("2147483647.5", None),
        ("-2147483648.5", None),
        ("2147483647.4", Some(i32::MAX)),
        ("-2147483648.4", Some(i32::MIN)),
        ("1e10", None),
        ("2.5", Some(3)),
    ] {
        let got = Spi::get_one::<i32>(&format!(
            "SELECT outbox._option_int('{{\"n\": {stored}}}', '{{n}}')"
        ))
        .unwrap();
        assert_eq!(got, read, "{stored}");
    }
    let bound = Spi::get_one::<i32>(
        "SELECT outbox._in_flight_bound('{\"idempotency_header\": \"K\", \"max_in_flight\": 2147483647.5}')",
    )
    .unwrap();
    assert_eq!(bound, Some(crate::channels::options::DEFAULT_MAX_IN_FLIGHT as i32));
}

#[pg_test]
fn outbox_channels_shows_the_bound_and_why() {
    Spi::run("SELECT outbox.create_channel('sms', 'http://127.0.0.1:9/sms', '{}')").unwrap();
    Spi::run("SELECT outbox.create_channel('keyed', 'http://127.0.0.1:9/k', '{\"idempotency_header\": \"Idempotency-Key\"}')").unwrap();
    let row = |name: &str| {
        Spi::get_two::<i32, String>(&format!(
            "SELECT in_flight_bound, in_flight_reason FROM outbox.channels WHERE name = '{name}'"
        ))
        .unwrap()
    };
    assert_eq!(row("sms"), (Some(8), Some("max_unverifiable_in_flight: no dedupe, no lookup".into())));
    assert_eq!(row("keyed"), (Some(64), Some("max_in_flight".into())));
    Spi::run("SELECT outbox.alter_channel('sms', '{\"max_unverifiable_in_flight\": 2}')").unwrap();
    assert_eq!(row("sms").0, Some(2));
    // The worker's claim and every reader of the view may call what it calls.
    for role in ["outbox_worker", "outbox_writer", "outbox_operator", "outbox_admin"] {
        Spi::run(&format!("SET LOCAL ROLE {role}")).unwrap();
        let bound = Spi::get_one::<i32>("SELECT outbox._in_flight_bound('{}')").unwrap();
        assert_eq!(bound, Some(8), "{role}");
        Spi::run("RESET ROLE").unwrap();
    }
    Spi::run("SET LOCAL ROLE outbox_admin").unwrap();
    assert_eq!(row("sms").0, Some(2), "as outbox_admin");
    Spi::run("RESET ROLE").unwrap();
}
