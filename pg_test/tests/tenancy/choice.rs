//! Sections 4 and 5: which tenant a role acts for (its bindings, `outbox.tenant`), and
//! bindings inherited through role membership.

use super::*;

// ---------------------------------------------------------------------------------------
// 4. tenant choice
// ---------------------------------------------------------------------------------------

/// (rows seen in outbox.messages, rows of tenant `a`, rows of tenant `b`, rows of neither).
pub(super) fn seen(s: &mut Session, a: &str, b: &str) -> (i64, i64, i64, i64) {
    let row = s
        .c
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE tenant = $1), count(*) FILTER (WHERE tenant = $2),
                    count(*) FILTER (WHERE tenant IS DISTINCT FROM $1 AND tenant IS DISTINCT FROM $2)
               FROM outbox.messages",
            &[&a, &b],
        )
        .unwrap_or_else(|e| panic!("{} reading outbox.messages: {}", s.who, describe(&e)));
    (row.get(0), row.get(1), row.get(2), row.get(3))
}

/// `SET outbox.tenant = t` for a tenant the role may not act for: true when it was set
/// (the refusal is then expected from enqueue); a check that refuses the value itself
/// must do so with 42501 or 22023.
fn named(s: &mut Session, t: &str, problems: &mut Vec<String>) -> bool {
    match s.try_set_tenant(Some(t)) {
        Ok(()) => true,
        Err(e) => {
            if !["42501", "22023"].contains(&code_of(&e).as_str()) {
                problems.push(format!(
                    "{}: SET outbox.tenant = {t} failed with {}; expected success (refused later, by enqueue) or 42501",
                    s.who,
                    describe(&e)
                ));
            }
            let _ = s.try_set_tenant(None);
            false
        }
    }
}

/// Notes a problem when `s` (described by `who`) sees any row of messages, attempts or
/// the ledger.
pub(super) fn sees_no_rows(s: &mut Session, who: &str, problems: &mut Vec<String>) {
    let n = rows_seen(s);
    if n != 0 {
        problems.push(format!(
            "{who} sees {n} rows in messages/attempts/ledger; expected none"
        ));
    }
}

/// `s`, acting for `t` (one of the fixture's tenants `a` and `b`), enqueues a message: it
/// is `t`'s.
fn enqueues_for_tenant(s: &mut Session, su: &mut Client, ch: &str, who: &str, t: &str) {
    let id = s.enqueue(ch, &unique(&format!("ten_{who}")));
    assert_eq!(
        tenant_of(su, id).as_deref(),
        Some(t),
        "{who} with outbox.tenant = {t} enqueued message {id}"
    );
}

/// Notes a problem unless `s` (described by `who`), acting for `t` (one of the fixture's
/// tenants `a` and `b`), sees at least `at_least` messages, all of them `t`'s.
fn sees_one_tenant(
    s: &mut Session,
    who: &str,
    (a, b): (&str, &str),
    t: &str,
    at_least: i64,
    problems: &mut Vec<String>,
) {
    let (all, in_a, in_b, other) = seen(s, a, b);
    let (own, theirs) = if t == a { (in_a, in_b) } else { (in_b, in_a) };
    if !(own >= at_least && theirs == 0 && other == 0 && all == own) {
        problems.push(format!(
            "{who} with outbox.tenant = {t} sees {all} messages: {in_a} of {a}, {in_b} of {b}, {other} of other tenants; expected at least {at_least}, all of {t}"
        ));
    }
}

/// Rows `s` sees in messages, attempts and ledger together.
pub(super) fn rows_seen(s: &mut Session) -> i64 {
    s.count(
        "SELECT (SELECT count(*) FROM outbox.messages) + (SELECT count(*) FROM outbox.attempts)
              + (SELECT count(*) FROM outbox.ledger)",
        &[],
    )
}

