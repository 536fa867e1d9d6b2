//! The schema version of the worker's database against the version of this library.
//!
//! A new library is installed and the server restarted before `ALTER EXTENSION
//! outbox_delivery UPDATE` runs: until then the database's SQL objects are those of the older
//! release, and the worker's statements are written for the new one. The worker therefore
//! waits (one cheap catalog lookup per poll), says once what it waits for, and starts
//! delivering when the update has run, without a restart. It waits too for a schema newer
//! than the library (a library that was rolled back): it never runs statements written for
//! another schema.

use crate::worker_slots as slots;
use pgrx::bgworkers::BackgroundWorker;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use std::cmp::Ordering;

/// The schema version this library's statements are written for.
pub const LIBRARY_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The version of the extension installed in the worker's database (NULL when there is none).
const INSTALLED_VERSION: &str = "SELECT extversion FROM pg_catalog.pg_extension WHERE extname = $1";

/// How the database's schema version stands to the library's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchemaMatch {
    /// The same version: the worker delivers.
    Current,
    /// An older release: waits for `ALTER EXTENSION … UPDATE`.
    Older,
    /// A newer release than the library: waits for the matching library.
    Newer,
    /// A version that is not dotted numbers: waits, never guesses.
    Unreadable,
}

/// Compares an installed schema version with the library's (dotted numbers, `0.10.0` after
/// `0.9.0`; a missing part counts as 0, so `1.2` equals `1.2.0`).
pub fn compare(installed: &str, library: &str) -> SchemaMatch {
    match (numbers(installed), numbers(library)) {
        (Some(i), Some(l)) => match cmp_parts(&i, &l) {
            Ordering::Equal => SchemaMatch::Current,
            Ordering::Less => SchemaMatch::Older,
            Ordering::Greater => SchemaMatch::Newer,
        },
        _ if installed == library => SchemaMatch::Current,
        _ => SchemaMatch::Unreadable,
    }
}

fn numbers(version: &str) -> Option<Vec<u64>> {
    version.split('.').map(|p| p.parse::<u64>().ok()).collect()
}

fn cmp_parts(a: &[u64], b: &[u64]) -> Ordering {
    let len = a.len().max(b.len());
    let at = |v: &[u64], i: usize| v.get(i).copied().unwrap_or(0);
    (0..len)
        .map(|i| at(a, i).cmp(&at(b, i)))
        .find(|o| o.is_ne())
        .unwrap_or(Ordering::Equal)
}

/// What the worker says, once per installed version it waits on: message, detail and hint.
pub fn waiting_report(installed: &str, verdict: SchemaMatch) -> (String, String, &'static str) {
    let message = format!(
        "outbox_delivery worker: the database is on schema version {installed}, the library is version {LIBRARY_VERSION}; delivering nothing until they match"
    );
    let (detail, hint) = match verdict {
        SchemaMatch::Older | SchemaMatch::Current => (
            format!("The library {LIBRARY_VERSION} was installed over {installed} and the extension is not updated yet. Queued messages stay queued."),
            "Run ALTER EXTENSION outbox_delivery UPDATE in that database; the worker starts delivering within seconds, without a restart.",
        ),
        SchemaMatch::Newer => (
            format!("The schema {installed} is newer than the library {LIBRARY_VERSION} (was an older library installed?)."),
            "Install the library of the version the schema is on (or a newer one) and restart the server.",
        ),
        SchemaMatch::Unreadable => (
            format!("The schema version {installed:?} is not one this library can compare."),
            "Install a released version of outbox_delivery (see RELEASES.md) and update the extension.",
        ),
    };
    (message, detail, hint)
}

/// The extension's version in this database; None when it is not installed (dropped
/// meanwhile: reading a value of the empty result would be an error instead).
fn installed_version() -> Option<String> {
    BackgroundWorker::transaction(|| {
        Spi::connect(|client| {
            let rows = client.select(INSTALLED_VERSION, Some(1), &["outbox_delivery".into()])?;
            if rows.is_empty() {
                return Ok(None);
            }
            rows.first().get_one::<String>()
        })
    })
    .unwrap_or_else(|e| crate::error::spi_failure(e))
}

/// Waits until the database's extension is on this library's version. `pause` sleeps one
/// poll and returns false when the worker must stop; then this returns false too.
pub fn wait_until_current(index: usize, mut pause: impl FnMut() -> bool) -> bool {
    let mut told: Option<String> = None;
    loop {
        // No extension at all (dropped meanwhile) is the main loop's business: it restarts.
        let installed = installed_version().unwrap_or_else(|| LIBRARY_VERSION.to_string());
        let verdict = compare(&installed, LIBRARY_VERSION);
        if verdict == SchemaMatch::Current {
            if told.is_some() {
                log!("outbox_delivery worker {index}: the database is on schema version {installed} now; delivering");
            }
            return true;
        }
        if told.as_deref() != Some(installed.as_str()) {
            let (message, detail, hint) = waiting_report(&installed, verdict);
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
                message,
                "outbox_delivery",
            )
            .set_detail(detail)
            .set_hint(hint)
            .report(PgLogLevel::LOG);
            slots::update(index, |s| s.phase = slots::Phase::WaitingForUpdate);
            told = Some(installed);
        }
        if !pause() {
            return false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_version_is_current() {
        assert_eq!(compare("0.2.0", "0.2.0"), SchemaMatch::Current);
        assert_eq!(compare("1.2", "1.2.0"), SchemaMatch::Current);
    }

    #[test]
    fn an_older_release_waits_for_the_update() {
        assert_eq!(compare("0.1.0", "0.2.0"), SchemaMatch::Older);
        assert_eq!(compare("0.9.0", "0.10.0"), SchemaMatch::Older);
        assert_eq!(compare("0.2", "0.2.1"), SchemaMatch::Older);
    }

    #[test]
    fn a_newer_schema_than_the_library_waits_too() {
        assert_eq!(compare("0.3.0", "0.2.0"), SchemaMatch::Newer);
        assert_eq!(compare("1.0.0", "0.99.99"), SchemaMatch::Newer);
    }

    #[test]
    fn a_version_that_is_not_numbers_is_unreadable_unless_identical() {
        assert_eq!(compare("0.2.0-dev", "0.2.0"), SchemaMatch::Unreadable);
        assert_eq!(compare("", "0.2.0"), SchemaMatch::Unreadable);
        assert_eq!(compare("unpackaged", "0.2.0"), SchemaMatch::Unreadable);
        assert_eq!(compare("0.2.0-dev", "0.2.0-dev"), SchemaMatch::Current);
    }

    #[test]
    fn the_report_names_both_versions_and_the_statement_that_ends_the_wait() {
        let (message, detail, hint) = waiting_report("0.1.0", SchemaMatch::Older);
        assert!(message.contains("0.1.0") && message.contains(LIBRARY_VERSION));
        assert!(detail.contains("Queued messages stay queued"));
        assert!(hint.contains("ALTER EXTENSION outbox_delivery UPDATE"));
        let (_, detail, _) = waiting_report("9.0.0", SchemaMatch::Newer);
        assert!(detail.contains("newer than the library"));
    }
}
