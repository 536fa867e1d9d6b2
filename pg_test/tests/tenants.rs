//! End-to-end tests of tenants, roles and row-level security (`docs/security.md`), against
//! the real cluster (`scripts/cluster.sh`, located by `OUTBOX_BASE` / `OUTBOX_PGPORT`), the
//! real delivery workers and the provider simulator:
//!
//! 1. reads: every tenant-data view shows a tenant's roles their own rows, all of them, and
//!    not one row of another tenant; writers do not read the work queue or operator log;
//! 2. actions: an operator action, `reconcile(id)` and `status(id)` on another tenant's
//!    message behave exactly as on an id that does not exist, and change nothing;
//! 3. privileges: what each role may call and read (by calling it and from the catalog),
//!    masked channel secrets, a role without any outbox grant;
//! 4. tenant choice: the table of docs/security.md (unset / `SET outbox.tenant`, bound to
//!    one, several, `'*'`, nothing) and effect keys unique per tenant;
//! 5. bindings inherited through role membership;
//! 6. `bind_tenant` / `unbind_tenant` validation and audit rows;
//! 7. the worker runs as a non-superuser in a security-restricted operation: a trigger
//!    planted on `outbox._messages` records who it runs as and what it may do;
//! 8. hostile `outbox.tenant` values never widen what a role sees;
//! 9. a superuser or missing `outbox.role` stops the worker, said once in the server log;
//! 10. the catalog: SECURITY DEFINER writers with a pinned `search_path`, RLS on the
//!     tenant tables, `security_invoker` views, NOLOGIN roles.
//!
//! Run: `cargo test -p outbox_e2e --release --test tenants`.
//!
//! Roles act through `SET ROLE` on a superuser connection (the roles are NOLOGIN). Every
//! role, tenant, channel and key has a unique name, so the tests rerun on the same cluster;
//! the roles are dropped (after their bindings are removed) when a test ends, also when it
//! fails. The tests take one lock, so they run one at a time whatever `--test-threads`
//! says: test 7 plants a trigger on `outbox._messages` and test 9 stops the workers.

use outbox_e2e::cluster::{state_of, unique, wait_for_state, wait_for_workers, Cluster};
use outbox_e2e::helpers::{
    code_of, count, create_channel, describe, ident, serial, session_as, try_enqueue_payload,
    wait_state, Params, SETTLE,
};
use outbox_e2e::sim::{Action, Simulator};
use postgres::types::ToSql;
use postgres::{Client, NoTls};
use std::time::Duration;

/// How long a negative check ("the worker does nothing") watches.
const LONG_QUIET: Duration = Duration::from_secs(3);
/// The channels of this file: the provider gets the effect key and answers an external id.
const OPTIONS: &str = r#"{"idempotency_header": "Idempotency-Key", "external_id": "/id"}"#;
/// The roles `CREATE EXTENSION` creates (docs/security.md, "Roles").
const EXTENSION_ROLES: [&str; 4] = [
    "outbox_writer",
    "outbox_operator",
    "outbox_admin",
    "outbox_worker",
];

// ---------------------------------------------------------------------------------------
// Helpers (local to this file)
// ---------------------------------------------------------------------------------------

/// A quoted SQL string literal.
fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// `Err(problem)` unless `r` failed with SQLSTATE `want`.
fn check_code<T: std::fmt::Debug>(
    r: Result<T, postgres::Error>,
    want: &str,
    what: &str,
) -> Result<(), String> {
    match r {
        Ok(v) => Err(format!(
            "{what}: expected SQLSTATE {want}, but it succeeded (returned {v:?})"
        )),
        Err(e) if code_of(&e) == want => Ok(()),
        Err(e) => Err(format!(
            "{what}: expected SQLSTATE {want}, got {}",
            describe(&e)
        )),
    }
}

/// Panics unless `r` failed with SQLSTATE `want`.
fn expect_code<T: std::fmt::Debug>(r: Result<T, postgres::Error>, want: &str, what: &str) {
    if let Err(problem) = check_code(r, want, what) {
        panic!("{problem}");
    }
}

/// Panics with every problem found, one per line.
fn assert_no_problems(problems: &[String], what: &str) {
    assert!(
        problems.is_empty(),
        "{what}: {} problem(s):\n  - {}",
        problems.len(),
        problems.join("\n  - ")
    );
}

/// Replaces every whole decimal number equal to `id` in `text` by `<id>`, so that an error
/// about one id can be compared with the same error about another.
fn mask_id(text: &str, id: i64) -> String {
    let id = id.to_string();
    let mut out = String::with_capacity(text.len());
    let mut digits = String::new();
    let flush = |digits: &mut String, out: &mut String| {
        if *digits == id {
            out.push_str("<id>");
        } else {
            out.push_str(digits);
        }
        digits.clear();
    };
    for ch in text.chars() {
        if ch.is_ascii_digit() {
            digits.push(ch);
        } else {
            flush(&mut digits, &mut out);
            out.push(ch);
        }
    }
    flush(&mut digits, &mut out);
    out
}

/// What an error says (SQLSTATE, message, detail, hint) with `id` masked.
fn error_text_without_id(e: &postgres::Error, id: i64) -> String {
    match e.as_db_error() {
        Some(d) => mask_id(
            &format!(
                "{} | {} | {} | {}",
                d.code().code(),
                d.message(),
                d.detail().unwrap_or(""),
                d.hint().unwrap_or("")
            ),
            id,
        ),
        None => format!("<no SQLSTATE: {e}>"),
    }
}

/// A name for a tenant; the `_t` suffix keeps one tenant's name from being a prefix of
/// another's, so that a substring search for it finds that tenant alone.
fn tenant_name(label: &str) -> String {
    format!("{}_t", unique(&format!("tenant_{label}")))
}

/// A connection acting as `role` (`SET ROLE` on a superuser connection).
struct Session {
    c: Client,
    who: String,
}

impl Session {
    fn new(cluster: &Cluster, role: &str) -> Session {
        Session {
            c: session_as(cluster, role),
            who: role.to_string(),
        }
    }

    /// `SET outbox.tenant` (Some) or `RESET outbox.tenant` (None).
    fn try_set_tenant(&mut self, tenant: Option<&str>) -> Result<(), postgres::Error> {
        match tenant {
            Some(t) => self
                .c
                .execute(
                    "SELECT pg_catalog.set_config('outbox.tenant', $1::text, false)",
                    &[&t],
                )
                .map(|_| ()),
            None => self.c.batch_execute("RESET outbox.tenant"),
        }
    }

    fn set_tenant(&mut self, tenant: Option<&str>) {
        self.try_set_tenant(tenant).unwrap_or_else(|e| {
            panic!(
                "{}: setting outbox.tenant to {tenant:?}: {}",
                self.who,
                describe(&e)
            )
        });
    }