/// The table of docs/security.md, row by row. Bound to one tenant: acts for it, unset or
/// named; another name is refused.
#[test]
fn a_role_bound_to_one_tenant_acts_for_it_and_may_not_name_another() {
    let (_serial, cluster, mut su) = start();
    let fx = Fixture::new(&cluster);
    let (a, b) = (fx.a.as_str(), fx.b.as_str());
    let mut problems = Vec::new();

    // Bound to one tenant: acts for it, unset or named; another name is refused.
    let mut wa = fx.session(&fx.writer_a);
    let id = wa.enqueue(&fx.ok_ch, &unique("ten_choice_a"));
    assert_eq!(
        tenant_of(&mut su, id).as_deref(),
        Some(a),
        "writer_a (bound to {a}) enqueued message {id} without outbox.tenant"
    );
    wa.set_tenant(Some(a));
    let id = wa.enqueue(&fx.ok_ch, &unique("ten_choice_a_named"));
    assert_eq!(
        tenant_of(&mut su, id).as_deref(),
        Some(a),
        "writer_a with outbox.tenant = its own tenant {a} enqueued message {id}"
    );
    if named(&mut wa, b, &mut problems) {
        expect_code(
            wa.try_enqueue(&fx.ok_ch, &unique("ten_choice_wrong")),
            "42501",
            &format!("writer_a (bound to {a}) enqueueing with outbox.tenant = {b}"),
        );
        sees_no_rows(
            &mut wa,
            &format!("writer_a with outbox.tenant = {b} (not its tenant)"),
            &mut problems,
        );
    }
    wa.set_tenant(None);
    assert_no_problems(
        &problems,
        "tenant choice (a role bound to one tenant acts for it and may not name another)",
    );
}

/// Bound to `'*'`: names a tenant per connection and sees that tenant alone.
#[test]
fn a_role_bound_to_star_names_a_tenant_per_connection_and_sees_that_tenant_alone() {
    let (_serial, cluster, mut su) = start();
    let fx = Fixture::new(&cluster);
    let (a, b) = (fx.a.as_str(), fx.b.as_str());
    let mut problems = Vec::new();

    // Bound to '*': names a tenant per connection and sees that tenant alone.
    let mut sh = fx.session(&fx.shared);
    expect_code(
        sh.try_enqueue(&fx.ok_ch, &unique("ten_shared_unset")),
        "42501",
        "shared (bound to '*') enqueueing without outbox.tenant",
    );
    sees_no_rows(
        &mut sh,
        "shared (bound to '*') without outbox.tenant",
        &mut problems,
    );
    sh.set_tenant(Some(a));
    enqueues_for_tenant(&mut sh, &mut su, &fx.ok_ch, "shared", a);
    // The fixture's 3 and its own.
    sees_one_tenant(&mut sh, "shared", (a, b), a, 4, &mut problems);
    sh.set_tenant(Some(b));
    // Not the one it just enqueued in a.
    sees_one_tenant(&mut sh, "shared", (a, b), b, 3, &mut problems);
    sh.set_tenant(None);
    assert_no_problems(&problems, "tenant choice (a role bound to star names a tenant per connection and sees that tenant alone)");
}

/// Bound to several: names one to enqueue; sees all of them, or the one named.
#[test]
fn a_role_bound_to_several_tenants_names_one_to_enqueue_and_sees_all_or_the_one_named() {
    let (_serial, cluster, mut su) = start();
    let fx = Fixture::new(&cluster);
    let (a, b) = (fx.a.as_str(), fx.b.as_str());
    let mut problems = Vec::new();

    // Bound to several: names one to enqueue; sees all of them, or the one named.
    let mut mu = fx.session(&fx.multi);
    expect_code(
        mu.try_enqueue(&fx.ok_ch, &unique("ten_multi_unset")),
        "42501",
        &format!("multi (bound to {a} and {b}) enqueueing without outbox.tenant"),
    );
    let (all, in_a, in_b, other) = seen(&mut mu, a, b);
    if !(in_a >= 3 && in_b >= 3 && other == 0 && all == in_a + in_b) {
        problems.push(format!(
            "multi (bound to {a} and {b}) without outbox.tenant sees {all} messages: {in_a} of {a}, {in_b} of {b} (expected at least 3 each), {other} of other tenants (expected 0)"
        ));
    }
    mu.set_tenant(Some(a));
    enqueues_for_tenant(&mut mu, &mut su, &fx.ok_ch, "multi", a);
    sees_one_tenant(&mut mu, "multi", (a, b), a, 3, &mut problems);
    mu.set_tenant(Some(b));
    sees_one_tenant(&mut mu, "multi", (a, b), b, 3, &mut problems);
    let c = tenant_name("c");
    if named(&mut mu, &c, &mut problems) {
        expect_code(
            mu.try_enqueue(&fx.ok_ch, &unique("ten_multi_c")),
            "42501",
            &format!("multi (bound to {a} and {b}) enqueueing with outbox.tenant = {c}"),
        );
        sees_no_rows(
            &mut mu,
            &format!("multi with outbox.tenant = {c} (not one of its tenants)"),
            &mut problems,
        );
    }
    mu.set_tenant(None);
    assert_no_problems(&problems, "tenant choice (a role bound to several tenants names one to enqueue and sees all or the one named)");
}

