// `#[pg_test]`s of how the record takes messages out of their claims
// (`crate::worker::record::RELEASE_CLAIMED`), as the worker plans it.

/// Each claim's ids, by the channel that names it here.
fn claim_ids() -> Vec<(i32, Option<Vec<i64>>)> {
    Spi::connect(|client| {
        client
            .select("SELECT channel_id, message_ids FROM outbox._claims ORDER BY channel_id", None, &[])
            .unwrap()
            .map(|row| (row.get::<i32>(1).unwrap().unwrap(), row.get::<Vec<i64>>(2).unwrap()))
            .collect()
    })
}

/// Runs the release of `released` (and of the claims `taken_back`) as the worker plans it.
fn release(released: &str, taken_back: &str) {
    let statement = &crate::worker::record::RELEASE_CLAIMED;
    let mode = statement.plan.plan_cache_mode().to_str().unwrap();
    Spi::run(&format!("SET LOCAL plan_cache_mode = {mode}")).unwrap();
    Spi::run(&format!("PREPARE release_statement(int8[], int8[]) AS {}", statement.sql)).unwrap();
    Spi::run(&format!("EXECUTE release_statement('{released}', '{taken_back}')")).unwrap();
    Spi::run("DEALLOCATE release_statement").unwrap();
}

#[pg_test]
fn a_record_takes_its_messages_out_of_its_own_claims_and_of_those_taken_back_alone() {
    // Claims told apart by their channel_id (no channel is needed for this table): 1 and 2
    // are this backend's; 3 and 4 another worker's, whose 4 recovery took back from it.
    Spi::run(
        "INSERT INTO outbox._claims (channel_id, lease_owner, worker_pid, lease_until, started_at, message_ids)
         VALUES (1, 0, pg_backend_pid(), now() + interval '1 minute', now(), '{1,2,3,4,5}'),
                (2, 0, pg_backend_pid(), now() + interval '1 minute', now(), '{10,11,12}'),
                (3, 0, pg_backend_pid() + 1, now() + interval '1 minute', now(), '{1,2,3}'),
                (4, 0, pg_backend_pid() + 1, now() + interval '1 minute', now(), '{20,21,22}')",
    )
    .unwrap();
    let taken_back = Spi::get_one::<i64>("SELECT id FROM outbox._claims WHERE channel_id = 4").unwrap().unwrap();
    let versions = "SELECT string_agg(ctid::text, ',' ORDER BY channel_id) FROM outbox._claims";
    let before = Spi::get_one::<String>(versions).unwrap();

    // Nothing of any claim: no claim is written.
    release("{7,8,30}", &format!("{{{taken_back}}}"));
    assert_eq!(Spi::get_one::<String>(versions).unwrap(), before);

    // In no particular order: claim 2 is emptied and goes, 1 and 4 keep the rest in their
    // order, and 3 keeps ids released from this backend's claims.
    release("{12,3,21,10,1,11}", &format!("{{{taken_back}}}"));
    assert_eq!(
        claim_ids(),
        vec![
            (1, Some(vec![2, 4, 5])),
            (3, Some(vec![1, 2, 3])),
            (4, Some(vec![20, 22])),
        ]
    );

    release("{2,4,5,20,22}", "{}");
    assert_eq!(claim_ids(), vec![(3, Some(vec![1, 2, 3])), (4, Some(vec![20, 22]))]);
}

#[pg_test]
fn what_is_left_of_a_claim_is_null_when_nothing_of_it_was_released() {
    let left = |sql: &str| Spi::get_one::<Vec<Option<i64>>>(&format!("SELECT outbox._claim_ids_left({sql})")).unwrap();
    assert_eq!(left("'{5,1,9,3}', '{9,1}'"), Some(vec![Some(5), Some(3)]));
    assert_eq!(left("'{5,1}', '{1,5,6}'"), Some(vec![]));
    assert_eq!(left("'{5,1}', '{2,NULL}'"), None);
    assert_eq!(left("'{5,NULL,1}', '{NULL,5}'"), Some(vec![None, Some(1)]));
    assert_eq!(left("'{}', '{1}'"), None);
    assert_eq!(left("NULL, '{1}'"), None);
}

#[pg_test]
fn a_counter_at_its_limit_in_flight_reads_as_the_attempt_under_way_in_every_view() {
    // Set by hand to its limit, as in pg_test's bad_rows: the attempt under way saturates,
    // as the claim counts it, and no view or operator action fails with 22003.
    Spi::run("SELECT outbox.create_channel('limit', 'http://127.0.0.1:9/x', '{}')").unwrap();
    let id = Spi::get_one::<i64>("SELECT outbox.enqueue('limit', '{}'::jsonb, 'at-limit')")
        .unwrap()
        .unwrap();
    Spi::run(&format!("UPDATE outbox._messages SET attempts = 2147483647 WHERE id = {id}")).unwrap();
    Spi::run(&format!(
        "INSERT INTO outbox._claims (channel_id, lease_owner, worker_pid, lease_until, started_at, message_ids)
         SELECT channel_id, 0, pg_backend_pid() + 1, now() + interval '1 minute', now(), ARRAY[id]
           FROM outbox._messages WHERE id = {id}"
    ))
    .unwrap();
    let row = Spi::get_two::<String, i32>(&format!("SELECT state::text, attempts FROM outbox.messages WHERE id = {id}"))
        .unwrap();
    assert_eq!(row, (Some("sending".into()), Some(i32::MAX)));
    let open = Spi::get_one::<i32>(&format!(
        "SELECT attempt FROM outbox.attempts WHERE message_id = {id} AND finished_at IS NULL"
    ))
    .unwrap();
    assert_eq!(open, Some(i32::MAX));
    let status = Spi::get_one::<String>(&format!("SELECT outbox.status({id})::text")).unwrap();
    assert!(status.is_some());
    // An operator action locks the message and sees it sending: refused as such (55000),
    // not failed on the counter.
    assert_eq!(sqlstate(&format!("SELECT outbox.cancel({id}, 'at the limit')")), "55000");
}
