// `#[pg_test]`s of the operator actions: state checks, SQLSTATEs, the operator log, the
// ledger written by a manual `resolve`.

fn op_setup(channel: &str) -> i64 {
    Spi::run(&format!("SELECT outbox.create_channel('{channel}', 'http://127.0.0.1:9/ch/{channel}')")).unwrap();
    Spi::get_one::<i64>(&format!("SELECT outbox.enqueue('{channel}', '{{\"t\": 1}}', 'key-{channel}')"))
        .unwrap()
        .unwrap()
}

/// Puts the message in `state`; `sending` is a queued message in a claim of a worker.
fn set_state(id: i64, state: &str) {
    Spi::run(&format!("DELETE FROM outbox._claims WHERE {id} = ANY (message_ids)")).unwrap();
    if state == "sending" {
        Spi::run(&format!("UPDATE outbox._messages SET state = 'queued', attempts = 2 WHERE id = {id}")).unwrap();
        Spi::run(&format!(
            "INSERT INTO outbox._claims (channel_id, lease_owner, worker_pid, lease_until, started_at, message_ids)
             SELECT channel_id, 0, 1, now() + interval '1 minute', now(), ARRAY[id] FROM outbox._messages WHERE id = {id}"
        ))
        .unwrap();
        return;
    }
    Spi::run(&format!("UPDATE outbox._messages SET state = '{state}', attempts = 3 WHERE id = {id}")).unwrap();
}

fn state(id: i64) -> String {
    Spi::get_one::<String>(&format!("SELECT state::text FROM outbox._messages WHERE id = {id}")).unwrap().unwrap()
}

fn log_rows(id: i64) -> i64 {
    Spi::get_one::<i64>(&format!("SELECT count(*) FROM outbox.operator_log WHERE message_id = {id}")).unwrap().unwrap()
}

#[pg_test]
fn operator_refusals_have_their_sqlstate_and_log_nothing() {
    let id = op_setup("opr");
    assert_eq!(sqlstate("SELECT outbox.retry(-42, 'why')"), "02000");
    assert_eq!(sqlstate("SELECT outbox.resolve(-42, 'delivered', 'why')"), "02000");
    assert_eq!(sqlstate("SELECT outbox.cancel(-42, 'why')"), "02000");
    assert_eq!(sqlstate("SELECT outbox.assign(-42, 'ann')"), "02000");
    assert_eq!(sqlstate("SELECT outbox.reconcile(-42::bigint)"), "02000");
    assert_eq!(sqlstate("SELECT outbox.reconcile(NULL::bigint)"), "22023");
    assert_eq!(sqlstate(&format!("SELECT outbox.retry({id}, '')")), "22023");
    assert_eq!(sqlstate(&format!("SELECT outbox.retry({id}, NULL)")), "22023");
    assert_eq!(sqlstate(&format!("SELECT outbox.cancel({id}, '  ')")), "22023");
    assert_eq!(sqlstate(&format!("SELECT outbox.resolve({id}, 'maybe', 'why')")), "22023");
    set_state(id, "sending");
    assert_eq!(sqlstate(&format!("SELECT outbox.retry({id}, 'why')")), "55000");
    assert_eq!(sqlstate(&format!("SELECT outbox.cancel({id}, 'why')")), "55000");
    set_state(id, "delivered");
    assert_eq!(sqlstate(&format!("SELECT outbox.cancel({id}, 'why')")), "55000");
    assert_eq!(sqlstate(&format!("SELECT outbox.resolve({id}, 'failed', 'why')")), "55000");
    assert_eq!(log_rows(id), 0, "a refused action is not logged as done");
}

/// Runs `sql` in a subtransaction: its SQLSTATE and message, or `00000`.
fn refusal(sql: &str) -> String {
    Spi::run(
        r#"CREATE OR REPLACE FUNCTION pg_temp.refusal_of(stmt text) RETURNS text LANGUAGE plpgsql AS $$
           BEGIN
               EXECUTE stmt;
               RETURN '00000';
           EXCEPTION WHEN OTHERS THEN
               RETURN SQLSTATE || ': ' || SQLERRM;
           END $$"#,
    )
    .expect("helper");
    Spi::get_one_with_args::<String>("SELECT pg_temp.refusal_of($1)", &[sql.into()])
        .expect("spi")
        .expect("refusal")
}

