//! How many idle HTTP connections a worker keeps across its channels.
//!
//! Each channel has its own pool, and a pool keeps as many connections as the channel had
//! requests under way at once: up to two batches (400 with the default batch size) for a
//! fast provider. An idle connection of reqwest's pools (`https://` channels) costs the
//! worker about 30 kB of private memory (the HTTP/1.1 read and write buffers and its task),
//! so a worker that drained four channels one after the other held 1,600 connections and
//! 66 MB for the minute they took to idle out; one of an `http://` channel's own
//! connections (`wire`) costs a few kB.
//!
//! The rule: the pools of channels used in the last [`GRACE`] are kept whatever their size.
//! Beyond them, the estimated connections of all pools are held to [`budget`]; the pools
//! of the channels used least recently are closed first. A closed pool is opened again at
//! the channel's next send, whose connections are then new ones.
//!
//! A pool's size is estimated by [`Demand`]: the most requests under way at once in this
//! window or the two before. Windows are as long as a pooled connection's idle life
//! ([`IDLE_LIFE`]); the pool looks for idle connections once per idle life, so one may stay
//! up to twice that after its last use. The estimate forgets a burst only once its
//! connections must have been closed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The pool of a channel used this recently is never closed for the budget: a channel in
/// use keeps its connections.
pub const GRACE: Duration = Duration::from_secs(1);

/// How long a pooled connection may stay idle before the pool closes it (at its next look
/// for idle connections, one per idle life), and the length of a [`Demand`] window.
pub const IDLE_LIFE: Duration = Duration::from_secs(60);

/// The windows a burst counts in: the current one and the two before, so at least twice
/// [`IDLE_LIFE`].
pub const WINDOWS: u32 = 3;

/// The idle connections a worker keeps across its channels' pools: twice the connections
/// its batches under way can use at once, so that two channels sent to at full speed in
/// turn keep theirs.
pub fn budget(batch_connections: usize) -> usize {
    batch_connections.max(1) * 2
}

/// The requests of one channel's pool under way now, and the most that were under way at
/// once in this window and the two before.
#[derive(Debug, Default)]
pub struct Demand {
    in_flight: AtomicUsize,
    peak: AtomicUsize,
    /// The peaks of the two windows before, the last one first.
    earlier_peaks: [AtomicUsize; (WINDOWS - 1) as usize],
}

impl Demand {
    /// Counts one request under way until the returned guard is dropped (the request
    /// ended, or its future was dropped).
    pub fn start(self: &Arc<Self>) -> UnderWay {
        let now = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak.fetch_max(now, Ordering::Relaxed);
        UnderWay(self.clone())
    }

    /// The connections the pool is estimated to hold: no more than the requests that were
    /// under way at once while its connections could still be idle in it.
    pub fn connections(&self) -> usize {
        self.earlier_peaks
            .iter()
            .map(|p| p.load(Ordering::Relaxed))
            .fold(self.peak.load(Ordering::Relaxed), usize::max)
    }

    /// Starts a new window: the peak of the one ending becomes the last earlier peak, and
    /// the oldest is forgotten.
    pub fn new_window(&self) {
        let now = self.in_flight.load(Ordering::Relaxed);
        let mut ended = self.peak.swap(now, Ordering::Relaxed);
        for earlier in &self.earlier_peaks {
            ended = earlier.swap(ended, Ordering::Relaxed);
        }
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }
}

/// One request counted by [`Demand::start`].
#[derive(Debug)]
pub struct UnderWay(Arc<Demand>);

impl Drop for UnderWay {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the budget needs to know of one channel's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolUse {
    pub channel_id: i32,
    /// Since the channel was last sent to or looked up on.
    pub idle_for: Duration,
    /// [`Demand::connections`].
    pub connections: usize,
    /// Requests under way on it now.
    pub in_flight: usize,
}

