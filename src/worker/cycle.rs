//! One worker cycle, in named phases: claim (one transaction); sort and start the sends with
//! no transaction open (`send`); wait for what the batches under way come to, and run the
//! `sql` effects and record every outcome that arrived (one transaction). A sweep for lost
//! leases and due lookups (at most every 250 ms, see `sweep`; one transaction, then the
//! lookups) runs beside the sends of a busy worker's claim, and after the record of a
//! worker that was idle. Up to [`flight::FLIGHTS`] batches are under way at once, and beside
//! them batches whose last sends linger at a slow provider (`flight`).

use super::claim::{self, ClaimMemory, LookupJob, NextDue};
use super::claimed::{Channels, Job};
use super::decide;
use super::due_channels;
use super::flight::{self, Bell, Sends};
use super::record::{self, Outcomes, Tally};
use super::send::{self, unusable_channel};
use super::sweep::SweepClock;
use super::{flow, key_hold, lease, recovery, retention};
use crate::channels::fence::Fence;
use crate::channels::lookup::Lookup;
use crate::channels::options::Kind;
use crate::channels::pool_budget;
use crate::channels::remote::Remotes;
use crate::channels::sql_effect;
use crate::classify::Class;
use crate::clock::now_ms;
use crate::gucs::{self, FaultPoint};
use crate::identity;
use crate::outbox::state::State;
use crate::random::SplitMix64;
use crate::reconcile;
use crate::worker_locks;
use crate::worker_slots as slots;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};
use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Lost leases recovered per sweep at most.
const RECOVER_PER_SWEEP: i64 = 500;
/// Reconcile lookups per sweep at most.
const LOOKUPS_PER_SWEEP: i32 = 50;
/// Retention statements per retention run at most.
const RETENTION_ROUNDS: usize = 20;

pub struct CycleReport {
    /// Batches are under way, or more may be due: the worker goes on without sleeping.
    pub busy: bool,
    pub next_due: Option<NextDue>,
}

/// What the claim transaction hands to the rest of the cycle.
struct Claimed {
    channels: Rc<Channels>,
    jobs: Vec<Job>,
    /// When the next message is due, for an idle worker's sleep.
    next_due: Option<NextDue>,
    /// The claim lock could not be had within [`CLAIM_LOCK_WAIT`], and the claim ran
    /// without it (`claim::claim_unserialized`): the process that held it then, when it was
    /// still held.
    lock_busy: Option<Option<i32>>,
}

/// Longest wait for the claim lock (`worker_locks::CLAIMS`). A claim holds it for
/// milliseconds; a holder that keeps it longer is stopped or stuck, and the worker claims
/// without it (`claim::claim_unserialized`).
const CLAIM_LOCK_WAIT: Duration = Duration::from_secs(1);
/// How often idle pools beyond the budget are looked for (`keep_pools`).
const TRIM_POOLS_EVERY: Duration = Duration::from_millis(100);
/// The wait for the claim lock while its holder has kept it past [`CLAIM_LOCK_WAIT`] within
/// the last [`LOCK_BUSY_LOG_EVERY`]: a claim holds it for milliseconds.
const CLAIM_LOCK_WAIT_WHILE_BUSY: Duration = Duration::from_millis(50);
/// The first pause before a failed record is tried again, and the longest.
const RECORD_RETRY_FIRST: Duration = Duration::from_millis(100);
const RECORD_RETRY_MAX: Duration = Duration::from_secs(5);
/// Tries of a failing record once the worker is asked to stop.
const RECORD_TRIES_AT_STOP: u32 = 3;
/// How often a worker says in the log that the claim lock is held past [`CLAIM_LOCK_WAIT`].
const LOCK_BUSY_LOG_EVERY: Duration = Duration::from_secs(10);

/// A claimed batch under way (`flight`): its sends run on the runtime, its other outcomes
/// and its `sql` effects wait for its first record.
struct Flight {
    /// Shared with the claim and the other flights while no channel changed.
    channels: Rc<Channels>,
    jobs: Vec<Job>,
    /// Outcomes known without a send (the barrier, unusable channels).
    known: Outcomes,
    /// Jobs (by index) whose `sql` effect runs in the flight's first record.
    effects: Vec<usize>,
    sends: Sends,
    claimed_at: Instant,
}

impl Flight {
    /// Its messages not yet recorded: sends running or arrived, outcomes known at the
    /// claim, `sql` effects.
    fn outstanding(&self) -> usize {
        self.sends.outstanding()
            + self.known.delivered.len()
            + self.known.settled.len()
            + self.effects.len()
    }

    /// Its sends still running once it has been under way for `flight::LINGER_AFTER`.
    fn lingering(&self, now: Instant) -> usize {
        if now.saturating_duration_since(self.claimed_at) >= flight::LINGER_AFTER {
            self.sends.running()
        } else {
            0
        }
    }

    /// Nothing is left to send or to record.
    fn landed(&self) -> bool {
        self.outstanding() == 0
    }

    /// What it has is to be recorded now: all of it (nothing is running), or what arrived
    /// and has waited long enough for the rest (`flight::should_land`). Outcomes known at
    /// the claim count as arrived then, so a hanging send does not hold them back. A flight
    /// that is not ready is left whole for a later record, not split by another flight's.
    fn ready(&self, now: Instant) -> bool {
        let known_since = (!self.known.is_empty() || !self.effects.is_empty())
            .then(|| now.saturating_duration_since(self.claimed_at));
        !self.landed()
            && flight::should_land(
                self.sends.all_ended(),
                self.sends.oldest_arrival(now).max(known_since),
            )
    }
}

