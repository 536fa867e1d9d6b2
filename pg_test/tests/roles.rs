//! The extension's roles and the tenant bindings belong to the roles they were made for.
//!
//! 1. A binding holds the role itself: a role dropped and created again under the same
//!    name is another role, bound to nothing; `unbind_tenant` still removes what the dropped
//!    role left.
//! 2. `CREATE EXTENSION` does not adopt a role of its names that it did not create and that
//!    has members, memberships or attributes (whoever made it would get the rights the
//!    extension gives it); a bare one is adopted. A role of ours that gained an attribute the
//!    extension never gives (LOGIN) is refused too. Each refusal is 42710 with a hint, and
//!    leaves nothing behind.
//!
//! Run: `cargo test -p outbox_e2e --release --test roles`.

use outbox_e2e::cluster::{unique, Cluster};
use outbox_e2e::helpers::{code_of, count, ident, serial, session_as};
use postgres::{Client, NoTls};

#[test]
fn a_new_role_with_a_dropped_role_name_inherits_no_binding() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut su = cluster.connect();
    let (role, tenant) = (unique("rb_app"), unique("rb_t"));
    let create = format!("CREATE ROLE {} NOLOGIN IN ROLE outbox_writer", ident(&role));
    su.batch_execute(&create).expect("role");
    su.execute("SELECT outbox.bind_tenant($1, $2)", &[&role, &tenant])
        .expect("bind");
    su.batch_execute(&format!("DROP ROLE {}", ident(&role)))
        .expect("a bound role can be dropped");
    su.batch_execute(&create).expect("the same name again");

    let mut app = session_as(&cluster, &role);
    let e = app
        .query_one("SELECT outbox.enqueue('x', '{}'::jsonb, 'k')", &[])
        .expect_err("the new role is bound to no tenant");
    assert_eq!(code_of(&e), "42501", "{e:?}");
    let visible: Vec<String> = app
        .query_one("SELECT outbox._visible_tenants()", &[])
        .expect("visible")
        .get(0);
    assert!(visible.is_empty(), "the new role sees tenants {visible:?}");

    su.execute("SELECT outbox.unbind_tenant($1, $2)", &[&role, &tenant])
        .expect("unbind what the dropped role left");
    let left = count(
        &mut su,
        "SELECT count(*) FROM outbox._tenant_bindings WHERE tenant = $1",
        &[&tenant],
    );
    assert_eq!(left, 0);
    su.batch_execute(&format!("DROP ROLE {}", ident(&role)))
        .expect("drop");
}

/// A database of its own for a `CREATE EXTENSION`, dropped with whatever was changed on
/// the roles when the test ends (also when it fails).
struct Scratch<'a> {
    cluster: &'a Cluster,
    db: String,
    undo: Vec<String>,
}

impl<'a> Scratch<'a> {
    fn new(cluster: &'a Cluster) -> Scratch<'a> {
        let db = unique("roles_db");
        cluster
            .connect()
            .batch_execute(&format!("CREATE DATABASE {}", ident(&db)))
            .expect("create database");
        Scratch {
            cluster,
            db,
            undo: Vec::new(),
        }
    }

    /// Runs `change` now and `undo` when the test ends.
    fn change(&mut self, su: &mut Client, change: &str, undo: &str) {
        su.batch_execute(change).expect(change);
        self.undo.push(undo.to_string());
    }

    fn undo_all(&mut self, su: &mut Client) {
        for undo in self.undo.drain(..).rev() {
            su.batch_execute(&undo).expect(&undo);
        }
    }

    fn create_extension(&self) -> Result<(), postgres::Error> {
        let conninfo = self.cluster.conninfo().replace(
            &format!("dbname={}", self.cluster.db),
            &format!("dbname={}", self.db),
        );
        let mut c = Client::connect(&conninfo, NoTls).expect("connect to the scratch database");
        let result = c.batch_execute("CREATE EXTENSION outbox_delivery");
        if result.is_ok() {
            c.batch_execute("DROP EXTENSION outbox_delivery")
                .expect("drop extension");
        }
        result
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        let mut su = self.cluster.connect();
        for undo in self.undo.drain(..).rev() {
            let _ = su.batch_execute(&undo);
        }
        let _ = su.batch_execute(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            ident(&self.db)
        ));
    }
}

fn marker(su: &mut Client, role: &str) -> Option<String> {
    su.query_one(
        "SELECT shobj_description(oid, 'pg_authid') FROM pg_roles WHERE rolname = $1",
        &[&role],
    )
    .expect("comment")
    .get(0)
}

#[test]
fn create_extension_refuses_roles_it_did_not_make_or_that_gained_attributes() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let mut su = cluster.connect();
    let ours = marker(&mut su, "outbox_worker").expect("the extension marks the roles it creates");
    let mut scratch = Scratch::new(&cluster);
    scratch
        .create_extension()
        .expect("our own roles are reused");

    // A role of our name that someone else made, with a member: refused.
    let member = unique("rb_member");
    let restore = format!(
        "COMMENT ON ROLE outbox_worker IS '{}'",
        ours.replace('\'', "''")
    );
    scratch.change(&mut su, "COMMENT ON ROLE outbox_worker IS NULL", &restore);
    scratch.change(
        &mut su,
        &format!(
            "CREATE ROLE {} NOLOGIN IN ROLE outbox_worker",
            ident(&member)
        ),
        &format!("DROP ROLE IF EXISTS {}", ident(&member)),
    );
    let e = scratch
        .create_extension()
        .expect_err("a foreign outbox_worker with a member");
    assert_eq!(code_of(&e), "42710", "{e:?}");
    let db = e.as_db_error().expect("a server error");
    assert!(
        db.message().contains("outbox_worker") && db.message().contains("members"),
        "{}",
        db.message()
    );
    assert!(
        db.hint().is_some_and(|h| h.contains("outbox_worker")),
        "{:?}",
        db.hint()
    );
    assert_eq!(
        marker(&mut su, "outbox_worker"),
        None,
        "the refusal changed the role"
    );

    // The same role bare: adopted, and marked as ours.
    su.batch_execute(&format!("DROP ROLE {}", ident(&member)))
        .expect("drop member");
    scratch
        .create_extension()
        .expect("a bare role of our name is adopted");
    assert_eq!(
        marker(&mut su, "outbox_worker").as_deref(),
        Some(ours.as_str())
    );

    // One of ours that can log in now: refused.
    scratch.change(
        &mut su,
        "ALTER ROLE outbox_writer LOGIN",
        "ALTER ROLE outbox_writer NOLOGIN",
    );
    let e = scratch
        .create_extension()
        .expect_err("outbox_writer with LOGIN");
    assert_eq!(code_of(&e), "42710", "{e:?}");
    assert!(
        e.as_db_error()
            .is_some_and(|d| d.message().contains("LOGIN")),
        "{e:?}"
    );
    scratch.undo_all(&mut su);
    scratch
        .create_extension()
        .expect("the roles as the extension made them");
}
