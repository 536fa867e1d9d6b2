//! Section 10: writing functions are SECURITY DEFINER, tenant tables have row-level
//! security.

use super::*;

// ---------------------------------------------------------------------------------------
// 10. the catalog
// ---------------------------------------------------------------------------------------

#[test]
fn writing_functions_are_security_definer_and_tenant_tables_have_row_level_security() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut su = cluster.connect();
    check_extension_roles(&mut su);
    let mut problems = Vec::new();

    const WRITERS: [&str; 5] = ["enqueue", "retry", "resolve", "cancel", "assign"];
    for f in WRITERS.into_iter().chain(ADMINISTRATION) {
        let rows = su
            .query(
                "SELECT p.oid::regprocedure::text, p.prosecdef, coalesce(array_to_string(p.proconfig, ';'), ''),
                        l.lanname
                   FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
                  WHERE p.pronamespace = 'outbox'::regnamespace AND p.proname = $1",
                &[&f],
            )
            .expect("pg_proc");
        if rows.is_empty() {
            problems.push(format!("outbox.{f} does not exist"));
        }
        for r in rows {
            let (sig, definer, config, language): (String, bool, String, String) =
                (r.get(0), r.get(1), r.get(2), r.get(3));
            if !definer {
                problems.push(format!("{sig} is not SECURITY DEFINER"));
            }
            // A C-language function (enqueue) pins the search path of its statements itself
            // (src/pinned_statement.rs); the #[pg_test] enqueue_ignores_the_callers_search_path
            // checks that a caller's operators and functions are never reached.
            if language == "c" {
                continue;
            }
            let search_path = config
                .split(';')
                .find_map(|s| s.strip_prefix("search_path="))
                .map(|s| s.replace([' ', '"'], ""));
            if search_path.as_deref() != Some("pg_catalog,pg_temp") {
                problems.push(format!(
                    "{sig} must pin search_path to pg_catalog, pg_temp; its settings are {config:?}"
                ));
            }
        }
    }
    for t in ["_messages", "_attempts", "_ledger", "_operator_log"] {
        let rls: Option<bool> = su
            .query_opt(
                "SELECT relrowsecurity FROM pg_class WHERE oid = to_regclass('outbox.' || $1)",
                &[&t],
            )
            .expect("pg_class")
            .map(|r| r.get(0));
        if rls != Some(true) {
            problems.push(format!(
                "outbox.{t} must have row-level security enabled; relrowsecurity = {rls:?}"
            ));
        }
        let policies = count(
            &mut su,
            "SELECT count(*) FROM pg_policies WHERE schemaname = 'outbox' AND tablename = $1",
            &[&t],
        );
        if policies < 2 {
            problems.push(format!(
                "outbox.{t} should have a policy for readers and one for outbox_worker; it has {policies}"
            ));
        }
    }
    for v in [
        "messages",
        "attempts",
        "ledger",
        "operator_log",
        "work_queue",
    ] {
        let options: Option<String> = su
            .query_opt(
                "SELECT coalesce(array_to_string(reloptions, ','), '') FROM pg_class WHERE oid = to_regclass('outbox.' || $1)",
                &[&v],
            )
            .expect("pg_class")
            .map(|r| r.get(0));
        let invoker = options.as_deref().is_some_and(|o| {
            o.split(',').any(|kv| {
                matches!(
                    kv.to_ascii_lowercase().as_str(),
                    "security_invoker=true"
                        | "security_invoker=on"
                        | "security_invoker=1"
                        | "security_invoker=yes"
                )
            })
        });
        if !invoker {
            problems.push(format!(
                "the view outbox.{v} must be security_invoker; its options are {options:?}"
            ));
        }
    }
    let roles: Vec<(String, bool, bool)> = su
        .query(
            "SELECT rolname::text, rolcanlogin, rolsuper FROM pg_roles WHERE rolname = ANY($1::text[]) ORDER BY 1",
            &[&EXTENSION_ROLES.to_vec()],
        )
        .expect("pg_roles")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    for (name, login, superuser) in roles {
        if login {
            problems.push(format!(
                "role {name} can log in; the extension's roles are NOLOGIN"
            ));
        }
        if superuser {
            problems.push(format!("role {name} is a superuser"));
        }
    }
    assert_no_problems(&problems, "the catalog");
}
