//! One worker cycle, in named phases: sweep for lost leases and due lookups (at most every
//! 250 ms, see `sweep`) and claim (one transaction); the lookups; sort, send and decide with
//! no transaction open (`send`); run the `sql` effects and record every outcome (one
//! transaction).

use super::claim::{self, Channels, Job, LookupJob};
use super::claim_cursor::ClaimCursors;
use super::decide;
use super::record::{self, Outcomes, Tally};
use super::send::{self, unusable_channel};
use super::sweep::SweepClock;
use super::{flow, lease, recovery, retention, slots};
use crate::channels::lookup::Lookup;
use crate::channels::options::Kind;
use crate::channels::remote::Remotes;
use crate::channels::sql_effect;
use crate::classify::Class;
use crate::clock::now_ms;
use crate::gucs::{self, FaultPoint};
use crate::identity;
use crate::outbox::state::State;
use crate::random::SplitMix64;
use crate::reconcile;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::time::Instant;

/// Lost leases recovered per sweep at most.
const RECOVER_PER_SWEEP: i64 = 500;
/// Reconcile lookups per sweep at most.
const LOOKUPS_PER_SWEEP: i32 = 50;
/// Retention statements per retention run at most.
const RETENTION_ROUNDS: usize = 20;

pub struct CycleReport {
    pub claimed: usize,
    pub next_due_ms: Option<i64>,
}

/// What the claim transaction hands to the rest of the cycle.
struct Claimed {
    channels: Channels,
    lookups: Vec<LookupJob>,
    jobs: Vec<Job>,
    /// When the next message is due, for an idle worker's sleep.
    next_due_ms: Option<i64>,
}

pub struct Worker {
    index: usize,
    pid: i32,
    runtime: tokio::runtime::Runtime,
    /// The remote channels (HTTP pools, NATS connections).
    remotes: Remotes,
    /// The random source of retry jitter, seeded per worker process.
    jitter: SplitMix64,
    first_cycle: bool,
    longest_retry_horizon_ms: u64,
    /// Where the next claim of each channel starts, measured on the clock of `started`.
    cursors: ClaimCursors,
    /// When lost leases and due lookups were last looked for, on the clock of `started`.
    sweeps: SweepClock,
    started: Instant,
    /// The role every transaction of the worker runs as (`outbox.role`).
    pub role: pgrx::pg_sys::Oid,
}