/// One flight's share of a record transaction.
struct Landing {
    flight: usize,
    effects: Vec<usize>,
    sent: Vec<usize>,
    outcomes: Outcomes,
}

pub struct Worker {
    index: usize,
    pid: i32,
    runtime: crate::runtime::IoRuntime,
    /// The remote channels (HTTP pools, NATS connections).
    remotes: Remotes,
    /// The channels the pools were last matched with, and when idle pools were last closed
    /// (`keep_pools`).
    pools_kept_for: Option<Rc<Channels>>,
    pools_trimmed_at: Option<Instant>,
    /// The random source of retry jitter, seeded per worker process.
    jitter: SplitMix64,
    first_cycle: bool,
    longest_retry_horizon_ms: u64,
    /// Where the next claim of each channel starts, measured on the clock of `started`.
    memory: ClaimMemory,
    /// Where the next claim's walk of the due index starts (`due_channels`).
    rotation: due_channels::Rotation,
    /// When lost leases and due lookups were last looked for, on the clock of `started`.
    sweeps: SweepClock,
    /// When messages waiting behind their ordering key were last held, and from where.
    key_holds: key_hold::HoldClock,
    started: Instant,
    /// The batches under way, oldest first.
    flights: Vec<Flight>,
    /// Whether the next cycle claims: more may be due (the last claim was full, a record
    /// freed room, a commit woke the worker).
    claim_wanted: bool,
    /// With batches under way: when to claim again unwoken, as an idle worker would (the
    /// next message is due, or at once when a sweep took attempts back or ran lookups).
    claim_at: Option<Instant>,
    /// What the sends ring when a batch's first and last answers arrive.
    bell: Arc<Bell>,
    /// Claims that took messages, since the worker started.
    claims_made: u64,
    /// The role every transaction of the worker runs as (`outbox.role`).
    pub role: pgrx::pg_sys::Oid,
    /// When the worker last said that the claim lock was held too long.
    lock_busy_told: Option<Instant>,
}

/// Dies at a fault-injection point, as a crash would: nothing after this point happens, an
/// open transaction is rolled back, and the postmaster starts a new worker. Armed with the
/// stall of that point, the worker stops itself there instead (`SIGSTOP`, every thread),
/// as a paused VM would, and goes on from there once it gets a `SIGCONT`.
fn crash_if<'a>(point: FaultPoint, armed: FaultPoint, jobs: impl IntoIterator<Item = &'a Job>) {
    if point != armed && point.stall() != armed {
        return;
    }
    let jobs: Vec<&Job> = jobs.into_iter().collect();
    if !jobs.iter().any(|j| j.attempt == 1) {
        return;
    }
    let ids: Vec<i64> = jobs.iter().map(|j| j.message_id).collect();
    if armed == point.stall() {
        if !slots::take_stall() {
            return;
        }
        log!(
            "outbox_delivery: fault injection {}: worker stops itself with messages {ids:?} in flight",
            armed.as_str()
        );
        // SAFETY: raise takes no pointers; SIGSTOP stops the whole process.
        unsafe { libc::raise(libc::SIGSTOP) };
        log!(
            "outbox_delivery: fault injection {}: worker runs again",
            armed.as_str()
        );
        return;
    }
    log!(
        "outbox_delivery: fault injection {}: worker dies with messages {ids:?} in flight",
        point.as_str()
    );
    unsafe { pgrx::pg_sys::proc_exit(1) };
}

impl Worker {
    pub fn new(
        index: usize,
        pid: i32,
        runtime: crate::runtime::IoRuntime,
        bell: Arc<Bell>,
        role: pgrx::pg_sys::Oid,
    ) -> Worker {
        Worker {
            index,
            pid,
            runtime,
            remotes: Remotes::default(),
            pools_kept_for: None,
            pools_trimmed_at: None,
            jitter: SplitMix64::new(SplitMix64::seed_from(now_ms(), pid)),
            first_cycle: true,
            longest_retry_horizon_ms: 0,
            memory: ClaimMemory::default(),
            rotation: due_channels::Rotation::default(),
            sweeps: SweepClock::default(),
            key_holds: key_hold::HoldClock::default(),
            started: Instant::now(),
            flights: Vec::new(),
            claim_wanted: true,
            claim_at: None,
            bell,
            claims_made: 0,
            role,
            lock_busy_told: None,
        }
    }

    /// The worker's slot.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Claims that took messages, since the worker started.
    pub fn claims_made(&self) -> u64 {
        self.claims_made
    }

    /// Claimed messages not yet recorded.
    fn outstanding(&self) -> usize {
        self.flights.iter().map(Flight::outstanding).sum()
    }

    /// What the worker has under way now, for the rule of when it may claim.
    fn load(&self, now: Instant) -> flight::Load {
        flight::Load {
            outstanding: self.outstanding(),
            lingering: self.flights.iter().map(|f| f.lingering(now)).sum(),
            flights: self.flights.len(),
        }
    }

