//! Batches in flight. A worker keeps up to [`FLIGHTS`] claimed batches under way at once:
//! their sends run on the worker's runtime while the worker claims the next batch and
//! records what has arrived. What a batch's sends came to is recorded in groups as it
//! arrives, not when the slowest request of the batch ends: a provider that hangs holds
//! back its own messages only, never another channel's records or claims.
//!
//! Nor its claims: once a batch has been under way for [`LINGER_AFTER`], the sends it still
//! runs linger and no longer count against the two batches. With one endpoint in ten
//! answering after a second, the worker would otherwise hold two batches' worth of those
//! requests and claim nothing for the endpoints that answer in milliseconds. Lingering
//! sends have a bound of their own ([`LINGERING_BATCHES`], [`MOST_FLIGHTS`]), so a worker's
//! sockets and the jobs it holds stay bounded whatever its providers do.
//!
//! This module holds the rules (when to claim, when to record) and the bookkeeping of one
//! batch's sends; it touches no Postgres API, so it is tested without a server.

use crate::channels::http::Transmission;
use crate::channels::remote::{Pending, Sent};
use crate::classify::Phase;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Batches a worker keeps under way at most, besides those whose sends linger: one being
/// sent while the next is claimed.
pub const FLIGHTS: usize = 2;

/// How long a batch has been under way before the sends it still runs linger: they no
/// longer count against the worker's room to claim, so that a slow provider's requests
/// (an endpoint that answers after a second, of one customer in ten) do not stop the
/// worker from claiming for the channels whose providers answer in milliseconds. A batch
/// that its providers answer is recorded well within this.
pub const LINGER_AFTER: Duration = Duration::from_millis(100);

/// Batches' worth of lingering sends a worker keeps at most, besides [`FLIGHTS`]: the
/// bound on its open connections ([`most_sends`]) and on the jobs it holds.
pub const LINGERING_BATCHES: usize = 8;

/// Batches a worker keeps under way at most, lingering ones included. A batch keeps its
/// jobs until its last send is recorded, the payloads of those still under way only. A
/// batch whose last sends wait a second for a slow provider stays that long: a worker that
/// claims 60 times a second beside such providers has as many batches under way.
pub const MOST_FLIGHTS: usize = 128;

/// How long an arrived outcome may wait for the rest of its batch before it is recorded
/// on its own group: a batch whose requests all answer within this is recorded in one
/// transaction; a slow request holds back the others' records no longer than this.
pub const GROUP_WAIT: Duration = Duration::from_millis(50);

/// How long the last batch claimed has been under way before the worker claims another
/// beside it only because the last claim was full. A batch that its providers answer
/// sooner is recorded first, and a drain claims and records in turn: on a machine whose
/// cores the drain already fills, a second batch under way adds work and no speed. A
/// commit that wakes the worker, or a message falling due, claims at once.
pub const AHEAD_AFTER: Duration = Duration::from_millis(50);

/// How often a worker with batches under way looks at them when nothing woke it: for the
/// group wait, the claim beside a slow batch, a due time. The ends that matter ring its
/// [`Bell`] and are seen at once.
pub const LOOK_EVERY: Duration = Duration::from_millis(5);

/// Connections one worker may have open to a destination at once: its batches under way
/// (the ceiling of a channel's connection slots, and of the idle connections its pools keep:
/// `pool_budget`). Lingering sends come on top, each on a connection of its own.
pub fn connections(batch_size: usize) -> usize {
    batch_size.max(1) * FLIGHTS
}

/// Sends one worker may have running at once, lingering ones included: the sockets it may
/// hold open (`descriptors`).
pub fn most_sends(batch_size: usize) -> usize {
    batch_size.max(1) * (FLIGHTS + LINGERING_BATCHES)
}

/// What a worker has under way: claimed messages not yet recorded, those of them whose
/// sends linger (running in a batch claimed [`LINGER_AFTER`] ago or longer), and batches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    pub outstanding: usize,
    pub lingering: usize,
    pub flights: usize,
}