    fn try_enqueue(&mut self, channel: &str, key: &str) -> Result<i64, postgres::Error> {
        let payload = format!(r#"{{"tenant_test": "{key}"}}"#);
        try_enqueue_payload(&mut self.c, channel, &payload, key)
    }

    fn enqueue(&mut self, channel: &str, key: &str) -> i64 {
        self.try_enqueue(channel, key).unwrap_or_else(|e| {
            panic!(
                "{} could not enqueue on {channel} (key {key}): {}",
                self.who,
                describe(&e)
            )
        })
    }

    fn count(&mut self, sql: &str, params: &Params<'_>) -> i64 {
        self.c
            .query_one(sql, params)
            .unwrap_or_else(|e| panic!("{}: {sql}: {}", self.who, describe(&e)))
            .get(0)
    }

    fn status(&mut self, id: i64) -> Result<Option<String>, postgres::Error> {
        self.c
            .query_one("SELECT outbox.status($1::int8)::text", &[&id])
            .map(|r| r.get(0))
    }
}

/// The tenant a message was written for, read as the superuser.
fn tenant_of(c: &mut Client, id: i64) -> Option<String> {
    c.query_opt("SELECT tenant FROM outbox._messages WHERE id = $1", &[&id])
        .unwrap_or_else(|e| panic!("tenant of message {id}: {}", describe(&e)))
        .map(|r| r.get(0))
}

fn bind(c: &mut Client, role: &str, tenant: &str) -> Result<u64, postgres::Error> {
    c.execute(
        "SELECT outbox.bind_tenant($1::text::name, $2::text)",
        &[&role, &tenant],
    )
}

fn unbind(c: &mut Client, role: &str, tenant: &str) -> Result<u64, postgres::Error> {
    c.execute(
        "SELECT outbox.unbind_tenant($1::text::name, $2::text)",
        &[&role, &tenant],
    )
}

/// Panics with a clear message when the roles `CREATE EXTENSION` creates are missing.
fn check_extension_roles(c: &mut Client) {
    let missing: Vec<String> = c
        .query(
            "SELECT r FROM unnest($1::text[]) r WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r)",
            &[&EXTENSION_ROLES.to_vec()],
        )
        .expect("look up the extension's roles")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        missing.is_empty(),
        "CREATE EXTENSION must create the roles {EXTENSION_ROLES:?}; missing: {missing:?}"
    );
}

/// Roles created by a test, dropped (after their bindings are removed) when it ends.
struct Roles<'a> {
    cluster: &'a Cluster,
    names: Vec<String>,
    /// Every (role, tenant) that may have been bound, to unbind before dropping.
    bindings: Vec<(String, String)>,
}

impl<'a> Roles<'a> {
    fn new(cluster: &'a Cluster) -> Self {
        Roles {
            cluster,
            names: Vec::new(),
            bindings: Vec::new(),
        }
    }

    /// Creates a NOLOGIN role granted `grants` and returns its name.
    fn create(&mut self, c: &mut Client, label: &str, grants: &[&str]) -> String {
        let name = unique(&format!("tr_{label}"));
        c.batch_execute(&format!("CREATE ROLE {} NOLOGIN", ident(&name)))
            .unwrap_or_else(|e| panic!("CREATE ROLE {name}: {}", describe(&e)));
        self.names.push(name.clone());
        for g in grants {
            c.batch_execute(&format!("GRANT {} TO {}", ident(g), ident(&name)))
                .unwrap_or_else(|e| panic!("GRANT {g} TO {name}: {}", describe(&e)));
        }
        name
    }

    /// `bind_tenant` as the superuser, remembered for the cleanup.
    fn bind(&mut self, c: &mut Client, role: &str, tenant: &str) {
        self.bindings.push((role.to_string(), tenant.to_string()));
        bind(c, role, tenant).unwrap_or_else(|e| {
            panic!(
                "outbox.bind_tenant({role}, {tenant}) as superuser: {}",
                describe(&e)
            )
        });
    }

    /// Remembers a binding a test may create by other means (or by mistake).
    fn may_be_bound(&mut self, role: &str, tenant: &str) {
        self.bindings.push((role.to_string(), tenant.to_string()));
    }
}

impl Drop for Roles<'_> {
    fn drop(&mut self) {
        let Ok(mut c) = Client::connect(&self.cluster.conninfo(), NoTls) else {
            eprintln!("cleanup: cannot connect; roles {:?} are left", self.names);
            return;
        };
        for (role, tenant) in &self.bindings {
            let _ = unbind(&mut c, role, tenant);
        }
        // Members first: a role created later may be a member of one created earlier.
        for name in self.names.iter().rev() {
            if let Err(e) = c.batch_execute(&format!("DROP ROLE IF EXISTS {}", ident(name))) {
                eprintln!("cleanup: could not drop role {name}: {}", describe(&e));
            }
        }
    }
}

/// Two tenants with their roles and messages:
///
/// | role | granted | bound to |
/// |---|---|---|
/// | `writer_a`, `writer_b` | outbox_writer | A, B |
/// | `operator_a`, `operator_b` | outbox_operator | A, B |
/// | `admin` | outbox_admin | — |
/// | `shared` | outbox_writer | `'*'` |
/// | `multi` | outbox_writer | A and B |
/// | `unbound` | outbox_writer | — |
/// | `nogrant` | — | — |
///
/// Each tenant has two delivered messages and one failed (answered 400), enqueued by its
/// writer; its operator assigned the failed one, so that every tenant-data view
/// (messages, attempts, ledger, work_queue, operator_log) has rows of both tenants.
struct Fixture<'a> {
    cluster: &'a Cluster,
    sim: Simulator,
    ok_ch: String,
    a: String,
    b: String,
    writer_a: String,
    writer_b: String,
    operator_a: String,
    operator_b: String,
    admin: String,
    shared: String,
    multi: String,
    unbound: String,
    nogrant: String,
    /// Delivered, delivered, failed.
    a_ids: Vec<i64>,
    b_ids: Vec<i64>,
    a_failed: i64,
    b_failed: i64,
    a_delivered: i64,
    b_delivered: i64,
    /// Last: dropped (roles and bindings removed) after everything above.
    _roles: Roles<'a>,
}

impl<'a> Fixture<'a> {
    fn new(cluster: &'a Cluster) -> Fixture<'a> {
        let mut su = cluster.connect();
        check_extension_roles(&mut su);
        let sim = Simulator::start();
        let ok_ch = unique("ten_ok");
        let bad_ch = unique("ten_bad");
        create_channel(&mut su, &ok_ch, &sim.send_url(&ok_ch), OPTIONS);
        sim.set_default(&bad_ch, Action::Status(400));
        create_channel(&mut su, &bad_ch, &sim.send_url(&bad_ch), OPTIONS);

        let a = tenant_name("a");
        let b = tenant_name("b");
        let mut roles = Roles::new(cluster);
        let writer_a = roles.create(&mut su, "writer_a", &["outbox_writer"]);
        let writer_b = roles.create(&mut su, "writer_b", &["outbox_writer"]);
        let operator_a = roles.create(&mut su, "operator_a", &["outbox_operator"]);
        let operator_b = roles.create(&mut su, "operator_b", &["outbox_operator"]);
        let admin = roles.create(&mut su, "admin", &["outbox_admin"]);
        let shared = roles.create(&mut su, "shared", &["outbox_writer"]);
        let multi = roles.create(&mut su, "multi", &["outbox_writer"]);
        let unbound = roles.create(&mut su, "unbound", &["outbox_writer"]);
        let nogrant = roles.create(&mut su, "nogrant", &[]);
        roles.bind(&mut su, &writer_a, &a);
        roles.bind(&mut su, &operator_a, &a);
        roles.bind(&mut su, &writer_b, &b);
        roles.bind(&mut su, &operator_b, &b);
        roles.bind(&mut su, &shared, "*");
        roles.bind(&mut su, &multi, &a);
        roles.bind(&mut su, &multi, &b);

        let mut ids = Vec::new();
        for (writer, label) in [(&writer_a, "a"), (&writer_b, "b")] {
            let mut w = Session::new(cluster, writer);
            let d1 = w.enqueue(&ok_ch, &unique(&format!("ten_{label}_d1")));
            let d2 = w.enqueue(&ok_ch, &unique(&format!("ten_{label}_d2")));
            let f = w.enqueue(&bad_ch, &unique(&format!("ten_{label}_f")));
            ids.push(vec![d1, d2, f]);
        }
        let (a_ids, b_ids) = (ids[0].clone(), ids[1].clone());
        for ids in [&a_ids, &b_ids] {
            wait_state(cluster, ids[0], "delivered");
            wait_state(cluster, ids[1], "delivered");
            wait_state(cluster, ids[2], "failed");
        }
        for (operator, id, owner) in [
            (&operator_a, a_ids[2], "alice"),
            (&operator_b, b_ids[2], "bob"),
        ] {
            let mut o = Session::new(cluster, operator);
            o.c.execute("SELECT outbox.assign($1::int8, $2::text)", &[&id, &owner])
                .unwrap_or_else(|e| {
                    panic!(
                        "{operator} (outbox_operator of the message's tenant) could not assign its failed message {id}: {}",
                        describe(&e)
                    )
                });
        }

        Fixture {
            cluster,
            sim,
            ok_ch,
            a,
            b,
            writer_a,
            writer_b,
            operator_a,
            operator_b,
            admin,
            shared,
            multi,
            unbound,
            nogrant,
            a_failed: a_ids[2],
            b_failed: b_ids[2],
            a_delivered: a_ids[0],
            b_delivered: b_ids[0],
            a_ids,
            b_ids,
            _roles: roles,
        }
    }

    fn session(&self, role: &str) -> Session {
        Session::new(self.cluster, role)
    }

    /// An id no message has (and none will have while the test runs).
    fn unknown_id(&self) -> i64 {
        let mut su = self.cluster.connect();
        su.query_one(
            "SELECT coalesce(max(id), 0) + 1000000000 FROM outbox._messages",
            &[],
        )
        .expect("max message id")
        .get(0)
    }
}

impl Drop for Fixture<'_> {
    fn drop(&mut self) {
        // The failed messages need not raise a terminal_failures alert for the next hour.
        if let Ok(mut c) = Client::connect(&self.cluster.conninfo(), NoTls) {
            for id in [self.a_failed, self.b_failed] {
                let _ = c.execute(
                    "SELECT outbox.cancel($1::int8, 'tenants test cleanup')",
                    &[&id],
                );
            }
        }
    }
}