    /// One cycle: claim when there is room for a batch and more may be due, wait for what
    /// the batches under way come to and record it (`flight`), and sweep when a sweep is
    /// due (`sweep`): beside the sends of a busy worker's claim, after the record of an
    /// idle one's.
    pub fn run_once(&mut self) -> CycleReport {
        let fault = gucs::fault_injection();
        let batch_size = gucs::batch_size();
        let mut next_due = None;
        // The first cycle sweeps before it claims: it takes back the attempts its slot left
        // open before it started, and no commit is waiting for it.
        if self.first_cycle {
            self.sweep_and_claim_again();
        }
        // With no batch under way the worker was idle until now: it claims.
        let idle = self.flights.is_empty();
        if (self.claim_wanted || idle) && flight::may_claim(self.load(Instant::now()), batch_size) {
            next_due = self.claim_and_send(batch_size, fault);
            // With batches under way, the claim after one that took all it could comes
            // when an idle worker's would: at the next due time, within the poll interval.
            let (wait, _) = super::idle_wait(next_due, now_ms(), gucs::poll_interval());
            self.claim_at = Some(Instant::now() + wait);
            // A busy worker sweeps beside the sends it has just started, off the path from
            // its record to its next claim.
            if !idle {
                self.sweep_and_claim_again();
            }
        }
        if !self.flights.is_empty() && self.wait_for_arrivals(batch_size) {
            self.land(fault);
        }
        // A worker that was idle sweeps last: a sweep run right after its claim held the
        // core that its send thread, woken by the claim, was to write the requests on
        // (BENCHMARKS.md). A busy worker that did not claim sweeps here too.
        self.sweep_and_claim_again();
        if self.flights.is_empty() {
            return CycleReport {
                busy: self.claim_wanted,
                next_due,
            };
        }
        CycleReport {
            busy: true,
            next_due: None,
        }
    }

    /// Sweeps when a sweep is due (`sweep`). Attempts taken back may be due at once: then
    /// the worker claims again without sleeping, and beside its batches under way without
    /// waiting for them.
    fn sweep_and_claim_again(&mut self) {
        if self.sweep() {
            self.claim_wanted = true;
            self.claim_at = Some(Instant::now());
        }
    }

    /// Claims a batch and starts its sends; returns when the next message is due when
    /// nothing was claimed.
    fn claim_and_send(&mut self, batch_size: usize, fault: FaultPoint) -> Option<NextDue> {
        self.refresh_allowed_hosts();
        // A commit from now on sets the latch again, and the wait for arrivals sees it; one
        // before is seen by this claim.
        unsafe { pgrx::pg_sys::ResetLatch(pgrx::pg_sys::MyLatch) };
        slots::update(self.index, |s| {
            s.phase = slots::Phase::Claiming;
            s.starved = false;
            s.last_loop_at_ms = now_ms();
        });
        let Claimed {
            channels,
            jobs,
            next_due,
            lock_busy,
        } = self.claim();
        if let Some(holder) = lock_busy {
            self.tell_lock_busy(holder);
        }
        self.longest_retry_horizon_ms = channels.longest_retry_horizon_ms();
        self.keep_pools(&channels, &jobs, batch_size);
        // A full batch says more may be due; a partial one took all it could.
        self.claim_wanted = jobs.len() >= batch_size;
        if jobs.is_empty() {
            if !self.flights.is_empty() {
                // Back to its batches under way, no longer claiming: another worker's record
                // wakes claiming workers (`slots::wake_starved_peers`), and this one claims
                // again after its own record, which frees room, not beside every record of
                // the others, where both would claim the same room and one of them nothing.
                slots::update(self.index, |s| s.phase = slots::Phase::Sending);
            }
            return next_due;
        }
        if self.claim_wanted {
            slots::wake_idle_peer(self.index);
        }
        let claimed = jobs.len() as i64;
        self.claims_made += 1;
        crash_if(FaultPoint::CrashAfterClaim, fault, &jobs);
        let send::Sorted {
            outcomes,
            effects,
            requests,
        } = send::sort(&mut self.remotes, &channels, &jobs, &mut self.jitter);
        self.flights.push(Flight {
            channels,
            jobs,
            known: outcomes,
            effects,
            sends: Sends::start(self.runtime.handle(), &self.bell, requests),
            claimed_at: Instant::now(),
        });
        let outstanding = self.outstanding() as i32;
        slots::update(self.index, |s| {
            s.claimed_total += claimed;
            s.in_flight = outstanding;
            s.phase = slots::Phase::Sending;
        });
        None
    }

    /// Waits until what has arrived is to be recorded (true), or until the worker may
    /// claim again (a commit woke it, the next message is due, or its last claim was full
    /// and has been under way for `flight::AHEAD_AFTER`) or is asked to stop (false). It
    /// sleeps on its latch and its bell, and looks around every `flight::LOOK_EVERY`.
    fn wait_for_arrivals(&mut self, batch_size: usize) -> bool {
        let mut woken = false;
        loop {
            let now = Instant::now();
            let mut ready = false;
            // A send that ends from here on rings again and cuts the next sleep short.
            self.bell.silence();
            for f in &mut self.flights {
                f.sends.collect(now);
                ready |= f.ready(now);
            }
            if ready {
                return true;
            }
            // Flights are kept oldest first: the last one is the last claim.
            let last_claim_age = self.flights.last().map_or(Duration::MAX, |f| {
                now.saturating_duration_since(f.claimed_at)
            });
            if self.claim_wanted
                && flight::may_claim_beside(self.load(now), batch_size, woken, last_claim_age)
            {
                return false;
            }
            if super::latch_set_within(Some(&self.bell), flight::LOOK_EVERY)
                || self.claim_at.is_some_and(|at| Instant::now() >= at)
            {
                self.claim_wanted = true;
                woken = true;
            }
            if super::stop_requested() {
                return false;
            }
        }
    }

