//! A worker on a hot standby delivers nothing: it connects (read-only), shows the state
//! `standby` in `worker_status()`, and looks every [`PROMOTION_POLL`] whether the server
//! was promoted. Then it notes when it saw the promotion (the first worker to see it
//! records the time for all), and starts delivering.
//!
//! The messages that were `sending` when the old primary died are in the new primary's
//! tables with leases that have not run out. They were claimed before the promotion (their
//! `updated_at`, the claim's time, is older than the recorded time), so the first sweep of
//! every worker takes them back as interrupted attempts: the ambiguous path, never a blind
//! resend. A claim made on this server is never older than that time: every worker claims
//! only after it saw the promotion, and the recorded time is the earliest sighting.

use crate::clock::now_ms;
use crate::worker_slots as slots;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::time::Duration;

/// How often a worker on a standby looks whether the server was promoted.
pub const PROMOTION_POLL: Duration = Duration::from_millis(100);

/// Whether the server is (still) a standby in recovery.
pub fn in_recovery() -> bool {
    unsafe { pg_sys::RecoveryInProgress() }
}

/// Waits while the server is a standby. `pause` sleeps and returns false when the worker
/// must stop; then this returns false too.
pub fn wait_for_promotion(
    index: usize,
    database: &str,
    mut pause: impl FnMut(Duration) -> bool,
) -> bool {
    if !in_recovery() {
        return true;
    }
    log!("outbox_delivery worker {index}: the server is a hot standby; delivering nothing from \"{database}\" until it is promoted");
    slots::update(index, |s| s.phase = slots::Phase::Standby);
    while in_recovery() {
        if !pause(PROMOTION_POLL) {
            return false;
        }
    }
    let at = slots::promoted_at_ms(now_ms());
    log!("outbox_delivery worker {index}: the server was promoted; attempts claimed before it (seen at {at} ms) are taken back as interrupted attempts");
    true
}

/// The time before which a `sending` message was claimed by an old primary (Unix ms; 0:
/// this server was not promoted while its workers ran).
pub fn claimed_by_old_primary_before_ms() -> i64 {
    slots::promoted_at_ms_if_any()
}
