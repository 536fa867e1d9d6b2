//! Sweeps: the part of a cycle that looks for work other than due messages, namely
//! attempts whose lease ran out (`recovery`) and `uncertain` messages due for a reconcile
//! lookup (`claim::claim_lookups`).
//!
//! Both statements find nothing almost always, and planning them took about 0.6 ms of
//! every claim transaction they ran in: a quarter of the time from a COMMIT to its
//! message's request when the worker is idle, and a cost paid again for every batch of a
//! backlog. Their work is not urgent to the millisecond (a lease lasts `outbox.lease_ms`, a
//! lookup waits for its backoff), so a worker sweeps at its first cycle, then at most every
//! [`SWEEP_EVERY_MS`], and again at once while a sweep comes back full; and it sweeps in a
//! transaction of its own: a busy worker beside the sends its claim has just started, one
//! that was idle at the end of its cycle, once the answers that arrived are recorded, so
//! that a commit that wakes a worker idle for longer than that is not sent after a sweep
//! (`cycle::Worker::sweep`).
//!
//! Pure bookkeeping on the worker's monotonic clock.

/// Longest time between two sweeps of a worker that is cycling.
pub const SWEEP_EVERY_MS: i64 = 250;

#[derive(Debug, Default)]
pub struct SweepClock {
    last_ms: Option<i64>,
    more: bool,
}

impl SweepClock {
    /// Whether the cycle starting at `now_ms` sweeps.
    pub fn due(&self, now_ms: i64) -> bool {
        match self.last_ms {
            None => true,
            _ if self.more => true,
            Some(last) => now_ms - last >= SWEEP_EVERY_MS,
        }
    }

    /// Notes a sweep at `now_ms`; `full` when it found as many rows as it may take, so that
    /// more may be waiting.
    pub fn swept(&mut self, now_ms: i64, full: bool) {
        self.last_ms = Some(now_ms);
        self.more = full;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_cycle_sweeps() {
        assert!(SweepClock::default().due(0));
        assert!(SweepClock::default().due(123_456));
    }

    #[test]
    fn a_sweep_waits_for_its_interval() {
        let mut c = SweepClock::default();
        c.swept(1_000, false);
        assert!(!c.due(1_000));
        assert!(!c.due(1_000 + SWEEP_EVERY_MS - 1));
        assert!(c.due(1_000 + SWEEP_EVERY_MS));
        assert!(c.due(1_000 + 10 * SWEEP_EVERY_MS));
    }

    #[test]
    fn a_full_sweep_is_followed_by_another_at_once() {
        let mut c = SweepClock::default();
        c.swept(1_000, true);
        assert!(c.due(1_000));
        c.swept(1_001, false);
        assert!(!c.due(1_002));
    }
}
