// `#[pg_test]`s of the operator actions: state checks, SQLSTATEs, the operator log, the
// ledger written by a manual `resolve`.

fn op_setup(channel: &str) -> i64 {
    Spi::run(&format!("SELECT outbox.create_channel('{channel}', 'http://127.0.0.1:9/ch/{channel}')")).unwrap();
    Spi::get_one::<i64>(&format!("SELECT outbox.enqueue('{channel}', '{{\"t\": 1}}', 'key-{channel}')"))
        .unwrap()
        .unwrap()
}

fn set_state(id: i64, state: &str) {
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