/// Every operator action that takes a reason, called without one, names what is missing
/// (not "function does not exist"), and nothing is done or logged.
#[pg_test]
fn an_operator_call_without_a_reason_says_a_reason_is_required() {
    let id = op_setup("opreason");
    set_state(id, "failed");
    for call in [
        format!("SELECT outbox.retry({id})"),
        format!("SELECT outbox.cancel({id})"),
        format!("SELECT outbox.resolve({id}, 'failed')"),
        format!("SELECT outbox.retry({id}, NULL)"),
        format!("SELECT outbox.cancel({id}, ' ')"),
        "SELECT outbox.pause_channel('opreason')".to_string(),
        "SELECT outbox.drop_channel('opreason')".to_string(),
        "SELECT outbox.pause_channel('opreason', '')".to_string(),
    ] {
        assert_eq!(refusal(&call), "22023: a reason is required", "{call}");
    }
    assert_eq!(state(id), "failed");
    assert_eq!(log_rows(id), 0);
    assert_eq!(
        count("SELECT count(*) FROM outbox.operator_log WHERE channel = 'opreason' AND action IN ('pause_channel', 'drop_channel')"),
        0
    );
    assert_eq!(count("SELECT count(*) FROM outbox.channels WHERE name = 'opreason' AND NOT paused"), 1);
    // With a reason, the same calls go through.
    assert_eq!(refusal(&format!("SELECT outbox.cancel({id}, 'customer asked')")), "00000");
    assert_eq!(state(id), "cancelled");
}

#[pg_test]
fn retry_requeues_with_the_same_key_and_a_fresh_budget() {
    let id = op_setup("opretry");
    let key: String = Spi::get_one(&format!("SELECT effect_key FROM outbox._messages WHERE id = {id}")).unwrap().unwrap();
    set_state(id, "exhausted");
    let after = Spi::get_one::<String>(&format!("SELECT outbox.retry({id}, 'provider is back')::text")).unwrap();
    assert_eq!(after.as_deref(), Some("queued"));
    let (base, same_key) = Spi::get_two::<i32, bool>(&format!(
        "SELECT budget_base, effect_key = '{key}' FROM outbox._messages WHERE id = {id}"
    ))
    .unwrap();
    assert_eq!((base, same_key), (Some(3), Some(true)));
    // A second operator retrying the same job: one effect, two log rows.
    let again = Spi::get_one::<String>(&format!("SELECT outbox.retry({id}, 'me too')::text")).unwrap();
    assert_eq!(again.as_deref(), Some("queued"));
    assert_eq!(log_rows(id), 2);
    let (actor, before, after, reason) = (
        Spi::get_one::<String>(&format!("SELECT actor FROM outbox.operator_log WHERE message_id = {id} ORDER BY id LIMIT 1")).unwrap(),
        Spi::get_one::<String>(&format!("SELECT state_before::text FROM outbox.operator_log WHERE message_id = {id} ORDER BY id LIMIT 1")).unwrap(),
        Spi::get_one::<String>(&format!("SELECT state_after::text FROM outbox.operator_log WHERE message_id = {id} ORDER BY id DESC LIMIT 1")).unwrap(),
        Spi::get_one::<String>(&format!("SELECT reason FROM outbox.operator_log WHERE message_id = {id} ORDER BY id LIMIT 1")).unwrap(),
    );
    assert!(actor.is_some());
    assert_eq!(before.as_deref(), Some("exhausted"));
    assert_eq!(after.as_deref(), Some("queued"));
    assert_eq!(reason.as_deref(), Some("provider is back"));
    // delivered: no-op, logged.
    set_state(id, "delivered");
    assert_eq!(Spi::get_one::<String>(&format!("SELECT outbox.retry({id}, 'again')::text")).unwrap().as_deref(), Some("delivered"));
    assert_eq!(log_rows(id), 3);
}