/// A tenant-data view, the column that names the message of a row, and who reads it.
struct TenantView {
    name: &'static str,
    id_column: &'static str,
    writer_reads: bool,
}

const TENANT_VIEWS: [TenantView; 5] = [
    TenantView {
        name: "messages",
        id_column: "id",
        writer_reads: true,
    },
    TenantView {
        name: "attempts",
        id_column: "message_id",
        writer_reads: true,
    },
    TenantView {
        name: "ledger",
        id_column: "message_id",
        writer_reads: true,
    },
    TenantView {
        name: "work_queue",
        id_column: "id",
        writer_reads: false,
    },
    TenantView {
        name: "operator_log",
        id_column: "message_id",
        writer_reads: false,
    },
];

fn has_tenant_column(c: &mut Client, view: &str) -> bool {
    c.query_one(
        "SELECT EXISTS (SELECT 1 FROM pg_attribute
                         WHERE attrelid = ('outbox.' || $1)::regclass AND attname = 'tenant'
                           AND attnum > 0 AND NOT attisdropped)",
        &[&view],
    )
    .unwrap_or_else(|e| panic!("columns of outbox.{view}: {}", describe(&e)))
    .get(0)
}

/// Checks what `role` (acting for `own`, with messages `own_ids`) sees in every tenant-data
/// view: all of its own rows (as many as the superuser sees), none of `other_ids`, no row
/// of another tenant. Returns the problems found.
#[allow(clippy::too_many_arguments)]
fn check_reads(
    fx: &Fixture<'_>,
    su: &mut Client,
    role: &str,
    is_operator: bool,
    own: &str,
    own_ids: &[i64],
    other: &str,
    other_ids: &[i64],
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut s = fx.session(role);
    let own_ids = own_ids.to_vec();
    let other_ids = other_ids.to_vec();
    for v in &TENANT_VIEWS {
        let by_ids = format!(
            "SELECT count(*) FROM outbox.{} WHERE {} = ANY($1::int8[])",
            v.name, v.id_column
        );
        let role_kind = if is_operator { "operator" } else { "writer" };
        if !(v.writer_reads || is_operator) {
            let r =
                s.c.query_one(&format!("SELECT count(*) FROM outbox.{}", v.name), &[]);
            if let Err(p) = check_code(
                r.map(|row| row.get::<_, i64>(0)),
                "42501",
                &format!("{role_kind} {role} reading outbox.{}", v.name),
            ) {
                problems.push(p);
            }
            continue;
        }
        // All of its own rows: as many as the superuser sees.
        let su_own = count(su, &by_ids, &[&own_ids]);
        let su_other = count(su, &by_ids, &[&other_ids]);
        assert!(
            su_own > 0 && su_other > 0,
            "fixture: the superuser sees {su_own} rows of tenant {own} and {su_other} of tenant {other} in outbox.{}; the setup should have produced rows of both",
            v.name
        );
        let mine = s.count(&by_ids, &[&own_ids]);
        if mine != su_own {
            problems.push(format!(
                "{role_kind} {role} of tenant {own} sees {mine} of its own tenant's {su_own} rows in outbox.{} ({} = ANY({own_ids:?}))",
                v.name, v.id_column
            ));
        }
        let theirs = s.count(&by_ids, &[&other_ids]);
        if theirs != 0 {
            problems.push(format!(
                "{role_kind} {role} of tenant {own} sees {theirs} rows of tenant {other} in outbox.{} ({} = ANY({other_ids:?})); expected 0",
                v.name, v.id_column
            ));
        }
        for id in &other_ids {
            let one = s.count(
                &format!(
                    "SELECT count(*) FROM outbox.{} WHERE {} = $1",
                    v.name, v.id_column
                ),
                &[id],
            );
            if one != 0 {
                problems.push(format!(
                    "{role_kind} {role} of tenant {own}: outbox.{} WHERE {} = {id} (tenant {other}'s message) returned {one} rows; expected none",
                    v.name, v.id_column
                ));
            }
        }
        if has_tenant_column(su, v.name) {
            let foreign = s.count(
                &format!(
                    // Rows about a channel carry no tenant and are shown to every operator.
                    "SELECT count(*) FROM outbox.{} WHERE tenant IS NOT NULL AND tenant <> $1",
                    v.name
                ),
                &[&own],
            );
            if foreign != 0 {
                problems.push(format!(
                    "{role_kind} {role} of tenant {own} sees {foreign} rows of other tenants in outbox.{} (tenant <> {own}); expected 0",
                    v.name
                ));
            }
        }
    }
    if is_operator {
        // A binding's log row belongs to the tenant it binds; channel rows are everyone's.
        let mentions = "SELECT count(*) FROM outbox.operator_log o WHERE strpos(o::text, $1) > 0";
        let theirs = s.count(mentions, &[&other]);
        if theirs != 0 {
            problems.push(format!(
                "operator {role} of tenant {own} sees {theirs} outbox.operator_log rows that mention tenant {other} (its bindings); expected 0"
            ));
        }
        let own_bindings = s.count(mentions, &[&own]);
        if own_bindings == 0 {
            problems.push(format!(
                "operator {role} of tenant {own} sees no outbox.operator_log row that mentions its own tenant; the bind_tenant rows for {own} belong to it"
            ));
        }
        let channel_rows = s.count(
            "SELECT count(*) FROM outbox.operator_log o WHERE message_id IS NULL AND strpos(o::text, $1) > 0",
            &[&fx.ok_ch],
        );
        if channel_rows == 0 {
            problems.push(format!(
                "operator {role} sees no outbox.operator_log row about channel {} (its create_channel); rows about a channel are shown to every operator",
                fx.ok_ch
            ));
        }
    }
    problems
}

// ---------------------------------------------------------------------------------------
// 1. reads
// ---------------------------------------------------------------------------------------

