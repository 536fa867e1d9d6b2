//! How many requests of an HTTP channel a worker sends at once.
//!
//! A batch's requests are started together, but each waits for one of its channel's
//! connection slots before it is written. A provider that answers fast then serves a
//! batch over a few keep-alive connections, one request after another on each, instead of
//! one connection per request. On loopback, with the machine otherwise quiet, 32 slots a
//! worker took its send thread about 25 µs a request against 30 with every request of a
//! batch at once, and the provider 14 against 16; beside other load on the same cores the
//! difference was within the drains' spread (BENCHMARKS.md).
//!
//! A slower provider must not pay for it. A request waits at most [`OVERFLOW_AFTER`] for
//! a slot; then it goes on without one, on a connection of its own, as every request did
//! before there were slots. So no request is held back by more than [`OVERFLOW_AFTER`]: a
//! claim's lease, which covers the channel's timeout and a margin of seconds
//! (`worker::lease`), still covers every request of its batch. The channel gets one slot
//! more (up to the connections the worker's batches under way may use) for each request
//! that overflowed, and for each answer that gives a slot back while others wait, as long
//! as answers come about as fast as the fastest seen ([`Slots::released`]): a provider
//! that answers in 3 or 20 ms, with room for more at once, soon has a slot for each
//! request; a machine whose CPU is what requests queue for (loopback) keeps few. A
//! channel without an overflow or a new slot for [`SETTLE_AFTER`] halves its slots, not
//! below [`FLOOR`], and learns its answers' times anew.
//!
//! [`Slots`] holds the rule on plain numbers and is tested without a runtime;
//! [`ConnectionSlots`] applies it to a tokio semaphore.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The slots a channel starts with in each worker.
pub const FLOOR: usize = 32;

/// Longest a request waits for a slot before it goes on without one.
pub const OVERFLOW_AFTER: Duration = Duration::from_millis(20);

/// Time without an overflow after which a channel's slots halve.
pub const SETTLE_AFTER: Duration = Duration::from_secs(10);

/// A channel's slots, when they last changed or overflowed (ms on the caller's clock), and
/// how long requests have held them since they last settled (µs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slots {
    pub limit: usize,
    pub floor: usize,
    pub ceiling: usize,
    changed_at_ms: u64,
    overflowed_at_ms: Option<u64>,
    /// The shortest hold.
    fastest_us: Option<u64>,
    /// The typical hold: each hold moves it by an eighth of the difference.
    typical_us: Option<u64>,
    /// Holds seen since the slots last settled.
    holds: usize,
}

impl Slots {
    /// [`FLOOR`] slots (fewer when `ceiling` is lower), for a channel whose batches under
    /// way may use `ceiling` connections at once.
    pub fn new(ceiling: usize, now_ms: u64) -> Slots {
        let ceiling = ceiling.max(1);
        let floor = FLOOR.min(ceiling);
        Slots {
            limit: floor,
            floor,
            ceiling,
            changed_at_ms: now_ms,
            overflowed_at_ms: None,
            fastest_us: None,
            typical_us: None,
            holds: 0,
        }
    }

    /// One slot more, up to the ceiling. Returns the slots added (0 or 1).
    fn grow(&mut self, now_ms: u64) -> usize {
        if self.limit >= self.ceiling {
            return 0;
        }
        self.limit += 1;
        self.changed_at_ms = now_ms;
        1
    }

    /// A request waited [`OVERFLOW_AFTER`] without a slot and went on without one: the
    /// channel gets one slot more. Returns the slots added (0 or 1).
    pub fn overflowed(&mut self, now_ms: u64) -> usize {
        self.overflowed_at_ms = Some(now_ms);
        self.grow(now_ms)
    }

    /// A request gave back the slot it held for `held_us` while `waiting` others waited
    /// for one. The channel gets one slot more when others wait and the typical hold is
    /// within twice the fastest: the provider answers about as fast as it can, so the
    /// wait is the slots' own and more slots send more. A typical hold further from the
    /// fastest is queueing somewhere (at the provider, or for this machine's CPU, as on
    /// loopback): more requests at once would only queue more. The first [`FLOOR`] holds
    /// only teach: they include new connections, slower than any answer after them.
    /// Returns the slots added.
    pub fn released(&mut self, held_us: u64, waiting: usize, now_ms: u64) -> usize {
        let fastest = self.fastest_us.map_or(held_us, |f| f.min(held_us));
        let typical = self.typical_us.map_or(held_us, |t| {
            if held_us >= t {
                t + (held_us - t) / 8
            } else {
                t - (t - held_us) / 8
            }
        });
        self.fastest_us = Some(fastest);
        self.typical_us = Some(typical);
        self.holds += 1;
        if self.holds > FLOOR && waiting > 0 && typical <= fastest.saturating_mul(2) {
            self.grow(now_ms)
        } else {
            0
        }
    }

