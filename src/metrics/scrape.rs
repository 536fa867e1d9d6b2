//! One database's part of a scrape: a short-lived background worker connects to the
//! database, reads `outbox.prometheus()` as `pg_monitor` and leaves the text in a file of
//! `pg_stat_tmp` (the data directory is every server process's working directory) that the
//! listener reads and removes. The file is named by the listener's PID, the scrape's number
//! and the database's position in `outbox.database`, so that a worker left over from an
//! earlier listener or scrape never answers for a later one.
//!
//! Bounds: a background worker's statements never arm `statement_timeout` (PostgreSQL arms
//! it for a client's queries alone), so the scrape worker arms the statement timer itself
//! for its whole scrape (`STATEMENT_TIMEOUT`): a slow scrape ends with an error part for
//! its database. `lock_timeout` bounds its lock waits. The listener waits at most
//! `SCRAPE_BOUND` for every worker of a scrape and stops the ones still running.

use super::exposition::Part;
use crate::error::sqlstate_and_message;
use crate::gucs;
use crate::served_database;
use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BackgroundWorkerStatus, BgWorkerStartTime,
    DynamicBackgroundWorker,
};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The exposition statement (schema-qualified; runs as `pg_monitor`).
const EXPOSITION: &str = "SELECT outbox.prometheus()";
/// The scrape worker's type in `pg_stat_activity`.
const SCRAPER: &str = "outbox_delivery metrics scrape";
/// Longest a scrape of one database may run, in milliseconds: its statement is cancelled
/// (57014) after this.
const STATEMENT_TIMEOUT_MS: i32 = 10_000;
/// Longest the listener waits for the workers of one scrape (their start, their connection
/// and `STATEMENT_TIMEOUT_MS`); the ones still running then are stopped.
pub const SCRAPE_BOUND: Duration = Duration::from_secs(15);
/// Longest it waits for a lock (a `DROP EXTENSION` or an update in progress, say).
const LOCK_TIMEOUT: &core::ffi::CStr = c"2s";

/// What a scrape worker writes first in its file.
const FOUND: &str = "exposition";
const NO_EXTENSION: &str = "no extension";
const FAILED: &str = "failed";

const DIRECTORY: &str = "pg_stat_tmp";
const PREFIX: &str = "outbox_metrics.";

/// The scrape worker's argument: the scrape's number and the database's position.
fn argument(scrape: u32, index: usize) -> usize {
    ((scrape as usize) << 16) | (index & 0xffff)
}

fn from_argument(argument: usize) -> (u32, usize) {
    ((argument >> 16) as u32, argument & 0xffff)
}

fn answer_file(listener: i32, scrape: u32, index: usize) -> PathBuf {
    PathBuf::from(DIRECTORY).join(format!("{PREFIX}{listener}.{scrape}.{index}.prom"))
}

/// Removes the answer files no running scrape waits for (a listener killed mid-scrape, a
/// worker stopped after its scrape's bound leave some).
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
    file: PathBuf,
    worker: DynamicBackgroundWorker,
}

/// Starts the scrape `scrape` of the database at `index`; fails when no background worker
/// slot is free.
pub fn start(scrape: u32, index: usize, database: &str) -> Result<Running, String> {
    let listener = unsafe { pg_sys::MyProcPid };
    let file = answer_file(listener, scrape, index);
    let _ = std::fs::remove_file(&file);
    BackgroundWorkerBuilder::new(&format!("{SCRAPER} ({database})"))
        .set_type(SCRAPER)
        .set_library("outbox_delivery")
        .set_function("outbox_delivery_metrics_scrape_main")
        .set_argument(Some(pg_sys::Datum::from(argument(scrape, index))))
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(None)
        .set_notify_pid(listener)
        .load_dynamic()
        .map(|worker| Running { file, worker })
        .map_err(|_| "no background worker slot is free (max_worker_processes)".to_string())
}

