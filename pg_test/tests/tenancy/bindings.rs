//! Section 6: `bind_tenant` / `unbind_tenant` validate their arguments and write the
//! operator log.

use super::*;

// ---------------------------------------------------------------------------------------
// 6. bind_tenant / unbind_tenant
// ---------------------------------------------------------------------------------------

/// operator_log rows (as the superuser) whose action contains `action` and that mention
/// both `role` and `tenant`.
fn binding_log_rows(su: &mut Client, action: &str, role: &str, tenant: &str) -> i64 {
    count(
        su,
        "SELECT count(*) FROM outbox.operator_log o
          WHERE o.action LIKE '%' || $1 || '%'
            AND ($1 <> 'bind' OR o.action NOT LIKE '%unbind%')
            AND strpos(o::text, $2) > 0 AND strpos(o::text, $3) > 0",
        &[&action, &role, &tenant],
    )
}

/// What a binding test acts on: the simulator and a channel on it to enqueue on, the roles
/// (which go, with any binding they may have got, when dropped), a role granted
/// outbox_writer and the tenant it is to be bound to.
type Bindee<'a> = (Simulator, String, Roles<'a>, String, String);

fn bindee<'a>(cluster: &'a Cluster, su: &mut Client) -> Bindee<'a> {
    check_extension_roles(su);
    let sim = Simulator::start();
    let ch = unique("ten_bind");
    create_channel(su, &ch, &sim.send_url(&ch), OPTIONS);
    let mut roles = Roles::new(cluster);
    let role = roles.create(su, "bindee", &["outbox_writer"]);
    let t = tenant_name("bind");
    roles.may_be_bound(&role, &t);
    (sim, ch, roles, role, t)
}

/// `bind_tenant` / `unbind_tenant` validate their arguments. An unknown role: 42704.
#[test]
fn bind_and_unbind_refuse_an_unknown_role() {
    let (_serial, cluster, mut su) = start();
    let (_sim, _, _roles, _, t) = bindee(&cluster, &mut su);
    let mut problems = Vec::new();

    // Unknown role.
    let ghost = unique("no_such_role");
    if let Err(p) = check_code(
        bind(&mut su, &ghost, &t),
        "42704",
        "bind_tenant(unknown role)",
    ) {
        problems.push(p);
    }
    match unbind(&mut su, &ghost, &t) {
        Ok(_) => {}
        Err(e) if code_of(&e) == "42704" => {}
        Err(e) => problems.push(format!(
            "unbind_tenant(unknown role): expected success (nothing to remove) or 42704, got {}",
            describe(&e)
        )),
    }
    assert_no_problems(
        &problems,
        "bind_tenant / unbind_tenant (bind and unbind refuse an unknown role)",
    );
}

/// Bad tenant names: 22023 from both functions.
#[test]
fn bind_and_unbind_refuse_bad_tenant_names() {
    let (_serial, cluster, mut su) = start();
    let (_sim, _, mut roles, role, _) = bindee(&cluster, &mut su);
    let mut problems = Vec::new();

    // Bad tenant names: 22023 from both functions.
    let too_long = "x".repeat(129);
    let too_long_bytes = "é".repeat(65); // 65 characters, 130 bytes
    let bad: Vec<(&str, String)> = vec![
        ("an empty tenant", String::new()),
        ("a tenant with \\u0001", "a\u{1}b".into()),
        ("a tenant with a newline", "a\nb".into()),
        ("a tenant with a carriage return", "a\rb".into()),
        ("a tenant with a tab", "a\tb".into()),
        ("a tenant with ESC", "\u{1b}[31m".into()),
        ("a tenant with DEL", "a\u{7f}".into()),
        ("a tenant of 129 bytes", too_long),
        ("a tenant of 65 characters, 130 bytes", too_long_bytes),
    ];
    for (what, tenant) in &bad {
        roles.may_be_bound(&role, tenant);
        if let Err(p) = check_code(
            bind(&mut su, &role, tenant),
            "22023",
            &format!("bind_tenant(role, {what}: {tenant:?})"),
        ) {
            problems.push(p);
        }
        if let Err(p) = check_code(
            unbind(&mut su, &role, tenant),
            "22023",
            &format!("unbind_tenant(role, {what}: {tenant:?})"),
        ) {
            problems.push(p);
        }
    }
    assert_no_problems(
        &problems,
        "bind_tenant / unbind_tenant (bind and unbind refuse bad tenant names)",
    );
}

/// NULL arguments are refused by both functions.
#[test]
fn bind_and_unbind_refuse_null_arguments() {
    let (_serial, cluster, mut su) = start();
    let (_sim, _, _roles, role, t) = bindee(&cluster, &mut su);
    let mut problems = Vec::new();

    // NULLs.
    let null_text: Option<&str> = None;
    for (f, sql) in [
        (
            "bind_tenant",
            "SELECT outbox.bind_tenant($1::text::name, $2::text)",
        ),
        (
            "unbind_tenant",
            "SELECT outbox.unbind_tenant($1::text::name, $2::text)",
        ),
    ] {
        for (what, r, tn) in [
            ("NULL role", null_text, Some(t.as_str())),
            ("NULL tenant", Some(role.as_str()), null_text),
            ("NULL role and tenant", null_text, null_text),
        ] {
            if let Err(p) = check_code(
                su.execute(sql, &[&r, &tn]),
                "22023",
                &format!("{f}({what})"),
            ) {
                problems.push(p);
            }
        }
    }
    assert_no_problems(
        &problems,
        "bind_tenant / unbind_tenant (bind and unbind refuse null arguments)",
    );
}