    /// Before a request takes a slot: after [`SETTLE_AFTER`] without an overflow or a
    /// change, the limit halves, not below the floor, and the holds are learnt anew.
    /// Returns the slots to remove; those that cannot be removed (held by requests under
    /// way) are given back with [`Slots::kept`].
    pub fn settle(&mut self, now_ms: u64) -> usize {
        let quiet_since = self.overflowed_at_ms.unwrap_or(0).max(self.changed_at_ms);
        if self.limit <= self.floor
            || now_ms.saturating_sub(quiet_since) < SETTLE_AFTER.as_millis() as u64
        {
            return 0;
        }
        let settled = (self.limit / 2).max(self.floor);
        let removed = self.limit - settled;
        self.limit = settled;
        self.changed_at_ms = now_ms;
        self.fastest_us = None;
        self.typical_us = None;
        self.holds = 0;
        removed
    }

    /// `n` of the slots [`Slots::settle`] removed were held and stay.
    pub fn kept(&mut self, n: usize) {
        self.limit = (self.limit + n).min(self.ceiling);
    }
}

/// A channel's slots in one worker: a semaphore of [`Slots::limit`] permits.
pub struct ConnectionSlots {
    permits: Arc<Semaphore>,
    rule: Mutex<Slots>,
    /// Requests waiting for a slot now.
    waiting: AtomicUsize,
    epoch: Instant,
}

/// One request's slot, given back when dropped; `None` inside for a request that went on
/// without one.
pub struct Slot {
    permit: Option<OwnedSemaphorePermit>,
    taken_at: Instant,
    slots: Arc<ConnectionSlots>,
}

impl Slot {
    /// Whether the request holds a slot (it did not overflow).
    pub fn held(&self) -> bool {
        self.permit.is_some()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.permit.is_some() {
            let held_us = self.taken_at.elapsed().as_micros() as u64;
            let waiting = self.slots.waiting.load(Ordering::Relaxed);
            let now_ms = self.slots.now_ms();
            let added = self.slots.rule().released(held_us, waiting, now_ms);
            self.slots.permits.add_permits(added);
        }
    }
}

