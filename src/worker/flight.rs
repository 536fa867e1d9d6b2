//! Batches in flight. A worker keeps up to [`FLIGHTS`] claimed batches under way at once:
//! their sends run on the worker's runtime while the worker claims the next batch and
//! records what has arrived. What a batch's sends came to is recorded in groups as it
//! arrives, not when the slowest request of the batch ends: a provider that hangs holds
//! back its own messages only, never another channel's records or claims.
//!
//! This module holds the rules (when to claim, when to record) and the bookkeeping of one
//! batch's sends; it touches no Postgres API, so it is tested without a server.

use crate::channels::http::Transmission;
use crate::channels::remote::{Pending, Sent};
use crate::classify::Phase;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// Batches a worker keeps under way at most: one being sent while the next is claimed.
pub const FLIGHTS: usize = 2;

/// How long an arrived outcome may wait for the rest of its batch before it is recorded
/// on its own group: a batch whose requests all answer within this is recorded in one
/// transaction; a slow request holds back the others' records no longer than this.
pub const GROUP_WAIT: Duration = Duration::from_millis(50);

/// Connections one worker may have open to a destination at once: its batches under way.
pub fn connections(batch_size: usize) -> usize {
    batch_size.max(1) * FLIGHTS
}

/// Whether a worker with `outstanding` claimed messages not yet recorded may claim another
/// batch of `batch_size`: at most [`FLIGHTS`] batches are under way at once.
pub fn may_claim(outstanding: usize, batch_size: usize) -> bool {
    outstanding <= (FLIGHTS - 1) * batch_size.max(1)
}

/// Whether what has arrived is recorded now: a batch has nothing left running (all of it
/// can be recorded in one group), or the oldest arrival has waited [`GROUP_WAIT`].
pub fn should_land(a_batch_is_complete: bool, oldest_arrival: Option<Duration>) -> bool {
    a_batch_is_complete || oldest_arrival.is_some_and(|waited| waited >= GROUP_WAIT)
}

/// The sends of one claimed batch: those still running, by the index of their job, and
/// those that arrived and wait to be recorded.
#[derive(Default)]
pub struct Sends {
    running: Vec<(usize, JoinHandle<Sent>)>,
    arrived: Vec<(usize, Sent)>,
    /// When the oldest outcome waiting in `arrived` was noticed.
    arrived_since: Option<Instant>,
}

impl Sends {
    /// Starts every send on `runtime`; they run while the worker does other things.
    pub fn start(runtime: &tokio::runtime::Runtime, sends: Vec<(usize, Pending<Sent>)>) -> Sends {
        Sends {
            running: sends
                .into_iter()
                .map(|(i, send)| (i, runtime.spawn(send)))
                .collect(),
            ..Sends::default()
        }
    }

    /// Moves the sends that ended into `arrived`; `runtime` only collects what has ended.
    pub fn collect(&mut self, runtime: &tokio::runtime::Runtime, now: Instant) {
        if !self.running.iter().any(|(_, h)| h.is_finished()) {
            return;
        }
        let (ended, running): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|(_, h)| h.is_finished());
        self.running = running;
        for (i, handle) in ended {
            let sent = runtime
                .block_on(handle)
                .unwrap_or_else(|e| ended_abnormally(&e));
            self.arrived.push((i, sent));
        }
        self.arrived_since.get_or_insert(now);
    }

    /// Waits for every send still running.
    pub fn collect_all(&mut self, runtime: &tokio::runtime::Runtime) {
        for (i, handle) in std::mem::take(&mut self.running) {
            let sent = runtime
                .block_on(handle)
                .unwrap_or_else(|e| ended_abnormally(&e));
            self.arrived.push((i, sent));
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

    /// Nothing is running any more.
    pub fn all_ended(&self) -> bool {
        self.running.is_empty()
    }

    /// How long the oldest arrived outcome has waited to be recorded.
    pub fn oldest_arrival(&self, now: Instant) -> Option<Duration> {
        self.arrived_since
            .map(|since| now.saturating_duration_since(since))
    }

    /// Sends running or arrived and not yet recorded.
    pub fn outstanding(&self) -> usize {
        self.running.len() + self.arrived.len()
    }
}

/// A send whose task ended without an outcome (it panicked or was cancelled): no answer,
/// so the provider may or may not have acted.
fn ended_abnormally(e: &tokio::task::JoinError) -> Sent {
    Sent::Http(Transmission::Failed {
        phase: Phase::Wait,
        timed_out: false,
        error: format!("send task ended abnormally: {e}"),
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

    #[test]
    fn a_worker_keeps_at_most_two_batches_under_way() {
        assert!(may_claim(0, 200));
        assert!(may_claim(1, 200));
        assert!(
            may_claim(200, 200),
            "one full batch under way: the next is claimed"
        );
        assert!(!may_claim(201, 200));
        assert!(!may_claim(400, 200));
        assert!(may_claim(0, 0), "a batch size of 0 counts as 1");
        assert!(may_claim(1, 0));
        assert!(!may_claim(2, 0));
        assert_eq!(connections(200), 400);
        assert_eq!(connections(0), 2);
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
        let mut sends = Sends::start(&rt, vec![(0, slow), (1, fast)]);
        assert_eq!(sends.outstanding(), 2);
        let started = Instant::now();
        while sends.oldest_arrival(Instant::now()).is_none() {
            assert!(started.elapsed() < Duration::from_secs(10));
            sends.collect(&rt, Instant::now());
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
        sends.collect_all(&rt);
        assert!(sends.all_ended());
        assert!(sends.oldest_arrival(Instant::now()).is_some());
        assert_eq!(sends.take_arrived(), vec![(0, answered(500))]);
        assert_eq!(sends.outstanding(), 0);
    }

    #[test]
    fn the_oldest_arrival_is_kept_while_later_ones_join_it() {
        let rt = runtime();
        let first: Pending<Sent> = Box::pin(async { answered(200) });
        let mut sends = Sends::start(&rt, vec![(3, first)]);
        sends.collect_all(&rt);
        std::thread::sleep(Duration::from_millis(2));
        sends.collect(&rt, Instant::now());
        assert!(
            sends.oldest_arrival(Instant::now()).unwrap() >= Duration::from_millis(2),
            "a later look does not restart the wait of what arrived before"
        );
    }

    #[test]
    fn a_send_that_panics_arrives_as_a_failure_without_an_answer() {
        let rt = runtime();
        let panics: Pending<Sent> = Box::pin(async { panic!("boom") });
        let mut sends = Sends::start(&rt, vec![(0, panics)]);
        sends.collect_all(&rt);
        match sends.take_arrived().pop() {
            Some((0, Sent::Http(Transmission::Failed { phase, error, .. }))) => {
                assert_eq!(phase, Phase::Wait);
                assert!(error.contains("ended abnormally"), "{error}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
