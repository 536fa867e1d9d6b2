//! Sections 1 and 2: a tenant reads its own rows and no other, and an action on another
//! tenant's message behaves as on an id that does not exist.

use super::*;

// ---------------------------------------------------------------------------------------
// 1. reads
// ---------------------------------------------------------------------------------------

#[test]
fn each_tenant_reads_its_own_rows_and_no_other() {
    let (_serial, cluster, mut su) = start();
    let fx = Fixture::new(&cluster);
    let mut problems = Vec::new();
    for (role, is_operator, own, own_ids, other, other_ids) in [
        (&fx.writer_a, false, &fx.a, &fx.a_ids, &fx.b, &fx.b_ids),
        (&fx.operator_a, true, &fx.a, &fx.a_ids, &fx.b, &fx.b_ids),
        (&fx.writer_b, false, &fx.b, &fx.b_ids, &fx.a, &fx.a_ids),
        (&fx.operator_b, true, &fx.b, &fx.b_ids, &fx.a, &fx.a_ids),
    ] {
        problems.extend(check_reads(
            &fx,
            &mut su,
            role,
            is_operator,
            own,
            own_ids,
            other,
            other_ids,
        ));
    }
    // The work queue of an operator: its tenant's failed message is in it, with its owner.
    let mut opa = fx.session(&fx.operator_a);
    let owner: Option<Option<String>> = opa
        .c
        .query_opt(
            "SELECT owner FROM outbox.work_queue WHERE id = $1",
            &[&fx.a_failed],
        )
        .unwrap_or_else(|e| panic!("operator_a reading outbox.work_queue: {}", describe(&e)))
        .map(|r| r.get(0));
    if owner != Some(Some("alice".to_string())) {
        problems.push(format!(
            "operator_a: outbox.work_queue row of its failed message {} should exist with owner alice; got {owner:?}",
            fx.a_failed
        ));
    }
    // Messages in flight: one claim holding a message of each tenant (their failed ones,
    // which are still in the queue table). A writer sees its own in outbox._under_way (which
    // outbox.messages reads) and not the other's.
    let (a_id, b_id) = (fx.a_failed, fx.b_failed);
    let claim: i64 = su
        .query_one(
            "INSERT INTO outbox._claims (channel_id, lease_owner, worker_pid, lease_until, started_at, message_ids)
             SELECT channel_id, 0, 0, now() + interval '1 hour', now(), ARRAY[$1::int8, $2::int8]
               FROM outbox._messages WHERE id = $1
             RETURNING id",
            &[&a_id, &b_id],
        )
        .expect("a claim of both tenants' messages")
        .get(0);
    let mut wa = fx.session(&fx.writer_a);
    let seen: Vec<i64> =
        wa.c.query("SELECT message_id FROM outbox._under_way ORDER BY 1", &[])
            .unwrap_or_else(|e| panic!("writer_a reading outbox._under_way: {}", describe(&e)))
            .iter()
            .map(|r| r.get(0))
            .collect();
    if seen != vec![a_id] {
        problems.push(format!(
            "writer_a: outbox._under_way should show its own message {a_id} in flight and not {b_id}; got {seen:?}"
        ));
    }
    su.execute("DELETE FROM outbox._claims WHERE id = $1", &[&claim])
        .expect("remove the claim");
    assert_no_problems(&problems, "tenant isolation of the views");
}

// ---------------------------------------------------------------------------------------
// 2. actions on another tenant's messages
// ---------------------------------------------------------------------------------------

/// What the superuser sees of some messages: their rows and how many attempts, ledger and
/// operator log rows they have.
fn snapshot(su: &mut Client, ids: &[i64]) -> (Vec<String>, i64, i64, i64) {
    let ids = ids.to_vec();
    let rows = su
        .query(
            "SELECT id, state::text, owner, attempts, external_id, updated_at::text
               FROM outbox._messages WHERE id = ANY($1::int8[]) ORDER BY id",
            &[&ids],
        )
        .expect("snapshot of messages")
        .iter()
        .map(|r| {
            format!(
                "id {} state {} owner {:?} attempts {} external_id {:?} updated_at {}",
                r.get::<_, i64>(0),
                r.get::<_, String>(1),
                r.get::<_, Option<String>>(2),
                r.get::<_, i32>(3),
                r.get::<_, Option<String>>(4),
                r.get::<_, String>(5)
            )
        })
        .collect();
    let n = |su: &mut Client, table: &str, col: &str| {
        count(
            su,
            &format!("SELECT count(*) FROM outbox.{table} WHERE {col} = ANY($1::int8[])"),
            &[&ids],
        )
    };
    (
        rows,
        n(su, "_attempts", "message_id"),
        n(su, "_ledger", "message_id"),
        n(su, "_operator_log", "message_id"),
    )
}

