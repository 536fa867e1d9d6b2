//! Wake at COMMIT: `enqueue` marks the transaction; when it commits, the workers' latches
//! are set. A rollback wakes nobody. The workers' poll interval is only a fallback.

use crate::worker_slots as slots;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::Cell;

thread_local! {
    static WAKE_PENDING: Cell<bool> = const { Cell::new(false) };
    static CALLBACK_REGISTERED: Cell<bool> = const { Cell::new(false) };
    static WARNED_NOT_PRELOADED: Cell<bool> = const { Cell::new(false) };
}

#[pg_guard]
unsafe extern "C-unwind" fn on_xact_event(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::XactEvent::*;
    match event {
        XACT_EVENT_COMMIT | XACT_EVENT_PARALLEL_COMMIT if WAKE_PENDING.replace(false) => {
            slots::wake_workers();
        }
        XACT_EVENT_ABORT | XACT_EVENT_PARALLEL_ABORT | XACT_EVENT_PREPARE => {
            WAKE_PENDING.set(false);
        }
        _ => {}
    }
}

fn warn_not_preloaded_once() {
    if !WARNED_NOT_PRELOADED.replace(true) {
        pg_sys::panic::ErrorReport::new(
            PgSqlErrorCode::ERRCODE_WARNING,
            "outbox_delivery is not in shared_preload_libraries: messages are stored but no worker will deliver them",
            "outbox_delivery",
        )
        .set_hint(
            "Add it (ALTER SYSTEM SET shared_preload_libraries = 'outbox_delivery'), set outbox.database \
             to this database, and restart the server.",
        )
        .report(PgLogLevel::WARNING);
    }
}

/// Marks the current transaction so that the workers are woken when it commits.
#[pg_extern(volatile, parallel_unsafe)]
pub fn _wake_at_commit() {
    if !slots::preloaded() {
        warn_not_preloaded_once();
        return;
    }
    if !CALLBACK_REGISTERED.replace(true) {
        unsafe { pg_sys::RegisterXactCallback(Some(on_xact_event), std::ptr::null_mut()) };
    }
    WAKE_PENDING.set(true);
}

/// Run at CREATE EXTENSION: warns when no worker can run, or when the workers serve other
/// databases than this one (its messages would stay queued, silently).
#[pg_extern(volatile)]
fn _check_preloaded() -> bool {
    let preloaded = slots::preloaded();
    if !preloaded {
        warn_not_preloaded_once();
        return false;
    }
    let served = crate::served_database::served_here();
    if !served {
        pg_sys::panic::ErrorReport::new(
            PgSqlErrorCode::ERRCODE_WARNING,
            "no delivery worker serves this database: its messages are stored but stay queued",
            "outbox_delivery",
        )
        .set_detail(format!(
            "outbox.database is \"{}\" and outbox.workers is {}.",
            crate::gucs::database(),
            crate::gucs::workers()
        ))
        .set_hint(
            "Add this database to outbox.database (a comma-separated list) and restart the server; \
             outbox.alerts shows database_not_served until then.",
        )
        .report(PgLogLevel::WARNING);
    }
    served
}
