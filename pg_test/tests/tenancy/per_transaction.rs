//! Section 11: a tenant named per transaction. Under a transaction-mode pooler a connection
//! names its tenant with `SET LOCAL outbox.tenant` inside each transaction (docs/pooling.md):
//! it works everywhere `SET outbox.tenant` does, and ends with its transaction.

use super::*;

/// How a session names its tenant for a run of the probes.
#[derive(Debug, Clone, Copy)]
enum Naming<'a> {
    /// None: `outbox.tenant` unset.
    Unset,
    /// A session-level `SET outbox.tenant`, before the transaction.
    Session(&'a str),
    /// `SET LOCAL outbox.tenant` as the transaction's first statement.
    Local(&'a str),
    /// A transaction with `SET LOCAL outbox.tenant` committed before the probes' own.
    LocalCommitted(&'a str),
}

/// One statement of the SQL API or a view, returning one value (NULL is `"NULL"`), or the
/// SQLSTATE it raised.
type Outcome = Result<String, String>;

/// Runs `probes` in one transaction of `s`, each in a savepoint, named as `naming` says,
/// and rolls everything back: the outcomes of each.
fn run_probes(s: &mut Session, naming: Naming<'_>, probes: &[(String, String)]) -> Vec<Outcome> {
    let set = |s: &mut Session, sql: String| {
        s.c.batch_execute(&sql)
            .unwrap_or_else(|e| panic!("{}: {sql}: {}", s.who, describe(&e)))
    };
    match naming {
        Naming::Session(t) => set(s, format!("SET outbox.tenant = {}", literal(t))),
        Naming::LocalCommitted(t) => set(
            s,
            format!(
                "BEGIN; SET LOCAL outbox.tenant = {}; SELECT 1; COMMIT",
                literal(t)
            ),
        ),
        Naming::Unset | Naming::Local(_) => {}
    }
    set(s, "BEGIN".into());
    if let Naming::Local(t) = naming {
        set(s, format!("SET LOCAL outbox.tenant = {}", literal(t)));
    }
    let mut outcomes = Vec::new();
    for (_, sql) in probes {
        set(s, "SAVEPOINT probe".into());
        let outcome = match s.c.query_one(sql.as_str(), &[]) {
            Ok(row) => Ok(row
                .get::<_, Option<String>>(0)
                .unwrap_or_else(|| "NULL".into())),
            Err(e) => {
                set(s, "ROLLBACK TO SAVEPOINT probe".into());
                Err(code_of(&e))
            }
        };
        outcomes.push(outcome);
    }
    set(s, "ROLLBACK; RESET outbox.tenant".into());
    outcomes
}

/// What a writer bound to `'*'` does: enqueue (on a channel of every tenant and on one of
/// tenant `a` alone), read its message back, count the rows of each view by tenant, ask
/// the status of a message of each tenant.
fn writer_probes(fx: &Fixture<'_>, a_channel: &str, key: &str) -> Vec<(String, String)> {
    let a = literal(&fx.a);
    let mut probes = vec![
        (
            "enqueue".to_string(),
            format!(
                "SELECT (outbox.enqueue({}, '{{}}', {}) IS NOT NULL)::text",
                literal(&fx.ok_ch),
                literal(key)
            ),
        ),
        (
            "the message's tenant".into(),
            format!(
                "SELECT string_agg(tenant, ',') FROM outbox.messages WHERE effect_key = {}",
                literal(key)
            ),
        ),
        (
            "enqueue on tenant a's channel".into(),
            format!(
                "SELECT (outbox.enqueue({}, '{{}}', {}) IS NOT NULL)::text",
                literal(a_channel),
                literal(&format!("{key}_a"))
            ),
        ),
        (
            "tenant a's channel in outbox.channels".into(),
            format!(
                "SELECT count(*)::text FROM outbox.channels WHERE name = {}",
                literal(a_channel)
            ),
        ),
        (
            "status of a's message".into(),
            format!("SELECT outbox.status({})::text", fx.a_delivered),
        ),
        (
            "status of b's message".into(),
            format!("SELECT outbox.status({})::text", fx.b_delivered),
        ),
    ];
    for view in ["messages", "attempts", "ledger"] {
        probes.push((
            format!("rows of a / of others in outbox.{view}"),
            format!("SELECT format('%s / %s', count(*) FILTER (WHERE tenant = {a}), count(*) FILTER (WHERE tenant <> {a})) FROM outbox.{view}"),
        ));
    }
    probes
}

/// What an operator bound to `'*'` does: read the work queue and the log by tenant, and
/// act on a message of each tenant.
fn operator_probes(fx: &Fixture<'_>) -> Vec<(String, String)> {
    let a = literal(&fx.a);
    let mut probes = Vec::new();
    for view in ["work_queue", "operator_log", "messages"] {
        let tenant = if view == "work_queue" {
            "(SELECT tenant FROM outbox.messages m WHERE m.id = v.id)"
        } else {
            "v.tenant"
        };
        probes.push((
            format!("rows of a / of others in outbox.{view}"),
            format!("SELECT format('%s / %s', count(*) FILTER (WHERE {tenant} = {a}), count(*) FILTER (WHERE {tenant} <> {a})) FROM outbox.{view} v"),
        ));
    }
    for (label, id) in [("a's", fx.a_failed), ("b's", fx.b_failed)] {
        probes.push((
            format!("assign {label} failed message"),
            format!("SELECT 'done' FROM (SELECT outbox.assign({id}, 'carol')) s"),
        ));
        probes.push((
            format!("reconcile {label} failed message"),
            format!("SELECT outbox.reconcile({id})"),
        ));
        probes.push((
            format!("retry {label} failed message"),
            format!("SELECT outbox.retry({id}, 'probe')::text"),
        ));
        probes.push((
            format!("cancel {label} failed message"),
            format!("SELECT outbox.cancel({id}, 'probe')::text"),
        ));
    }
    probes
}

/// Panics unless two runs of the probes had the same outcomes, naming every difference.
fn assert_same(
    probes: &[(String, String)],
    left: (&str, &[Outcome]),
    right: (&str, &[Outcome]),
    who: &str,
) {
    let differences: Vec<String> = probes
        .iter()
        .zip(left.1.iter().zip(right.1))
        .filter(|(_, (l, r))| l != r)
        .map(|((label, _), (l, r))| format!("{label}: {} → {l:?}, {} → {r:?}", left.0, right.0))
        .collect();
    assert!(
        differences.is_empty(),
        "{who}: {} should behave as {}; differences:\n  - {}",
        right.0,
        left.0,
        differences.join("\n  - ")
    );
}

#[test]
fn set_local_names_the_tenant_for_one_transaction_wherever_set_does() {
    let (_serial, cluster, mut su) = start();
    let fx = Fixture::new(&cluster);
    let (a, b) = (fx.a.as_str(), fx.b.as_str());
    let mut roles = Roles::new(&cluster);
    let star_operator = roles.create(&mut su, "star_operator", &["outbox_operator"]);
    roles.bind(&mut su, &star_operator, "*");
    let a_channel = unique("ten_local_a");
    let a_only = format!(r#"{{"tenants": [{}]}}"#, serde_json::Value::from(a));
    create_channel(&mut su, &a_channel, &fx.sim.send_url(&a_channel), &a_only);
    let key = unique("ten_local");

    for (role, probes) in [
        (&fx.shared, writer_probes(&fx, &a_channel, &key)),
        (&star_operator, operator_probes(&fx)),
    ] {
        let mut s = fx.session(role);
        let who = format!("{role} (bound to '*')");
        let session_a = run_probes(&mut s, Naming::Session(a), &probes);
        let local_a = run_probes(&mut s, Naming::Local(a), &probes);
        assert_same(
            &probes,
            ("SET outbox.tenant = a", &session_a),
            ("SET LOCAL outbox.tenant = a", &local_a),
            &who,
        );
        let session_b = run_probes(&mut s, Naming::Session(b), &probes);
        let local_b = run_probes(&mut s, Naming::Local(b), &probes);
        assert_same(
            &probes,
            ("SET outbox.tenant = b", &session_b),
            ("SET LOCAL outbox.tenant = b", &local_b),
            &who,
        );
        let unset = run_probes(&mut s, Naming::Unset, &probes);
        let after = run_probes(&mut s, Naming::LocalCommitted(a), &probes);
        assert_same(
            &probes,
            ("outbox.tenant unset", &unset),
            (
                "a transaction after one with SET LOCAL outbox.tenant = a",
                &after,
            ),
            &who,
        );
        // The comparisons above mean something only if naming a tenant changes what the
        // role may do: it acts for a with a named, and for no one unset.
        let differs = probes
            .iter()
            .zip(session_a.iter().zip(&unset))
            .filter(|(_, (x, y))| x != y)
            .count();
        assert!(
            differs * 2 >= probes.len(),
            "{who}: naming tenant a changed only {differs} of {} outcomes: {:?} vs unset {:?}",
            probes.len(),
            session_a,
            unset
        );
    }

    // The writer's outcomes, spelled out for tenant a.
    let mut s = fx.session(&fx.shared);
    let probes = writer_probes(&fx, &a_channel, &key);
    let local_a = run_probes(&mut s, Naming::Local(a), &probes);
    let expected: Vec<Outcome> = vec![
        Ok("true".into()),
        Ok(a.to_string()),
        Ok("true".into()),
        Ok("1".into()),
        Ok("delivered".into()),
        Ok("NULL".into()),
    ];
    assert_eq!(
        &local_a[..6],
        &expected[..],
        "shared (bound to '*') with SET LOCAL outbox.tenant = {a}"
    );
    for (i, view) in ["messages", "attempts", "ledger"].iter().enumerate() {
        let seen = local_a[6 + i].clone().unwrap_or_default();
        assert!(
            seen.ends_with(" / 0") && !seen.starts_with("0 "),
            "shared with SET LOCAL outbox.tenant = {a} sees {seen} rows (of a / of others) in outbox.{view}"
        );
    }
}