#[pg_test]
fn uncertain_without_reconcile_is_requeued_by_an_operator_and_reconcile_says_not_supported() {
    let id = op_setup("opunc");
    set_state(id, "uncertain");
    assert_eq!(Spi::get_one::<String>(&format!("SELECT outbox.reconcile({id}::bigint)")).unwrap().as_deref(), Some("not_supported"));
    assert_eq!(state(id), "uncertain");
    let counts = Spi::get_one::<i32>("SELECT checked FROM outbox.reconcile()").unwrap();
    assert_eq!(counts, Some(0), "channels without a lookup are not reconciled");
    assert_eq!(Spi::get_one::<String>(&format!("SELECT outbox.retry({id}, 'checked by hand: not there')::text")).unwrap().as_deref(), Some("queued"));
}

#[pg_test]
fn resolve_delivered_writes_the_ledger() {
    let id = op_setup("opres");
    set_state(id, "uncertain");
    let after = Spi::get_one::<String>(&format!("SELECT outbox.resolve({id}, 'delivered', 'provider support confirmed', 'ext-77')::text")).unwrap();
    assert_eq!(after.as_deref(), Some("delivered"));
    let (by, ext) = Spi::get_two::<String, String>(&format!("SELECT recorded_by, external_id FROM outbox.ledger WHERE message_id = {id}")).unwrap();
    assert_eq!((by.as_deref(), ext.as_deref()), (Some("operator"), Some("ext-77")));
    assert_eq!(Spi::get_one::<String>(&format!("SELECT outbox.status({id})::text")).unwrap().as_deref(), Some("delivered"));
    assert_eq!(log_rows(id), 1);
}

#[pg_test]
fn cancel_and_assign_and_the_work_queue() {
    let id = op_setup("opcan");
    set_state(id, "failed");
    Spi::run(&format!("SELECT outbox.assign({id}, 'alice')")).unwrap();
    let (owner, action) = Spi::get_two::<String, String>(&format!("SELECT owner, suggested_action FROM outbox.work_queue WHERE id = {id}")).unwrap();
    assert_eq!(owner.as_deref(), Some("alice"));
    assert!(action.unwrap().contains("retry"));
    assert_eq!(Spi::get_one::<String>(&format!("SELECT outbox.cancel({id}, 'customer withdrew')::text")).unwrap().as_deref(), Some("cancelled"));
    assert_eq!(Spi::get_one::<i64>(&format!("SELECT count(*) FROM outbox.work_queue WHERE id = {id}")).unwrap(), Some(0));
    assert_eq!(log_rows(id), 2);
}