#[test]
fn each_tenant_reads_its_own_rows_and_no_other() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let fx = Fixture::new(&cluster);
    let mut su = cluster.connect();
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
    let _serial = serial();
    let cluster = Cluster::from_env();
    let fx = Fixture::new(&cluster);
    let mut su = cluster.connect();
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

// ---------------------------------------------------------------------------------------
// 3. privileges
// ---------------------------------------------------------------------------------------

/// The `_`-prefixed (private) tables and views of the schema.
fn private_relations(su: &mut Client) -> Vec<String> {
    su.query(
        "SELECT c.relname::text FROM pg_class c
          WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm')
            AND c.relname LIKE '\\_%' ORDER BY 1",
        &[],
    )
    .expect("private relations")
    .iter()
    .map(|r| r.get(0))
    .collect()
}

#[test]
fn each_role_may_do_what_the_table_says_and_nothing_more() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let fx = Fixture::new(&cluster);
    let mut su = cluster.connect();
    let secret = unique("s3cr3t");
    let secret_ch = unique("ten_secret");
    create_channel(
        &mut su,
        &secret_ch,
        &fx.sim.send_url(&secret_ch),
        &format!(
            r#"{{"headers": {{"Authorization": "Bearer {secret}", "X-Api-Key": "{secret}"}}}}"#
        ),
    );
    su.execute(
        "SELECT outbox.pause_channel($1, 'tenants test: nothing to send')",
        &[&secret_ch],
    )
    .unwrap_or_else(|e| panic!("pause {secret_ch}: {}", describe(&e)));
    // Any binding a refused call might have created is removed at the end.
    let mut problems = Vec::new();
    let new_channel = unique("ten_nope");
    let endpoint = fx.sim.send_url(&new_channel);
    let a_id = fx.a_failed;

    // Calls that need a privilege the role has not: (what, sql, params).
    type Call<'c> = (&'static str, &'static str, Vec<&'c (dyn ToSql + Sync)>);
    let admin_calls: Vec<Call<'_>> = vec![
        (
            "create_channel",
            "SELECT outbox.create_channel($1::text, $2::text, '{}'::jsonb)",
            vec![&new_channel, &endpoint],
        ),
        (
            "alter_channel",
            "SELECT outbox.alter_channel($1::text, '{\"max_in_flight\": 3}'::jsonb)",
            vec![&fx.ok_ch],
        ),
        (
            "pause_channel",
            "SELECT outbox.pause_channel($1::text, 'tenants test')",
            vec![&fx.ok_ch],
        ),
        (
            "resume_channel",
            "SELECT outbox.resume_channel($1::text)",
            vec![&secret_ch],
        ),
        (
            "bind_tenant",
            "SELECT outbox.bind_tenant($1::text::name, $2::text)",
            vec![&fx.writer_a, &fx.b],
        ),
        (
            "unbind_tenant",
            "SELECT outbox.unbind_tenant($1::text::name, $2::text)",
            vec![&fx.writer_b, &fx.b],
        ),
        ("prometheus", "SELECT outbox.prometheus()", vec![]),
        ("metrics", "SELECT count(*) FROM outbox.metrics", vec![]),
        ("alerts", "SELECT count(*) FROM outbox.alerts", vec![]),
    ];
    let operator_calls: Vec<Call<'_>> = vec![
        (
            "retry",
            "SELECT outbox.retry($1::int8, 'tenants test')",
            vec![&a_id],
        ),
        (
            "resolve",
            "SELECT outbox.resolve($1::int8, 'cancelled', 'tenants test')",
            vec![&a_id],
        ),
        (
            "cancel",
            "SELECT outbox.cancel($1::int8, 'tenants test')",
            vec![&a_id],
        ),
        (
            "assign",
            "SELECT outbox.assign($1::int8, 'writer')",
            vec![&a_id],
        ),
        (
            "reconcile(id)",
            "SELECT outbox.reconcile($1::int8)",
            vec![&a_id],
        ),
        ("reconcile()", "SELECT * FROM outbox.reconcile()", vec![]),
        (
            "worker_status",
            "SELECT * FROM outbox.worker_status()",
            vec![],
        ),
        (
            "work_queue",
            "SELECT count(*) FROM outbox.work_queue",
            vec![],
        ),
        (
            "operator_log",
            "SELECT count(*) FROM outbox.operator_log",
            vec![],
        ),
    ];
    let key = unique("ten_op_enqueue");
    let payload = "{}";
    let enqueue_call: Call<'_> = (
        "enqueue",
        "SELECT outbox.enqueue($1::text, $2::text::jsonb, $3::text)",
        vec![&fx.ok_ch, &payload, &key],
    );

    let mut expect_refused = |s: &mut Session, role_kind: &str, calls: &[Call<'_>]| {
        for (what, sql, params) in calls {
            if let Err(p) = check_code(
                s.c.execute(*sql, params),
                "42501",
                &format!("{role_kind} {} calling {what}", s.who),
            ) {
                problems.push(p);
            }
        }
    };
    let mut writer = fx.session(&fx.writer_a);
    expect_refused(&mut writer, "writer", &admin_calls);
    expect_refused(&mut writer, "writer", &operator_calls);
    let mut operator = fx.session(&fx.operator_a);
    expect_refused(&mut operator, "operator", &admin_calls);
    expect_refused(
        &mut operator,
        "operator",
        std::slice::from_ref(&enqueue_call),
    );
    let mut nogrant = fx.session(&fx.nogrant);
    expect_refused(&mut nogrant, "role without outbox grants", &admin_calls);
    expect_refused(&mut nogrant, "role without outbox grants", &operator_calls);
    expect_refused(
        &mut nogrant,
        "role without outbox grants",
        std::slice::from_ref(&enqueue_call),
    );
    let reader_calls: Vec<Call<'_>> = vec![
        ("status", "SELECT outbox.status($1::int8)", vec![&a_id]),
        (
            "effect_key",
            "SELECT outbox.effect_key('src', 'op')",
            vec![],
        ),
    ];
    expect_refused(&mut nogrant, "role without outbox grants", &reader_calls);
    drop(expect_refused);

    // Private tables and views: 42501 for writer, operator and the role without grants.
    let private = private_relations(&mut su);
    for must in [
        "_channels",
        "_messages",
        "_attempts",
        "_ledger",
        "_operator_log",
    ] {
        assert!(
            private.iter().any(|p| p == must),
            "outbox.{must} should exist (private tables found: {private:?})"
        );
    }
    // The tables under the views are readable by the roles that read the views, because the
    // views run with the caller's rights (security_invoker): row-level security filters
    // them, which the isolation test checks. Every other private relation is refused.
    let under_views = |who: &str, rel: &str| {
        let writer_tables = ["_messages", "_attempts", "_ledger"];
        (who.contains("writer") && writer_tables.contains(&rel))
            || (who.contains("operator")
                && (writer_tables.contains(&rel) || rel == "_operator_log"))
    };
    for s in [&mut writer, &mut operator, &mut nogrant] {
        for rel in &private {
            if under_views(&s.who, rel) {
                continue;
            }
            if let Err(p) = check_code(
                s.c.query(&format!("SELECT 1 FROM outbox.{} LIMIT 1", ident(rel)), &[]),
                "42501",
                &format!("{} reading the private outbox.{rel}", s.who),
            ) {
                problems.push(p);
            }
        }
    }
    // Every view of the schema: 42501 for the role without grants.
    let views: Vec<String> = su
        .query(
            "SELECT relname::text FROM pg_class WHERE relnamespace = 'outbox'::regnamespace AND relkind IN ('v', 'm') ORDER BY 1",
            &[],
        )
        .expect("views")
        .iter()
        .map(|r| r.get(0))
        .collect();
    for v in &views {
        if let Err(p) = check_code(
            nogrant
                .c
                .query(&format!("SELECT 1 FROM outbox.{} LIMIT 1", ident(v)), &[]),
            "42501",
            &format!("role without outbox grants reading outbox.{v}"),
        ) {
            problems.push(p);
        }
    }

    // What they may do: writer enqueues, reads status and effect keys; operator assigns,
    // reads worker_status.
    if let Err(e) = writer.try_enqueue(&fx.ok_ch, &unique("ten_priv_ok")) {
        problems.push(format!(
            "writer {} could not enqueue into its tenant: {}",
            writer.who,
            describe(&e)
        ));
    }
    for (what, sql) in [
        ("status", "SELECT outbox.status(1)::text"),
        ("effect_key", "SELECT outbox.effect_key('src', 'op')"),
    ] {
        if let Err(e) = writer.c.query(sql, &[]) {
            problems.push(format!("writer may call {what}: {}", describe(&e)));
        }
    }
    for (what, sql) in [
        ("worker_status", "SELECT * FROM outbox.worker_status()"),
        ("status", "SELECT outbox.status(1)::text"),
    ] {
        if let Err(e) = operator.c.query(sql, &[]) {
            problems.push(format!("operator may call {what}: {}", describe(&e)));
        }
    }

    // Channel secrets: masked for writer and operator, everywhere they can read.
    for s in [&mut writer, &mut operator] {
        match s.c.query_one(
            "SELECT count(*), coalesce(string_agg(c::text, E'\\n'), ''),
                    bool_and(c.options -> 'headers' ? 'Authorization')
               FROM outbox.channels c WHERE c.name = $1",
            &[&secret_ch],
        ) {
            Ok(row) => {
                let (n, text, has_name): (i64, String, Option<bool>) =
                    (row.get(0), row.get(1), row.get(2));
                if n != 1 {
                    problems.push(format!(
                        "{} sees {n} rows of channel {secret_ch} in outbox.channels; expected 1 (channels are not tenant data)",
                        s.who
                    ));
                }
                if text.contains(&secret) {
                    problems.push(format!(
                        "{} reads the channel secret in outbox.channels: {text}",
                        s.who
                    ));
                }
                if has_name != Some(true) {
                    problems.push(format!(
                        "{}: outbox.channels should show the header name Authorization with its value masked; row: {text}",
                        s.who
                    ));
                }
            }
            Err(e) => problems.push(format!(
                "{} could not read outbox.channels: {}",
                s.who,
                describe(&e)
            )),
        }
        let all = s.c.query_one(
            "SELECT coalesce(string_agg(c::text, E'\\n'), '') FROM outbox.channels c",
            &[],
        );
        if let Ok(row) = all {
            let text: String = row.get(0);
            if text.contains(&secret) {
                problems.push(format!(
                    "{} finds the channel secret somewhere in outbox.channels",
                    s.who
                ));
            }
        }
    }
    match operator.c.query_one(
        "SELECT count(*) FROM outbox.operator_log o WHERE strpos(o::text, $1) > 0",
        &[&secret],
    ) {
        Ok(row) if row.get::<_, i64>(0) == 0 => {}
        Ok(row) => problems.push(format!(
            "operator reads the channel secret in {} outbox.operator_log rows",
            row.get::<_, i64>(0)
        )),
        Err(e) => problems.push(format!(
            "operator could not read outbox.operator_log: {}",
            describe(&e)
        )),
    }

    // The admin reads the secret in outbox._channels and administers channels.
    let mut admin = fx.session(&fx.admin);
    match admin.c.query_one(
        "SELECT options::text FROM outbox._channels WHERE name = $1",
        &[&secret_ch],
    ) {
        Ok(row) => {
            let options: String = row.get(0);
            if !options.contains(&secret) {
                problems.push(format!(
                    "admin reads outbox._channels but the secret is not in the options: {options}"
                ));
            }
        }
        Err(e) => problems.push(format!(
            "admin {} could not read outbox._channels: {}",
            fx.admin,
            describe(&e)
        )),
    }
    let admin_ch = unique("ten_admin");
    for (what, r) in [
        (
            "create_channel",
            admin.c.execute(
                "SELECT outbox.create_channel($1::text, $2::text, '{}'::jsonb)",
                &[&admin_ch, &fx.sim.send_url(&admin_ch)],
            ),
        ),
        (
            "pause_channel",
            admin.c.execute(
                "SELECT outbox.pause_channel($1::text, 'tenants test')",
                &[&admin_ch],
            ),
        ),
        (
            "alter_channel",
            admin.c.execute(
                "SELECT outbox.alter_channel($1::text, '{\"max_in_flight\": 2}'::jsonb)",
                &[&admin_ch],
            ),
        ),
        (
            "resume_channel",
            admin
                .c
                .execute("SELECT outbox.resume_channel($1::text)", &[&admin_ch]),
        ),
        (
            "prometheus",
            admin.c.execute("SELECT outbox.prometheus()", &[]),
        ),
        (
            "metrics",
            admin.c.execute("SELECT count(*) FROM outbox.metrics", &[]),
        ),
        (
            "alerts",
            admin.c.execute("SELECT count(*) FROM outbox.alerts", &[]),
        ),
        (
            "worker_status",
            admin.c.execute("SELECT * FROM outbox.worker_status()", &[]),
        ),
    ] {
        if let Err(e) = r {
            problems.push(format!("admin may call {what}: {}", describe(&e)));
        }
    }

    // The catalog says the same: function and table privileges per role.
    problems.extend(catalog_privileges(&mut su, &fx));

    // Undo what a wrongly accepted call may have changed.
    let _ = su.execute("SELECT outbox.resume_channel($1)", &[&fx.ok_ch]);
    let _ = unbind(&mut su, &fx.writer_a, &fx.b);
    let _ = bind(&mut su, &fx.writer_b, &fx.b);
    assert_no_problems(&problems, "role privileges");
}