/// The longest tenant: 128 bytes (in 64 two-byte characters).
#[test]
fn the_longest_tenant_name_binds_and_is_acted_for() {
    let (_serial, cluster, mut su) = start();
    let (_sim, ch, mut roles, role, _) = bindee(&cluster, &mut su);
    let mut problems = Vec::new();

    // The longest tenant: 128 bytes (in 64 two-byte characters).
    let longest = "é".repeat(64);
    roles.may_be_bound(&role, &longest);
    match bind(&mut su, &role, &longest) {
        Ok(_) => {
            let mut s = Session::new(&cluster, &role);
            match s.try_enqueue(&ch, &unique("ten_longest")) {
                Ok(id) => {
                    if tenant_of(&mut su, id).as_deref() != Some(longest.as_str()) {
                        problems.push(format!(
                            "a role bound to a 128-byte tenant enqueued message {id} with tenant {:?}",
                            tenant_of(&mut su, id)
                        ));
                    }
                }
                Err(e) => problems.push(format!(
                    "a role bound to a 128-byte tenant could not enqueue: {}",
                    describe(&e)
                )),
            }
            if let Err(e) = unbind(&mut su, &role, &longest) {
                problems.push(format!(
                    "unbind_tenant(role, 128-byte tenant): {}",
                    describe(&e)
                ));
            }
        }
        Err(e) => problems.push(format!(
            "bind_tenant(role, a tenant of exactly 128 bytes) must be accepted: {}",
            describe(&e)
        )),
    }
    assert_no_problems(
        &problems,
        "bind_tenant / unbind_tenant (the longest tenant name binds and is acted for)",
    );
}

/// Twice is once; by an outbox_admin; both write the operator log; one unbind removes the
/// binding made twice; unbinding what is not bound is no error; `'*'` is a binding, not a
/// tenant.
#[test]
fn binding_twice_is_once_one_unbind_removes_it_and_both_write_the_operator_log() {
    let (_serial, cluster, mut su) = start();
    let (_sim, ch, mut roles, role, t) = bindee(&cluster, &mut su);
    let admin = roles.create(&mut su, "bind_admin", &["outbox_admin"]);
    let mut problems = Vec::new();

    // Twice is once; by an outbox_admin; both write the operator log.
    let mut adm = Session::new(&cluster, &admin);
    let log_before = binding_log_rows(&mut su, "bind", &role, &t);
    for n in 1..=2 {
        if let Err(e) = bind(&mut adm.c, &role, &t) {
            problems.push(format!(
                "bind_tenant({role}, {t}) #{n} by outbox_admin {admin}: {}",
                describe(&e)
            ));
        }
    }
    let log_after = binding_log_rows(&mut su, "bind", &role, &t);
    if log_after <= log_before {
        problems.push(format!(
            "bind_tenant({role}, {t}) wrote no outbox.operator_log row whose action names a bind and that mentions the role and the tenant ({log_before} before, {log_after} after)"
        ));
    }
    let mut s = Session::new(&cluster, &role);
    match s.try_enqueue(&ch, &unique("ten_bound_twice")) {
        Ok(id) => {
            if tenant_of(&mut su, id).as_deref() != Some(t.as_str()) {
                problems.push(format!(
                    "{role}, bound twice to {t}, enqueued message {id} for tenant {:?}",
                    tenant_of(&mut su, id)
                ));
            }
        }
        Err(e) => problems.push(format!(
            "{role}, bound twice to {t} (one tenant), could not enqueue without outbox.tenant: {}",
            describe(&e)
        )),
    }
    let unlog_before = binding_log_rows(&mut su, "unbind", &role, &t);
    if let Err(e) = unbind(&mut adm.c, &role, &t) {
        problems.push(format!(
            "unbind_tenant({role}, {t}) by outbox_admin: {}",
            describe(&e)
        ));
    }
    let unlog_after = binding_log_rows(&mut su, "unbind", &role, &t);
    if unlog_after <= unlog_before {
        problems.push(format!(
            "unbind_tenant({role}, {t}) wrote no outbox.operator_log row whose action names an unbind and that mentions the role and the tenant"
        ));
    }
    // One unbind removes the binding made twice.
    match s.try_enqueue(&ch, &unique("ten_unbound_now")) {
        Err(e) if code_of(&e) == "42501" => {}
        other => problems.push(format!(
            "{role} after its only binding (made twice) was removed once: enqueue should fail with 42501, got {}",
            match other {
                Ok(id) => format!("message {id}"),
                Err(e) => describe(&e),
            }
        )),
    }
    // Unbinding what is not bound: no error.
    if let Err(e) = unbind(&mut su, &role, &t) {
        problems.push(format!(
            "unbind_tenant of a binding that does not exist should be a no-op (or a NOTICE): {}",
            describe(&e)
        ));
    }
    // '*' is a binding, not a tenant: bind it, but it cannot be named.
    roles.may_be_bound(&role, "*");
    match bind(&mut su, &role, "*") {
        Ok(_) => {
            if s.try_set_tenant(Some("*")).is_ok() {
                match s.try_enqueue(&ch, &unique("ten_star")) {
                    Err(e) if ["22023", "42501"].contains(&code_of(&e).as_str()) => {}
                    other => problems.push(format!(
                        "a role bound to '*' with outbox.tenant = '*': enqueue should be refused ('*' is not a tenant; 22023 or 42501), got {}",
                        match other {
                            Ok(id) => format!("message {id} with tenant {:?}", tenant_of(&mut su, id)),
                            Err(e) => describe(&e),
                        }
                    )),
                }
            }
            let _ = s.try_set_tenant(None);
            let _ = unbind(&mut su, &role, "*");
        }
        Err(e) => problems.push(format!("bind_tenant(role, '*'): {}", describe(&e))),
    }
    assert_no_problems(&problems, "bind_tenant / unbind_tenant (binding twice is once one unbind removes it and both write the operator log)");
}