/// Whether a worker with `load` under way may claim another batch of `batch_size`: at most
/// [`FLIGHTS`] batches' worth of messages that do not linger, at most
/// [`LINGERING_BATCHES`] more that do, and fewer than [`MOST_FLIGHTS`] batches.
pub fn may_claim(load: Load, batch_size: usize) -> bool {
    let b = batch_size.max(1);
    let lingering = load.lingering.min(load.outstanding);
    load.outstanding - lingering <= (FLIGHTS - 1) * b
        && load.outstanding <= (FLIGHTS - 1 + LINGERING_BATCHES) * b
        && load.flights < MOST_FLIGHTS
}

/// Whether a worker with a batch under way claims another beside it now: there is room
/// ([`may_claim`]), and it was woken (a commit, a due time) or its last batch has been
/// under way for [`AHEAD_AFTER`].
pub fn may_claim_beside(
    load: Load,
    batch_size: usize,
    woken: bool,
    last_claim_age: Duration,
) -> bool {
    may_claim(load, batch_size) && (woken || last_claim_age >= AHEAD_AFTER)
}

/// Whether what has arrived is recorded now: a batch has nothing left running (all of it
/// can be recorded in one group), or the oldest arrival has waited [`GROUP_WAIT`].
pub fn should_land(a_batch_is_complete: bool, oldest_arrival: Option<Duration>) -> bool {
    a_batch_is_complete || oldest_arrival.is_some_and(|waited| waited >= GROUP_WAIT)
}

/// What a worker waits on beside its latch: an `eventfd` that the sends ring when the
/// first and when the last send of a batch ends. A batch's answers are seen as soon as
/// they are complete, without the worker looking every millisecond.
pub struct Bell(OwnedFd);

impl Bell {
    pub fn new() -> std::io::Result<Arc<Bell>> {
        // SAFETY: eventfd takes no pointers; a negative result is an error.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd was just opened and is owned by nothing else.
        Ok(Arc::new(Bell(unsafe { OwnedFd::from_raw_fd(fd) })))
    }

