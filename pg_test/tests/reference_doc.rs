//! docs/reference.md covers the whole public surface, read from where it is defined: every
//! function, view and type of schema `outbox` whose name does not start with `_` (with a
//! `COMMENT` in the database), every column of those views, every channel option (the list
//! `create_channel` checks, read from src/channels/options.rs) and every `outbox.*` setting
//! (with a description). A new object, column, option or setting without its entry fails here.
//!
//! Run: `cargo test -p outbox_e2e --release --test reference_doc` (needs the test cluster).

use outbox_e2e::cluster::Cluster;
use outbox_e2e::helpers::source_list;
use std::path::PathBuf;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn reference() -> String {
    std::fs::read_to_string(repo().join("docs/reference.md")).expect("read docs/reference.md")
}

/// The part of `doc` under the heading `heading` (a whole line), up to the next heading of
/// the same or a higher level.
fn section<'a>(doc: &'a str, heading: &str) -> Option<&'a str> {
    let level = heading.chars().take_while(|c| *c == '#').count();
    let start = doc.find(&format!("\n{heading}\n"))? + heading.len() + 2;
    let rest = &doc[start..];
    let end = rest
        .match_indices("\n#")
        .find(|(at, _)| {
            let hashes = rest[at + 1..].chars().take_while(|c| *c == '#').count();
            hashes <= level && rest[at + 1 + hashes..].starts_with(' ')
        })
        .map_or(rest.len(), |(at, _)| at);
    Some(&rest[..end])
}

#[test]
fn every_public_object_option_and_setting_is_in_the_reference() {
    let doc = reference();
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let mut missing = Vec::new();

    // Functions (by name: overloads share an entry), views and types, each commented.
    let objects = c
        .query(
            "SELECT 'function', p.proname::text, bool_and(pg_catalog.obj_description(p.oid, 'pg_proc') IS NOT NULL)
               FROM pg_catalog.pg_proc p
              WHERE p.pronamespace = 'outbox'::regnamespace AND p.proname !~ '^_'
              GROUP BY p.proname
             UNION ALL
             SELECT 'view', c.relname::text, pg_catalog.obj_description(c.oid, 'pg_class') IS NOT NULL
               FROM pg_catalog.pg_class c
              WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind = 'v' AND c.relname !~ '^_'
             UNION ALL
             SELECT 'type', t.typname::text, pg_catalog.obj_description(t.oid, 'pg_type') IS NOT NULL
               FROM pg_catalog.pg_type t
              WHERE t.typnamespace = 'outbox'::regnamespace AND t.typtype IN ('e', 'd', 'c')
                AND t.typname !~ '^_'
                AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_class r
                                 WHERE r.oid = t.typrelid AND r.relkind <> 'c')
              ORDER BY 1, 2",
            &[],
        )
        .unwrap();
    assert!(
        objects.len() > 20,
        "the public objects of schema outbox: {}",
        objects.len()
    );
    for row in &objects {
        let (kind, name, commented): (String, String, bool) = (row.get(0), row.get(1), row.get(2));
        let documented = match kind.as_str() {
            "function" => {
                doc.contains(&format!("\n### {name}\n"))
                    || doc.contains(&format!("\n### {name}("))
                    || doc.contains(&format!("\n### {name} "))
            }
            "view" => section(&doc, &format!("### outbox.{name}")).is_some(),
            _ => section(&doc, "## Types").is_some_and(|s| s.contains(&format!("`outbox.{name}`"))),
        };
        if !documented {
            missing.push(format!("{kind} outbox.{name}: no entry"));
        }
        if !commented {
            missing.push(format!("{kind} outbox.{name}: no COMMENT"));
        }
    }

    // Every column of every public view, in its view's entry.
    let columns = c
        .query(
            "SELECT c.relname::text, a.attname::text
               FROM pg_catalog.pg_class c
               JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
              WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind = 'v' AND c.relname !~ '^_'
              ORDER BY 1, a.attnum",
            &[],
        )
        .unwrap();
    for row in &columns {
        let (view, column): (String, String) = (row.get(0), row.get(1));
        let Some(entry) = section(&doc, &format!("### outbox.{view}")) else {
            continue; // said above
        };
        if !entry.contains(&format!("`{column}`")) {
            missing.push(format!("view outbox.{view}: column {column} not described"));
        }
    }

    // Channel options, each a row of the options table.
    let options_table = section(&doc, "## Channel options").unwrap_or_default();
    let options = source_list("src/channels/options.rs", "KNOWN_KEYS");
    assert!(
        options.len() > 20,
        "options read from the source: {options:?}"
    );
    // The first cells of the table's rows (a row may name several options).
    let named: Vec<&str> = options_table
        .lines()
        .filter_map(|l| l.strip_prefix('|'))
        .filter_map(|l| l.split('|').next())
        .collect();
    for option in &options {
        if !named
            .iter()
            .any(|cell| cell.contains(&format!("`{option}`")))
        {
            missing.push(format!(
                "channel option {option}: no row in \"Channel options\""
            ));
        }
    }

    // Settings, each a row of the settings section, each described.
    let settings_section = section(&doc, "## Settings").unwrap_or_default();
    let settings = c
        .query(
            "SELECT name, coalesce(short_desc, '') <> '' FROM pg_catalog.pg_settings
              WHERE name LIKE 'outbox.%' ORDER BY name",
            &[],
        )
        .unwrap();
    assert!(settings.len() > 10, "outbox.* settings: {}", settings.len());
    for row in &settings {
        let (name, described): (String, bool) = (row.get(0), row.get(1));
        if !settings_section.contains(&format!("`{name}`")) {
            missing.push(format!("setting {name}: not in \"Settings\""));
        }
        if !described {
            missing.push(format!("setting {name}: no description"));
        }
    }

    assert!(
        missing.is_empty(),
        "docs/reference.md and the COMMENTs miss {} entries:\n{}",
        missing.len(),
        missing.join("\n")
    );
}
