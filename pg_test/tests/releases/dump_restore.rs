//! pg_dump of a database that uses the extension, and pg_restore into a new database that
//! the worker then serves: every row comes along once, and the promises hold after it.

use super::population::{
    assert_delivers_as_promised, assert_rows_kept, maxima, populate, release_hold, rows, TABLES,
};
use super::*;

/// The tables and sequences of the extension that pg_dump would leave out (not registered
/// with `pg_extension_config_dump`). A partitioned table holds no rows of its own: its
/// partitions are registered and dumped (the generations of the ledger).
const NOT_DUMPED: &str = "
    SELECT c.oid::regclass::text
      FROM pg_catalog.pg_depend d
      JOIN pg_catalog.pg_extension e ON e.oid = d.refobjid
      JOIN pg_catalog.pg_class c ON c.oid = d.objid
     WHERE d.classid = 'pg_catalog.pg_class'::regclass
       AND d.refclassid = 'pg_catalog.pg_extension'::regclass
       AND d.deptype = 'e'
       AND e.extname = 'outbox_delivery'
       AND c.relkind IN ('r', 'S')
       AND c.oid <> ALL (coalesce(e.extconfig, '{}'))
     ORDER BY 1";

/// The tables of the extension.
const EXTENSION_TABLES: &str = "
    SELECT c.relname::text
      FROM pg_catalog.pg_depend d
      JOIN pg_catalog.pg_class c ON c.oid = d.objid
     WHERE d.classid = 'pg_catalog.pg_class'::regclass
       AND d.refobjid = (SELECT oid FROM pg_catalog.pg_extension WHERE extname = 'outbox_delivery')
       AND d.deptype = 'e'
       AND c.relkind IN ('r', 'p')
     ORDER BY 1";

/// `last_value` of every sequence of the extension.
const SEQUENCES: &str = "
    SELECT sequencename::text, last_value FROM pg_catalog.pg_sequences
     WHERE schemaname = 'outbox' ORDER BY 1";

fn sequences(c: &mut Client) -> Vec<(String, Option<i64>)> {
    c.query(SEQUENCES, &[])
        .expect("sequences")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Every table of the extension is registered for pg_dump, and the test compares them all.
fn assert_every_table_and_sequence_is_dumped(c: &mut Client) {
    let missing: Vec<String> = c
        .query(NOT_DUMPED, &[])
        .expect("config dump check")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        missing.is_empty(),
        "not registered with pg_extension_config_dump: {missing:?}"
    );
    let mut tables: Vec<String> = c
        .query(EXTENSION_TABLES, &[])
        .expect("extension tables")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut compared: Vec<String> = TABLES.iter().map(|t| t.to_string()).collect();
    tables.sort();
    compared.sort();
    assert_eq!(tables, compared, "the tables whose rows the tests compare");
}

/// The partitioned tables of the extension: the archive holds their partitions' rows.
const PARTITIONED: [&str; 1] = ["_ledger"];

/// The archive holds the rows of each table, and the value of each sequence, exactly once.
fn assert_each_table_data_once(toc: &str, seqs: &[(String, Option<i64>)]) {
    for table in TABLES.iter().filter(|t| !PARTITIONED.contains(t)) {
        let entries = toc
            .lines()
            .filter(|l| l.contains(&format!("TABLE DATA outbox {table} ")))
            .count();
        assert_eq!(entries, 1, "TABLE DATA of {table} in the archive:\n{toc}");
    }
    for (seq, _) in seqs {
        let entries = toc
            .lines()
            .filter(|l| l.contains(&format!("SEQUENCE SET outbox {seq} ")))
            .count();
        assert_eq!(entries, 1, "SEQUENCE SET of {seq} in the archive:\n{toc}");
    }
}

#[test]
fn dump_and_restore_into_a_served_database_keeps_every_row_and_promise() {
    let prefix = Prefix::create("dump");
    prefix.install(&current_package().tree);
    let mut rc = ReleaseCluster::fresh("dump", 2, &prefix.bindir());
    rc.cluster.db = "src".into();
    rc.start();
    let population = populate(&rc);
    let mut src = rc.cluster.connect();
    assert_every_table_and_sequence_is_dumped(&mut src);
    let before = rows(&mut src);
    let seqs_before = sequences(&mut src);
    let ids_before = maxima(&mut src);

    // Dump; restore into a new database in one transaction (no worker sees half of it).
    let file = rc.cluster.base.join("src.dump");
    let file = file.to_string_lossy();
    rc.run_pg("pg_dump", &["-d", "src", "-Fc", "-f", &file]);
    assert_each_table_data_once(&rc.run_pg("pg_restore", &["-l", &file]), &seqs_before);
    src.batch_execute("CREATE DATABASE app")
        .expect("CREATE DATABASE");
    let out = rc.run_pg(
        "pg_restore",
        &[
            "-d",
            "app",
            "--single-transaction",
            "--exit-on-error",
            &file,
        ],
    );
    assert!(
        !out.to_lowercase().contains("error"),
        "pg_restore reported:\n{out}"
    );

    let mut app = rc.connect_to("app");
    let restored = rows(&mut app);
    assert_eq!(before, restored, "every row restored once, unchanged");
    assert_rows_kept(&before, &restored, "restore");
    let secret: String = app
        .query_one(
            "SELECT options -> 'headers' ->> 'Authorization' FROM outbox._channels WHERE name = 'ok'",
            &[],
        )
        .expect("channel secret")
        .get(0);
    assert_eq!(
        secret,
        super::population::SECRET,
        "the channel keeps its secret"
    );
    assert_eq!(
        sequences(&mut app),
        seqs_before,
        "the sequences continue where they were"
    );
    drop(app);

    // Serve the restored database.
    release_hold(&mut src);
    src.batch_execute("ALTER SYSTEM SET outbox.database = 'app'")
        .expect("ALTER SYSTEM");
    drop(src);
    rc.stop("fast");
    rc.cluster.db = "app".into();
    rc.start();
    rc.cluster.wait_for_worker();
    assert_delivers_as_promised(&rc.cluster, &population, &ids_before);
}