    /// Makes the descriptor readable; any thread may ring.
    pub fn ring(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer; a full counter (EAGAIN) is still readable.
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Makes it unreadable again, before the worker looks at what has arrived.
    pub fn silence(&self) {
        let mut count = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live buffer; EAGAIN when not rung.
        unsafe { libc::read(self.0.as_raw_fd(), count.as_mut_ptr().cast(), count.len()) };
    }

    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// One send's way back: its outcome into the batch's inbox, then a ring of the bell when it
/// is the first or the last of its batch to end. A send that ends without an outcome (its
/// task panicked or was cancelled) hands in a failure when it is dropped.
struct Handover {
    index: usize,
    inbox: Option<mpsc::Sender<(usize, Sent)>>,
    bell: Arc<Bell>,
    left: Arc<AtomicUsize>,
    total: usize,
}

impl Handover {
    fn hand_in(&mut self, sent: Sent) {
        let Some(inbox) = self.inbox.take() else {
            return;
        };
        // The receiver is gone only when the worker no longer waits for this batch.
        let _ = inbox.send((self.index, sent));
        let left = self.left.fetch_sub(1, Ordering::AcqRel) - 1;
        if left == 0 || left + 1 == self.total {
            self.bell.ring();
        }
    }
}

impl Drop for Handover {
    fn drop(&mut self) {
        self.hand_in(ended_abnormally());
    }
}

/// The sends of one claimed batch: how many are still running, and those that arrived and
/// wait to be recorded, by the index of their job.
pub struct Sends {
    running: usize,
    inbox: mpsc::Receiver<(usize, Sent)>,
    arrived: Vec<(usize, Sent)>,
    /// When the oldest outcome waiting in `arrived` was noticed.
    arrived_since: Option<Instant>,
}

impl Sends {
    /// Starts every send on `runtime`; they run while the worker does other things, and
    /// ring `bell` when the first and the last of them end.
    ///
    /// The batch crosses to the runtime's thread as one task, which starts each send as a
    /// task of its own from there. A task spawned from outside the runtime wakes its
    /// thread when that thread sleeps, and a batch handed over send by send woke it about
    /// once a send: a write to its eventfd and a wake-up of the thread each time. Every
    /// send has its handover before it crosses: a send that never starts (the runtime shut
    /// down) hands in a failure when its handover is dropped, like one that ends without
    /// an outcome.
    pub fn start(
        runtime: &tokio::runtime::Handle,
        bell: &Arc<Bell>,
        sends: Vec<(usize, Pending<Sent>)>,
    ) -> Sends {
        let (outbox, inbox) = mpsc::channel();
        let total = sends.len();
        let left = Arc::new(AtomicUsize::new(total));
        let batch: Vec<(Handover, Pending<Sent>)> = sends
            .into_iter()
            .map(|(index, send)| {
                let handover = Handover {
                    index,
                    inbox: Some(outbox.clone()),
                    bell: bell.clone(),
                    left: left.clone(),
                    total,
                };
                (handover, send)
            })
            .collect();
        drop(outbox);
        if !batch.is_empty() {
            runtime.spawn(async move {
                for (mut handover, send) in batch {
                    tokio::spawn(async move {
                        let sent = send.await;
                        handover.hand_in(sent);
                    });
                }
            });
        }
        Sends {
            running: total,
            inbox,
            arrived: Vec::new(),
            arrived_since: None,
        }
    }

    /// Moves the sends that ended into `arrived`.
    pub fn collect(&mut self, now: Instant) {
        let before = self.arrived.len();
        while let Ok(outcome) = self.inbox.try_recv() {
            self.arrived.push(outcome);
        }
        self.running -= self.arrived.len() - before;
        if !self.arrived.is_empty() {
            self.arrived_since.get_or_insert(now);
        }
    }

    /// Waits for every send still running.
    pub fn collect_all(&mut self) {
        while self.running > 0 {
            let outcome = self
                .inbox
                .recv()
                .expect("every send hands in an outcome, also when it ends abnormally");
            self.arrived.push(outcome);
            self.running -= 1;
        }
        if !self.arrived.is_empty() {
            self.arrived_since.get_or_insert_with(Instant::now);
        }
    }

    /// Takes what has arrived, in the order of the jobs, for one record.
    pub fn take_arrived(&mut self) -> Vec<(usize, Sent)> {
        self.arrived_since = None;
        let mut arrived = std::mem::take(&mut self.arrived);
        arrived.sort_by_key(|(i, _)| *i);
        arrived
    }

    /// Sends still running.
    pub fn running(&self) -> usize {
        self.running
    }

    /// Nothing is running any more.
    pub fn all_ended(&self) -> bool {
        self.running == 0
    }

    /// How long the oldest arrived outcome has waited to be recorded.
    pub fn oldest_arrival(&self, now: Instant) -> Option<Duration> {
        self.arrived_since
            .map(|since| now.saturating_duration_since(since))
    }

    /// Sends running or arrived and not yet recorded.
    pub fn outstanding(&self) -> usize {
        self.running + self.arrived.len()
    }
}

/// A send whose task ended without an outcome (it panicked or was cancelled): no answer,
/// so the provider may or may not have acted.
fn ended_abnormally() -> Sent {
    Sent::Http(Transmission::Failed {
        phase: Phase::Wait,
        timed_out: false,
        error: "send task ended abnormally: it stopped without an outcome".into(),
        elapsed_ms: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(status: u16) -> Sent {
        Sent::Http(Transmission::Answered {
            status,
            retry_after: None,
            external_id: None,
            body_complete: true,
            body_error: None,
            excerpt: None,
            elapsed_ms: 0,
        })
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    }

    fn bell() -> Arc<Bell> {
        Bell::new().unwrap()
    }

    /// Whether the bell's descriptor is readable now.
    fn rung(bell: &Bell) -> bool {
        let mut fds = libc::pollfd {
            fd: bell.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        unsafe { libc::poll(&mut fds, 1, 0) == 1 }
    }

    #[test]
    fn the_bell_rings_when_the_first_and_the_last_send_of_a_batch_end() {
        let rt = runtime();
        let bell = bell();
        assert!(!rung(&bell));
        let (release, held) = tokio::sync::oneshot::channel::<()>();
        let slow: Pending<Sent> = Box::pin(async move {
            let _ = held.await;
            answered(500)
        });
        let fast: Pending<Sent> = Box::pin(async { answered(200) });
        let third: Pending<Sent> = Box::pin(async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            answered(201)
        });
        let mut sends = Sends::start(rt.handle(), &bell, vec![(0, slow), (1, fast), (2, third)]);
        let started = Instant::now();
        while !rung(&bell) {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the first end rang no bell"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        bell.silence();
        assert!(!rung(&bell));
        while sends.arrived.len() < 2 {
            assert!(started.elapsed() < Duration::from_secs(10));
            sends.collect(Instant::now());
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!rung(&bell), "the second of three ends quietly");
        release.send(()).unwrap();
        while !rung(&bell) {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the last end rang no bell"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        sends.collect(Instant::now());
        assert!(sends.all_ended(), "what rang has arrived");
        assert_eq!(sends.outstanding(), 3);
    }

    #[test]
    fn a_worker_keeps_at_most_two_batches_under_way() {
        assert!(may_claim(load(0, 0, 0), 200));
        assert!(may_claim(load(1, 0, 1), 200));
        assert!(
            may_claim(load(200, 0, 1), 200),
            "one full batch under way: the next is claimed"
        );
        assert!(!may_claim(load(201, 0, 2), 200));
        assert!(!may_claim(load(400, 0, 2), 200));
        assert!(may_claim(load(0, 0, 0), 0), "a batch size of 0 counts as 1");
        assert!(may_claim(load(1, 0, 1), 0));
        assert!(!may_claim(load(2, 0, 2), 0));
        assert_eq!(connections(200), 400);
        assert_eq!(connections(0), 2);
        assert_eq!(most_sends(200), 2_000);
    }

    fn load(outstanding: usize, lingering: usize, flights: usize) -> Load {
        Load {
            outstanding,
            lingering,
            flights,
        }
    }

    #[test]
    fn sends_that_linger_leave_room_to_claim_up_to_their_own_bound() {
        // Two batches under way, a tenth of each still running past LINGER_AFTER: the
        // worker claims beside them.
        assert!(may_claim(load(400, 40 + 200, 2), 200));
        assert!(!may_claim(load(400, 199, 2), 200), "201 that do not linger");
        // Lingering sends count up to their own bound.
        let most = (FLIGHTS - 1 + LINGERING_BATCHES) * 200;
        assert!(may_claim(load(most, most, 20), 200));
        assert!(!may_claim(load(most + 1, most + 1, 20), 200));
        // And batches up to theirs, however few messages they hold.
        assert!(may_claim(
            load(MOST_FLIGHTS - 1, MOST_FLIGHTS - 1, MOST_FLIGHTS - 1),
            200
        ));
        assert!(!may_claim(
            load(MOST_FLIGHTS, MOST_FLIGHTS, MOST_FLIGHTS),
            200
        ));
        // A count of lingering sends above the outstanding ones (read at another moment)
        // frees nothing more.
        assert!(!may_claim(load(201, 500, 2), 1));
        // The bounds hold for every load: never more than most_sends running after a
        // claim of a whole batch.
        for outstanding in (0..=3_000).step_by(7) {
            for lingering in (0..=outstanding).step_by(13) {
                for flights in [0, 1, 2, 10, MOST_FLIGHTS - 1, MOST_FLIGHTS] {
                    if may_claim(load(outstanding, lingering, flights), 200) {
                        assert!(outstanding + 200 <= most_sends(200));
                        assert!(outstanding - lingering + 200 <= connections(200));
                        assert!(flights < MOST_FLIGHTS);
                    }
                }
            }
        }
    }

    #[test]
    fn a_second_batch_is_claimed_beside_a_slow_one_or_when_woken() {
        let soon = Duration::from_millis(1);
        let one = load(200, 0, 1);
        assert!(
            !may_claim_beside(one, 200, false, soon),
            "a fast batch is recorded first"
        );
        assert!(!may_claim_beside(one, 200, false, AHEAD_AFTER - soon));
        assert!(may_claim_beside(one, 200, false, AHEAD_AFTER));
        assert!(
            may_claim_beside(one, 200, true, Duration::ZERO),
            "a commit claims at once"
        );
        assert!(may_claim_beside(load(1, 0, 1), 200, true, soon));
        assert!(
            !may_claim_beside(load(201, 0, 2), 200, true, AHEAD_AFTER),
            "no room"
        );
        assert!(!may_claim_beside(
            load(400, 0, 2),
            200,
            false,
            Duration::from_secs(60)
        ));
    }

    #[test]
    fn what_arrived_is_recorded_when_its_batch_is_complete_or_has_waited_long_enough() {
        assert!(!should_land(false, None));
        assert!(should_land(true, None));
        assert!(!should_land(false, Some(Duration::from_millis(49))));
        assert!(should_land(false, Some(GROUP_WAIT)));
        assert!(should_land(true, Some(Duration::ZERO)));
    }

    #[test]
    fn a_slow_send_does_not_hold_back_the_outcomes_that_arrived() {
        let rt = runtime();
        let (release, held) = tokio::sync::oneshot::channel::<()>();
        let slow: Pending<Sent> = Box::pin(async move {
            let _ = held.await;
            answered(500)
        });
        let fast: Pending<Sent> = Box::pin(async { answered(200) });
        let mut sends = Sends::start(rt.handle(), &bell(), vec![(0, slow), (1, fast)]);
        assert_eq!(sends.outstanding(), 2);
        let started = Instant::now();
        while sends.oldest_arrival(Instant::now()).is_none() {
            assert!(started.elapsed() < Duration::from_secs(10));
            sends.collect(Instant::now());
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!sends.all_ended());
        assert_eq!(
            sends.outstanding(),
            2,
            "arrived and not yet recorded still counts"
        );
        assert_eq!(sends.take_arrived(), vec![(1, answered(200))]);
        assert_eq!(sends.outstanding(), 1);
        assert_eq!(sends.oldest_arrival(Instant::now()), None);

        release.send(()).unwrap();
        sends.collect_all();
        assert!(sends.all_ended());
        assert!(sends.oldest_arrival(Instant::now()).is_some());
        assert_eq!(sends.take_arrived(), vec![(0, answered(500))]);
        assert_eq!(sends.outstanding(), 0);
    }

    #[test]
    fn the_oldest_arrival_is_kept_while_later_ones_join_it() {
        let rt = runtime();
        let first: Pending<Sent> = Box::pin(async { answered(200) });
        let mut sends = Sends::start(rt.handle(), &bell(), vec![(3, first)]);
        sends.collect_all();
        std::thread::sleep(Duration::from_millis(2));
        sends.collect(Instant::now());
        assert!(
            sends.oldest_arrival(Instant::now()).unwrap() >= Duration::from_millis(2),
            "a later look does not restart the wait of what arrived before"
        );
    }

    #[test]
    fn a_send_that_panics_arrives_as_a_failure_without_an_answer() {
        let rt = runtime();
        let panics: Pending<Sent> = Box::pin(async { panic!("boom") });
        let mut sends = Sends::start(rt.handle(), &bell(), vec![(0, panics)]);
        sends.collect_all();
        match sends.take_arrived().pop() {
            Some((0, Sent::Http(Transmission::Failed { phase, error, .. }))) => {
                assert_eq!(phase, Phase::Wait);
                assert!(error.contains("ended abnormally"), "{error}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn a_batch_dropped_before_it_started_arrives_as_failures() {
        // A runtime that no thread drives: the sends wait in its queue until it is dropped.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let batch: Vec<(usize, Pending<Sent>)> = (0..3)
            .map(|i| (i, Box::pin(async { answered(200) }) as Pending<Sent>))
            .collect();
        let bell = bell();
        let mut sends = Sends::start(rt.handle(), &bell, batch);
        drop(rt);
        sends.collect_all();
        let mut arrived = sends.take_arrived();
        arrived.sort_by_key(|(i, _)| *i);
        assert_eq!(
            arrived.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            [0, 1, 2]
        );
        for (_, sent) in arrived {
            assert!(
                matches!(
                    sent,
                    Sent::Http(Transmission::Failed {
                        phase: Phase::Wait,
                        ..
                    })
                ),
                "{sent:?}"
            );
        }
        assert!(rung(&bell), "the last failure rings the bell");
    }
}