/// Bound to nothing: refused, sees nothing.
#[test]
fn a_role_bound_to_no_tenant_is_refused_and_sees_nothing() {
    let (_serial, cluster, _) = start();
    let fx = Fixture::new(&cluster);
    let a = fx.a.as_str();
    let mut problems = Vec::new();

    // Bound to nothing: refused, sees nothing.
    let mut ub = fx.session(&fx.unbound);
    expect_code(
        ub.try_enqueue(&fx.ok_ch, &unique("ten_unbound")),
        "42501",
        "unbound (outbox_writer, no binding) enqueueing",
    );
    if named(&mut ub, a, &mut problems) {
        expect_code(
            ub.try_enqueue(&fx.ok_ch, &unique("ten_unbound_a")),
            "42501",
            &format!("unbound (outbox_writer, no binding) enqueueing with outbox.tenant = {a}"),
        );
    }
    sees_no_rows(&mut ub, "unbound (no binding)", &mut problems);
    assert_no_problems(
        &problems,
        "tenant choice (a role bound to no tenant is refused and sees nothing)",
    );
}

/// The superuser: `default` unless it names a tenant.
#[test]
fn the_superuser_acts_for_default_unless_it_names_a_tenant() {
    let (_serial, cluster, mut su) = start();
    let fx = Fixture::new(&cluster);
    let a = fx.a.as_str();

    // The superuser: 'default' unless it names a tenant.
    let mut root = Session {
        c: cluster.connect(),
        who: "superuser".into(),
    };
    let id = root.enqueue(&fx.ok_ch, &unique("ten_su_default"));
    assert_eq!(
        tenant_of(&mut su, id).as_deref(),
        Some("default"),
        "the superuser enqueued message {id} without outbox.tenant"
    );
    root.set_tenant(Some(a));
    let id = root.enqueue(&fx.ok_ch, &unique("ten_su_a"));
    assert_eq!(
        tenant_of(&mut su, id).as_deref(),
        Some(a),
        "the superuser enqueued message {id} with outbox.tenant = {a}"
    );
}

