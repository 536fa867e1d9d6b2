//! Record: one transaction per batch. A confirmed delivery writes the ledger entry and
//! marks the message delivered, atomically, and the delivered message stands for its
//! attempt's row (`crate::ledger::RECORD_SENT`); any other outcome moves the message to its
//! next state and writes the attempt's row with its classified facts. The row of an attempt
//! is written once, here or by recovery, with its outcome: while the attempt is in progress
//! its claim stands for it (src/worker/claim.rs). The record takes the messages it settles
//! out of their claims in the same transaction.

use crate::classify::Class;
use crate::ledger;
use crate::ledger::Delivery;
use crate::metrics::latency::{self, Histogram};
use crate::outbox::state::State;
use crate::spi::{self, Statement};
use crate::worker::decide::Verdict;
use pgrx::spi::{SpiClient, SpiResult};

/// The attempt rows of confirmed deliveries whose message was no longer in the attempt
/// that sent them (a late answer, after recovery took the message back; the message and
/// the ledger are recorded by `crate::ledger::record_delivered`): the row recovery wrote
/// for that attempt takes the answer, else one is written. The `a.message_id = ANY(...)`
/// condition beside the join keeps the attempt table reached through its index.
pub(crate) static RECORD_LATE_DELIVERED_ATTEMPTS: Statement = Statement::planned_once(
    "
WITH d AS (
    SELECT * FROM unnest($1::int8[], $2::int4[], $3::text[], $4::int4[], $5::text[], $6::int8[])
        AS d(id, attempt, external_id, http_status, outcome, started_at_us)
), closed AS (
    UPDATE outbox._attempts a
       SET finished_at = now(), outcome = d.outcome, http_status = d.http_status, external_id = d.external_id
      FROM d
     WHERE a.message_id = d.id AND a.message_id = ANY ($1::int8[]) AND a.attempt = d.attempt AND a.kind = 'send'
 RETURNING a.message_id
)
INSERT INTO outbox._attempts (message_id, tenant, attempt, kind, started_at, finished_at, outcome,
                              http_status, external_id, effect_key_sent, worker_pid)
SELECT d.id, m.tenant, d.attempt, 'send',
       coalesce(timestamptz 'epoch' + d.started_at_us * interval '1 microsecond', now()), now(),
       d.outcome, d.http_status, d.external_id, outbox._provider_key(m.tenant, m.effect_key),
       pg_catalog.pg_backend_pid()
  FROM d
  JOIN outbox._messages m ON m.id = d.id AND m.id = ANY ($1::int8[])
 WHERE d.id NOT IN (SELECT closed.message_id FROM closed)",
);