/// Function and relation privileges of the fixture's roles, from the catalog.
fn catalog_privileges(su: &mut Client, fx: &Fixture<'_>) -> Vec<String> {
    let mut problems = Vec::new();
    let functions: Vec<(String, String, String)> = su
        .query(
            "SELECT p.proname::text, p.oid::regprocedure::text, p.oid::text FROM pg_proc p
              WHERE p.pronamespace = 'outbox'::regnamespace ORDER BY 2",
            &[],
        )
        .expect("functions of the schema")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let may_execute = |su: &mut Client, role: &str, oid: &str| -> bool {
        su.query_one(
            "SELECT has_function_privilege($1::text, $2::text::oid, 'EXECUTE')",
            &[&role, &oid],
        )
        .unwrap_or_else(|e| panic!("has_function_privilege({role}, {oid}): {}", describe(&e)))
        .get(0)
    };
    // The public functions of the contract; functions added later are only checked for
    // PUBLIC.
    const CONTRACT: [&str; 16] = [
        "effect_key",
        "create_channel",
        "alter_channel",
        "pause_channel",
        "resume_channel",
        "enqueue",
        "status",
        "reconcile",
        "retry",
        "resolve",
        "cancel",
        "assign",
        "bind_tenant",
        "unbind_tenant",
        "prometheus",
        "worker_status",
    ];
    const WRITER_MAY: [&str; 3] = ["enqueue", "status", "effect_key"];
    const OPERATOR_MAY: [&str; 7] = [
        "status",
        "reconcile",
        "retry",
        "resolve",
        "cancel",
        "assign",
        "worker_status",
    ];
    const OPERATOR_MAY_NOT: [&str; 8] = [
        "enqueue",
        "create_channel",
        "alter_channel",
        "pause_channel",
        "resume_channel",
        "bind_tenant",
        "unbind_tenant",
        "prometheus",
    ];
    const ADMIN_MAY: [&str; 8] = [
        "create_channel",
        "alter_channel",
        "pause_channel",
        "resume_channel",
        "bind_tenant",
        "unbind_tenant",
        "prometheus",
        "worker_status",
    ];
    for (name, signature, oid) in &functions {
        let name = name.as_str();
        if CONTRACT.contains(&name) {
            let w = may_execute(su, &fx.writer_a, oid);
            let expected = WRITER_MAY.contains(&name);
            if w != expected {
                problems.push(format!(
                    "catalog: outbox_writer {} EXECUTE on {signature}; expected {}",
                    if w { "has" } else { "lacks" },
                    if expected { "to have it" } else { "it not to" }
                ));
            }
            let o = may_execute(su, &fx.operator_a, oid);
            if OPERATOR_MAY.contains(&name) && !o {
                problems.push(format!(
                    "catalog: outbox_operator lacks EXECUTE on {signature}"
                ));
            }
            if OPERATOR_MAY_NOT.contains(&name) && o {
                problems.push(format!(
                    "catalog: outbox_operator has EXECUTE on {signature}; it must not"
                ));
            }
            if ADMIN_MAY.contains(&name) && !may_execute(su, &fx.admin, oid) {
                problems.push(format!(
                    "catalog: outbox_admin lacks EXECUTE on {signature}"
                ));
            }
        }
        if name != "_visible_tenants" && may_execute(su, &fx.nogrant, oid) {
            problems.push(format!(
                "catalog: a role without outbox grants (PUBLIC) has EXECUTE on {signature}; only outbox._visible_tenants() is PUBLIC"
            ));
        }
    }

    let relations: Vec<(String, String, String)> = su
        .query(
            "SELECT c.relname::text, c.relkind::text, c.oid::text FROM pg_class c
              WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
              ORDER BY 1",
            &[],
        )
        .expect("relations of the schema")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let has = |su: &mut Client, role: &str, oid: &str, kind: &str, privilege: &str| -> bool {
        let f = if kind == "S" {
            "has_sequence_privilege"
        } else {
            "has_table_privilege"
        };
        su.query_one(
            &format!("SELECT {f}($1::text, $2::text::oid, $3::text)"),
            &[&role, &oid, &privilege],
        )
        .unwrap_or_else(|e| panic!("{f}({role}, {oid}, {privilege}): {}", describe(&e)))
        .get(0)
    };
    const WRITER_READS: [&str; 4] = ["messages", "attempts", "ledger", "channels"];
    const OPERATOR_READS: [&str; 6] = [
        "messages",
        "attempts",
        "ledger",
        "channels",
        "work_queue",
        "operator_log",
    ];
    const ADMIN_READS: [&str; 4] = ["_channels", "metrics", "alerts", "channels"];
    for (name, kind, oid) in &relations {
        let writes = if kind == "S" {
            "USAGE, UPDATE"
        } else {
            "INSERT, UPDATE, DELETE, TRUNCATE"
        };
        for (role, label) in [
            (&fx.writer_a, "outbox_writer"),
            (&fx.operator_a, "outbox_operator"),
            (&fx.nogrant, "a role without outbox grants"),
        ] {
            if has(su, role, oid, kind, writes) {
                problems.push(format!(
                    "catalog: {label} has one of {writes} on outbox.{name}; every change goes through a function"
                ));
            }
        }
        if kind == "S" {
            continue;
        }
        // Counted across tenants or private: no tenant role reads them (but the tables
        // under the security_invoker views, which row-level security filters).
        let under_view =
            ["_messages", "_attempts", "_ledger", "_operator_log"].contains(&name.as_str());
        let not_for_tenants =
            (name.starts_with('_') && !under_view) || name == "metrics" || name == "alerts";
        let w = has(su, &fx.writer_a, oid, kind, "SELECT");
        if WRITER_READS.contains(&name.as_str()) && !w {
            problems.push(format!(
                "catalog: outbox_writer lacks SELECT on outbox.{name}"
            ));
        }
        if (not_for_tenants
            || name == "work_queue"
            || name == "operator_log"
            || name == "_operator_log")
            && w
        {
            problems.push(format!(
                "catalog: outbox_writer has SELECT on outbox.{name}; it must not"
            ));
        }
        let o = has(su, &fx.operator_a, oid, kind, "SELECT");
        if OPERATOR_READS.contains(&name.as_str()) && !o {
            problems.push(format!(
                "catalog: outbox_operator lacks SELECT on outbox.{name}"
            ));
        }
        if not_for_tenants && o {
            problems.push(format!(
                "catalog: outbox_operator has SELECT on outbox.{name}; it must not"
            ));
        }
        if ADMIN_READS.contains(&name.as_str()) && !has(su, &fx.admin, oid, kind, "SELECT") {
            problems.push(format!(
                "catalog: outbox_admin lacks SELECT on outbox.{name}"
            ));
        }
        if has(su, &fx.nogrant, oid, kind, "SELECT") {
            problems.push(format!(
                "catalog: a role without outbox grants (PUBLIC) has SELECT on outbox.{name}"
            ));
        }
    }
    problems
}

