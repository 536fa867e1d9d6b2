//! The bound around a `sql` effect: its channel's `timeout_ms`, and the worker's stop.
//!
//! A background worker's statements arm no `statement_timeout` (PostgreSQL arms it around a
//! client's query alone), and the worker's SIGTERM handler only sets the stop flag
//! (`ShutdownRequestPending`). So while an effect runs, the worker arms two timers of its
//! own ([`arm`], [`disarm`]):
//! - `STATEMENT_TIMEOUT`, `timeout_ms` after the call began: its handler cancels the running
//!   statement as it does in a client session (SQLSTATE 57014, "canceling statement due to
//!   statement timeout"); a background worker connected to a database receives the cancel
//!   (its SIGINT handler is PostgreSQL's `StatementCancelHandler`);
//! - a check every [`CHECK_EVERY_MS`] ([`action`]): once the worker was asked to stop (a
//!   fast shutdown, `pg_terminate_backend`) or the deadline has passed, it cancels the
//!   statement again; an effect that has gone on [`GRACE_MS`] past either (a function
//!   that catches `query_canceled` and goes on) ends the worker's process as
//!   `pg_terminate_backend` ends a client's backend: the record transaction is rolled back,
//!   the worker is restarted, and the lease's recovery retries its batch.
//!
//! A cancel rolls the effect's subtransaction back; the worker records the outcome and,
//! when asked to stop, stops after its cycle as it does otherwise.

use pgrx::pg_sys;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering::Relaxed};

use crate::pg_timeout as timeout;

/// How often a running effect's check looks at the stop flag and the deadline.
pub const CHECK_EVERY_MS: i32 = 100;
/// How long an effect may ignore the cancels of its check before the worker's process ends.
pub const GRACE_MS: i64 = 500;

/// The id `RegisterTimeout` gave the check in this process; 0 (a predefined id, never a
/// user's): not registered yet.
static CHECK_ID: AtomicU32 = AtomicU32::new(0);
/// When the running effect's `timeout_ms` ends (microseconds, `TimestampTz`); `i64::MAX`:
/// no effect runs.
static DEADLINE: AtomicI64 = AtomicI64::new(i64::MAX);
/// When the check first saw the stop flag during the running effect; 0: not seen.
static STOP_SEEN_AT: AtomicI64 = AtomicI64::new(0);

/// What the check does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Nothing,
    /// Cancel the running statement (57014), again if it was already.
    Cancel,
    /// End the process: the effect has ignored its cancels for [`GRACE_MS`].
    Terminate,
}

/// What the check does at `now` (all three in microseconds), for an effect whose
/// `timeout_ms` ends at `deadline`, when the stop flag was first seen at `stop_seen_at`.
pub fn action(now: i64, deadline: i64, stop_seen_at: Option<i64>) -> Action {
    let overdue_since = [(now >= deadline).then_some(deadline), stop_seen_at]
        .into_iter()
        .flatten()
        .min();
    match overdue_since {
        None => Action::Nothing,
        Some(since) if now.saturating_sub(since) >= GRACE_MS * 1000 => Action::Terminate,
        Some(_) => Action::Cancel,
    }
}

/// Whether the worker was asked to stop (the flag its SIGTERM handler sets, see
/// `worker::stop_requested`).
pub fn stop_requested() -> bool {
    unsafe { (&raw const pg_sys::ShutdownRequestPending).read_volatile() != 0 }
}

/// The check, run by the timeout machinery in its SIGALRM handler: it only reads and sets
/// flags, as PostgreSQL's own signal handlers do (`StatementCancelHandler`, `die`); the
/// handler sets the process latch, which wakes a waiting statement to see them.
unsafe extern "C-unwind" fn check() {
    let now = pg_sys::GetCurrentTimestamp();
    if stop_requested() && STOP_SEEN_AT.load(Relaxed) == 0 {
        STOP_SEEN_AT.store(now, Relaxed);
    }
    let seen = Some(STOP_SEEN_AT.load(Relaxed)).filter(|&t| t != 0);
    match action(now, DEADLINE.load(Relaxed), seen) {
        Action::Nothing => {}
        Action::Cancel => {
            (&raw mut pg_sys::QueryCancelPending).write_volatile(1);
            (&raw mut pg_sys::InterruptPending).write_volatile(1);
        }
        Action::Terminate => {
            (&raw mut pg_sys::ProcDiePending).write_volatile(1);
            (&raw mut pg_sys::InterruptPending).write_volatile(1);
        }
    }
    // Before PostgreSQL 15 a timeout cannot repeat by itself: the check arms itself again.
    #[cfg(any(feature = "pg13", feature = "pg14"))]
    timeout::enable_timeout_after(CHECK_ID.load(Relaxed), CHECK_EVERY_MS);
}

