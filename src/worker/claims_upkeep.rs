//! Keeping `outbox._claims` small. Every claim inserts a row there, every record rewrites
//! or deletes one: a busy worker leaves a dead row version or two per claim. Autovacuum
//! looks at a table at most once a `autovacuum_naptime` (a minute by default), and until a
//! VACUUM has entered the space those versions leave in the free space map, every new claim
//! goes to a new page at the end of the table. In a drain of 1,000,000 the table grew to
//! 1,800 pages of a few live rows, and each claim, record and sweep, which read the table
//! whole, read all of them. So a worker that claims vacuums the table itself, at most every
//! [`VACUUM_EVERY`] and only after [`CLAIMS_BETWEEN`] claims of its own: a VACUUM of a
//! table of a few pages, in a transaction of its own between two cycles.
//!
//! `SKIP_LOCKED`: a vacuum of the table already under way (the other worker's, or
//! autovacuum's) is not waited for. `TRUNCATE false`: cutting the empty pages off the end of
//! the table needs its exclusive lock, which a worker would wait up to 5 s for while the
//! others claim and record; autovacuum still truncates when it gets it.

use pgrx::pg_sys;
use std::ffi::CStr;
use std::time::{Duration, Instant};

/// The statement; it reads no parameter.
const VACUUM_CLAIMS: &CStr = c"VACUUM (SKIP_LOCKED, TRUNCATE false) outbox._claims";

/// The shortest time between two vacuums of one worker. A vacuum is not free (its own
/// transactions, the database's frozen-xid horizon computed again, the table's statistics
/// in `pg_class` updated), and in drains of 20,000 one every 250 ms gave lower rates than
/// one every two seconds (BENCHMARKS.md); two seconds of growth are a few dozen pages in
/// a fast drain.
pub const VACUUM_EVERY: Duration = Duration::from_millis(2000);

/// The claims a worker makes before it vacuums: an idle or nearly idle worker leaves the
/// table to autovacuum.
pub const CLAIMS_BETWEEN: u64 = 20;

/// When the worker last vacuumed the claims, and how many claims it had made by then.
#[derive(Debug, Default)]
pub struct Upkeep {
    last: Option<Instant>,
    claims_then: u64,
}

impl Upkeep {
    /// Whether the worker vacuums now, having made `claims` claims since it started.
    pub fn due(&self, now: Instant, claims: u64) -> bool {
        claims.saturating_sub(self.claims_then) >= CLAIMS_BETWEEN
            && self
                .last
                .is_none_or(|at| now.saturating_duration_since(at) >= VACUUM_EVERY)
    }

    /// The worker vacuumed at `now`, having made `claims` claims.
    pub fn done(&mut self, now: Instant, claims: u64) {
        self.last = Some(now);
        self.claims_then = claims;
    }
}

/// Runs [`VACUUM_CLAIMS`] as a statement of its own, outside any transaction of the worker
/// (VACUUM runs in transactions it starts and commits itself), as a client backend runs a
/// top-level VACUUM. It runs as the worker's session user; VACUUM itself acts as the
/// table's owner. An error ends the worker's process, as in any step of its loop.
pub fn vacuum_claims(workspace: &Workspace) {
    let context = workspace.0;
    // The parse tree and VACUUM's own memory (made under PortalContext) live in `context`,
    // which outlives the transactions VACUUM commits; it is emptied afterwards.
    struct Restore {
        portal: pg_sys::MemoryContext,
        current: pg_sys::MemoryContext,
        context: pg_sys::MemoryContext,
    }
    impl Drop for Restore {
        fn drop(&mut self) {
            unsafe {
                pg_sys::PortalContext = self.portal;
                pg_sys::MemoryContextSwitchTo(self.current);
                pg_sys::MemoryContextReset(self.context);
            }
        }
    }
    unsafe {
        let _restore = Restore {
            portal: pg_sys::PortalContext,
            current: pg_sys::CurrentMemoryContext,
            context,
        };
        pg_sys::SetCurrentStatementStartTimestamp();
        pg_sys::StartTransactionCommand();
        pg_sys::MemoryContextSwitchTo(context);
        pg_sys::PortalContext = context;
        let parsed = pg_sys::raw_parser(
            VACUUM_CLAIMS.as_ptr(),
            pg_sys::RawParseMode::RAW_PARSE_DEFAULT,
        );
        let raw = pg_sys::list_nth(parsed, 0) as *mut pg_sys::RawStmt;
        let stmt = (*raw).stmt as *mut pg_sys::VacuumStmt;
        let pstate = pg_sys::make_parsestate(std::ptr::null_mut());
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
        // Commits the transaction above, vacuums in transactions of its own, and starts
        // one more for its caller to commit.
        pg_sys::ExecVacuum(pstate, stmt, true);
        if pg_sys::ActiveSnapshotSet() {
            pg_sys::PopActiveSnapshot();
        }
        pg_sys::CommitTransactionCommand();
    }
}

/// The memory [`vacuum_claims`] works in: a context made once per worker under the
/// process's top context, emptied after each vacuum.
pub struct Workspace(pg_sys::MemoryContext);

impl Workspace {
    pub fn create() -> Workspace {
        Workspace(unsafe {
            pg_sys::AllocSetContextCreateExtended(
                pg_sys::TopMemoryContext,
                c"outbox claims upkeep".as_ptr(),
                pg_sys::ALLOCSET_SMALL_MINSIZE as usize,
                pg_sys::ALLOCSET_SMALL_INITSIZE as usize,
                pg_sys::ALLOCSET_SMALL_MAXSIZE as usize,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_worker_vacuums_after_its_first_claims() {
        let u = Upkeep::default();
        let now = Instant::now();
        assert!(!u.due(now, 0));
        assert!(!u.due(now, CLAIMS_BETWEEN - 1));
        assert!(u.due(now, CLAIMS_BETWEEN));
    }

    #[test]
    fn it_waits_for_both_the_claims_and_the_time() {
        let mut u = Upkeep::default();
        let t0 = Instant::now();
        u.done(t0, 100);
        // Claims enough, too soon.
        assert!(!u.due(t0 + VACUUM_EVERY / 2, 100 + CLAIMS_BETWEEN * 10));
        // Time enough, too few claims: an idle worker does not vacuum.
        assert!(!u.due(t0 + VACUUM_EVERY * 100, 100 + CLAIMS_BETWEEN - 1));
        assert!(u.due(t0 + VACUUM_EVERY, 100 + CLAIMS_BETWEEN));
    }

    #[test]
    fn exhaustive_over_claims_and_elapsed_time() {
        let t0 = Instant::now();
        for since_ms in 0..=600u64 {
            for claims in 0..=3 * CLAIMS_BETWEEN {
                let mut u = Upkeep::default();
                u.done(t0, 7);
                let now = t0 + Duration::from_millis(since_ms);
                let expected =
                    claims >= CLAIMS_BETWEEN && Duration::from_millis(since_ms) >= VACUUM_EVERY;
                assert_eq!(
                    u.due(now, 7 + claims),
                    expected,
                    "{since_ms} ms, {claims} claims"
                );
            }
        }
    }

    #[test]
    fn a_clock_that_seems_to_go_back_is_not_time_enough() {
        let mut u = Upkeep::default();
        let t0 = Instant::now() + Duration::from_secs(10);
        u.done(t0, 0);
        assert!(!u.due(t0 - Duration::from_secs(5), 1000));
    }
}