/// Waits for the workers of one scrape to end, `SCRAPE_BOUND` at most, and reads what each
/// left; a worker still running then is stopped and its part says so. A SIGTERM of the
/// listener meanwhile stops them and the listener (exit 1: the postmaster restarts it).
pub fn finish(runs: Vec<Result<Running, String>>) -> Vec<Part> {
    let until = Instant::now() + SCRAPE_BOUND;
    loop {
        let running = runs.iter().any(|run| {
            run.as_ref().is_ok_and(|r| {
                !matches!(
                    r.worker.pid(),
                    Err(BackgroundWorkerStatus::Stopped | BackgroundWorkerStatus::PostmasterDied)
                )
            })
        });
        let left = until.saturating_duration_since(Instant::now());
        if !running || left.is_zero() {
            break;
        }
        // The postmaster sets the latch when a worker of ours starts or stops.
        if !BackgroundWorker::wait_latch(Some(left.min(Duration::from_millis(200)))) {
            for run in runs.into_iter().flatten() {
                let _ = run.worker.terminate();
            }
            unsafe { pg_sys::proc_exit(1) };
        }
    }
    runs.into_iter()
        .map(|run| match run {
            Err(why) => Part::Missing(why),
            Ok(run) => {
                let stopped = matches!(
                    run.worker.pid(),
                    Err(BackgroundWorkerStatus::Stopped | BackgroundWorkerStatus::PostmasterDied)
                );
                if !stopped {
                    let _ = run.worker.terminate().wait_for_shutdown();
                    let _ = std::fs::remove_file(&run.file);
                    return Part::Missing(format!(
                        "the scrape of this database did not end within {} s; it was stopped",
                        SCRAPE_BOUND.as_secs()
                    ));
                }
                let text = std::fs::read_to_string(&run.file);
                let _ = std::fs::remove_file(&run.file);
                read_answer(text.ok())
            }
        })
        .collect()
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

/// The statement timer (`crate::pg_timeout`).
mod statement_timer {
    use crate::pg_timeout::{disable_timeout, enable_timeout_after, STATEMENT_TIMEOUT};
    use pgrx::pg_sys::ffi::pg_guard_ffi_boundary;
    use std::ffi::c_int;

    /// Arms it: `ms` from now the running statement is cancelled (57014, "canceling
    /// statement due to statement timeout"); a background worker connected to a database
    /// receives the cancel (its SIGINT handler is `StatementCancelHandler`).
    pub fn arm(ms: c_int) {
        unsafe { pg_guard_ffi_boundary(|| enable_timeout_after(STATEMENT_TIMEOUT, ms)) }
    }

    pub fn disarm() {
        unsafe { pg_guard_ffi_boundary(|| disable_timeout(STATEMENT_TIMEOUT, false)) }
    }
}

/// `scrape_connected` under the statement timer, armed here because a background worker's
/// statements do not arm it; an error (the timer's 57014 among them) becomes the text of a
/// failed part.
fn scrape_bounded() -> String {
    statement_timer::arm(STATEMENT_TIMEOUT_MS);
    let text = PgTryBuilder::new(scrape_connected)
        .catch_others(|caught| {
            let (sqlstate, message) = sqlstate_and_message(&caught);
            format!("{FAILED}\n{message} (SQLSTATE {sqlstate})")
        })
        .execute();
    statement_timer::disarm();
    text
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn outbox_delivery_metrics_scrape_main(arg: pg_sys::Datum) {
    // The default handlers of a background worker: SIGTERM ends it at once, SIGINT (the
    // statement timer's) cancels its statement.
    unsafe { pg_sys::BackgroundWorkerUnblockSignals() };
    let (scrape, index) = from_argument(arg.value());
    let listener = unsafe { (*pg_sys::MyBgworkerEntry).bgw_notify_pid };
    let Some(database) = gucs::databases().get(index).cloned() else {
        return;
    };
    BackgroundWorker::connect_worker_to_spi(Some(&database), None);
    for (name, value) in [(c"lock_timeout", LOCK_TIMEOUT), (c"jit", c"off")] {
        unsafe {
            pg_sys::SetConfigOption(
                name.as_ptr(),
                value.as_ptr(),
                pg_sys::GucContext::PGC_SUSET,
                pg_sys::GucSource::PGC_S_SESSION,
            )
        };
    }
    let text = scrape_bounded();
    let file = answer_file(listener, scrape, index);
    let partial = file.with_extension("partial");
    if let Err(e) = std::fs::write(&partial, text).and_then(|_| std::fs::rename(&partial, &file)) {
        log!("{SCRAPER}: cannot write {}: {e}", file.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_argument_carries_the_scrape_and_the_database() {
        for (scrape, index) in [(0, 0), (1, 3), (u32::MAX, 65535), (70_000, 12)] {
            assert_eq!(from_argument(argument(scrape, index)), (scrape, index));
        }
        assert_eq!(
            answer_file(42, 7, 1),
            PathBuf::from("pg_stat_tmp/outbox_metrics.42.7.1.prom")
        );
    }

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
