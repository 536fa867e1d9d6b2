//! End-to-end tests of releases: the upgrade from every released version (built from its
//! recorded commit) to this one, the schema check that an upgrade equals a fresh install,
//! pg_dump and pg_restore into a database the worker serves, and the Debian package.
//!
//! Each test runs clusters of its own on private copies of PostgreSQL
//! (`outbox_e2e::releases`), except the package test, which installs into the system
//! PostgreSQL 15 under its lock. Run with `--test-threads=1`.

use outbox_e2e::cluster::{poll, wait_until, Cluster};
use outbox_e2e::helpers::{count, create_channel, describe, enqueue, set_setting, SETTLE};
use outbox_e2e::releases::{
    assert_same_schema, current_package, library_version, release_tree, released_versions, Prefix,
    ReleaseCluster,
};
use outbox_e2e::sim::{Action, Simulator};
use postgres::Client;
use std::time::Duration;

mod dump_restore;
mod package;
mod population;
mod schema;
mod upgrade;

/// The version of the extension installed in the connected database.
fn extversion(c: &mut Client) -> String {
    c.query_one(
        "SELECT extversion FROM pg_extension WHERE extname = 'outbox_delivery'",
        &[],
    )
    .expect("extversion")
    .get(0)
}

/// Every `state` of a message, read with a fresh connection each time (survives restarts).
fn wait_for_message_state(cluster: &Cluster, id: i64, state: &str, timeout: Duration) {
    let seen = poll(cluster, timeout, |c| {
        let s: Option<String> = c
            .query_one("SELECT outbox.status($1)::text", &[&id])?
            .get(0);
        Ok((s.as_deref() == Some(state)).then_some(()))
    });
    if seen.is_none() {
        let last: Option<String> = cluster
            .connect()
            .query_one("SELECT outbox.status($1)::text", &[&id])
            .ok()
            .and_then(|r| r.get(0));
        panic!(
            "message {id} did not become {state} within {timeout:?} (last: {last:?}); see {}",
            cluster.log_path().display()
        );
    }
}
