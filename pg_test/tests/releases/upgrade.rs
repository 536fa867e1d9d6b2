//! The upgrade of a running installation: every released version, built from its recorded
//! commit and populated with something in every state, is stopped, replaced by this build,
//! started and updated with `ALTER EXTENSION outbox_delivery UPDATE`.

use super::population::{
    assert_delivers_as_promised, assert_rows_kept, maxima, populate, release_hold, rows, state,
};
use super::*;

/// The worker's message while the database is on an older schema (said once).
const WAITING: &str = "delivering nothing until they match";

#[test]
fn every_release_upgrades_in_place_keeping_every_row_and_promise() {
    let current = current_package();
    for version in released_versions() {
        if version != library_version() {
            upgrade_from(&version, &current.tree);
        }
    }
}

fn upgrade_from(version: &str, current_tree: &std::path::Path) {
    let prefix = Prefix::create("upgrade");
    prefix.install(&release_tree(version));
    let rc = ReleaseCluster::fresh("upgrade", 1, &prefix.bindir());
    rc.start();
    let mut c = rc.cluster.connect();
    assert_eq!(extversion(&mut c), version, "the old release is installed");
    let population = populate(&rc);
    let mut c = rc.cluster.connect();
    let before = rows(&mut c);
    let ids_before = maxima(&mut c);
    release_hold(&mut c);
    drop(c);

    // Stop, install this build over it, start: the worker waits for the update.
    rc.stop("fast");
    prefix.install(current_tree);
    let mark = rc.cluster.log_mark();
    rc.start();
    let mut c = rc.cluster.connect();
    assert_eq!(
        extversion(&mut c),
        version,
        "nothing is updated by a restart"
    );
    let waiting = wait_until(SETTLE, || rc.cluster.log_since(mark).contains(WAITING));
    assert!(
        waiting,
        "the worker did not say what it waits for; see {}",
        rc.cluster.log_path().display()
    );
    std::thread::sleep(Duration::from_millis(5000));
    let log = rc.cluster.log_since(mark);
    assert_eq!(
        log.matches(WAITING).count(),
        1,
        "said once, not at every poll:\n{log}"
    );
    assert!(
        !log.contains("restarting") && !log.contains("exited with exit code"),
        "the worker did not crash-loop:\n{log}"
    );
    let shown: String = c
        .query_one(
            "SELECT state FROM outbox.worker_status() WHERE pid IS NOT NULL",
            &[],
        )
        .expect("worker_status")
        .get(0);
    assert_eq!(shown, "waiting for extension update");
    for (id, _) in &population.queued {
        assert_eq!(
            state(&mut c, *id),
            "queued",
            "nothing is sent before the update"
        );
    }
    assert_eq!(
        population.sim.sends("ok").len(),
        2,
        "only the two messages delivered before"
    );

    // The update keeps every row; the worker starts delivering without a restart.
    let mut tx = c.transaction().expect("BEGIN");
    tx.batch_execute("ALTER EXTENSION outbox_delivery UPDATE")
        .unwrap_or_else(|e| panic!("ALTER EXTENSION UPDATE from {version}: {}", describe(&e)));
    let after = rows(&mut tx);
    tx.commit().expect("COMMIT");
    assert_eq!(extversion(&mut c), library_version());
    assert_rows_kept(&before, &after, &format!("update from {version}"));
    assert_delivers_as_promised(&rc.cluster, &population, &ids_before);
    let log = rc.cluster.log_since(mark);
    assert!(
        log.contains(&format!(
            "is on schema version {} now; delivering",
            library_version()
        )),
        "the worker says when it starts delivering:\n{log}"
    );

    // The schema equals a fresh install's.
    c.batch_execute("CREATE DATABASE fresh")
        .expect("CREATE DATABASE");
    rc.connect_to("fresh")
        .batch_execute("CREATE EXTENSION outbox_delivery")
        .expect("CREATE EXTENSION");
    assert_same_schema(
        &rc.schema("fresh"),
        "a fresh install",
        &rc.schema("app"),
        &format!("a database updated from {version} after use"),
    );
}
