//! The schema check: the SQL this version generates must equal every released version's
//! frozen install script followed by the upgrade scripts. Fails, listing the difference,
//! when the SQL surface changed and no upgrade script covers the change.

use super::*;
use outbox_e2e::releases::{repo_root, script_entities};

/// A cluster on a private PostgreSQL with this version's package installed.
fn current_cluster(name: &str, offset: u16) -> (Prefix, ReleaseCluster) {
    let prefix = Prefix::create(name);
    prefix.install(&current_package().tree);
    let rc = ReleaseCluster::fresh(name, offset, &prefix.bindir());
    rc.start();
    (prefix, rc)
}

#[test]
fn upgraded_schema_of_every_release_equals_a_fresh_install() {
    let (_prefix, rc) = current_cluster("schema", 0);
    let mut c = rc.cluster.connect();
    assert_eq!(
        extversion(&mut c),
        library_version(),
        "a fresh install is the current version"
    );
    let fresh = rc.schema("app");
    let versions = released_versions();
    assert!(!versions.is_empty(), "no released install script in sql/");
    for version in versions {
        let db = format!("from_{}", version.replace('.', "_"));
        c.batch_execute(&format!("CREATE DATABASE {db}"))
            .expect("CREATE DATABASE");
        let mut u = rc.connect_to(&db);
        u.batch_execute(&format!(
            "CREATE EXTENSION outbox_delivery VERSION '{version}'"
        ))
        .unwrap_or_else(|e| panic!("CREATE EXTENSION VERSION '{version}': {}", describe(&e)));
        assert_eq!(extversion(&mut u), version);
        u.batch_execute("ALTER EXTENSION outbox_delivery UPDATE")
            .unwrap_or_else(|e| panic!("ALTER EXTENSION UPDATE from {version}: {}", describe(&e)));
        assert_eq!(extversion(&mut u), library_version());
        assert_same_schema(
            &fresh,
            "a fresh install",
            &rc.schema(&db),
            &format!("{version} updated"),
        );
    }
}

#[test]
fn update_to_an_unknown_version_fails_and_changes_nothing() {
    let (_prefix, rc) = current_cluster("schema", 0);
    let mut c = rc.cluster.connect();
    let before = rc.schema("app");
    let err = c
        .batch_execute("ALTER EXTENSION outbox_delivery UPDATE TO '9.9.9'")
        .expect_err("there is no version 9.9.9");
    let db = err.as_db_error().expect("a server error");
    assert_eq!(db.code().code(), "22023", "{}", describe(&err));
    assert!(
        db.message().contains("9.9.9") && db.message().contains("outbox_delivery"),
        "PostgreSQL names the extension and the version: {}",
        describe(&err)
    );
    assert_eq!(
        extversion(&mut c),
        library_version(),
        "the version is unchanged"
    );
    assert_same_schema(
        &before,
        "before",
        &rc.schema("app"),
        "after the refused update",
    );
}

#[test]
fn frozen_install_script_of_every_release_is_what_its_commit_generates() {
    for version in released_versions() {
        let name = format!("outbox_delivery--{version}.sql");
        let frozen = repo_root().join("sql").join(&name);
        let built = release_tree(&version)
            .join("usr/share/postgresql/15/extension")
            .join(&name);
        let frozen_text = std::fs::read_to_string(&frozen).expect("frozen script");
        let built_text =
            std::fs::read_to_string(&built).unwrap_or_else(|e| panic!("{}: {e}", built.display()));
        assert!(
            script_entities(&frozen_text) == script_entities(&built_text),
            "sql/{name} is not what {version}'s commit generates ({}): a released script never changes",
            built.display()
        );
    }
}