/// Every other outcome. Applies only while the message is still in the attempt that
/// produced it (queued, its row counting the attempts before: `$2` - 1): a late answer never
/// overrides a newer state, and an attempt taken back by recovery keeps the row recovery
/// wrote. The message row counts the attempt and keeps when it started and which worker
/// made it (`$11`, `$12`; the recording worker when NULL). The attempt's row is written with
/// the message's move, unless `$10` says it is written already.
/// The outcomes drive the join, one probe of the primary key each: the state is compared
/// as text so that the plan cannot start from the partial index of queued messages and
/// compare each of them with the whole array, as `crate::ledger::RECORD_SENT` does.
pub(crate) static RECORD_SETTLED: Statement = Statement::planned_once(
    "
WITH o AS (
    SELECT o.*, coalesce(timestamptz 'epoch' + o.started_at_us * interval '1 microsecond', now()) AS started_at,
           coalesce(o.by_pid, pg_catalog.pg_backend_pid()) AS pid
      FROM unnest($1::int8[], $2::int4[], $3::text[], $4::int8[], $5::text[], $6::text[],
                  $7::int4[], $8::int8[], $9::text[], $10::bool[], $11::int8[], $12::int4[],
                  $13::int8[])
        AS o(message_id, attempt, state, next_at_ms, error_class, error, http_status,
             retry_after_ms, outcome, row_written, started_at_us, by_pid, settle_boot_ms)
), m AS (
    UPDATE outbox._messages m
       SET state = o.state::outbox.state,
           attempts = o.attempt,
           first_attempt_at = coalesce(m.first_attempt_at, o.started_at),
           attempt_started_at = o.started_at,
           attempt_pid = o.pid,
           next_attempt_at = CASE WHEN o.next_at_ms IS NULL THEN m.next_attempt_at
                                  ELSE to_timestamp(o.next_at_ms / 1000.0) END,
           last_error_class = o.error_class::outbox.error_class,
           last_error = o.error,
           last_http_status = o.http_status,
           lease_until = NULL,
           lease_owner = NULL,
           -- The settle window of an uncertain message on the boot clock of this boot
           -- ($14, the machine's boot id): its first lookup waits for it.
           settle_boot_id = CASE WHEN o.settle_boot_ms IS NOT NULL THEN $14::uuid END,
           settle_boot_ms = o.settle_boot_ms,
           updated_at = now()
      FROM o
     WHERE m.id = o.message_id AND m.state::text = 'queued'
       AND least(m.attempts, 2147483646) = o.attempt - 1
 RETURNING m.id, m.tenant, m.effect_key, m.attempt_started_at, m.attempt_pid
)
INSERT INTO outbox._attempts (message_id, tenant, attempt, kind, started_at, finished_at, outcome,
                              error_class, http_status, error, retry_after_ms, effect_key_sent, worker_pid)
SELECT m.id, m.tenant, o.attempt, 'send', m.attempt_started_at, now(), o.outcome,
       o.error_class::outbox.error_class, o.http_status, o.error, o.retry_after_ms,
       outbox._provider_key(m.tenant, m.effect_key), m.attempt_pid
  FROM m JOIN o ON o.message_id = m.id
 WHERE NOT o.row_written",
);

/// Takes messages (`$1`, ascending) out of their claims, once their outcomes are recorded:
/// out of the recording worker's own claims, or of the claims `$2` (those recovery took them
/// back from). A claim left empty is deleted. Each claim's ids are read from the version
/// the statement writes, so that a claim changed meanwhile by another worker's recovery
/// loses nothing that recovery took out of it. What is left of a claim is computed in one
/// pass (`outbox._claim_ids_left`, `claim_release`: NULL for a claim none of whose messages
/// is released); the delete and the update take disjoint claims, those left with none and
/// those left with some.
pub(crate) static RELEASE_CLAIMED: Statement = Statement::planned_once(
    "
WITH emptied AS (
    DELETE FROM outbox._claims w
     WHERE (w.worker_pid = pg_catalog.pg_backend_pid() OR w.id = ANY ($2::int8[]))
       AND pg_catalog.cardinality(outbox._claim_ids_left(w.message_ids, $1::int8[])) = 0
)
UPDATE outbox._claims w
   SET message_ids = outbox._claim_ids_left(w.message_ids, $1::int8[])
 WHERE (w.worker_pid = pg_catalog.pg_backend_pid() OR w.id = ANY ($2::int8[]))
   AND pg_catalog.cardinality(outbox._claim_ids_left(w.message_ids, $1::int8[])) > 0",
);

/// Rows of sends still open from before the update from 0.1.0, which wrote a send's row
/// when it was claimed: recovery closes each with the outcome it decided, instead of
/// writing a second row for the attempt. Returns the messages whose row it closed.
static CLOSE_OPEN_ATTEMPTS: Statement = Statement::planned_once(
    "
UPDATE outbox._attempts a
   SET finished_at = now(),
       outcome = o.outcome,
       error_class = o.error_class::outbox.error_class,
       http_status = o.http_status,
       error = o.error,
       retry_after_ms = o.retry_after_ms,
       external_id = o.external_id
  FROM unnest($1::int8[], $2::int4[], $3::text[], $4::text[], $5::text[], $6::int4[], $7::int8[], $8::text[])
       AS o(message_id, attempt, outcome, error_class, error, http_status, retry_after_ms, external_id)
 WHERE a.message_id = o.message_id AND a.message_id = ANY ($1::int8[]) AND a.attempt = o.attempt
   AND a.kind = 'send' AND a.finished_at IS NULL
RETURNING a.message_id",
);

/// Locks the messages whose effects run in this transaction, in id order, while they are
/// still in an attempt (in a claim of this worker): with the numbers of those attempts. A
/// worker looking for lost leases skips locked rows, so however long the effects take,
/// none of them is taken back while the transaction that runs it is open.
pub(crate) static LOCK_EFFECT_MESSAGES: Statement = Statement::planned_once(
    "
SELECT m.id, least(m.attempts, 2147483646) + 1
  FROM outbox._messages m
 WHERE m.id = ANY ($1::int8[]) AND m.state::text = 'queued'
   AND m.id IN (SELECT pg_catalog.unnest(w.message_ids) FROM outbox._claims w
                 WHERE w.worker_pid = pg_catalog.pg_backend_pid())
 ORDER BY m.id
   FOR UPDATE OF m",
);

/// The recovery decision for an attempt interrupted by a stopped worker, as its own row.
static RECORD_RECOVERY_ROWS: Statement = Statement::planned_once("
INSERT INTO outbox._attempts (message_id, tenant, attempt, kind, finished_at, outcome, error_class, error,
                              effect_key_sent, worker_pid)
SELECT o.message_id, m.tenant, o.attempt, 'recovery', now(), o.outcome, 'ambiguous', o.error,
       outbox._provider_key(m.tenant, m.effect_key), $5
  FROM unnest($1::int8[], $2::int4[], $3::text[], $4::text[]) AS o(message_id, attempt, outcome, error)
  JOIN outbox._messages m ON m.id = o.message_id");

/// One outcome other than a delivery.
#[derive(Debug, Clone)]
pub struct Settlement {
    pub message_id: i64,
    pub attempt: i32,
    /// When the attempt started (µs since the epoch), where the worker knows it.
    pub started_at_us: Option<i64>,
    /// The worker that made the attempt, when it is not the one recording it (recovery).
    pub pid: Option<i32>,
    pub verdict: Verdict,
    /// The attempt's row is written already (a send open at the update from 0.1.0).
    pub row_written: bool,
}

/// The attempt an outcome belongs to: its number, when it started (µs since the epoch)
/// and by which worker, where known (the recording worker's own attempt when `pid` is None).
#[derive(Debug, Clone, Copy)]
pub struct AttemptMade {
    pub attempt: i32,
    pub started_at_us: Option<i64>,
    pub pid: Option<i32>,
}

/// Everything one transaction records: deliveries, other outcomes, and the per-channel
/// counters they add up to.
#[derive(Debug, Default, Clone)]
pub struct Outcomes {
    pub delivered: Vec<Delivery>,
    pub settled: Vec<Settlement>,
    pub tallies: std::collections::HashMap<i32, Tally>,
    /// Messages claimed whose request never started, their fence having passed
    /// (`crate::channels::fence`): taken out of this worker's claims and left as they were,
    /// queued and due, no attempt counted. One that recovery took back meanwhile is in no
    /// claim of this worker any more, and stays as recovery left it.
    pub unsent: Vec<i64>,
}

impl Outcomes {
    /// Adds the outcome of one message of `channel_id`; `sent` is false when nothing was
    /// attempted (the ledger barrier).
    pub fn push_for(
        &mut self,
        channel_id: i32,
        sent: bool,
        message_id: i64,
        attempt: AttemptMade,
        verdict: Verdict,
    ) {
        let tally = self.tallies.entry(channel_id).or_default();
        tally.count(verdict.state, sent);
        if sent && verdict.class == Some(crate::classify::Class::Ambiguous) {
            tally.ambiguous += 1;
        }
        self.push(message_id, attempt, verdict);
    }

    /// Adds the outcome of a claimed job (see [`Outcomes::push_for`]). A delivery of a job
    /// that was sent went through the claim's barrier ([`Delivery::key_unrecorded_at_claim`]).
    pub fn push_job(&mut self, job: &crate::worker::claimed::Job, sent: bool, verdict: Verdict) {
        if verdict.state == State::Delivered {
            self.observe_delivery(job.channel_id, job.enqueued_at_ms);
        }
        let delivered_before = self.delivered.len();
        self.push_for(
            job.channel_id,
            sent,
            job.message_id,
            AttemptMade {
                attempt: job.attempt,
                started_at_us: Some(job.started_at_us),
                pid: None,
            },
            verdict,
        );
        if let Some(d) = self.delivered.get_mut(delivered_before) {
            d.key_unrecorded_at_claim = sent && job.ledger.is_none();
        }
    }

    /// Counts how long one send on `channel_id` took (`crate::metrics::latency`).
    pub fn observe_send(&mut self, channel_id: i32, elapsed_ms: u64) {
        let tally = self.tallies.entry(channel_id).or_default();
        tally.send.observe(elapsed_ms.min(i64::MAX as u64) as i64);
    }

    /// Counts a delivery on `channel_id` of a message enqueued at `enqueued_at_ms`: its wait
    /// from enqueue to now.
    pub fn observe_delivery(&mut self, channel_id: i32, enqueued_at_ms: i64) {
        self.tallies
            .entry(channel_id)
            .or_default()
            .observe_delivery(enqueued_at_ms);
    }

    pub fn push(&mut self, message_id: i64, made: AttemptMade, verdict: Verdict) {
        let AttemptMade {
            attempt,
            started_at_us,
            pid,
        } = made;
        if verdict.state == State::Delivered {
            self.delivered.push(Delivery {
                message_id,
                attempt,
                started_at_us,
                pid,
                external_id: verdict.external_id,
                http_status: verdict.http_status.map(i32::from),
                outcome: verdict.outcome,
                row_written: false,
                key_unrecorded_at_claim: false,
            });
        } else {
            self.settled.push(Settlement {
                message_id,
                attempt,
                started_at_us,
                pid,
                verdict,
                row_written: false,
            });
        }
    }

    pub fn is_empty(&self) -> bool {
        self.delivered.is_empty() && self.settled.is_empty() && self.unsent.is_empty()
    }
}

/// Locks the messages of `attempts` (message id, attempt number) for the effects about to
/// run; returns the ids still in that attempt. An effect whose message is not among them
/// was taken back by another worker and must not run here.
pub fn lock_effect_messages(
    client: &mut SpiClient<'_>,
    attempts: &[(i64, i32)],
) -> SpiResult<std::collections::HashSet<i64>> {
    let ids: Vec<i64> = attempts.iter().map(|(id, _)| *id).collect();
    let mut current = std::collections::HashMap::new();
    for row in spi::run(client, &LOCK_EFFECT_MESSAGES, None, &[ids.into()])? {
        if let (Some(id), Some(attempt)) = (row.get::<i64>(1)?, row.get::<i32>(2)?) {
            current.insert(id, attempt);
        }
    }
    Ok(attempts
        .iter()
        .filter(|(id, attempt)| current.get(id) == Some(attempt))
        .map(|(id, _)| *id)
        .collect())
}

/// Records deliveries, other outcomes and the counters, in the caller's transaction.
pub fn record(client: &mut SpiClient<'_>, outcomes: &Outcomes) -> SpiResult<()> {
    if !outcomes.delivered.is_empty() {
        record_delivered(client, &outcomes.delivered)?;
    }
    if !outcomes.settled.is_empty() {
        record_settled(client, &outcomes.settled)?;
    }
    release_claimed(client, outcomes, &[])?;
    // Last: every worker of a channel updates the same counter rows, so the row locks
    // this takes are held only until the commit that follows.
    record_stats(client, &outcomes.tallies)
}

/// Takes the messages of `outcomes` out of this worker's claims, and out of `claims`
/// (those recovery took them back from): they are no longer under way.
pub fn release_claimed(
    client: &mut SpiClient<'_>,
    outcomes: &Outcomes,
    claims: &[i64],
) -> SpiResult<()> {
    let mut ids: Vec<i64> = outcomes
        .delivered
        .iter()
        .map(|d| d.message_id)
        .chain(outcomes.settled.iter().map(|s| s.message_id))
        .chain(outcomes.unsent.iter().copied())
        .collect();
    // Sorted, as `outbox._claim_ids_left` would otherwise sort them for every claim.
    ids.sort_unstable();
    if ids.is_empty() {
        return Ok(());
    }
    spi::run(
        client,
        &RELEASE_CLAIMED,
        None,
        &[ids.into(), claims.to_vec().into()],
    )?;
    Ok(())
}

/// Deliveries: those still in their attempt in one statement (`crate::ledger::record_sent`);
/// a late answer through `outbox._record_delivered`, with its attempt's row.
fn record_delivered(client: &mut SpiClient<'_>, delivered: &[Delivery]) -> SpiResult<()> {
    let recorded = ledger::record_sent(client, delivered)?;
    let late: Vec<&Delivery> = delivered
        .iter()
        .filter(|d| !recorded.contains(&d.message_id))
        .collect();
    if late.is_empty() {
        return Ok(());
    }
    let confirmed: Vec<ledger::Confirmed> = late
        .iter()
        .map(|x| ledger::Confirmed {
            message_id: x.message_id,
            external_id: x.external_id.clone(),
            http_status: x.http_status,
        })
        .collect();
    ledger::record_delivered(client, &confirmed, ledger::Recorder::Worker)?;
    let late: Vec<&Delivery> = late.into_iter().filter(|d| !d.row_written).collect();
    if late.is_empty() {
        return Ok(());
    }
    spi::run(
        client,
        &RECORD_LATE_DELIVERED_ATTEMPTS,
        None,
        &[
            late.iter().map(|x| x.message_id).collect::<Vec<_>>().into(),
            late.iter().map(|x| x.attempt).collect::<Vec<_>>().into(),
            late.iter()
                .map(|x| x.external_id.clone())
                .collect::<Vec<_>>()
                .into(),
            late.iter()
                .map(|x| x.http_status)
                .collect::<Vec<_>>()
                .into(),
            late.iter()
                .map(|x| x.outcome.clone())
                .collect::<Vec<_>>()
                .into(),
            late.iter()
                .map(|x| x.started_at_us)
                .collect::<Vec<_>>()
                .into(),
        ],
    )?;
    Ok(())
}

/// The class of a verdict as the attempt's `error_class` (none for a delivery).
fn error_class(verdict: &Verdict) -> Option<String> {
    verdict
        .class
        .map(|c: Class| c.as_str().to_string())
        .filter(|c| c != "delivered")
}

fn retry_after_ms(verdict: &Verdict) -> Option<i64> {
    verdict
        .retry_after_ms
        .map(|v| v.min(i64::MAX as u64) as i64)
}

fn record_settled(client: &mut SpiClient<'_>, s: &[Settlement]) -> SpiResult<()> {
    // The end of the settle window of each message left uncertain with a lookup ahead, on
    // the boot clock (from now: a little after the request, never before): a step of the
    // wall clock never brings that lookup forward.
    let boot_now_ms = crate::clock::boot_ms();
    let settle_boot_ms: Vec<Option<i64>> = s
        .iter()
        .map(|x| {
            x.verdict
                .settle_ms
                .filter(|_| x.verdict.state == State::Uncertain)
                .map(|ms| boot_now_ms.saturating_add(ms.min(i64::MAX as u64) as i64))
        })
        .collect();
    spi::run(
        client,
        &RECORD_SETTLED,
        None,
        &[
            s.iter().map(|x| x.message_id).collect::<Vec<_>>().into(),
            s.iter().map(|x| x.attempt).collect::<Vec<_>>().into(),
            s.iter()
                .map(|x| x.verdict.state.as_str().to_string())
                .collect::<Vec<_>>()
                .into(),
            s.iter()
                .map(|x| x.verdict.next_at_ms)
                .collect::<Vec<_>>()
                .into(),
            s.iter()
                .map(|x| error_class(&x.verdict))
                .collect::<Vec<_>>()
                .into(),
            s.iter()
                .map(|x| x.verdict.error.clone())
                .collect::<Vec<_>>()
                .into(),
            s.iter()
                .map(|x| x.verdict.http_status.map(i32::from))
                .collect::<Vec<_>>()
                .into(),
            s.iter()
                .map(|x| retry_after_ms(&x.verdict))
                .collect::<Vec<_>>()
                .into(),
            s.iter()
                .map(|x| x.verdict.outcome.clone())
                .collect::<Vec<_>>()
                .into(),
            s.iter().map(|x| x.row_written).collect::<Vec<_>>().into(),
            s.iter().map(|x| x.started_at_us).collect::<Vec<_>>().into(),
            s.iter().map(|x| x.pid).collect::<Vec<_>>().into(),
            settle_boot_ms.into(),
            crate::clock::boot_id().map(str::to_string).into(),
        ],
    )?;
    Ok(())
}

/// Recovery, before it records `outcomes`: a send still open from before the update from
/// 0.1.0 has its row, which is closed with the outcome decided for it ([`CLOSE_OPEN_ATTEMPTS`])
/// and marked written, so that the record writes no second row for that attempt.
pub fn close_open_rows(client: &mut SpiClient<'_>, outcomes: &mut Outcomes) -> SpiResult<()> {
    let d = &outcomes.delivered;
    let s = &outcomes.settled;
    let ids: Vec<i64> = d
        .iter()
        .map(|x| x.message_id)
        .chain(s.iter().map(|x| x.message_id))
        .collect();
    if ids.is_empty() {
        return Ok(());
    }
    let attempts: Vec<i32> = d
        .iter()
        .map(|x| x.attempt)
        .chain(s.iter().map(|x| x.attempt))
        .collect();
    let outcome: Vec<String> = d
        .iter()
        .map(|x| x.outcome.clone())
        .chain(s.iter().map(|x| x.verdict.outcome.clone()))
        .collect();
    let class: Vec<Option<String>> = d
        .iter()
        .map(|_| None)
        .chain(s.iter().map(|x| error_class(&x.verdict)))
        .collect();
    let error: Vec<Option<String>> = d
        .iter()
        .map(|_| None)
        .chain(s.iter().map(|x| x.verdict.error.clone()))
        .collect();
    let status: Vec<Option<i32>> = d
        .iter()
        .map(|x| x.http_status)
        .chain(s.iter().map(|x| x.verdict.http_status.map(i32::from)))
        .collect();
    let retry: Vec<Option<i64>> = d
        .iter()
        .map(|_| None)
        .chain(s.iter().map(|x| retry_after_ms(&x.verdict)))
        .collect();
    let external: Vec<Option<String>> = d
        .iter()
        .map(|x| x.external_id.clone())
        .chain(s.iter().map(|x| x.verdict.external_id.clone()))
        .collect();
    let closed: std::collections::HashSet<i64> = spi::run(
        client,
        &CLOSE_OPEN_ATTEMPTS,
        None,
        &[
            ids.into(),
            attempts.into(),
            outcome.into(),
            class.into(),
            error.into(),
            status.into(),
            retry.into(),
            external.into(),
        ],
    )?
    .map(|row| row.get::<i64>(1).map(|id| id.unwrap_or_default()))
    .collect::<SpiResult<_>>()?;
    for x in &mut outcomes.delivered {
        x.row_written = closed.contains(&x.message_id);
    }
    for x in &mut outcomes.settled {
        x.row_written = closed.contains(&x.message_id);
    }
    Ok(())
}

/// Adds a `recovery` attempt row for each recovered message.
pub fn record_recovery_rows(
    client: &mut SpiClient<'_>,
    recovered: &[Settlement],
    pid: i32,
) -> SpiResult<()> {
    if recovered.is_empty() {
        return Ok(());
    }
    spi::run(
        client,
        &RECORD_RECOVERY_ROWS,
        None,
        &[
            recovered
                .iter()
                .map(|x| x.message_id)
                .collect::<Vec<_>>()
                .into(),
            recovered
                .iter()
                .map(|x| x.attempt)
                .collect::<Vec<_>>()
                .into(),
            recovered
                .iter()
                .map(|x| x.verdict.outcome.clone())
                .collect::<Vec<_>>()
                .into(),
            recovered
                .iter()
                .map(|x| x.verdict.error.clone())
                .collect::<Vec<_>>()
                .into(),
            pid.into(),
        ],
    )?;
    Ok(())
}

/// Per-channel counters of one batch, folded into `_channel_stats` and `_channel_minutes`.
static RECORD_STATS: Statement = Statement::planned_once("
WITH u AS (
    SELECT * FROM unnest($1::int4[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[], $7::int8[],
                         $9::int8[], $11::int8[]) WITH ORDINALITY
        AS u(channel_id, delivered, attempts_failed, exhausted, failed, uncertain, ambiguous,
             send_ms_sum, delivery_ms_sum, ord)
), s AS (
    -- The histograms' buckets come flattened, $12 per channel (crate::metrics::latency).
    SELECT u.*, ($8::int8[])[(u.ord - 1) * $12 + 1 : u.ord * $12] AS send_ms_counts,
           ($10::int8[])[(u.ord - 1) * $12 + 1 : u.ord * $12] AS delivery_ms_counts
      FROM u
), minutes AS (
    INSERT INTO outbox._channel_minutes AS b
           (channel_id, minute, delivered, failed, ambiguous, send_ms_counts, delivery_ms_counts)
    SELECT s.channel_id, date_trunc('minute', now()), s.delivered, s.attempts_failed, s.ambiguous,
           s.send_ms_counts, s.delivery_ms_counts
      FROM s
        ON CONFLICT (channel_id, minute) DO UPDATE
       SET delivered = b.delivered + excluded.delivered, failed = b.failed + excluded.failed,
           ambiguous = b.ambiguous + excluded.ambiguous,
           send_ms_counts = outbox._add_counts(b.send_ms_counts, excluded.send_ms_counts),
           delivery_ms_counts = outbox._add_counts(b.delivery_ms_counts, excluded.delivery_ms_counts)
)
INSERT INTO outbox._channel_stats AS cs
       (channel_id, delivered_total, attempts_failed_total, exhausted_total, failed_total, uncertain_total,
        error_streak, error_streak_since, last_success_at, last_failure_at,
        send_ms_counts, send_ms_sum, delivery_ms_counts, delivery_ms_sum)
SELECT s.channel_id, s.delivered, s.attempts_failed, s.exhausted, s.failed, s.uncertain,
       CASE WHEN s.delivered > 0 THEN 0 ELSE s.attempts_failed END,
       CASE WHEN s.delivered = 0 AND s.attempts_failed > 0 THEN now() END,
       CASE WHEN s.delivered > 0 THEN now() END,
       CASE WHEN s.attempts_failed > 0 THEN now() END,
       s.send_ms_counts, s.send_ms_sum, s.delivery_ms_counts, s.delivery_ms_sum
  FROM s
    ON CONFLICT (channel_id) DO UPDATE
   SET delivered_total = cs.delivered_total + excluded.delivered_total,
       attempts_failed_total = cs.attempts_failed_total + excluded.attempts_failed_total,
       exhausted_total = cs.exhausted_total + excluded.exhausted_total,
       failed_total = cs.failed_total + excluded.failed_total,
       uncertain_total = cs.uncertain_total + excluded.uncertain_total,
       error_streak = CASE WHEN excluded.delivered_total > 0 THEN 0
                           ELSE cs.error_streak + excluded.attempts_failed_total END,
       error_streak_since = CASE WHEN excluded.delivered_total > 0 THEN NULL
                                 WHEN cs.error_streak = 0 AND excluded.attempts_failed_total > 0 THEN now()
                                 ELSE cs.error_streak_since END,
       last_success_at = coalesce(excluded.last_success_at, cs.last_success_at),
       last_failure_at = coalesce(excluded.last_failure_at, cs.last_failure_at),
       send_ms_counts = outbox._add_counts(cs.send_ms_counts, excluded.send_ms_counts),
       send_ms_sum = cs.send_ms_sum + excluded.send_ms_sum,
       delivery_ms_counts = outbox._add_counts(cs.delivery_ms_counts, excluded.delivery_ms_counts),
       delivery_ms_sum = cs.delivery_ms_sum + excluded.delivery_ms_sum");

/// What one batch did on one channel.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    pub delivered: i64,
    pub attempts_failed: i64,
    pub exhausted: i64,
    pub failed: i64,
    pub uncertain: i64,
    /// Attempts whose outcome was ambiguous, whatever came next (a retry with the key, a
    /// lookup, an operator): counted apart for `outbox.alerts`' ambiguity_high.
    pub ambiguous: i64,
    /// How long each send took.
    pub send: Histogram,
    /// How long each message delivered waited from enqueue.
    pub delivery: Histogram,
}

impl Tally {
    /// Counts a delivery of a message enqueued at `enqueued_at_ms`.
    pub fn observe_delivery(&mut self, enqueued_at_ms: i64) {
        self.delivery
            .observe(crate::clock::now_ms().saturating_sub(enqueued_at_ms));
    }

    /// Counts one outcome; `was_attempt` is false for a barrier hit (nothing was sent).
    pub fn count(&mut self, state: State, was_attempt: bool) {
        match state {
            State::Delivered => self.delivered += 1,
            _ if !was_attempt => {}
            other => {
                self.attempts_failed += 1;
                match other {
                    State::Exhausted => self.exhausted += 1,
                    State::Failed => self.failed += 1,
                    State::Uncertain => self.uncertain += 1,
                    _ => {}
                }
            }
        }
    }
}

pub fn record_stats(
    client: &mut SpiClient<'_>,
    tallies: &std::collections::HashMap<i32, Tally>,
) -> SpiResult<()> {
    if tallies.is_empty() {
        return Ok(());
    }
    let mut ids: Vec<i32> = tallies.keys().copied().collect();
    ids.sort_unstable(); // a fixed order: concurrent workers lock the rows the same way
    let col = |f: fn(&Tally) -> i64| ids.iter().map(|id| f(&tallies[id])).collect::<Vec<i64>>();
    let buckets = |f: fn(&Tally) -> &Histogram| {
        ids.iter()
            .flat_map(|id| f(&tallies[id]).counts)
            .collect::<Vec<i64>>()
    };
    spi::run(
        client,
        &RECORD_STATS,
        None,
        &[
            ids.clone().into(),
            col(|t| t.delivered).into(),
            col(|t| t.attempts_failed).into(),
            col(|t| t.exhausted).into(),
            col(|t| t.failed).into(),
            col(|t| t.uncertain).into(),
            col(|t| t.ambiguous).into(),
            buckets(|t| &t.send).into(),
            col(|t| t.send.sum_ms).into(),
            buckets(|t| &t.delivery).into(),
            col(|t| t.delivery.sum_ms).into(),
            (latency::BUCKETS as i32).into(),
        ],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::claimed::Job;

    fn job(id: i64, ledger: Option<(i64, Option<String>)>) -> Job {
        Job {
            message_id: id,
            started_at_us: 1,
            attempt: 1,
            tenant: "default".into(),
            channel_id: 7,
            effect_key: format!("k{id}"),
            payload: "{}".into(),
            headers: None,
            budget_started_at_ms: 0,
            first_attempt_at_ms: 0,
            enqueued_at_ms: 0,
            budget_attempt: 1,
            ledger,
            position: None,
            fence: crate::channels::fence::Fence::open(),
            turn: crate::worker::claimed::Turn { lanes: 1, pick: 1 },
        }
    }

    fn delivered() -> Verdict {
        Verdict {
            state: State::Delivered,
            next_at_ms: None,
            class: None,
            http_status: Some(200),
            retry_after_ms: None,
            external_id: None,
            error: None,
            outcome: "delivered".into(),
            settle_ms: None,
        }
    }

    /// Only a delivery of a job that was sent after the claim's barrier found its key
    /// unrecorded skips the record's ledger probe: not a barrier hit, not an outcome
    /// recorded for another worker's attempt (recovery, a late answer).
    #[test]
    fn only_a_send_past_the_barrier_skips_the_records_ledger_probe() {
        let mut o = Outcomes::default();
        o.push_job(&job(1, None), true, delivered());
        o.push_job(&job(2, Some((9, None))), false, delivered());
        let failed = Verdict {
            state: State::Failed,
            ..delivered()
        };
        o.push_job(&job(3, None), true, failed);
        o.push_for(
            7,
            true,
            4,
            AttemptMade {
                attempt: 1,
                started_at_us: None,
                pid: Some(42),
            },
            delivered(),
        );
        o.push_job(&job(5, None), true, delivered());
        let flags: Vec<(i64, bool)> = o
            .delivered
            .iter()
            .map(|d| (d.message_id, d.key_unrecorded_at_claim))
            .collect();
        assert_eq!(flags, vec![(1, true), (2, false), (4, false), (5, true)]);
        assert_eq!(o.settled.len(), 1);
    }
}
