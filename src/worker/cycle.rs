//! One worker cycle: sweep for lost leases and due lookups (at most every 250 ms, see
//! `sweep`) and claim (one transaction), check the barrier, send (no transaction open),
//! decide, record (one transaction).

use super::claim::{self, Channel, Channels, Job, LookupJob};
use super::claim_cursor::ClaimCursors;
use super::decide::{self, Verdict};
use super::record::{self, Outcomes, Tally};
use super::sweep::SweepClock;
use super::{identity, lease, recovery, retention, slots};
use crate::channels::http::{self, Outgoing, Transport};
use crate::channels::options::{ChannelOptions, Kind};
use crate::channels::sql;
use crate::classify::Class;
use crate::gucs::{self, FaultPoint};
use crate::outbox::state::State;
use crate::reconcile::{self, lookup, lookup::Lookup};
use pgrx::prelude::*;
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

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

/// Random source for jitter: xorshift64*, seeded per worker process.
struct Jitter(u64);

impl Jitter {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub struct Worker {
    index: usize,
    pid: i32,
    runtime: tokio::runtime::Runtime,
    transport: Transport,
    jitter: Jitter,
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

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
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
        let seed = (now_ms() as u64) ^ ((pid as u64) << 32) ^ 0x9E37_79B9_7F4A_7C15;
        Worker {
            index,
            pid,
            runtime,
            transport: Transport::default(),
            jitter: Jitter(seed | 1),
            first_cycle: true,
            longest_retry_horizon_ms: 0,
            cursors: ClaimCursors::default(),
            sweeps: SweepClock::default(),
            started: Instant::now(),
            role,
        }
    }