// ---------------------------------------------------------------------------------------
// 4. tenant choice
// ---------------------------------------------------------------------------------------

/// (rows seen in outbox.messages, rows of tenant `a`, rows of tenant `b`, rows of neither).
fn seen(s: &mut Session, a: &str, b: &str) -> (i64, i64, i64, i64) {
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

/// Rows `s` sees in messages, attempts and ledger together.
fn rows_seen(s: &mut Session) -> i64 {
    s.count(
        "SELECT (SELECT count(*) FROM outbox.messages) + (SELECT count(*) FROM outbox.attempts)
              + (SELECT count(*) FROM outbox.ledger)",
        &[],
    )
}

#[test]
fn the_tenant_a_role_acts_for_follows_its_bindings_and_outbox_tenant() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let fx = Fixture::new(&cluster);
    let mut su = cluster.connect();
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
        let n = rows_seen(&mut wa);
        if n != 0 {
            problems.push(format!(
                "writer_a with outbox.tenant = {b} (not its tenant) sees {n} rows in messages/attempts/ledger; expected none"
            ));
        }
    }
    wa.set_tenant(None);

    // Bound to '*': names a tenant per connection and sees that tenant alone.
    let mut sh = fx.session(&fx.shared);
    expect_code(
        sh.try_enqueue(&fx.ok_ch, &unique("ten_shared_unset")),
        "42501",
        "shared (bound to '*') enqueueing without outbox.tenant",
    );
    let n = rows_seen(&mut sh);
    if n != 0 {
        problems.push(format!(
            "shared (bound to '*') without outbox.tenant sees {n} rows in messages/attempts/ledger; expected none"
        ));
    }
    sh.set_tenant(Some(a));
    let shared_a = sh.enqueue(&fx.ok_ch, &unique("ten_shared_a"));
    assert_eq!(
        tenant_of(&mut su, shared_a).as_deref(),
        Some(a),
        "shared with outbox.tenant = {a} enqueued message {shared_a}"
    );
    let (all, in_a, in_b, other) = seen(&mut sh, a, b);
    if !(in_a >= 4 && in_b == 0 && other == 0 && all == in_a) {
        problems.push(format!(
            "shared with outbox.tenant = {a} sees {all} messages: {in_a} of {a} (expected at least 4: the fixture's 3 and its own), {in_b} of {b}, {other} of other tenants (expected 0 and 0)"
        ));
    }
    sh.set_tenant(Some(b));
    let (all, in_a, in_b, other) = seen(&mut sh, a, b);
    if !(in_b >= 3 && in_a == 0 && other == 0 && all == in_b) {
        problems.push(format!(
            "shared with outbox.tenant = {b} sees {all} messages: {in_b} of {b} (expected at least 3), {in_a} of {a} (incl. the one it just enqueued there), {other} of other tenants (expected 0 and 0)"
        ));
    }
    sh.set_tenant(None);

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
    let multi_a = mu.enqueue(&fx.ok_ch, &unique("ten_multi_a"));
    assert_eq!(
        tenant_of(&mut su, multi_a).as_deref(),
        Some(a),
        "multi with outbox.tenant = {a} enqueued message {multi_a}"
    );
    let (all, in_a, in_b, other) = seen(&mut mu, a, b);
    if !(in_a >= 3 && in_b == 0 && other == 0 && all == in_a) {
        problems.push(format!(
            "multi with outbox.tenant = {a} sees {all} messages: {in_a} of {a}, {in_b} of {b}, {other} of others; expected {a}'s alone"
        ));
    }
    mu.set_tenant(Some(b));
    let (all, in_a, in_b, other) = seen(&mut mu, a, b);
    if !(in_b >= 3 && in_a == 0 && other == 0 && all == in_b) {
        problems.push(format!(
            "multi with outbox.tenant = {b} sees {all} messages: {in_a} of {a}, {in_b} of {b}, {other} of others; expected {b}'s alone"
        ));
    }
    let c = tenant_name("c");
    if named(&mut mu, &c, &mut problems) {
        expect_code(
            mu.try_enqueue(&fx.ok_ch, &unique("ten_multi_c")),
            "42501",
            &format!("multi (bound to {a} and {b}) enqueueing with outbox.tenant = {c}"),
        );
        let n = rows_seen(&mut mu);
        if n != 0 {
            problems.push(format!(
                "multi with outbox.tenant = {c} (not one of its tenants) sees {n} rows; expected none"
            ));
        }
    }
    mu.set_tenant(None);

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
    let n = rows_seen(&mut ub);
    if n != 0 {
        problems.push(format!(
            "unbound (no binding) sees {n} rows in messages/attempts/ledger; expected none"
        ));
    }

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
    let again = wa.enqueue(&dup_ch, &key);
    assert_eq!(
        again, ida,
        "the same key enqueued again by tenant {a} must return its existing message"
    );
    wait_state(&cluster, ida, "delivered");
    wait_state(&cluster, idb, "delivered");
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
    assert_no_problems(&problems, "tenant choice");
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