#[test]
fn actions_on_another_tenants_message_behave_as_on_an_unknown_id() {
    let (_serial, cluster, mut su) = start();
    let fx = Fixture::new(&cluster);
    let unknown = fx.unknown_id();
    let targets = [fx.b_failed, fx.b_delivered];
    let before = snapshot(&mut su, &targets);

    let actions: [(&str, &str); 5] = [
        ("retry", "SELECT outbox.retry($1::int8, 'tenants test')"),
        (
            "resolve",
            "SELECT outbox.resolve($1::int8, 'delivered', 'tenants test')",
        ),
        ("cancel", "SELECT outbox.cancel($1::int8, 'tenants test')"),
        ("assign", "SELECT outbox.assign($1::int8, 'intruder')"),
        ("reconcile", "SELECT outbox.reconcile($1::int8)"),
    ];
    let mut problems = Vec::new();
    let mut opa = fx.session(&fx.operator_a);
    for (name, sql) in actions {
        // The reference: the same call on an id that does not exist.
        let reference = match opa.c.execute(sql, &[&unknown]) {
            Ok(_) => {
                problems.push(format!(
                    "operator_a: {name}({unknown}) on an id that does not exist succeeded; expected SQLSTATE 02000"
                ));
                None
            }
            Err(e) => {
                if code_of(&e) != "02000" {
                    problems.push(format!(
                        "operator_a: {name}({unknown}) on an id that does not exist: expected SQLSTATE 02000, got {}",
                        describe(&e)
                    ));
                }
                Some(error_text_without_id(&e, unknown))
            }
        };
        for id in targets {
            match opa.c.execute(sql, &[&id]) {
                Ok(_) => problems.push(format!(
                    "operator_a (tenant {}) called {name}({id}) on tenant {}'s message and it succeeded; expected SQLSTATE 02000 as for an unknown id",
                    fx.a, fx.b
                )),
                Err(e) => {
                    let seen = error_text_without_id(&e, id);
                    if code_of(&e) != "02000" {
                        problems.push(format!(
                            "operator_a: {name}({id}) on tenant {}'s message: expected SQLSTATE 02000, got {}",
                            fx.b,
                            describe(&e)
                        ));
                    } else if let Some(reference) = &reference {
                        if &seen != reference {
                            problems.push(format!(
                                "operator_a: {name} on another tenant's message must say exactly what it says for an unknown id (ids masked):\n      other tenant's: {seen}\n      unknown id:     {reference}"
                            ));
                        }
                    }
                }
            }
        }
    }

    // status(): NULL, as for an unknown id; the own tenant's message has a state.
    for role in [&fx.writer_a, &fx.operator_a] {
        let mut s = fx.session(role);
        for id in targets.iter().chain([&unknown]) {
            match s.status(*id) {
                Ok(None) => {}
                Ok(Some(state)) => problems.push(format!(
                    "{role}: outbox.status({id}) returned {state:?}; expected NULL (another tenant's or an unknown id)"
                )),
                Err(e) => problems.push(format!(
                    "{role}: outbox.status({id}) failed: {}; expected NULL",
                    describe(&e)
                )),
            }
        }
        match s.status(fx.a_delivered) {
            Ok(Some(state)) if state == "delivered" => {}
            other => problems.push(format!(
                "{role}: outbox.status({}) of its own tenant's delivered message returned {other:?}; expected Ok(Some(\"delivered\"))",
                fx.a_delivered
            )),
        }
    }

    let after = snapshot(&mut su, &targets);
    if before != after {
        problems.push(format!(
            "tenant {}'s messages changed although every action on them was refused:\n      before: {before:?}\n      after:  {after:?}",
            fx.b
        ));
    }

    // The control: the same action by the message's own operator works.
    let mut opb = fx.session(&fx.operator_b);
    if let Err(e) = opb
        .c
        .execute("SELECT outbox.assign($1::int8, 'bob2')", &[&fx.b_failed])
    {
        problems.push(format!(
            "operator_b could not assign its own tenant's message {}: {}",
            fx.b_failed,
            describe(&e)
        ));
    }
    assert_no_problems(&problems, "operator actions across tenants");
}