    /// Waits for every send under way and records everything: before the worker stops or
    /// changes its role.
    pub fn land_all(&mut self) {
        if self.flights.is_empty() {
            return;
        }
        for f in &mut self.flights {
            f.sends.collect_all();
        }
        self.land(gucs::fault_injection());
        debug_assert!(self.flights.is_empty());
    }

    /// Decides what has arrived in the flights that are ready and records it, with their
    /// other outcomes and effects, in one transaction; flights with nothing left are done.
    fn land(&mut self, fault: FaultPoint) {
        let mut landings = Vec::new();
        let now = Instant::now();
        for (at, f) in self.flights.iter_mut().enumerate() {
            if !f.ready(now) {
                continue;
            }
            let arrived = f.sends.take_arrived();
            crash_if(
                FaultPoint::CrashAfterSend,
                fault,
                arrived.iter().map(|(i, _)| &f.jobs[*i]),
            );
            let mut outcomes = std::mem::take(&mut f.known);
            send::decide_all(
                &f.channels,
                &f.jobs,
                &arrived,
                &mut self.jitter,
                &mut outcomes,
            );
            crash_if(
                FaultPoint::CrashAfterResponse,
                fault,
                arrived.iter().map(|(i, _)| &f.jobs[*i]),
            );
            landings.push(Landing {
                flight: at,
                effects: std::mem::take(&mut f.effects),
                sent: arrived.iter().map(|(i, _)| *i).collect(),
                outcomes,
            });
        }
        slots::update(self.index, |s| s.phase = slots::Phase::Recording);
        self.record(&mut landings, fault);
        // What is recorded needs its payload no more: a flight kept for its lingering sends
        // holds the payloads of those alone.
        for l in &landings {
            let jobs = &mut self.flights[l.flight].jobs;
            for &i in &l.sent {
                jobs[i].release_payload();
            }
        }
        slots::wake_starved_peers(self.index);
        let unsent: Vec<i64> = landings
            .iter()
            .flat_map(|l| l.outcomes.unsent.iter().copied())
            .collect();
        if !unsent.is_empty() {
            log!(
                "outbox_delivery worker {}: {} claimed message(s) not sent: their lease ran out before the request could start (the worker was stopped or held up); back in the queue with no attempt counted: {unsent:?}",
                self.index,
                unsent.len()
            );
        }
        let delivered: usize = landings.iter().map(|l| l.outcomes.delivered.len()).sum();
        let other: usize = landings.iter().map(|l| l.outcomes.settled.len()).sum();
        debug1!(
            "outbox_delivery worker {}: {} outcome(s) recorded ({delivered} delivered, {other} other)",
            self.index,
            delivered + other,
        );
        self.flights.retain(|f| !f.landed());
        // A record frees room (max_in_flight, an ordering key) and may have scheduled a
        // retry sooner than the poll interval.
        self.claim_wanted = true;
        let outstanding = self.outstanding() as i32;
        slots::update(self.index, |s| {
            s.delivered_total += delivered as i64;
            s.in_flight = outstanding;
            s.phase = if outstanding > 0 {
                slots::Phase::Sending
            } else {
                slots::Phase::Claiming
            };
        });
    }

    /// The pools of the remote channels after a claim: those of channels gone are dropped
    /// once no flight claimed for them, and the idle ones beyond the budget are closed. Both
    /// look at every open pool, which with 10,000 endpoints is most of a claim's own time:
    /// the first runs only when the channels changed, the second at most every
    /// [`TRIM_POOLS_EVERY`]; the pools of this claim's channels are marked used at every claim.
    fn keep_pools(&mut self, channels: &Rc<Channels>, jobs: &[Job], batch_size: usize) {
        if !self
            .pools_kept_for
            .as_ref()
            .is_some_and(|c| Rc::ptr_eq(c, channels))
        {
            let live: HashSet<i32> = self
                .flights
                .iter()
                .filter(|f| !Rc::ptr_eq(&f.channels, channels))
                .flat_map(|f| f.channels.by_id.keys().copied())
                .collect();
            self.remotes
                .retain(|id| channels.by_id.contains_key(&id) || live.contains(&id));
            self.memory
                .turns
                .retain(|id| channels.by_id.contains_key(&id));
            // While a flight of older channels is under way, look again at the next claim.
            self.pools_kept_for = live.is_empty().then(|| channels.clone());
        }
        let now = Instant::now();
        let in_use: Vec<i32> = jobs.iter().map(|j| j.channel_id).collect();
        if self
            .pools_trimmed_at
            .is_some_and(|at| now.saturating_duration_since(at) < TRIM_POOLS_EVERY)
        {
            self.remotes.touch(now, &in_use);
            return;
        }
        self.pools_trimmed_at = Some(now);
        // The channels of this claim are about to be sent to: their pools stay.
        self.remotes.trim(
            now,
            pool_budget::budget(flight::connections(batch_size)),
            &in_use,
        );
    }