#[pg_test]
fn a_delivered_message_lives_in_its_ledger_entry_and_every_action_still_finds_it() {
    let id = op_setup("ophist");
    Spi::run(&format!(
        "UPDATE outbox._messages SET owner = 'bob', attempts = 2, last_error_class = 'ambiguous',
                last_error = 'timed out after 3000 ms' WHERE id = {id}"
    ))
    .unwrap();
    Spi::run(&format!(
        "INSERT INTO outbox._attempts (message_id, tenant, attempt, kind, finished_at, outcome, error_class, error)
         VALUES ({id}, 'default', 1, 'send', now(), 'timeout', 'ambiguous', 'timed out after 3000 ms')"
    ))
    .unwrap();
    set_state(id, "uncertain");
    let after = Spi::get_one::<String>(&format!("SELECT outbox.resolve({id}, 'delivered', 'seen at the provider', 'ext-9')::text")).unwrap();
    assert_eq!(after.as_deref(), Some("delivered"));

    // It left the queue table; its entry holds it whole, and the views read it from there.
    assert_eq!(Spi::get_one::<i64>(&format!("SELECT count(*) FROM outbox._messages WHERE id = {id}")).unwrap(), Some(0));
    let (payload, channel) = Spi::get_two::<String, String>(&format!(
        "SELECT payload::text, channel FROM outbox.messages WHERE id = {id} AND state = 'delivered'
            AND external_id = 'ext-9' AND owner = 'bob' AND attempts = 3 AND effect_key = 'key-ophist'
            AND delivered_at IS NOT NULL AND next_attempt_at IS NULL"
    ))
    .unwrap();
    assert_eq!((payload.as_deref(), channel.as_deref()), (Some(r#"{"t": 1}"#), Some("ophist")));
    assert_eq!(Spi::get_one::<i64>(&format!("SELECT count(*) FROM outbox.attempts WHERE message_id = {id}")).unwrap(), Some(1), "its attempt rows stay");
    // A delivered message shows no error; the failure before stays on its attempt.
    assert_eq!(
        count(&format!("SELECT count(*) FROM outbox.messages WHERE id = {id} AND last_error IS NULL AND last_error_class IS NULL")),
        1,
        "a delivered message keeps no last_error"
    );
    assert_eq!(
        count(&format!("SELECT count(*) FROM outbox.attempts WHERE message_id = {id} AND error = 'timed out after 3000 ms'")),
        1
    );
    assert_eq!(Spi::get_one::<String>(&format!("SELECT outbox.status({id})::text")).unwrap().as_deref(), Some("delivered"));

    // The operator's actions find it, delivered.
    assert_eq!(Spi::get_one::<String>(&format!("SELECT outbox.retry({id}, 'again')::text")).unwrap().as_deref(), Some("delivered"));
    assert_eq!(sqlstate(&format!("SELECT outbox.cancel({id}, 'why')")), "55000");
    assert_eq!(sqlstate(&format!("SELECT outbox.resolve({id}, 'failed', 'why')")), "55000");
    assert_eq!(Spi::get_one::<String>(&format!("SELECT outbox.resolve({id}, 'delivered', 'twice')::text")).unwrap().as_deref(), Some("delivered"));
    Spi::run(&format!("SELECT outbox.assign({id}, 'carol')")).unwrap();
    assert_eq!(Spi::get_one::<String>(&format!("SELECT owner FROM outbox.messages WHERE id = {id}")).unwrap().as_deref(), Some("carol"));
    assert_eq!(Spi::get_one::<String>(&format!("SELECT outbox.reconcile({id}::bigint)")).unwrap().as_deref(), Some("delivered"));
    assert_eq!(log_rows(id), 4, "resolve, retry, resolve, assign: each logged once");

    // The same effect enqueued again names it and queues nothing; so does another payload
    // (with a warning).
    for payload in [r#"{"t": 1}"#, r#"{"t": 2}"#] {
        let again = Spi::get_one::<i64>(&format!("SELECT outbox.enqueue('ophist', '{payload}', 'key-ophist')")).unwrap();
        assert_eq!(again, Some(id));
    }
    assert_eq!(Spi::get_one::<i64>("SELECT count(*) FROM outbox._messages WHERE effect_key = 'key-ophist'").unwrap(), Some(0));

    // The ledger's retention empties the entry's generation, with the message's attempts,
    // once that generation closed longer ago than the ledger keeps entries.
    let generation = Spi::get_one::<i16>(&format!("SELECT generation FROM outbox._ledger WHERE message_id = {id}")).unwrap().unwrap();
    let next = (generation + 1) % crate::ledger::generations::GENERATIONS;
    Spi::run(&format!("DELETE FROM outbox._ledger_generations;
                       INSERT INTO outbox._ledger_generations VALUES
                           ({generation}, now() - interval '3 days', now() - interval '2 days'),
                           ({next}, now(), NULL)")).unwrap();
    // The tests that run beside this one read the ledger, and hold its tables until they
    // end: the round would put the emptying off (its lock timeout). The test waits for them
    // first, as a later round would.
    Spi::run(&format!("LOCK TABLE outbox._ledger_{generation} IN ACCESS EXCLUSIVE MODE")).unwrap();
    let retained = Spi::connect_mut(|client| crate::ledger::retain(client, 86_400.0)).unwrap();
    assert_eq!(retained.emptied, Some(generation), "{retained:?}");
    assert_eq!(retained.deferred, None);
    assert_eq!(retained.opened, None, "the current generation opened just now");
    assert_eq!(Spi::get_one::<i64>(&format!("SELECT count(*) FROM outbox.messages WHERE id = {id}")).unwrap(), Some(0));
    assert_eq!(Spi::get_one::<i64>(&format!("SELECT count(*) FROM outbox._attempts WHERE message_id = {id}")).unwrap(), Some(0));
    assert_eq!(Spi::get_one::<String>(&format!("SELECT outbox.status({id})::text")).unwrap(), None);
}

#[pg_test]
fn a_delivered_payload_moves_into_its_entry_as_stored_and_is_not_compressed_again() {
    // The entry's payload and headers keep the queue row's storage of them: the ledger's
    // columns are EXTERNAL, in every generation (sql/schema.sql).
    let storage = Spi::get_one::<String>(
        "SELECT string_agg(c.relname || '.' || a.attname || ' ' || a.attstorage::text, ', ' ORDER BY c.relname, a.attname)
           FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
          WHERE c.relnamespace = 'outbox'::regnamespace AND c.relname ~ '^_ledger(_[0-2])?$'
            AND a.attname IN ('payload', 'headers')",
    )
    .unwrap();
    assert_eq!(
        storage.as_deref(),
        Some("_ledger.headers e, _ledger.payload e, _ledger_0.headers e, _ledger_0.payload e, \
              _ledger_1.headers e, _ledger_1.payload e, _ledger_2.headers e, _ledger_2.payload e")
    );

    // A payload that compressed in its queue row stays compressed in its entry, and both
    // read back whole.
    Spi::run("SELECT outbox.create_channel('opstore', 'http://127.0.0.1:9/ch/opstore')").unwrap();
    let id = Spi::get_one::<i64>(
        "SELECT outbox.enqueue('opstore', jsonb_build_object('text', repeat('a delivered payload ', 1000)), 'key-opstore',
                               headers => jsonb_build_object('X-Note', repeat('n', 3000)))",
    )
    .unwrap()
    .unwrap();
    set_state(id, "uncertain");
    let after = Spi::get_one::<String>(&format!("SELECT outbox.resolve({id}, 'delivered', 'seen at the provider')::text")).unwrap();
    assert_eq!(after.as_deref(), Some("delivered"));
    let (compression, whole) = Spi::get_two::<String, bool>(&format!(
        "SELECT pg_catalog.pg_column_compression(l.payload),
                l.payload = jsonb_build_object('text', repeat('a delivered payload ', 1000))
                AND l.headers = jsonb_build_object('X-Note', repeat('n', 3000))
           FROM outbox._ledger l WHERE l.message_id = {id}"
    ))
    .unwrap();
    assert_eq!((compression.as_deref(), whole), (Some("pglz"), Some(true)));
}

#[pg_test]
fn a_confirmed_message_whose_effect_is_recorded_already_stays_in_the_queue_table() {
    let id = op_setup("opkept");
    // An entry for the key without its message (as a restore or a move may leave).
    Spi::run("INSERT INTO outbox._ledger (tenant, effect_key, message_id, external_id, recorded_by)
              VALUES ('default', 'key-opkept', -7, 'first', 'operator')").unwrap();
    set_state(id, "uncertain");
    let after = Spi::get_one::<String>(&format!("SELECT outbox.resolve({id}, 'delivered', 'confirmed', 'second')::text")).unwrap();
    assert_eq!(after.as_deref(), Some("delivered"));
    assert_eq!(state(id), "delivered", "the message stays, delivered");
    let (mid, ext) = Spi::get_two::<i64, String>("SELECT message_id, external_id FROM outbox._ledger WHERE effect_key = 'key-opkept'").unwrap();
    assert_eq!((mid, ext.as_deref()), (Some(-7), Some("first")), "the entry keeps its first message");
    assert_eq!(Spi::get_one::<i64>(&format!("SELECT count(*) FROM outbox.messages WHERE id = {id}")).unwrap(), Some(1), "shown once");
}
