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
//!     tenant tables, `security_invoker` views, NOLOGIN roles;
//! 11. a tenant named per transaction (`SET LOCAL outbox.tenant`, as under a
//!     transaction-mode pooler) works everywhere `SET outbox.tenant` does, and ends with its
//!     transaction.
//!
//! Run: `cargo test -p outbox_e2e --release --test tenancy`.
//!
//! Roles act through `SET ROLE` on a superuser connection (the roles are NOLOGIN). Every
//! role, tenant, channel and key has a unique name, so the tests rerun on the same cluster;
//! the roles are dropped (after their bindings are removed) when a test ends, also when it
//! fails. The tests take one lock, so they run one at a time whatever `--test-threads`
//! says: test 7 plants a trigger on `outbox._messages` and test 9 stops the workers.

use outbox_e2e::cluster::{state_of, unique, wait_for_state, wait_for_workers, Cluster};
use outbox_e2e::helpers::{
    code_of, count, create_channel, describe, ident, one, serial, session_as, try_enqueue_payload,
    wait_state, Params, SETTLE,
};
use outbox_e2e::sim::{Action, Simulator};
use postgres::types::ToSql;
use postgres::{Client, NoTls};
use std::sync::MutexGuard;
use std::time::Duration;

// The tests, by area (numbered as above).
mod bindings;
mod catalog;
mod choice;
mod hostile_names;
mod isolation;
mod per_transaction;
mod privileges;
mod shared_channels;
mod worker_role;

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

/// The functions that administer channels and tenant bindings: outbox_admin's alone among
/// the extension's roles, and SECURITY DEFINER.
const ADMINISTRATION: [&str; 6] = [
    "create_channel",
    "alter_channel",
    "pause_channel",
    "resume_channel",
    "bind_tenant",
    "unbind_tenant",
];

/// How every test here starts: the lock that runs them one at a time, the cluster, and a
/// superuser connection.
fn start() -> (MutexGuard<'static, ()>, Cluster, Client) {
    let serial = serial();
    let cluster = Cluster::from_env();
    let su = cluster.connect();
    (serial, cluster, su)
}

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
    c.query_opt("SELECT tenant FROM outbox.messages WHERE id = $1", &[&id])
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
