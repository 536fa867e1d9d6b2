//! The schema of the extension in one database, as comparable text: what the upgrade check
//! compares between a fresh install and a database installed at a released version and
//! updated.
//!
//! A plain `pg_dump --schema-only` writes only `CREATE EXTENSION` for an extension's objects.
//! `--binary-upgrade` (the mode pg_upgrade uses) writes every member object instead: tables
//! with their columns in order, indexes, constraints, functions with their bodies, views,
//! policies, triggers, enum labels, grants, comments, and the `ALTER EXTENSION … ADD` of each.
//! What differs between two databases with the same schema is removed by [`normalize`]:
//! OIDs, catalog fix-ups, the placeholders of dropped columns, the values of sequences, and
//! the order of the entries. Which tables and
//! sequences `pg_dump` dumps the rows of (`pg_extension_config_dump`) is added from the
//! catalog, by name.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// The config tables and sequences of the extension with their dump conditions, by name.
pub const CONFIG_DUMP: &str = "
    SELECT format('config_dump %s %L', c.oid::regclass, u.condition)
      FROM pg_catalog.pg_extension e,
           unnest(e.extconfig, e.extcondition) AS u(relid, condition)
      JOIN pg_catalog.pg_class c ON c.oid = u.relid
     WHERE e.extname = 'outbox_delivery'
     ORDER BY 1";

