//! Section 8: hostile `outbox.tenant` values are refused and never widen what is seen.

use super::choice::{rows_seen, seen, sees_no_rows};
use super::*;

// ---------------------------------------------------------------------------------------
// 8. hostile outbox.tenant values
// ---------------------------------------------------------------------------------------

#[test]
fn hostile_tenant_names_are_refused_and_never_widen_what_is_seen() {
    let (_serial, cluster, mut su) = start();
    let fx = Fixture::new(&cluster);
    let (a, b) = (fx.a.as_str(), fx.b.as_str());
    let values: Vec<String> = vec![
        "x' OR '1'='1".into(),
        format!("{a}' OR '1'='1"),
        format!("{a}' OR tenant = '{b}"),
        format!("{a}); DROP TABLE outbox._messages; --"),
        format!("{a},{b}"),
        format!("{{{a},{b}}}"),
        format!("{a}|{b}"),
        format!("{a}%"),
        "%".into(),
        "_".into(),
        ".*".into(),
        "*".into(),
        format!(" {a}"),
        format!("{a} "),
        a.to_uppercase(),
        format!("{a}\n"),
        format!("{a}\u{1}"),
        "$$".into(),
        "\\".into(),
        "default".into(),
        "x".repeat(129),
    ];
    let mut problems = Vec::new();

    // Bound to one tenant, to several, to none: every value other than their own is
    // refused on enqueue and shows nothing.
    for role in [&fx.writer_a, &fx.multi, &fx.unbound] {
        let mut s = fx.session(role);
        for v in &values {
            if let Err(e) = s.try_set_tenant(Some(v)) {
                // A check hook may refuse the value itself; then nothing changed.
                if !["22023", "42501"].contains(&code_of(&e).as_str()) {
                    problems.push(format!(
                        "{role}: SET outbox.tenant = {v:?} failed with {} (expected success, 22023 or 42501)",
                        describe(&e)
                    ));
                }
                let _ = s.try_set_tenant(None);
                continue;
            }
            match s.try_enqueue(&fx.ok_ch, &unique("ten_hostile")) {
                Err(e) if ["42501", "22023"].contains(&code_of(&e).as_str()) => {}
                Err(e) => problems.push(format!(
                    "{role} with outbox.tenant = {v:?}: enqueue should fail with 42501 (not bound) or 22023 (not a tenant name), got {}",
                    describe(&e)
                )),
                Ok(id) => problems.push(format!(
                    "{role} with outbox.tenant = {v:?} enqueued message {id} for tenant {:?}; expected 42501",
                    tenant_of(&mut su, id)
                )),
            }
            let n = rows_seen(&mut s);
            if n != 0 {
                let (all, in_a, in_b, other) = seen(&mut s, a, b);
                problems.push(format!(
                    "{role} with outbox.tenant = {v:?} sees {n} rows in messages/attempts/ledger (messages: {all}; of {a}: {in_a}, of {b}: {in_b}, others: {other}); expected none"
                ));
            }
            let _ = s.try_set_tenant(None);
        }
    }
    // The literal SET statement, as an application would write it.
    let mut s = fx.session(&fx.writer_a);
    if s.c
        .batch_execute("SET outbox.tenant = $$x' OR '1'='1$$")
        .is_ok()
    {
        expect_code(
            s.try_enqueue(&fx.ok_ch, &unique("ten_hostile_set")),
            "42501",
            "writer_a after SET outbox.tenant = $$x' OR '1'='1$$",
        );
        sees_no_rows(
            &mut s,
            "writer_a after SET outbox.tenant = $$x' OR '1'='1$$",
            &mut problems,
        );
    }

    // Bound to '*': any valid name is a tenant of its own (empty here), never A or B.
    let mut sh = fx.session(&fx.shared);
    for v in &values {
        if sh.try_set_tenant(Some(v)).is_err() {
            let _ = sh.try_set_tenant(None);
            continue;
        }
        let (all, in_a, in_b, other) = seen(&mut sh, a, b);
        let exact = sh.count(
            "SELECT count(*) FROM outbox.messages WHERE tenant = $1",
            &[v],
        );
        if in_a != 0 || in_b != 0 || all != exact || (v != a && other != exact) {
            problems.push(format!(
                "shared (bound to '*') with outbox.tenant = {v:?} sees {all} messages: {in_a} of {a}, {in_b} of {b}, {other} of others, {exact} of tenant {v:?} itself; expected only tenant {v:?}'s rows"
            ));
        }
        let _ = sh.try_set_tenant(None);
    }
    // ... and a value that looks like SQL is a tenant name like any other, kept verbatim.
    let sql_like = format!("{a}' OR '1'='1");
    sh.set_tenant(Some(&sql_like));
    match sh.try_enqueue(&fx.ok_ch, &unique("ten_sql_like")) {
        Ok(id) => {
            let t = tenant_of(&mut su, id);
            if t.as_deref() != Some(sql_like.as_str()) {
                problems.push(format!(
                    "shared with outbox.tenant = {sql_like:?} enqueued message {id} with tenant {t:?}; expected the name verbatim"
                ));
            }
            let (all, in_a, in_b, _) = seen(&mut sh, a, b);
            if all != 1 || in_a != 0 || in_b != 0 {
                problems.push(format!(
                    "shared with outbox.tenant = {sql_like:?} sees {all} messages ({in_a} of {a}, {in_b} of {b}); expected exactly its own one"
                ));
            }
            let _ = su.execute(
                "SELECT outbox.cancel($1::int8, 'tenants test cleanup')",
                &[&id],
            );
        }
        Err(e) => problems.push(format!(
            "shared (bound to '*') with outbox.tenant = {sql_like:?} (a valid tenant name) could not enqueue: {}",
            describe(&e)
        )),
    }
    assert_no_problems(&problems, "hostile outbox.tenant values");
}