    pub fn run_once(&mut self) -> CycleReport {
        let index = self.index;
        let pid = self.pid;
        let batch_size = gucs::batch_size();
        let lease_ms = gucs::lease_ms();
        let fault = gucs::fault_injection();
        let include_own_slot = std::mem::replace(&mut self.first_cycle, false);
        self.refresh_allowed_hosts();
        slots::update(index, |s| {
            s.phase = slots::Phase::Claiming;
            s.last_loop_at_ms = now_ms();
        });

        let jitter = &mut self.jitter;
        let cursors = &mut self.cursors;
        let started = self.started;
        let sweeps = &mut self.sweeps;
        let sweep_at = started.elapsed().as_millis() as i64;
        let (channels, lookups, jobs, next_due_ms) = identity::transaction(
            self.role,
            AssertUnwindSafe(|| {
                Spi::connect_mut(|client| -> pgrx::spi::SpiResult<_> {
                let channels = Channels::load(client)?;
                let lease_ms = lease::lease_ms(lease_ms, channels.longest_attempt_ms());
                let mut lookups = Vec::new();
                if sweeps.due(sweep_at) {
                    let lost = recovery::find_lost_leases(client, include_own_slot, index as i32, RECOVER_PER_SWEEP)?;
                    if !lost.is_empty() {
                        let mut outcomes = Outcomes::default();
                        for l in &lost {
                            let ctx = l.context(now_ms());
                            let verdict = match channels.by_id.get(&l.channel_id).map(|c| &c.options) {
                                Some(Ok(options)) => decide::after_lost_lease(options, ctx, &mut || jitter.next()),
                                Some(Err(e)) => unusable_channel(Class::Ambiguous, State::Uncertain, e.clone()),
                                None => unusable_channel(
                                    Class::Ambiguous,
                                    State::Uncertain,
                                    format!("channel {} no longer exists", l.channel_id),
                                ),
                            };
                            outcomes.push_for(l.channel_id, true, l.message_id, l.attempt_id.unwrap_or(0), l.attempt, verdict);
                        }
                        record::record(client, &outcomes)?;
                        record::record_recovery_rows(client, &outcomes.settled, pid)?;
                        log!("outbox_delivery worker {index}: recovered {} message(s) whose attempt was interrupted", lost.len());
                    }
                    lookups = claim::claim_lookups(client, LOOKUPS_PER_SWEEP, lease_ms)?;
                    sweeps.swept(
                        sweep_at,
                        lost.len() as i64 >= RECOVER_PER_SWEEP || lookups.len() as i32 >= LOOKUPS_PER_SWEEP,
                    );
                }
                let jobs = claim::claim_due(
                    client,
                    batch_size as i32,
                    lease_ms,
                    index as i32,
                    pid,
                    cursors,
                    started.elapsed().as_millis() as i64,
                )?;
                // Only an idle worker sleeps until the next due time; one that claimed claims again.
                let next_due = if jobs.is_empty() { claim::next_due_ms(client)? } else { None };
                Ok((channels, lookups, jobs, next_due))
            })
            .unwrap_or_else(|e| panic!("outbox_delivery worker: claim failed: {e}"))
            }),
        );
        self.longest_retry_horizon_ms = channels.longest_retry_horizon_ms();
        self.transport.retain(|id| channels.by_id.contains_key(&id));

        if !lookups.is_empty() {
            self.reconcile(&channels, lookups);
        }
        if jobs.is_empty() {
            return CycleReport {
                claimed: 0,
                next_due_ms,
            };
        }
        slots::update(index, |s| {
            s.claimed_total += jobs.len() as i64;
            s.in_flight = jobs.len() as i32;
            s.phase = slots::Phase::Sending;
        });
        crash_if(FaultPoint::CrashAfterClaim, fault, &jobs);

        // The barrier and unusable channels first; everything else is sent.
        let mut outcomes = Outcomes::default();
        let mut to_send: Vec<(usize, reqwest::Client, Outgoing)> = Vec::new();
        let mut effects: Vec<usize> = Vec::new();
        for (i, job) in jobs.iter().enumerate() {
            if let Some((recorded_by_message, external_id)) = &job.ledger {
                outcomes.push_for(
                    job.channel_id,
                    false,
                    job.message_id,
                    job.attempt_id,
                    job.attempt,
                    Verdict {
                        state: State::Delivered,
                        next_at_ms: None,
                        class: None,
                        http_status: None,
                        retry_after_ms: None,
                        external_id: external_id.clone(),
                        error: None,
                        outcome: format!("not sent: effect already in the ledger (message {recorded_by_message})"),
                    },
                );
                continue;
            }
            let Some(channel) = channels.by_id.get(&job.channel_id) else {
                outcomes.push_for(
                    job.channel_id,
                    true,
                    job.message_id,
                    job.attempt_id,
                    job.attempt,
                    unusable_channel(
                        Class::Permanent,
                        State::Failed,
                        format!("channel {} no longer exists", job.channel_id),
                    ),
                );
                continue;
            };
            if let Ok(ChannelOptions {
                kind: Kind::Sql { .. },
                ..
            }) = &channel.options
            {
                effects.push(i); // runs inside the record transaction
                continue;
            }
            match self.outgoing(job, channel) {
                Ok((client, out)) => to_send.push((i, client, out)),
                Err(error) => outcomes.push_for(
                    job.channel_id,
                    true,
                    job.message_id,
                    job.attempt_id,
                    job.attempt,
                    unusable_channel(Class::Permanent, State::Failed, error),
                ),
            }
        }

        let order: Vec<usize> = to_send.iter().map(|(i, _, _)| *i).collect();
        let transmissions = http::transmit_all(
            &self.runtime,
            to_send
                .into_iter()
                .map(|(_, client, out)| (client, out))
                .collect(),
            self.transport.allowed(),
        );
        crash_if(FaultPoint::CrashAfterSend, fault, &jobs);

        let now = now_ms();
        for (i, t) in order.into_iter().zip(transmissions.iter()) {
            let job = &jobs[i];
            let Some(Ok(options)) = channels.by_id.get(&job.channel_id).map(|c| &c.options) else {
                continue;
            };
            let ctx = job.context(now);
            let verdict = decide::after_transmission(t, options, ctx, &mut || self.jitter.next());
            if verdict.state != State::Delivered && verdict.state != State::Queued {
                log!(
                    "outbox_delivery: message {} on channel \"{}\" is {} after attempt {} ({}): {}",
                    job.message_id,
                    channels
                        .by_id
                        .get(&job.channel_id)
                        .map(|c| c.name.as_str())
                        .unwrap_or("?"),
                    verdict.state.as_str(),
                    job.attempt,
                    verdict.class.map(|c| c.as_str()).unwrap_or("-"),
                    verdict.error.as_deref().unwrap_or("")
                );
            }
            outcomes.push_for(
                job.channel_id,
                true,
                job.message_id,
                job.attempt_id,
                job.attempt,
                verdict,
            );
        }
        crash_if(FaultPoint::CrashAfterResponse, fault, &jobs);

        slots::update(index, |s| s.phase = slots::Phase::Recording);
        let jitter = &mut self.jitter;
        identity::transaction(
            self.role,
            AssertUnwindSafe(|| {
                Spi::connect_mut(|client| {
                    // Effects inside this database run here, each in its own subtransaction, so
                    // that they commit together with their ledger entry or not at all. Their
                    // messages are locked first: none is taken back by another worker while
                    // this transaction runs, however long the effects take.
                    let ours = if effects.is_empty() {
                        Default::default()
                    } else {
                        let attempts: Vec<(i64, i32)> =
                            effects.iter().map(|&i| (jobs[i].message_id, jobs[i].attempt)).collect();
                        record::lock_effect_messages(client, &attempts)?
                    };
                    for &i in &effects {
                        let job = &jobs[i];
                        if !ours.contains(&job.message_id) {
                            log!(
                                "outbox_delivery: message {} was taken back from attempt {} before its effect ran; the effect is not run here",
                                job.message_id,
                                job.attempt
                            );
                            continue;
                        }
                        let Some(Ok(options)) =
                            channels.by_id.get(&job.channel_id).map(|c| &c.options)
                        else {
                            continue;
                        };
                        let Kind::Sql { function, run_as } = &options.kind else {
                            continue;
                        };
                        let outcome = sql::call_effect(
                            client,
                            function,
                            run_as,
                            &job.tenant,
                            options.timeout_ms,
                            &job.payload,
                            &job.effect_key,
                        )?;
                        let ctx = job.context(now_ms());
                        let verdict =
                            decide::after_effect(&outcome, options, ctx, &mut || jitter.next());
                        outcomes.push_for(
                            job.channel_id,
                            true,
                            job.message_id,
                            job.attempt_id,
                            job.attempt,
                            verdict,
                        );
                    }
                    record::record(client, &outcomes)
                })
                .unwrap_or_else(|e| panic!("outbox_delivery worker: record failed: {e}"));
                crash_if(FaultPoint::CrashBeforeCommit, fault, &jobs);
            }),
        );
        let delivered = outcomes.delivered.len() as i64;
        debug1!(
            "outbox_delivery worker {index}: batch of {} recorded ({} delivered, {} other outcomes)",
            jobs.len(),
            delivered,
            outcomes.settled.len()
        );
        slots::update(index, |s| {
            s.delivered_total += delivered;
            s.in_flight = 0;
        });
        CycleReport {
            claimed: jobs.len(),
            next_due_ms: None,
        }
    }