#[test]
fn bind_tenant_validates_its_arguments_and_writes_the_operator_log() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut su = cluster.connect();
    check_extension_roles(&mut su);
    let sim = Simulator::start();
    let ch = unique("ten_bind");
    create_channel(&mut su, &ch, &sim.send_url(&ch), OPTIONS);
    let mut roles = Roles::new(&cluster);
    let role = roles.create(&mut su, "bindee", &["outbox_writer"]);
    let admin = roles.create(&mut su, "bind_admin", &["outbox_admin"]);
    let t = tenant_name("bind");
    roles.may_be_bound(&role, &t);
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
    assert_no_problems(&problems, "bind_tenant / unbind_tenant");
}

// ---------------------------------------------------------------------------------------
// 7. the worker's role
// ---------------------------------------------------------------------------------------

const PROBE_TRIGGER: &str = "e2e_tenants_worker_probe";
const PROBE_FUNCTION: &str = "public.e2e_tenants_worker_probe()";

/// Removes the probe trigger, its function, its table and a role it may have created;
/// when dropped too, so that a failing test leaves nothing behind.
struct ProbeGuard<'a> {
    cluster: &'a Cluster,
    table: String,
    evil_role: String,
}

fn drop_probe_trigger(c: &mut Client) -> Result<(), postgres::Error> {
    c.batch_execute(&format!(
        "DROP TRIGGER IF EXISTS {PROBE_TRIGGER} ON outbox._messages; DROP FUNCTION IF EXISTS {PROBE_FUNCTION};"
    ))
}

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        let Ok(mut c) = Client::connect(&self.cluster.conninfo(), NoTls) else {
            eprintln!(
                "cleanup: cannot connect; the trigger {PROBE_TRIGGER} on outbox._messages may be left"
            );
            return;
        };
        if let Err(e) = drop_probe_trigger(&mut c) {
            eprintln!(
                "cleanup: could not drop the probe trigger: {}",
                describe(&e)
            );
        }
        let _ = c.batch_execute(&format!(
            "DROP TABLE IF EXISTS public.{}; DROP ROLE IF EXISTS {};",
            ident(&self.table),
            ident(&self.evil_role)
        ));
    }
}

