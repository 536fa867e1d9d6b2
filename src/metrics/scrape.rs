//! One database's part of a scrape: a short-lived background worker connects to the
//! database, reads `outbox.prometheus()` as `pg_monitor` and leaves the text in a file of
//! `pg_stat_tmp` (the data directory is every server process's working directory) that the
//! listener reads and removes. Scrapes run one at a time, so the file is named by the
//! database's position in `outbox.database`.

use super::exposition::Part;
use crate::gucs;
use crate::worker::served_database;
use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, DynamicBackgroundWorker,
};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::path::PathBuf;

/// The exposition statement (schema-qualified; runs as `pg_monitor`).
const EXPOSITION: &str = "SELECT outbox.prometheus()";
/// The scrape worker's type in `pg_stat_activity`.
const SCRAPER: &str = "outbox_delivery metrics scrape";
/// Longest a scrape of one database may run: its statement is cancelled after this.
const STATEMENT_TIMEOUT: &core::ffi::CStr = c"10s";
/// Longest it waits for a lock (a `DROP EXTENSION` or an update in progress, say).
const LOCK_TIMEOUT: &core::ffi::CStr = c"2s";

/// What a scrape worker writes first in its file.
const FOUND: &str = "exposition";
const NO_EXTENSION: &str = "no extension";
const FAILED: &str = "failed";

const DIRECTORY: &str = "pg_stat_tmp";
const PREFIX: &str = "outbox_metrics.";

fn answer_file(index: usize) -> PathBuf {
    PathBuf::from(DIRECTORY).join(format!("{PREFIX}{index}.prom"))
}

/// Removes the files a listener that was killed mid-scrape left.
pub fn remove_leftovers() {
    let Ok(entries) = std::fs::read_dir(DIRECTORY) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(PREFIX) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// A scrape worker started for the database at `index` of `outbox.database`.
pub struct Running {
    index: usize,
    worker: DynamicBackgroundWorker,
}

/// Starts the scrape of the database at `index`; fails when no background worker slot is
/// free.
pub fn start(index: usize, database: &str) -> Result<Running, String> {
    let _ = std::fs::remove_file(answer_file(index));
    BackgroundWorkerBuilder::new(&format!("{SCRAPER} ({database})"))
        .set_type(SCRAPER)
        .set_library("outbox_delivery")
        .set_function("outbox_delivery_metrics_scrape_main")
        .set_argument(Some(pg_sys::Datum::from(index)))
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(None)
        .set_notify_pid(unsafe { pg_sys::MyProcPid })
        .load_dynamic()
        .map(|worker| Running { index, worker })
        .map_err(|_| "no background worker slot is free (max_worker_processes)".to_string())
}

impl Running {
    /// Waits for the scrape worker to end and reads what it left.
    pub fn finish(self) -> Part {
        let file = answer_file(self.index);
        let _ = self.worker.wait_for_shutdown();
        let text = std::fs::read_to_string(&file);
        let _ = std::fs::remove_file(&file);
        read_answer(text.ok())
    }
}

/// The part a scrape worker's file gives.
fn read_answer(text: Option<String>) -> Part {
    let Some(text) = text else {
        return Part::Missing("the scrape of this database failed; the server log says why".into());
    };
    let (status, rest) = text.split_once('\n').unwrap_or((text.as_str(), ""));
    match status {
        FOUND => Part::Exposition(rest.to_string()),
        NO_EXTENSION => Part::Missing("extension outbox_delivery is not installed there".into()),
        _ => Part::Missing(format!("outbox.prometheus() failed: {}", rest.trim())),
    }
}

/// The text of the database's answer file.
fn scrape_connected() -> String {
    if !served_database::extension_exists() {
        return format!("{NO_EXTENSION}\n");
    }
    let monitor = pg_sys::Oid::from(pg_sys::ROLE_PG_MONITOR);
    match crate::identity::transaction(monitor, || Spi::get_one::<String>(EXPOSITION)) {
        Ok(text) => format!("{FOUND}\n{}", text.unwrap_or_default()),
        Err(e) => format!("{FAILED}\n{e}"),
    }
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn outbox_delivery_metrics_scrape_main(arg: pg_sys::Datum) {
    // The default handlers of a background worker: SIGTERM ends it at once.
    unsafe { pg_sys::BackgroundWorkerUnblockSignals() };
    let index = arg.value();
    let Some(database) = gucs::databases().get(index).cloned() else {
        return;
    };
    BackgroundWorker::connect_worker_to_spi(Some(&database), None);
    for (name, value) in [
        (c"statement_timeout", STATEMENT_TIMEOUT),
        (c"lock_timeout", LOCK_TIMEOUT),
        (c"jit", c"off"),
    ] {
        unsafe {
            pg_sys::SetConfigOption(
                name.as_ptr(),
                value.as_ptr(),
                pg_sys::GucContext::PGC_SUSET,
                pg_sys::GucSource::PGC_S_SESSION,
            )
        };
    }
    let text = scrape_connected();
    let file = answer_file(index);
    let partial = file.with_extension("partial");
    if let Err(e) = std::fs::write(&partial, text).and_then(|_| std::fs::rename(&partial, &file)) {
        log!("{SCRAPER}: cannot write {}: {e}", file.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_file_reads_as_a_part() {
        assert_eq!(
            read_answer(Some("exposition\nx 1\ny 2\n".into())),
            Part::Exposition("x 1\ny 2\n".into())
        );
        assert_eq!(
            read_answer(Some("exposition\n".into())),
            Part::Exposition(String::new())
        );
        assert_eq!(
            read_answer(Some("no extension\n".into())),
            Part::Missing("extension outbox_delivery is not installed there".into())
        );
        assert_eq!(
            read_answer(Some("failed\nrelation does not exist\n".into())),
            Part::Missing("outbox.prometheus() failed: relation does not exist".into())
        );
        assert!(matches!(read_answer(None), Part::Missing(m) if m.contains("server log")));
        assert!(matches!(read_answer(Some(String::new())), Part::Missing(_)));
    }
}