    /// Takes the current `outbox.allowed_hosts` (a reload may have changed it) for this
    /// cycle's requests and says so in the log when it changed. An invalid value cannot be
    /// set (its check hook refuses it); were one seen, nothing would be sent until fixed.
    fn refresh_allowed_hosts(&mut self) {
        let text = gucs::allowed_hosts();
        match self.transport.set_allowed_hosts(&text) {
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
            let Some(config) = &options.reconcile else {
                continue;
            };
            let result = match (
                lookup::fill(&config.url, &job.subject),
                self.transport.client(
                    job.channel_id,
                    &channel.version,
                    options,
                    gucs::batch_size(),
                ),
            ) {
                (Ok(url), Ok(client)) => {
                    runs.push((
                        job.clone(),
                        options.clone(),
                        self.runtime.spawn(lookup::lookup(
                            client,
                            options.clone(),
                            url,
                            job.subject.clone(),
                            self.transport.allowed(),
                        )),
                    ));
                    continue;
                }
                (Err(e), _) | (_, Err(e)) => Lookup::Unavailable {
                    error: e,
                    http_status: None,
                },
            };
            settled.push((job, options.clone(), result));
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

    /// The request for one job on its channel, or why it cannot be sent.
    fn outgoing(
        &mut self,
        job: &Job,
        channel: &Channel,
    ) -> Result<(reqwest::Client, Outgoing), String> {
        let options = channel.options.as_ref().map_err(Clone::clone)?;
        let client = self.transport.client(
            job.channel_id,
            &channel.version,
            options,
            gucs::batch_size(),
        )?;
        let mut headers: Vec<(String, String)> = Vec::new();
        if let Some(raw) = &job.headers {
            let parsed: serde_json::Value = serde_json::from_str(raw)
                .map_err(|e| format!("message headers are not JSON: {e}"))?;
            let fields = match &parsed {
                serde_json::Value::Null => None,
                serde_json::Value::Object(fields) => Some(fields),
                other => {
                    return Err(format!(
                        "message headers must be a JSON object of strings, not {other}"
                    ))
                }
            };
            for (name, value) in fields.into_iter().flatten() {
                let value = value
                    .as_str()
                    .ok_or_else(|| format!("message header \"{name}\" is not a string"))?;
                // enqueue refuses these; a row written otherwise is not sent with them.
                if let Some(why) = crate::outbox::enqueue_check::reserved_header(name, &[]) {
                    return Err(format!(
                        "message header \"{name}\" may not be set: it {why}"
                    ));
                }
                headers.push((name.clone(), value.to_string()));
            }
        }
        // Channel headers win over message headers of the same name; the key header wins last.
        headers.retain(|(n, _)| {
            !options
                .headers
                .iter()
                .any(|(c, _)| c.eq_ignore_ascii_case(n))
        });
        headers.extend(options.headers.iter().cloned());
        if let Some(reference) = &options.reference_header {
            headers.retain(|(n, _)| !n.eq_ignore_ascii_case(reference));
            headers.push((reference.clone(), job.effect_key.clone()));
        }
        if let Some(key_header) = &options.idempotency_header {
            headers.retain(|(n, _)| !n.eq_ignore_ascii_case(key_header));
            headers.push((key_header.clone(), job.effect_key.clone()));
        }
        Ok((
            client,
            Outgoing {
                channel_id: job.channel_id,
                method: options.method.clone(),
                url: channel.endpoint.clone(),
                headers,
                body: job.payload.clone(),
                timeout: Duration::from_millis(options.timeout_ms),
                external_id: options.external_id.clone(),
                max_response_bytes: options.max_response_bytes as usize,
            },
        ))
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

/// A verdict for a message whose channel cannot be used (dropped, invalid options).
fn unusable_channel(class: Class, state: State, error: String) -> Verdict {
    Verdict {
        state,
        next_at_ms: None,
        class: Some(class),
        http_status: None,
        retry_after_ms: None,
        external_id: None,
        error: Some(error),
        outcome: class.as_str().to_string(),
    }
}