/// One effect key, two tenants: two messages, two sends, two ledger entries, even at a
/// provider that dedupes by key across all its callers.
#[test]
fn one_effect_key_in_two_tenants_makes_two_messages_two_sends_and_two_ledger_entries() {
    let (_serial, cluster, mut su) = start();
    let fx = Fixture::new(&cluster);
    let (a, b) = (fx.a.as_str(), fx.b.as_str());
    let mut problems = Vec::new();

    let mut wa = fx.session(&fx.writer_a);

    // One effect key, two tenants: two messages, two sends, two ledger entries — even at a
    // provider that dedupes by key across all its callers, because the key it receives is
    // qualified by the tenant.
    let dup_ch = unique("ten_dup");
    create_channel(
        &mut su,
        &dup_ch,
        &fx.sim.send_url(&dup_ch),
        r#"{"idempotency_header": "Idempotency-Key", "external_id": "/id"}"#,
    );
    fx.sim.set_dedupe(&dup_ch, "Idempotency-Key");
    let key = unique("ten_same_key");
    let mut wb = fx.session(&fx.writer_b);
    let ida = wa.enqueue(&dup_ch, &key);
    let idb = wb.enqueue(&dup_ch, &key);
    assert_ne!(
        ida, idb,
        "effect key {key} enqueued by tenant {a} and by tenant {b} must be two messages (keys are unique per tenant)"
    );
    wait_state(&cluster, ida, "delivered");
    wait_state(&cluster, idb, "delivered");
    // Once delivered, its ledger entry names it. (Enqueued again while its record is still
    // being committed, the key would make a second message that the claim settles without a
    // send: docs/runbook.md, and the foundation race tests.)
    let again = wa.enqueue(&dup_ch, &key);
    assert_eq!(
        again, ida,
        "the same key enqueued again by tenant {a} must return its existing message"
    );
    assert!(
        fx.sim.wait_for_stored(&dup_ch, 2, SETTLE),
        "the provider should have stored both tenants' messages with key {key}; stored: {:?}",
        fx.sim.stored(&dup_ch)
    );
    let mut sent = fx.sim.header_values(&dup_ch, "Idempotency-Key");
    sent.sort();
    let mut qualified = vec![
        format!("{}:{a}:{key}", a.len()),
        format!("{}:{b}:{key}", b.len()),
    ];
    qualified.sort();
    assert_eq!(
        sent, qualified,
        "the keys the provider received, qualified by tenant"
    );
    let mut ledger: Vec<(String, i64)> = su
        .query(
            "SELECT tenant, message_id FROM outbox.ledger WHERE effect_key = $1 ORDER BY tenant",
            &[&key],
        )
        .expect("ledger")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    ledger.sort();
    let mut expected = vec![(a.to_string(), ida), (b.to_string(), idb)];
    expected.sort();
    assert_eq!(
        ledger, expected,
        "the ledger should hold one entry per tenant for key {key}"
    );
    let mine = wa.count(
        "SELECT count(*) FROM outbox.messages WHERE effect_key = $1",
        &[&key],
    );
    if mine != 1 {
        problems.push(format!(
            "writer_a sees {mine} messages with key {key}; expected its own alone"
        ));
    }
    assert_no_problems(&problems, "tenant choice (one effect key in two tenants makes two messages two sends and two ledger entries)");
}

// ---------------------------------------------------------------------------------------
// 5. membership
// ---------------------------------------------------------------------------------------

#[test]
fn a_binding_of_a_group_role_binds_its_members() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut su = cluster.connect();
    check_extension_roles(&mut su);
    let sim = Simulator::start();
    let ch = unique("ten_group");
    create_channel(&mut su, &ch, &sim.send_url(&ch), OPTIONS);
    let c = tenant_name("c");
    let mut roles = Roles::new(&cluster);
    let group = roles.create(&mut su, "group", &["outbox_writer"]);
    let member = roles.create(&mut su, "member", &[]);
    su.batch_execute(&format!("GRANT {} TO {}", ident(&group), ident(&member)))
        .expect("grant the group to its member");
    roles.bind(&mut su, &group, &c);

    let mut m = Session::new(&cluster, &member);
    let id = m.enqueue(&ch, &unique("ten_member"));
    assert_eq!(
        tenant_of(&mut su, id).as_deref(),
        Some(c.as_str()),
        "{member}, a member of {group} (bound to {c}), enqueued message {id}"
    );
    let n = m.count("SELECT count(*) FROM outbox.messages WHERE id = $1", &[&id]);
    assert_eq!(
        n, 1,
        "{member} should see its own message {id} of tenant {c} (through its group's binding)"
    );
    wait_state(&cluster, id, "delivered");

    unbind(&mut su, &group, &c)
        .unwrap_or_else(|e| panic!("unbind_tenant({group}, {c}): {}", describe(&e)));
    expect_code(
        m.try_enqueue(&ch, &unique("ten_member_after")),
        "42501",
        &format!("{member} enqueueing after its group's binding to {c} was removed"),
    );
    let n = m.count("SELECT count(*) FROM outbox.messages WHERE id = $1", &[&id]);
    assert_eq!(
        n, 0,
        "{member} still sees message {id} of tenant {c} after its group's binding was removed"
    );

    // enqueue caches a role's bindings for its session: a membership revoked in another
    // session counts from the member's next transaction on.
    roles.bind(&mut su, &group, &c);
    let again = m.enqueue(&ch, &unique("ten_member_rebound"));
    assert_eq!(tenant_of(&mut su, again).as_deref(), Some(c.as_str()));
    su.batch_execute(&format!("REVOKE {} FROM {}", ident(&group), ident(&member)))
        .expect("revoke the group from its member");
    expect_code(
        m.try_enqueue(&ch, &unique("ten_member_revoked")),
        "42501",
        &format!("{member} enqueueing after its membership in {group} was revoked"),
    );
}