/// The channels whose pools to close so that the others fit `budget` connections: the
/// least recently used first, never one used within `grace` or with a request under way,
/// never an empty one. Nothing when all fit. When the pools that must stay exceed the
/// budget alone, every pool that may go goes.
pub fn to_close(pools: &[PoolUse], budget: usize, grace: Duration) -> Vec<i32> {
    let mut total: usize = pools.iter().map(|p| p.connections).sum();
    if total <= budget {
        return Vec::new();
    }
    let mut candidates: Vec<&PoolUse> = pools
        .iter()
        .filter(|p| p.idle_for >= grace && p.in_flight == 0 && p.connections > 0)
        .collect();
    candidates.sort_by(|a, b| {
        b.idle_for
            .cmp(&a.idle_for)
            .then(a.channel_id.cmp(&b.channel_id))
    });
    let mut closed = Vec::new();
    for p in candidates {
        if total <= budget {
            break;
        }
        total -= p.connections;
        closed.push(p.channel_id);
    }
    closed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(channel_id: i32, idle_ms: u64, connections: usize) -> PoolUse {
        PoolUse {
            channel_id,
            idle_for: Duration::from_millis(idle_ms),
            connections,
            in_flight: 0,
        }
    }

    #[test]
    fn the_budget_is_two_batches_of_connections() {
        assert_eq!(budget(400), 800);
        assert_eq!(budget(0), 2);
    }

    #[test]
    fn pools_within_the_budget_are_all_kept() {
        let pools = [pool(1, 5_000, 400), pool(2, 9_000, 400)];
        assert!(to_close(&pools, 800, GRACE).is_empty());
        assert!(to_close(&[], 800, GRACE).is_empty());
    }

    #[test]
    fn the_least_recently_used_pools_close_first_until_the_rest_fit() {
        // Four channels drained one after the other: the newest stays, then the next.
        let pools = [
            pool(1, 9_000, 400),
            pool(2, 6_000, 400),
            pool(3, 3_000, 400),
            pool(4, 0, 400),
        ];
        assert_eq!(to_close(&pools, 800, GRACE), vec![1, 2]);
        assert_eq!(to_close(&pools, 1_000, GRACE), vec![1, 2]);
        assert_eq!(to_close(&pools, 1_200, GRACE), vec![1]);
        assert_eq!(to_close(&pools, 1_600, GRACE), Vec::<i32>::new());
    }

    #[test]
    fn a_small_old_pool_goes_before_a_large_recent_one_only_by_age() {
        // Age decides the order, not size: the old small pool goes first even though the
        // recent large one alone would have made the rest fit.
        let pools = [pool(1, 9_000, 10), pool(2, 2_000, 700), pool(3, 0, 400)];
        assert_eq!(to_close(&pools, 800, GRACE), vec![1, 2]);
    }

    #[test]
    fn pools_used_within_the_grace_or_busy_or_empty_are_never_closed() {
        let mut busy = pool(2, 5_000, 400);
        busy.in_flight = 1;
        let pools = [pool(1, 999, 400), busy, pool(3, 10_000, 0), pool(4, 0, 400)];
        assert!(to_close(&pools, 100, GRACE).is_empty());
        // One that may go goes even when the others alone are over the budget.
        let pools = [pool(1, 999, 400), pool(4, 0, 400), pool(5, 1_000, 1)];
        assert_eq!(to_close(&pools, 100, GRACE), vec![5]);
    }

    #[test]
    fn equal_ages_close_in_channel_order() {
        let pools = [pool(7, 2_000, 300), pool(3, 2_000, 300), pool(9, 0, 300)];
        assert_eq!(to_close(&pools, 600, GRACE), vec![3]);
    }

    #[test]
    fn demand_counts_requests_under_way_and_the_peak_of_three_windows() {
        let d = Arc::new(Demand::default());
        assert_eq!(d.connections(), 0);
        let a = d.start();
        let b = d.start();
        let c = d.start();
        assert_eq!((d.in_flight(), d.connections()), (3, 3));
        drop(b);
        drop(c);
        assert_eq!((d.in_flight(), d.connections()), (1, 3));
        // The burst counts for this window and the two after it: a connection it left idle
        // may stay open up to two idle lives.
        d.new_window();
        assert_eq!(d.connections(), 3);
        d.new_window();
        assert_eq!(d.connections(), 3);
        d.new_window();
        assert_eq!(d.connections(), 1, "one request is still under way");
        drop(a);
        d.new_window();
        assert_eq!((d.in_flight(), d.connections()), (0, 1));
        d.new_window();
        assert_eq!(d.connections(), 1);
        d.new_window();
        assert_eq!(d.connections(), 0);
    }

    #[test]
    fn a_dropped_request_future_ends_its_count() {
        let d = Arc::new(Demand::default());
        let guards: Vec<UnderWay> = (0..5).map(|_| d.start()).collect();
        assert_eq!(d.in_flight(), 5);
        drop(guards);
        assert_eq!(d.in_flight(), 0);
        assert_eq!(d.connections(), 5);
    }
}