/// The check's timeout id, registered at the first effect of the process.
fn check_id() -> timeout::TimeoutId {
    let id = CHECK_ID.load(Relaxed);
    if id != 0 {
        return id;
    }
    let id = unsafe { timeout::RegisterTimeout(timeout::ANY_USER_TIMEOUT, Some(check)) };
    CHECK_ID.store(id, Relaxed);
    id
}

/// Arms the bound of an effect that starts now and may run `timeout_ms`.
pub fn arm(timeout_ms: u64) {
    let id = check_id();
    let ms = timeout_ms.clamp(1, i32::MAX as u64) as i32;
    unsafe {
        let now = pg_sys::GetCurrentTimestamp();
        STOP_SEEN_AT.store(if stop_requested() { now } else { 0 }, Relaxed);
        DEADLINE.store(now.saturating_add(i64::from(ms) * 1000), Relaxed);
        timeout::enable_timeout_after(timeout::STATEMENT_TIMEOUT, ms);
        #[cfg(not(any(feature = "pg13", feature = "pg14")))]
        timeout::enable_timeout_every(
            id,
            now.saturating_add(i64::from(CHECK_EVERY_MS) * 1000),
            CHECK_EVERY_MS,
        );
        #[cfg(any(feature = "pg13", feature = "pg14"))]
        timeout::enable_timeout_after(id, CHECK_EVERY_MS);
    }
}

/// Disarms the bound after the effect ended. A cancel
/// already pending is the effect's and is dropped with it, as PostgreSQL drops one after a
/// client's statement failed (`ended_in_error`). After an effect that returned, the caller
/// first lets a pending cancel raise inside the effect's subtransaction.
pub fn disarm(ended_in_error: bool) {
    let id = check_id();
    let timers = [
        timeout::DisableTimeoutParams {
            id: timeout::STATEMENT_TIMEOUT,
            keep_indicator: false,
        },
        timeout::DisableTimeoutParams {
            id,
            keep_indicator: false,
        },
    ];
    unsafe {
        timeout::disable_timeouts(timers.as_ptr(), timers.len() as i32);
        DEADLINE.store(i64::MAX, Relaxed);
        STOP_SEEN_AT.store(0, Relaxed);
        if ended_in_error {
            (&raw mut pg_sys::QueryCancelPending).write_volatile(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: i64 = 1000;

    #[test]
    fn nothing_happens_before_the_deadline_unless_the_worker_stops() {
        assert_eq!(action(0, 2_000 * MS, None), Action::Nothing);
        assert_eq!(action(1_999 * MS, 2_000 * MS, None), Action::Nothing);
        assert_eq!(action(100 * MS, 2_000 * MS, Some(50 * MS)), Action::Cancel);
        assert_eq!(action(0, i64::MAX, None), Action::Nothing);
    }

    #[test]
    fn an_overdue_effect_is_cancelled_then_ended_after_the_grace() {
        assert_eq!(action(2_000 * MS, 2_000 * MS, None), Action::Cancel);
        assert_eq!(action(2_499 * MS, 2_000 * MS, None), Action::Cancel);
        assert_eq!(action(2_500 * MS, 2_000 * MS, None), Action::Terminate);
    }

    #[test]
    fn a_stop_counts_its_grace_from_when_it_was_seen() {
        assert_eq!(
            action(1_400 * MS, 9_000 * MS, Some(1_000 * MS)),
            Action::Cancel
        );
        assert_eq!(
            action(1_500 * MS, 9_000 * MS, Some(1_000 * MS)),
            Action::Terminate
        );
        // The earlier of the two starts the grace.
        assert_eq!(
            action(2_600 * MS, 2_000 * MS, Some(2_500 * MS)),
            Action::Terminate
        );
    }
}