/// Counts a request among the waiting while it lives (also when its wait is cancelled).
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(count: &'a AtomicUsize) -> Waiting<'a> {
        count.fetch_add(1, Ordering::Relaxed);
        Waiting(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ConnectionSlots {
    /// Slots for a channel whose batches under way may use `ceiling` connections at once.
    pub fn new(ceiling: usize) -> ConnectionSlots {
        let rule = Slots::new(ceiling, 0);
        ConnectionSlots {
            permits: Arc::new(Semaphore::new(rule.limit)),
            rule: Mutex::new(rule),
            waiting: AtomicUsize::new(0),
            epoch: Instant::now(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn rule(&self) -> std::sync::MutexGuard<'_, Slots> {
        // The rule is plain numbers: a panic while it was held left them whole.
        self.rule.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for one request, held until the [`Slot`] is dropped; one that holds none
    /// when no slot came free within [`OVERFLOW_AFTER`] (the request goes on without one,
    /// and the slots grow).
    pub async fn take(self: &Arc<Self>) -> Slot {
        let remove = self.rule().settle(self.now_ms());
        if remove > 0 {
            let removed = self.permits.forget_permits(remove);
            if removed < remove {
                self.rule().kept(remove - removed);
            }
        }
        let permit = match self.permits.clone().try_acquire_owned() {
            Ok(permit) => Some(permit),
            Err(_) => {
                let _waiting = Waiting::new(&self.waiting);
                match tokio::time::timeout(OVERFLOW_AFTER, self.permits.clone().acquire_owned())
                    .await
                {
                    Ok(Ok(permit)) => Some(permit),
                    _ => None,
                }
            }
        };
        if permit.is_none() {
            let added = self.rule().overflowed(self.now_ms());
            self.permits.add_permits(added);
        }
        Slot {
            permit,
            taken_at: Instant::now(),
            slots: self.clone(),
        }
    }

    /// The slots now.
    pub fn limit(&self) -> usize {
        self.rule().limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAIT: u64 = OVERFLOW_AFTER.as_millis() as u64;
    const SETTLE: u64 = SETTLE_AFTER.as_millis() as u64;

    #[test]
    fn a_channel_starts_with_the_floor_or_its_ceiling_when_lower() {
        assert_eq!(Slots::new(400, 0).limit, FLOOR);
        assert_eq!(Slots::new(10, 0).limit, 10);
        assert_eq!(Slots::new(10, 0).floor, 10);
        assert_eq!(Slots::new(0, 0).limit, 1);
    }

    #[test]
    fn each_overflow_adds_a_slot_up_to_the_ceiling() {
        let mut s = Slots::new(40, 0);
        for t in 1..=8 {
            assert_eq!(s.overflowed(t), 1, "at {t}");
        }
        assert_eq!(s.limit, 40);
        assert_eq!(s.overflowed(9), 0);
        assert_eq!(s.limit, 40);
    }

    #[test]
    fn the_overflows_of_one_batch_make_room_for_the_next() {
        // A batch of 200 to a provider slower than the wait: 32 take slots, 168 overflow.
        let mut s = Slots::new(400, 0);
        let added: usize = (0..168).map(|_| s.overflowed(WAIT)).sum();
        assert_eq!(added, 168);
        assert_eq!(s.limit, 200);
    }

    #[test]
    fn slots_halve_after_a_quiet_spell_down_to_the_floor() {
        let mut s = Slots::new(400, 0);
        for _ in 0..224 {
            s.overflowed(3 * WAIT);
        }
        assert_eq!(s.limit, 256);
        assert_eq!(s.settle(3 * WAIT + SETTLE - 1), 0);
        assert_eq!(s.settle(3 * WAIT + SETTLE), 128);
        assert_eq!(s.limit, 128);
        // The next halving waits for another quiet spell from this change.
        assert_eq!(s.settle(3 * WAIT + SETTLE + 1), 0);
        assert_eq!(s.settle(3 * WAIT + 2 * SETTLE), 64);
        assert_eq!(s.settle(3 * WAIT + 3 * SETTLE), 32);
        assert_eq!(s.settle(3 * WAIT + 9 * SETTLE), 0);
        assert_eq!(s.limit, FLOOR);
    }

    #[test]
    fn an_overflow_postpones_the_halving_also_at_the_ceiling() {
        let mut s = Slots::new(FLOOR + 1, 0);
        assert_eq!(s.overflowed(WAIT), 1);
        assert_eq!(s.overflowed(WAIT + 1), 0, "at the ceiling");
        assert_eq!(s.settle(WAIT + SETTLE), 0);
        assert_eq!(s.settle(WAIT + 1 + SETTLE), 1);
        assert_eq!(s.limit, FLOOR);
    }

    #[test]
    fn slots_held_when_they_would_be_removed_stay() {
        let mut s = Slots::new(400, 0);
        for _ in 0..32 {
            s.overflowed(WAIT);
        }
        assert_eq!(s.settle(WAIT + SETTLE), 32);
        s.kept(20);
        assert_eq!(s.limit, 52);
        s.kept(1_000);
        assert_eq!(s.limit, 400);
    }

    #[test]
    fn the_floor_never_settles_and_a_ceiling_of_the_floor_never_grows() {
        let mut s = Slots::new(FLOOR, 0);
        assert_eq!(s.overflowed(WAIT), 0);
        assert_eq!(s.settle(100 * SETTLE), 0);
        assert_eq!(s.limit, FLOOR);
    }

    #[test]
    fn a_provider_answering_about_as_fast_as_it_can_gets_a_slot_for_each_answer_while_others_wait()
    {
        let mut s = Slots::new(400, 0);
        // The first answers only teach, however steady.
        for i in 0..FLOOR as u64 {
            assert_eq!(s.released(20_000 + i, 5, 1), 0, "answer {i}");
        }
        // 20 ms answers, steady: every answer with others waiting adds a slot.
        for i in 0..10 {
            assert_eq!(s.released(20_000 + i * 100, 5, 1), 1, "answer {i}");
        }
        assert_eq!(s.limit, FLOOR + 10);
        // Nobody waits: nothing added, however fast.
        assert_eq!(s.released(20_000, 0, 1), 0);
        assert_eq!(s.limit, FLOOR + 10);
    }

    #[test]
    fn answers_slowed_by_queueing_add_no_slot() {
        let mut s = Slots::new(400, 0);
        // One fast answer (the provider idle), then answers ten times slower: requests
        // queue for the CPU or at the provider.
        assert_eq!(s.released(200, 0, 1), 0);
        let added: usize = (0..200).map(|_| s.released(2_000, 50, 1)).sum();
        // The typical hold passes twice the fastest while the first answers still teach.
        assert_eq!(added, 0);
        assert_eq!(s.released(2_000, 50, 1), 0);
        // Answers back near the fastest add again once the typical hold has followed.
        let added: usize = (0..200).map(|_| s.released(250, 50, 1)).sum();
        assert!(added > 100, "{added}");
    }

    #[test]
    fn settling_forgets_the_holds() {
        let mut s = Slots::new(400, 0);
        s.released(200, 0, 0);
        for _ in 0..50 {
            s.released(5_000, 0, 0);
        }
        assert_eq!(s.released(5_000, 1, 0), 0, "far from the fastest");
        assert_eq!(s.settle(SETTLE), 0, "at the floor: nothing to settle");
        s.overflowed(1);
        assert_eq!(s.settle(1 + SETTLE), 1);
        // Learnt anew: after the first holds, 5 ms is the fastest.
        for _ in 0..FLOOR {
            assert_eq!(s.released(5_000, 1, 1 + SETTLE), 0);
        }
        assert_eq!(s.released(5_000, 1, 1 + SETTLE), 1);
    }

    /// `n` slots taken one after another, held until the vector is dropped or emptied.
    async fn take_n(slots: &Arc<ConnectionSlots>, n: usize) -> Vec<Slot> {
        let mut held = Vec::with_capacity(n);
        for _ in 0..n {
            held.push(slots.take().await);
        }
        held
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    #[test]
    fn a_request_without_a_free_slot_goes_on_after_the_wait_and_the_slots_grow() {
        runtime().block_on(async {
            let slots = Arc::new(ConnectionSlots::new(4 * FLOOR));
            let held = take_n(&slots, FLOOR).await;
            assert!(held.iter().all(Slot::held), "a free slot is taken at once");
            let started = Instant::now();
            assert!(!slots.take().await.held(), "no slot came free");
            let waited = started.elapsed();
            assert!(waited >= OVERFLOW_AFTER, "{waited:?}");
            assert!(waited < OVERFLOW_AFTER * 10, "{waited:?}");
            assert_eq!(slots.limit(), FLOOR + 1);
            // The slot added is free at once.
            assert!(slots.take().await.held());
        });
    }

    #[test]
    fn a_request_that_gives_its_slot_back_to_waiting_ones_adds_one_for_them() {
        runtime().block_on(async {
            let slots = Arc::new(ConnectionSlots::new(4 * FLOOR));
            // The first holds teach: FLOOR answers of about 5 ms.
            let held = take_n(&slots, FLOOR).await;
            tokio::time::sleep(Duration::from_millis(5)).await;
            drop(held);
            assert_eq!(slots.limit(), FLOOR, "nobody waited");
            let mut held = take_n(&slots, FLOOR).await;
            let waiters: Vec<_> = (0..2)
                .map(|_| {
                    let slots = slots.clone();
                    tokio::spawn(async move { slots.take().await.held() })
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(5)).await;
            // A slot given back after as long as the fastest, with two waiting: both get
            // one.
            drop(held.pop());
            for w in waiters {
                assert!(w.await.unwrap(), "a waiter got a slot");
            }
            assert_eq!(slots.limit(), FLOOR + 1);
        });
    }

    #[test]
    fn a_waiting_request_takes_the_slot_another_gives_back() {
        runtime().block_on(async {
            let slots = Arc::new(ConnectionSlots::new(FLOOR));
            let mut held = take_n(&slots, FLOOR).await;
            let waiter = {
                let slots = slots.clone();
                tokio::spawn(async move { slots.take().await.held() })
            };
            tokio::time::sleep(Duration::from_millis(2)).await;
            drop(held.pop());
            assert!(waiter.await.unwrap(), "the slot given back was taken");
        });
    }
}