    /// The claim transaction: the channels and the batch of due messages.
    fn claim(&mut self) -> Claimed {
        let (index, pid, role) = (self.index, self.pid, self.role);
        let batch_size = gucs::batch_size() as i32;
        // The fence of what this claim takes starts now, before the claim's transaction,
        // lock waits included: never later than the worker's beat that the lease counts
        // from (`liveness`).
        let claim_began_boot_ms = crate::clock::boot_ms();
        identity::transaction(
            role,
            AssertUnwindSafe(|| {
                Spi::connect_mut(|client| -> SpiResult<Claimed> {
                    let channels = Channels::load(client)?;
                    let lease_ms = lease::lease_ms(gucs::lease_ms(), channels.longest_attempt_ms());
                    let at = self.started.elapsed().as_millis() as i64;
                    let due = due_channels::due_channels(
                        client,
                        &mut self.rotation,
                        &self.memory.cursors.floors(at),
                        batch_size.max(1) as usize,
                    )?;
                    let gates = flow::gate(client, &channels, &due, batch_size.max(0) as u32)?;
                    // Once a wait ran out, the next claims wait briefly: the holder is
                    // stopped or stuck, and every claim would otherwise wait out the whole
                    // wait before it claims without the lock.
                    let wait = match self.lock_busy_told {
                        Some(at) if at.elapsed() < LOCK_BUSY_LOG_EVERY => {
                            CLAIM_LOCK_WAIT_WHILE_BUSY
                        }
                        _ => CLAIM_LOCK_WAIT,
                    };
                    let serialized = worker_locks::CLAIMS.take_within(wait);
                    let lock_busy = if serialized {
                        None
                    } else {
                        Some(worker_locks::CLAIMS.holder(client)?)
                    };
                    let claimant = claim::Claimant {
                        lease_ms,
                        worker_index: index as i32,
                        pid,
                        fence: Fence::for_claim(claim_began_boot_ms, lease_ms),
                    };
                    let mut claim = |client: &mut SpiClient<'_>| {
                        claim::claim_due(
                            client,
                            claimant,
                            batch_size,
                            &mut self.memory,
                            at,
                            &gates,
                            &due,
                        )
                    };
                    let jobs = if serialized {
                        claim(client)?
                    } else {
                        claim::claim_unserialized(client, pid, &mut claim)
                    };
                    crash_if(FaultPoint::StallInClaim, gucs::fault_injection(), &jobs);
                    flow::give_back(client, &channels, &gates, &jobs)?;
                    // Only an idle worker sleeps until the next due time; one that claimed claims again.
                    let next_due = if jobs.is_empty() {
                        claim::next_due(client)?
                    } else {
                        None
                    };
                    Ok(Claimed {
                        channels,
                        jobs,
                        next_due,
                        lock_busy,
                    })
                })
                .unwrap_or_else(|e| panic!("outbox_delivery worker: claim failed: {e}"))
            }),
        )
    }

    /// When a sweep is due (`sweep`): the attempts whose lease ran out, taken back, and the
    /// `uncertain` messages due for a lookup, claimed, in a transaction of its own; then
    /// those lookups. After the first cycle it never runs before the claim, and a worker
    /// that was idle runs it at the end of the cycle, once what arrived is recorded: a
    /// worker that a commit woke sends first, and its send thread, woken onto the worker's
    /// core, writes the requests before the sweep holds that core. (In the claim's
    /// transaction, a sweep came due at every wake of a worker idle for 250 ms or more, and
    /// took about 1.8 ms of the COMMIT → request of one message; right after the claim, the
    /// send thread waited for it; BENCHMARKS.md.) Its statements run in a subtransaction:
    /// one that fails is logged and tried again at the next sweep, and the batches under
    /// way are still recorded. Returns whether it took attempts back or ran lookups, after
    /// which more may be due.
    fn sweep(&mut self) -> bool {
        let sweep_at = self.started.elapsed().as_millis() as i64;
        if !self.sweeps.due(sweep_at) {
            return false;
        }
        let (index, pid, role) = (self.index, self.pid, self.role);
        let include_own_slot = std::mem::replace(&mut self.first_cycle, false);
        let jitter = &mut self.jitter;
        let swept = identity::transaction(
            role,
            AssertUnwindSafe(|| {
                crate::spi::subtransaction(|| {
                    Spi::connect_mut(
                        |client| -> SpiResult<(Rc<Channels>, usize, Vec<LookupJob>)> {
                            let channels = Channels::load(client)?;
                            let lease_ms =
                                lease::lease_ms(gucs::lease_ms(), channels.longest_attempt_ms());
                            let lost = recover_lost_leases(
                                client,
                                &channels,
                                jitter,
                                include_own_slot,
                                index,
                                pid,
                            )?;
                            let lookups =
                                claim::claim_lookups(client, LOOKUPS_PER_SWEEP, lease_ms)?;
                            Ok((channels, lost, lookups))
                        },
                    )
                })
            }),
        );
        let (channels, lost, lookups) = match swept {
            Ok(swept) => swept,
            Err((sqlstate, message)) => {
                warning!(
                    "outbox_delivery worker {index}: the sweep for lost leases and due lookups failed ({sqlstate}: {message}); it is tried again at the next sweep"
                );
                self.sweeps.swept(sweep_at, false);
                return false;
            }
        };
        let more = lost as i64 >= RECOVER_PER_SWEEP || lookups.len() as i32 >= LOOKUPS_PER_SWEEP;
        self.sweeps.swept(sweep_at, more);
        let found = lost > 0 || !lookups.is_empty();
        if !lookups.is_empty() {
            self.reconcile(&channels, lookups);
            slots::wake_starved_peers(self.index);
        }
        found
    }

    /// The record transaction: each flight's `sql` effects run first, each in its own
    /// subtransaction, so that they commit together with their ledger entry or not at all;
    /// then every outcome is recorded.
    ///
    /// The answers are in memory until the record commits, and a record that fails (a
    /// cancel, a full disk, a lock an application holds past a timeout) loses none of them:
    /// its work runs in a subtransaction, whose error rolls back the record alone (its
    /// effects too), and the record is tried again with the same answers after a pause
    /// that doubles up to [`RECORD_RETRY_MAX`]. A confirmed answer is never turned into an
    /// interrupted attempt by a failure of the local transaction. Meanwhile the worker
    /// beats, so its claims stay its own (`liveness`). Only a worker asked to stop gives
    /// up, after [`RECORD_TRIES_AT_STOP`] more tries: what it held is then taken back as
    /// interrupted, as after a crash.
    fn record(&mut self, landings: &mut [Landing], fault: FaultPoint) {
        let mut pause = RECORD_RETRY_FIRST;
        let mut tries_at_stop = 0;
        loop {
            let jitter = &mut self.jitter;
            let flights = &self.flights;
            let recorded = identity::transaction(
                self.role,
                AssertUnwindSafe(|| {
                    let recorded = crate::spi::subtransaction(|| {
                        Spi::connect_mut(|client| -> SpiResult<Vec<Outcomes>> {
                            let mut all = Vec::with_capacity(landings.len());
                            for l in landings.iter() {
                                let f = &flights[l.flight];
                                // The effects add their outcomes to a copy: a try that fails
                                // leaves the answers as they arrived.
                                let mut outcomes = l.outcomes.clone();
                                run_effects(
                                    client,
                                    &f.channels,
                                    &f.jobs,
                                    &l.effects,
                                    jitter,
                                    &mut outcomes,
                                )?;
                                record::record(client, &outcomes)?;
                                flow::after_batch(
                                    client,
                                    &f.channels,
                                    &f.jobs,
                                    &l.sent,
                                    &outcomes,
                                )?;
                                all.push(outcomes);
                            }
                            Ok(all)
                        })
                    });
                    if recorded.is_ok() {
                        crash_if(
                            FaultPoint::CrashBeforeCommit,
                            fault,
                            landings.iter().flat_map(|l| {
                                let jobs = &flights[l.flight].jobs;
                                l.sent.iter().chain(&l.effects).map(move |&i| &jobs[i])
                            }),
                        );
                    }
                    recorded
                }),
            );
            let (sqlstate, message) = match recorded {
                Ok(all) => {
                    for (l, outcomes) in landings.iter_mut().zip(all) {
                        l.outcomes = outcomes;
                    }
                    return;
                }
                Err(failed) => failed,
            };
            let held: usize = landings
                .iter()
                .map(|l| l.outcomes.delivered.len() + l.outcomes.settled.len() + l.effects.len())
                .sum();
            if super::stop_requested() {
                tries_at_stop += 1;
                if tries_at_stop > RECORD_TRIES_AT_STOP {
                    warning!(
                        "outbox_delivery worker {}: the record of {held} outcome(s) failed again ({sqlstate}: {message}) and the worker is stopping: they are taken back as interrupted attempts",
                        self.index
                    );
                    unsafe { pgrx::pg_sys::proc_exit(1) };
                }
            }
            warning!(
                "outbox_delivery worker {}: the record of {held} outcome(s) failed ({sqlstate}: {message}); it is tried again in {} ms with the answers in hand",
                self.index,
                pause.as_millis()
            );
            slots::update(self.index, |s| s.phase = slots::Phase::Recording);
            std::thread::sleep(pause);
            pgrx::pg_sys::check_for_interrupts!();
            pause = (pause * 2).min(RECORD_RETRY_MAX);
        }
    }

    /// Says in the log, at most every [`LOCK_BUSY_LOG_EVERY`], that a claim could not have
    /// the claim lock in time, and who held it.
    fn tell_lock_busy(&mut self, holder: Option<i32>) {
        if self
            .lock_busy_told
            .is_some_and(|at| at.elapsed() < LOCK_BUSY_LOG_EVERY)
        {
            return;
        }
        self.lock_busy_told = Some(Instant::now());
        let who = match holder {
            Some(pid) => format!("process {pid}"),
            None => "a process that has let it go since".to_string(),
        };
        warning!(
            "outbox_delivery worker {}: the claim lock was held by {who} for longer than {} ms; this worker claims without it meanwhile (a claim that meets another's claim is rolled back)",
            self.index,
            CLAIM_LOCK_WAIT.as_millis()
        );
    }

    /// Takes the current `outbox.allowed_hosts` (a reload may have changed it) for this
    /// cycle's requests and says so in the log when it changed. An invalid value cannot be
    /// set (its check hook refuses it); were one seen, nothing would be sent until fixed.
    fn refresh_allowed_hosts(&mut self) {
        let text = gucs::allowed_hosts();
        match self.remotes.set_allowed_hosts(&text) {
            None => {}
            Some(Ok(())) => log!(
                "outbox_delivery worker {}: outbox.allowed_hosts = '{text}'",
                self.index
            ),
            Some(Err(e)) => warning!(
                "outbox_delivery worker {}: outbox.allowed_hosts is invalid ({e}); no request is sent until it is fixed",
                self.index
            ),
        }
    }

    /// Runs due reconcile lookups (read-only) and records what they found.
    fn reconcile(&mut self, channels: &Channels, lookups: Vec<LookupJob>) {
        let mut runs = Vec::new();
        let mut settled = Vec::new();
        for job in lookups {
            let Some(channel) = channels.by_id.get(&job.channel_id) else {
                continue;
            };
            let Ok(options) = &channel.options else {
                continue;
            };
            if !options.can_look_up() {
                continue;
            }
            match self.remotes.channel(
                job.channel_id,
                &channel.version,
                &channel.endpoint,
                options,
                flight::connections(gucs::batch_size()),
            ) {
                Ok(remote) => {
                    let lookup = remote.lookup(&job.subject, self.remotes.allowed());
                    runs.push((job, options.clone(), self.runtime.spawn(lookup)));
                }
                Err(error) => settled.push((
                    job,
                    options.clone(),
                    Lookup::Unavailable {
                        error,
                        http_status: None,
                    },
                )),
            }
        }
        for (job, options, handle) in runs {
            let result = self
                .runtime
                .block_on(handle)
                .unwrap_or_else(|e| Lookup::Unavailable {
                    error: format!("lookup task ended abnormally: {e}"),
                    http_status: None,
                });
            settled.push((job, options, result));
        }
        let pid = self.pid;
        identity::transaction(
            self.role,
            AssertUnwindSafe(|| {
                Spi::connect_mut(|client| -> pgrx::spi::SpiResult<()> {
                    let mut tallies: HashMap<i32, Tally> = HashMap::new();
                    for (job, options, result) in &settled {
                        let state = reconcile::record_lookup(
                            client,
                            job.message_id,
                            result,
                            options,
                            job.lookups_so_far,
                            pid,
                        )?;
                        if state.as_deref() == Some("delivered") {
                            let tally = tallies.entry(job.channel_id).or_default();
                            tally.count(State::Delivered, true);
                            tally.observe_delivery(job.subject.created_at_s.saturating_mul(1000));
                        }
                        log!(
                            "outbox_delivery: reconcile of message {}: {} (now {})",
                            job.message_id,
                            result.as_str(),
                            state.as_deref().unwrap_or("unchanged")
                        );
                    }
                    record::record_stats(client, &tallies)
                })
                .unwrap_or_else(|e| panic!("outbox_delivery worker: recording lookups failed: {e}"))
            }),
        );
    }

    /// Holds the messages that wait behind their ordering key, when it is time to
    /// (`key_hold`), in transactions of their own between two cycles; now and then also
    /// releases the held messages that nothing is before any more. Only the first worker
    /// of each database does: two would read the same index entries. While steps hold half
    /// a scan's worth or more (a burst behind one key), it goes on for up to
    /// [`key_hold::HOLD_BURST_MS`] instead of claiming between them: until a message is
    /// held, every claim of its channel passes over it, so a claim between two steps is as
    /// slow as the burst is long.
    pub fn hold_keys(&mut self) {
        if !self.index.is_multiple_of(gucs::workers().max(1)) {
            return;
        }
        let clock = || self.started.elapsed().as_millis() as i64;
        let began = clock();
        loop {
            let now = clock();
            let Some(step) = self.key_holds.due(now) else {
                return;
            };
            let (held, released) = identity::transaction(self.role, || {
                Spi::connect_mut(
                    |client| -> SpiResult<(key_hold::Held, key_hold::Released)> {
                        if !key_hold::try_lock() {
                            // Another worker holds: this one reads from the start, later.
                            return Ok(Default::default());
                        }
                        let released = match &step.release_stranded {
                            Some(after) => key_hold::release_stranded(client, after)?,
                            None => key_hold::Released::default(),
                        };
                        Ok((key_hold::hold(client, &step.from)?, released))
                    },
                )
                .unwrap_or_else(|e| {
                    panic!("outbox_delivery worker: holding messages behind their ordering key failed: {e}")
                })
            });
            let (count, freed) = (held.held, released.released);
            self.key_holds.ran(now, &step, held, released);
            if count > 0 || freed > 0 {
                debug1!(
                    "outbox_delivery worker {}: held {count} message(s) behind their ordering key, released {freed} no longer behind one",
                    self.index
                );
            }
            if !self.key_holds.in_burst(clock() - began) || super::stop_requested() {
                return;
            }
        }
    }

    /// Runs retention in short transactions: finished queue rows a batch at a time, then
    /// one round of the ledger's generations in a transaction of its own.
    pub fn retention(&mut self) {
        let retention_s = gucs::retention_s();
        let ledger_retention_s = gucs::ledger_retention_s();
        let horizon = self.longest_retry_horizon_ms;
        for _ in 0..RETENTION_ROUNDS {
            let messages = identity::transaction(self.role, || {
                Spi::connect_mut(|client| retention::purge(client, retention_s))
                    .unwrap_or_else(|e| panic!("outbox_delivery worker: retention failed: {e}"))
            });
            if messages > 0 {
                debug1!(
                    "outbox_delivery worker {}: retention removed {messages} message(s)",
                    self.index
                );
            }
            if (messages as i64) < retention::PURGE_BATCH {
                break;
            }
        }
        let retained = identity::transaction(self.role, || {
            Spi::connect_mut(|client| {
                retention::retain_ledger(client, retention_s, ledger_retention_s, horizon)
            })
            .unwrap_or_else(|e| {
                panic!("outbox_delivery worker: retention of the ledger failed: {e}")
            })
        });
        if let Some(generation) = retained.emptied {
            debug1!(
                "outbox_delivery worker {}: retention emptied generation {generation} of the ledger",
                self.index
            );
        }
        if let Some(d) = &retained.deferred {
            // Said once, when the generation is first put off; then every round at DEBUG1
            // (outbox.alerts raises ledger_retention_deferred after five minutes).
            let text = format!(
                "outbox_delivery worker {}: generation {} of the ledger is due for emptying but its table is in use (SQLSTATE {}: {}); trying again at the next round",
                self.index, d.generation, d.sqlstate, d.message
            );
            if d.first {
                log!("{text}");
            } else {
                debug1!("{text}");
            }
        }
        if let Some(generation) = retained.opened {
            debug1!(
                "outbox_delivery worker {}: generation {generation} of the ledger takes new entries",
                self.index
            );
        }
    }
}

