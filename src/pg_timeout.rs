//! What the extension uses of PostgreSQL's timers (`utils/timeout.h`), which pgrx does not
//! bind: a background worker's statements never arm `statement_timeout` (postgres.c arms it
//! for a client's statements only), so the worker arms `STATEMENT_TIMEOUT` itself around a
//! `sql` effect (`channels::effect_bound`) and the scrape worker around its scrape
//! (`metrics::scrape`).

/// `TimeoutId`, a C enum.
pub type TimeoutId = std::ffi::c_uint;
/// `STATEMENT_TIMEOUT`: the fourth reason in every version (13 to 18).
pub const STATEMENT_TIMEOUT: TimeoutId = 3;
/// An id at or past `USER_TIMEOUT` in every version (8 in 13, 12 in 15, 13 in 17):
/// `RegisterTimeout` takes any such id as a request for a free user-defined reason, and
/// returns the one it gave.
pub const ANY_USER_TIMEOUT: TimeoutId = 20;

#[repr(C)]
pub struct DisableTimeoutParams {
    pub id: TimeoutId,
    pub keep_indicator: bool,
}

// They raise no ERROR (only a FATAL, which exits): nothing longjmps across Rust frames.
unsafe extern "C-unwind" {
    pub fn RegisterTimeout(
        id: TimeoutId,
        handler: Option<unsafe extern "C-unwind" fn()>,
    ) -> TimeoutId;
    pub fn enable_timeout_after(id: TimeoutId, delay_ms: std::ffi::c_int);
    #[cfg(not(any(feature = "pg13", feature = "pg14")))]
    pub fn enable_timeout_every(
        id: TimeoutId,
        fin_time: pgrx::pg_sys::TimestampTz,
        delay_ms: std::ffi::c_int,
    );
    pub fn disable_timeouts(timeouts: *const DisableTimeoutParams, count: std::ffi::c_int);
    pub fn disable_timeout(id: TimeoutId, keep_indicator: bool);
}