/// Dies at a fault-injection point, as a crash would: nothing after this point happens, an
/// open transaction is rolled back, and the postmaster starts a new worker.
fn crash_if(point: FaultPoint, armed: FaultPoint, jobs: &[Job]) {
    if point != armed || !jobs.iter().any(|j| j.attempt == 1) {
        return;
    }
    let ids: Vec<i64> = jobs.iter().map(|j| j.message_id).collect();
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
        runtime: tokio::runtime::Runtime,
        role: pgrx::pg_sys::Oid,
    ) -> Worker {
        Worker {
            index,
            pid,
            runtime,
            remotes: Remotes::default(),
            jitter: SplitMix64::new(SplitMix64::seed_from(now_ms(), pid)),
            first_cycle: true,
            longest_retry_horizon_ms: 0,
            cursors: ClaimCursors::default(),
            sweeps: SweepClock::default(),
            started: Instant::now(),
            role,
        }
    }

    /// The worker's slot.
    pub fn index(&self) -> usize {
        self.index
    }

    /// One cycle: claim, look up, send, record.
    pub fn run_once(&mut self) -> CycleReport {
        let fault = gucs::fault_injection();
        self.refresh_allowed_hosts();
        slots::update(self.index, |s| {
            s.phase = slots::Phase::Claiming;
            s.starved = false;
            s.last_loop_at_ms = now_ms();
        });
        let Claimed {
            channels,
            lookups,
            jobs,
            next_due_ms,
        } = self.claim();
        self.longest_retry_horizon_ms = channels.longest_retry_horizon_ms();
        self.remotes.retain(|id| channels.by_id.contains_key(&id));
        if !lookups.is_empty() {
            self.reconcile(&channels, lookups);
            slots::wake_starved_peers(self.index);
        }
        if jobs.is_empty() {
            return CycleReport {
                claimed: 0,
                next_due_ms,
            };
        }
        if jobs.len() >= gucs::batch_size().max(1) as usize {
            slots::wake_idle_peer(self.index);
        }
        slots::update(self.index, |s| {
            s.claimed_total += jobs.len() as i64;
            s.in_flight = jobs.len() as i32;
            s.phase = slots::Phase::Sending;
        });
        crash_if(FaultPoint::CrashAfterClaim, fault, &jobs);

        let send::Sorted {
            mut outcomes,
            effects,
            requests,
        } = send::sort(&mut self.remotes, &channels, &jobs, &mut self.jitter);
        let sent = send::send(&self.runtime, requests);
        crash_if(FaultPoint::CrashAfterSend, fault, &jobs);
        send::decide_all(&channels, &jobs, &sent, &mut self.jitter, &mut outcomes);
        crash_if(FaultPoint::CrashAfterResponse, fault, &jobs);

        slots::update(self.index, |s| s.phase = slots::Phase::Recording);
        let sent_jobs: Vec<usize> = sent.iter().map(|(i, _)| *i).collect();
        self.record(&channels, &jobs, &effects, &sent_jobs, &mut outcomes, fault);
        slots::wake_starved_peers(self.index);
        let delivered = outcomes.delivered.len() as i64;
        debug1!(
            "outbox_delivery worker {}: batch of {} recorded ({} delivered, {} other outcomes)",
            self.index,
            jobs.len(),
            delivered,
            outcomes.settled.len()
        );
        slots::update(self.index, |s| {
            s.delivered_total += delivered;
            s.in_flight = 0;
        });
        CycleReport {
            claimed: jobs.len(),
            next_due_ms: None,
        }
    }

    /// The claim transaction: the channels, a sweep when one is due, the due lookups and
    /// the batch of due messages.
    fn claim(&mut self) -> Claimed {
        let (index, pid, role) = (self.index, self.pid, self.role);
        let batch_size = gucs::batch_size() as i32;
        let include_own_slot = std::mem::replace(&mut self.first_cycle, false);
        let sweep_at = self.started.elapsed().as_millis() as i64;
        identity::transaction(
            role,
            AssertUnwindSafe(|| {
                Spi::connect_mut(|client| -> SpiResult<Claimed> {
                    let channels = Channels::load(client)?;
                    let lease_ms = lease::lease_ms(gucs::lease_ms(), channels.longest_attempt_ms());
                    let mut lookups = Vec::new();
                    if self.sweeps.due(sweep_at) {
                        let lost = recover_lost_leases(
                            client,
                            &channels,
                            &mut self.jitter,
                            include_own_slot,
                            index,
                            pid,
                        )?;
                        lookups = claim::claim_lookups(client, LOOKUPS_PER_SWEEP, lease_ms)?;
                        let more = lost as i64 >= RECOVER_PER_SWEEP
                            || lookups.len() as i32 >= LOOKUPS_PER_SWEEP;
                        self.sweeps.swept(sweep_at, more);
                    }
                    let at = self.started.elapsed().as_millis() as i64;
                    let gates = flow::gate(client, &channels, batch_size.max(0) as u32)?;
                    let jobs = claim::claim_due(
                        client,
                        batch_size,
                        lease_ms,
                        index as i32,
                        pid,
                        &mut self.cursors,
                        at,
                        &gates.caps,
                    )?;
                    flow::give_back(client, &channels, &gates, &jobs)?;
                    // Only an idle worker sleeps until the next due time; one that claimed claims again.
                    let next_due_ms = if jobs.is_empty() {
                        claim::next_due_ms(client)?
                    } else {
                        None
                    };
                    Ok(Claimed {
                        channels,
                        lookups,
                        jobs,
                        next_due_ms,
                    })
                })
                .unwrap_or_else(|e| panic!("outbox_delivery worker: claim failed: {e}"))
            }),
        )
    }

    /// The record transaction: the `sql` effects run first, each in its own
    /// subtransaction, so that they commit together with their ledger entry or not at all;
    /// then every outcome of the batch is recorded.
    fn record(
        &mut self,
        channels: &Channels,
        jobs: &[Job],
        effects: &[usize],
        sent: &[usize],
        outcomes: &mut Outcomes,
        fault: FaultPoint,
    ) {
        let jitter = &mut self.jitter;
        identity::transaction(
            self.role,
            AssertUnwindSafe(|| {
                Spi::connect_mut(|client| {
                    run_effects(client, channels, jobs, effects, jitter, outcomes)?;
                    record::record(client, outcomes)?;
                    flow::after_batch(client, channels, jobs, sent, outcomes)
                })
                .unwrap_or_else(|e| panic!("outbox_delivery worker: record failed: {e}"));
                crash_if(FaultPoint::CrashBeforeCommit, fault, jobs);
            }),
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
                gucs::batch_size(),
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
                            tallies
                                .entry(job.channel_id)
                                .or_default()
                                .count(State::Delivered, true);
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

    /// Runs retention in short transactions.
    pub fn retention(&mut self) {
        let retention_s = gucs::retention_s();
        let ledger_retention_s = gucs::ledger_retention_s();
        let horizon = self.longest_retry_horizon_ms;
        for _ in 0..RETENTION_ROUNDS {
            let (messages, ledger) = identity::transaction(self.role, || {
                Spi::connect_mut(|client| {
                    retention::purge(client, retention_s, ledger_retention_s, horizon)
                })
                .unwrap_or_else(|e| panic!("outbox_delivery worker: retention failed: {e}"))
            });
            if messages > 0 || ledger > 0 {
                debug1!("outbox_delivery worker {}: retention removed {messages} message(s), {ledger} ledger entries", self.index);
            }
            if (messages as i64) < retention::PURGE_BATCH
                && (ledger as i64) < retention::PURGE_BATCH
            {
                break;
            }
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
        outcomes.push_for(l.channel_id, true, l.message_id, (l.attempt, None), verdict);
    }
    record::close_open_rows(client, &mut outcomes)?;
    record::record(client, &outcomes)?;
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