/// `pg_dump --schema-only --binary-upgrade` of `db` on the server at `host` (a socket
/// directory) and `port`, as the `postgres` user; panics with pg_dump's error.
pub fn binary_upgrade_dump(pgbin: &Path, host: &Path, port: u16, db: &str) -> String {
    let out = Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(pgbin.join("pg_dump"))
        .arg("-h")
        .arg(host)
        .args(["-p", &port.to_string(), "-d", db])
        .args(["--schema-only", "--binary-upgrade"])
        .output()
        .expect("run pg_dump");
    assert!(
        out.status.success(),
        "pg_dump of {db} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// One dump entry per element, each normalized: the comparable schema.
pub type Schema = BTreeSet<String>;

/// Normalizes a `--binary-upgrade` schema dump into its entries (see the module docs).
/// `extra` lines (the [`CONFIG_DUMP`] rows) are entries of their own.
pub fn normalize(dump: &str, extra: &[String]) -> Schema {
    let mut entries = Schema::new();
    for entry in split_entries(dump) {
        // The value of a sequence is data (pg_dump writes it for the config sequences even
        // with --schema-only), not schema.
        if entry
            .lines()
            .next()
            .is_some_and(|l| l.contains("; Type: SEQUENCE SET;"))
        {
            continue;
        }
        let text = normalize_entry(&entry);
        if !text.trim().is_empty() {
            entries.insert(text);
        }
    }
    entries.extend(extra.iter().cloned());
    entries
}

/// The dump cut at each entry's `-- Name: …` header (the header starts the entry).
fn split_entries(dump: &str) -> Vec<String> {
    let mut entries = vec![String::new()];
    for line in dump.lines() {
        if line.starts_with("-- Name: ") || line.starts_with("-- Data for Name: ") {
            entries.push(String::new());
        }
        if let Some(last) = entries.last_mut() {
            last.push_str(line);
            last.push('\n');
        }
    }
    entries
}

fn normalize_entry(entry: &str) -> String {
    let mut out = Vec::new();
    let mut skipping_attribute_fix = false;
    for line in entry.lines() {
        // Fix-ups of catalog rows (a dropped column's pg_attribute row, a table's frozen xid
        // in pg_class) span lines up to their `;`.
        if line.starts_with("UPDATE pg_catalog.") {
            skipping_attribute_fix = true;
        }
        if skipping_attribute_fix {
            skipping_attribute_fix = !line.trim_end().ends_with(';');
            continue;
        }
        if is_noise(line) {
            continue;
        }
        let line = without_oid_arrays(line);
        // A column list loses its last comma when a dropped column after it is removed.
        out.push(line.trim_end().trim_end_matches(',').to_string());
    }
    out.join("\n")
}

/// Lines that differ between two databases with the same schema, or that say nothing.
fn is_noise(line: &str) -> bool {
    let t = line.trim();
    t.is_empty()
        || t == "--"
        || (t.starts_with("--") && !t.starts_with("-- Name: "))
        || t.starts_with("SELECT pg_catalog.binary_upgrade_set_")
        || t.contains("........pg.dropped.")
        || t.starts_with("SET ")
        || t.starts_with("SELECT pg_catalog.set_config(")
        || t.starts_with("\\restrict ")
        || t.starts_with("\\unrestrict ")
}

/// `binary_upgrade_create_empty_extension` carries the config tables as an OID array:
/// compared by name through [`CONFIG_DUMP`] instead.
fn without_oid_arrays(line: &str) -> String {
    if !line.contains("binary_upgrade_create_empty_extension") {
        return line.to_string();
    }
    let mut out = String::new();
    let mut rest = line;
    while let Some(start) = rest.find("'{") {
        let Some(len) = rest[start..].find("}'") else {
            break;
        };
        let inner = &rest[start + 2..start + len];
        out.push_str(&rest[..start]);
        if !inner.is_empty() && inner.chars().all(|c| c.is_ascii_digit() || c == ',') {
            out.push_str("'{<oids>}'");
        } else {
            out.push_str(&rest[start..start + len + 2]);
        }
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    out
}

/// The entries only in `a` and only in `b`, for a failure message.
pub fn difference(a: &Schema, b: &Schema) -> (Vec<String>, Vec<String>) {
    (
        a.difference(b).cloned().collect(),
        b.difference(a).cloned().collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const FRESH: &str = "\
--
-- PostgreSQL database dump
--
SET statement_timeout = 0;
SELECT pg_catalog.set_config('search_path', '', false);

--
-- Name: outbox_delivery; Type: EXTENSION; Schema: -; Owner: -
--

SELECT pg_catalog.binary_upgrade_create_empty_extension('outbox_delivery', 'outbox', false, '0.2.0', '{16390,16402}', '{\"\",\"\"}', ARRAY[]::pg_catalog.text[]);

--
-- Name: _messages; Type: TABLE; Schema: outbox; Owner: postgres
--

-- For binary upgrade, must preserve pg_type oid
SELECT pg_catalog.binary_upgrade_set_next_pg_type_oid('16392'::pg_catalog.oid);
CREATE TABLE outbox._messages (
    id bigint NOT NULL,
    state text
);
ALTER EXTENSION outbox_delivery ADD TABLE outbox._messages;
";

    const UPGRADED: &str = "\
\\restrict AeenmsDhjbBsJbTQD9O0duf3bDi0C
--
-- Name: _messages; Type: TABLE; Schema: outbox; Owner: postgres
--

SELECT pg_catalog.binary_upgrade_set_next_pg_type_oid('17001'::pg_catalog.oid);
CREATE TABLE outbox._messages (
    id bigint NOT NULL,
    state text,
    \"........pg.dropped.3........\" integer
);

-- For binary upgrade, recreate dropped column.
UPDATE pg_catalog.pg_attribute
SET attlen = 4, attalign = 'i', attbyval = false
WHERE attname = '........pg.dropped.3........'
  AND attrelid = '\"outbox\".\"_messages\"'::pg_catalog.regclass;
ALTER TABLE ONLY outbox._messages DROP COLUMN \"........pg.dropped.3........\";

-- For binary upgrade, set heap's relfrozenxid and relminmxid
UPDATE pg_catalog.pg_class
SET relfrozenxid = '743', relminmxid = '1'
WHERE oid = 'outbox._messages'::pg_catalog.regclass;
ALTER EXTENSION outbox_delivery ADD TABLE outbox._messages;

--
-- Name: outbox_delivery; Type: EXTENSION; Schema: -; Owner: -
--

SELECT pg_catalog.binary_upgrade_create_empty_extension('outbox_delivery', 'outbox', false, '0.2.0', '{17010,17020}', '{\"\",\"\"}', ARRAY[]::pg_catalog.text[]);
";

    #[test]
    fn oids_dropped_columns_settings_and_order_do_not_count() {
        assert_eq!(normalize(FRESH, &[]), normalize(UPGRADED, &[]));
    }

    #[test]
    fn sequence_values_do_not_count() {
        let used = format!(
            "{FRESH}\n--\n-- Name: _messages_id_seq; Type: SEQUENCE SET; Schema: outbox; Owner: postgres\n--\n\n\
             SELECT pg_catalog.setval('outbox._messages_id_seq', 37, true);\n"
        );
        assert_eq!(normalize(&used, &[]), normalize(FRESH, &[]));
    }

    #[test]
    fn a_column_of_another_type_or_a_missing_object_counts() {
        let changed = FRESH.replace("state text", "state varchar");
        assert_ne!(normalize(&changed, &[]), normalize(FRESH, &[]));
        let missing = FRESH.replace(
            "ALTER EXTENSION outbox_delivery ADD TABLE outbox._messages;",
            "",
        );
        assert_ne!(normalize(&missing, &[]), normalize(FRESH, &[]));
    }

    #[test]
    fn column_order_counts() {
        let swapped = FRESH.replace(
            "    id bigint NOT NULL,\n    state text\n",
            "    state text,\n    id bigint NOT NULL\n",
        );
        assert_ne!(normalize(&swapped, &[]), normalize(FRESH, &[]));
    }

    #[test]
    fn config_dump_rows_are_entries_of_their_own() {
        let a = normalize(FRESH, &["config_dump outbox._messages ''".to_string()]);
        let b = normalize(FRESH, &[]);
        let (only_a, only_b) = difference(&a, &b);
        assert_eq!(only_a, vec!["config_dump outbox._messages ''".to_string()]);
        assert!(only_b.is_empty());
    }

    #[test]
    fn only_oid_arrays_are_masked_in_the_extension_entry() {
        let line = "SELECT pg_catalog.binary_upgrade_create_empty_extension('x', 'outbox', false, '0.2.0', '{1,2}', '{\"a\"}', ARRAY[]);";
        assert_eq!(
            without_oid_arrays(line),
            "SELECT pg_catalog.binary_upgrade_create_empty_extension('x', 'outbox', false, '0.2.0', '{<oids>}', '{\"a\"}', ARRAY[]);"
        );
    }
}