/// Recovers the messages whose lease was lost (their worker died mid-attempt): each takes
/// the ambiguous path its channel allows (`decide::after_lost_lease`). Returns how many.
fn recover_lost_leases(
    client: &mut SpiClient<'_>,
    channels: &Channels,
    jitter: &mut SplitMix64,
    include_own_slot: bool,
    index: usize,
    pid: i32,
) -> SpiResult<usize> {
    let lost =
        recovery::find_lost_leases(client, include_own_slot, index as i32, RECOVER_PER_SWEEP)?;
    if lost.is_empty() {
        recovery::prune_lost_claims(client, include_own_slot, index as i32)?;
        return Ok(0);
    }
    let mut outcomes = Outcomes::default();
    for l in &lost {
        let ctx = l.context(now_ms());
        let verdict = match channels.by_id.get(&l.channel_id).map(|c| &c.options) {
            Some(Ok(options)) => decide::after_lost_lease(options, ctx, &mut || jitter.unit()),
            Some(Err(e)) => unusable_channel(Class::Ambiguous, State::Uncertain, e.clone()),
            None => unusable_channel(
                Class::Ambiguous,
                State::Uncertain,
                format!("channel {} no longer exists", l.channel_id),
            ),
        };
        let made = record::AttemptMade {
            attempt: l.attempt,
            started_at_us: l.started_at_us,
            pid: l.worker_pid,
        };
        outcomes.push_for(l.channel_id, true, l.message_id, made, verdict);
    }
    record::close_open_rows(client, &mut outcomes)?;
    record::record(client, &outcomes)?;
    let claims: Vec<i64> = lost.iter().map(|l| l.claim_id).collect();
    record::release_claimed(client, &outcomes, &claims)?;
    record::record_recovery_rows(client, &outcomes.settled, pid)?;
    log!(
        "outbox_delivery worker {index}: recovered {} message(s) whose attempt was interrupted",
        lost.len()
    );
    Ok(lost.len())
}