#[test]
fn a_trigger_on_the_message_table_runs_as_the_restricted_worker_role() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let mut su = cluster.connect();
    check_extension_roles(&mut su);
    // A previous run that failed may have left its trigger.
    drop_probe_trigger(&mut su).expect("drop a leftover probe trigger");
    let worker_role: String = su
        .query_one(
            "SELECT coalesce(nullif(current_setting('outbox.role', true), ''), 'outbox_worker')",
            &[],
        )
        .unwrap()
        .get(0);
    let guard = ProbeGuard {
        cluster: &cluster,
        table: format!("{}_probe", unique("e2e")),
        evil_role: unique("e2e_evil"),
    };
    let probe = format!("public.{}", ident(&guard.table));
    let key = unique("ten_probe_key");
    su.batch_execute(&format!(
        "CREATE TABLE {probe} (who text, su text, rolsuper text, tried text, outcome text, user_after text);
         GRANT INSERT ON {probe} TO {worker};",
        worker = ident(&worker_role)
    ))
    .expect("create the probe table");

    // Each attempt in its own block; the outcome is 'ok' or the SQLSTATE.
    let attempts: [(&str, String); 7] = [
        ("SET ROLE postgres", "SET LOCAL ROLE postgres".into()),
        (
            "SET SESSION AUTHORIZATION postgres",
            "SET LOCAL SESSION AUTHORIZATION postgres".into(),
        ),
        (
            "CREATE ROLE ... SUPERUSER",
            format!("CREATE ROLE {} SUPERUSER", ident(&guard.evil_role)),
        ),
        (
            "COPY ... TO PROGRAM",
            "COPY (SELECT 1) TO PROGRAM 'true'".into(),
        ),
        (
            "CREATE TEMP TABLE",
            format!(
                "CREATE TEMP TABLE {} (i int) ON COMMIT DROP",
                ident(&format!("{}_tmp", guard.table))
            ),
        ),
        (
            "pg_read_file",
            "SELECT pg_catalog.pg_read_file('PG_VERSION')".into(),
        ),
        (
            "SET session_replication_role",
            "SET LOCAL session_replication_role = replica".into(),
        ),
    ];
    let mut body = String::new();
    for (label, stmt) in &attempts {
        body.push_str(&format!(
            "    BEGIN
        EXECUTE {stmt};
        v_outcome := 'ok';
    EXCEPTION WHEN others THEN
        v_outcome := SQLSTATE;
    END;
    INSERT INTO {probe} VALUES (v_who, v_su, v_rolsuper, {label}, v_outcome, current_user::text);
",
            stmt = literal(stmt),
            label = literal(label),
        ));
    }
    let function = format!(
        "CREATE FUNCTION {PROBE_FUNCTION} RETURNS trigger
LANGUAGE plpgsql SECURITY INVOKER
AS $probe$
DECLARE
    v_who      text := current_user::text;
    v_su       text := current_setting('is_superuser');
    v_rolsuper text := (SELECT r.rolsuper::text FROM pg_catalog.pg_roles r WHERE r.rolname = current_user);
    v_outcome  text;
BEGIN
    IF NEW.effect_key IS DISTINCT FROM {key} THEN
        RETURN NULL;
    END IF;
{body}    RETURN NULL;
END
$probe$;
GRANT EXECUTE ON FUNCTION {PROBE_FUNCTION} TO {worker};
CREATE TRIGGER {PROBE_TRIGGER} AFTER UPDATE ON outbox._messages
    FOR EACH ROW EXECUTE FUNCTION {PROBE_FUNCTION};",
        key = literal(&key),
        worker = ident(&worker_role),
    );
    su.batch_execute(&function)
        .unwrap_or_else(|e| panic!("create the probe trigger: {}\n{function}", describe(&e)));

    let sim = Simulator::start();
    let ch = unique("ten_probe");
    create_channel(&mut su, &ch, &sim.send_url(&ch), OPTIONS);
    let mark = cluster.log_mark();
    let id: i64 = su
        .query_one(
            "SELECT outbox.enqueue($1::text, '{\"probe\": true}'::jsonb, $2::text)",
            &[&ch, &key],
        )
        .expect("enqueue the probed message")
        .get(0);
    if !wait_for_state(&cluster, id, "delivered", SETTLE) {
        let log: Vec<String> = cluster
            .log_since(mark)
            .lines()
            .filter(|l| l.contains("ERROR") || l.contains(&guard.table))
            .map(str::to_string)
            .collect();
        panic!(
            "message {id} with a probe trigger on outbox._messages was not delivered within {SETTLE:?} (last state {:?}); the trigger must not stop the worker. Errors in the server log since the enqueue:\n{}",
            state_of(&cluster, id),
            log.join("\n")
        );
    }
    drop_probe_trigger(&mut su).expect("drop the probe trigger");

    let rows: Vec<(String, String, String, String, String, String)> = su
        .query(
            &format!("SELECT who, su, rolsuper, tried, outcome, user_after FROM {probe}"),
            &[],
        )
        .expect("probe rows")
        .iter()
        .map(|r| {
            let g = |i: usize| {
                r.get::<_, Option<String>>(i)
                    .unwrap_or_else(|| "NULL".into())
            };
            (g(0), g(1), g(2), g(3), g(4), g(5))
        })
        .collect();
    assert!(
        !rows.is_empty(),
        "the probe trigger never fired while the worker delivered message {id}; a trigger on outbox._messages runs (as {worker_role}) when the worker updates a message"
    );
    let table: String = rows
        .iter()
        .map(|r| format!("{r:?}"))
        .collect::<Vec<_>>()
        .join("\n  ");
    let mut problems = Vec::new();
    for (who, su_setting, rolsuper, tried, outcome, after) in &rows {
        if who != &worker_role {
            problems.push(format!(
                "the trigger ran as current_user = {who}; expected {worker_role}"
            ));
        }
        if rolsuper != "false" {
            problems.push(format!(
                "the trigger's current_user {who} has rolsuper = {rolsuper}"
            ));
        }
        if outcome == "ok" {
            problems.push(format!(
                "inside the worker's transaction, a planted trigger could {tried} (current_user afterwards: {after})"
            ));
        }
        if su_setting != "off" {
            problems.push(format!(
                "current_setting('is_superuser') = {su_setting} inside the trigger (current_user {who}, rolsuper {rolsuper}); the worker's role switch should leave is_superuser off, as SET ROLE does"
            ));
        }
    }
    problems.sort();
    problems.dedup();
    let evil_exists = count(
        &mut su,
        "SELECT count(*) FROM pg_roles WHERE rolname = $1",
        &[&guard.evil_role],
    );
    if evil_exists != 0 {
        problems.push(format!(
            "the trigger created the superuser role {}",
            guard.evil_role
        ));
    }
    assert_no_problems(
        &problems,
        &format!("the worker's role, as a trigger sees it; probe rows (who, is_superuser, rolsuper, tried, outcome, current_user after):\n  {table}\n"),
    );
}

// ---------------------------------------------------------------------------------------
// 8. hostile outbox.tenant values
// ---------------------------------------------------------------------------------------

#[test]
fn hostile_tenant_names_are_refused_and_never_widen_what_is_seen() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let fx = Fixture::new(&cluster);
    let mut su = cluster.connect();
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
            match s.try_set_tenant(Some(v)) {
                Err(e) => {
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
                Ok(()) => {}
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
        let n = rows_seen(&mut s);
        if n != 0 {
            problems.push(format!(
                "writer_a after SET outbox.tenant = $$x' OR '1'='1$$ sees {n} rows; expected none"
            ));
        }
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

// ---------------------------------------------------------------------------------------
// 9. outbox.role
// ---------------------------------------------------------------------------------------

/// ALTER SYSTEM RESET outbox.role + reload when dropped, also while a panic unwinds.
struct RoleSettingGuard<'a>(&'a Cluster);

impl Drop for RoleSettingGuard<'_> {
    fn drop(&mut self) {
        for _ in 0..50 {
            let ok = Client::connect(&self.0.conninfo(), NoTls).and_then(|mut c| {
                c.batch_execute("ALTER SYSTEM RESET outbox.role")?;
                c.batch_execute("SELECT pg_reload_conf()")
            });
            if ok.is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        std::thread::sleep(Duration::from_millis(700));
    }
}

/// Lines of the server log that speak of `outbox.role`, other than the postmaster's
/// "parameter changed" lines.
fn role_complaints(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains("outbox.role"))
        .filter(|l| !l.contains("changed to") && !l.contains("removed from configuration file"))
        .map(str::to_string)
        .collect()
}

#[test]
fn a_superuser_or_missing_outbox_role_stops_the_worker_and_says_so_once() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let workers = wait_for_workers(&cluster, &[]).len();
    let mut su = cluster.connect();
    let sim = Simulator::start();
    let ch = unique("ten_role");
    create_channel(&mut su, &ch, &sim.send_url(&ch), OPTIONS);
    let _guard = RoleSettingGuard(&cluster);
    let mut held = Vec::new();

    for (what, value) in [
        ("a superuser", "postgres".to_string()),
        ("a role that does not exist", unique("no_such_worker_role")),
    ] {
        let mark = cluster.log_mark();
        su.batch_execute(&format!(
            "ALTER SYSTEM SET outbox.role = {}",
            literal(&value)
        ))
        .unwrap_or_else(|e| panic!("ALTER SYSTEM SET outbox.role = {value}: {}", describe(&e)));
        su.batch_execute("SELECT pg_reload_conf()").unwrap();
        // The workers reload at their next loop.
        std::thread::sleep(Duration::from_millis(1500));
        let id: i64 = su
            .query_one(
                "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text)",
                &[&ch, &unique("ten_role_key")],
            )
            .expect("enqueue while outbox.role is wrong")
            .get(0);
        held.push(id);
        std::thread::sleep(LONG_QUIET);
        let state = state_of(&cluster, id);
        assert_eq!(
            state.as_deref(),
            Some("queued"),
            "with outbox.role = {value} ({what}) the worker must do nothing, but message {id} is {state:?} after {LONG_QUIET:?}"
        );
        assert_eq!(
            sim.send_count(&ch),
            0,
            "with outbox.role = {value} ({what}) the worker sent something"
        );
        let complaints = role_complaints(&cluster.log_since(mark));
        assert!(
            !complaints.is_empty() && complaints.len() <= workers,
            "with outbox.role = {value} ({what}) each of the {workers} workers should say so in the server log once (a line naming outbox.role) and not repeat it every loop; found {} lines:\n{}",
            complaints.len(),
            complaints.join("\n")
        );
    }

    su.batch_execute("ALTER SYSTEM RESET outbox.role").unwrap();
    su.batch_execute("SELECT pg_reload_conf()").unwrap();
    for id in held {
        wait_state(&cluster, id, "delivered");
    }
}

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

    const WRITERS: [&str; 11] = [
        "enqueue",
        "retry",
        "resolve",
        "cancel",
        "assign",
        "create_channel",
        "alter_channel",
        "pause_channel",
        "resume_channel",
        "bind_tenant",
        "unbind_tenant",
    ];
    for f in WRITERS {
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
