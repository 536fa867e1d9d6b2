//! `/metrics` over HTTP. When `outbox.metrics_address` is set (postmaster), a background
//! worker of its own, never a delivery worker, listens there (`listener`), serving several
//! connections at once on threads that do socket I/O alone (`connections`), each with one
//! deadline for its whole request; `outbox.metrics_token_file` makes it ask for a bearer
//! token (`request`). For each `GET /metrics` (requests waiting together share one) it
//! starts one short-lived background worker per database of `outbox.database` (`scrape`),
//! all at once; each connects to its database, reads `outbox.prometheus()` as `pg_monitor`
//! under a statement timer it arms itself and hands the text back through a file in
//! `pg_stat_tmp`. The answer holds every database's figures with a `database` label
//! (`exposition`). No scrape takes a delivery worker's time or a client connection slot;
//! a scrape needs one free `max_worker_processes` slot per database for its duration.

mod connections;
pub mod exposition;
pub mod latency;
mod listener;
mod request;
mod scrape;

use crate::gucs;
use pgrx::bgworkers::{BackgroundWorkerBuilder, BgWorkerStartTime};
use pgrx::pg_sys;
use std::time::Duration;

pub use listener::outbox_delivery_metrics_main;
pub use scrape::outbox_delivery_metrics_scrape_main;

/// The listener's type in `pg_stat_activity`.
const LISTENER: &str = "outbox_delivery metrics";

/// Registers the listener when `outbox.metrics_address` is set.
pub fn register() {
    if !unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        return;
    }
    if gucs::metrics_address().is_empty() {
        return;
    }
    BackgroundWorkerBuilder::new(LISTENER)
        .set_type(LISTENER)
        .set_library("outbox_delivery")
        .set_function("outbox_delivery_metrics_main")
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        // Terminated (`pg_terminate_backend`) or failed, it exits 1 and is started again.
        .set_restart_time(Some(Duration::from_secs(5)))
        .load();
}