/// Runs the batch's `sql` effects and decides each. Their messages are locked first: none
/// is taken back by another worker while this transaction runs, however long the effects
/// take; a message taken back before its effect ran is left to its new attempt.
fn run_effects(
    client: &mut SpiClient<'_>,
    channels: &Channels,
    jobs: &[Job],
    effects: &[usize],
    jitter: &mut SplitMix64,
    outcomes: &mut Outcomes,
) -> SpiResult<()> {
    if effects.is_empty() {
        return Ok(());
    }
    let attempts: Vec<(i64, i32)> = effects
        .iter()
        .map(|&i| (jobs[i].message_id, jobs[i].attempt))
        .collect();
    let ours = record::lock_effect_messages(client, &attempts)?;
    for &i in effects {
        let job = &jobs[i];
        if !ours.contains(&job.message_id) {
            log!(
                "outbox_delivery: message {} was taken back from attempt {} before its effect ran; the effect is not run here",
                job.message_id,
                job.attempt
            );
            continue;
        }
        let Some(Ok(options)) = channels.by_id.get(&job.channel_id).map(|c| &c.options) else {
            continue;
        };
        let Kind::Sql { function, run_as } = &options.kind else {
            continue;
        };
        let outcome = sql_effect::call_effect(
            client,
            function,
            run_as,
            &job.tenant,
            options.timeout_ms,
            &job.payload,
            &job.effect_key,
        )?;
        let verdict = decide::after_effect(&outcome, options, job.context(now_ms()), &mut || {
            jitter.unit()
        });
        outcomes.push_job(job, true, verdict);
    }
    Ok(())
}
