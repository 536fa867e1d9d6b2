//! The ledger: the barrier against a second execution. An effect (tenant, effect key)
//! recorded in `outbox._ledger` is never sent again.
//!
//! - **Check.** The claim looks up each claimed message's effect with
//!   `outbox._ledger_entry` (sql/ledger.sql), one index probe per message; a message whose
//!   effect is recorded is settled without a send.
//! - **Record.** Every confirmation — a provider's answer ([`record_delivered`] from the
//!   worker), a lookup that found the message (reconcile), an operator's
//!   `resolve(…, 'delivered', …)` — goes through `outbox._record_delivered`: the message
//!   leaves the queue (`outbox._messages`, which holds only what is still to do) for its
//!   ledger entry, which keeps its columns: a delivery deletes one row and inserts one. An
//!   effect already recorded keeps its first entry, and the message stays in the queue
//!   table, marked delivered. The worker's answer for a message still in the attempt that
//!   sent it is recorded by one statement ([`record_sent`]) that makes the same writes as
//!   `outbox._record_delivered` (message, ledger entry) and adds the attempt's row.
//! - **Retention.** Entries live for `outbox.ledger_retention`, never shorter than the
//!   longest retry horizon of any channel ([`keep_s`]): a message may still be retried that
//!   long after it was enqueued, and its entry is what stops a second send. An entry that
//!   holds its delivered message lives at least `outbox.retention` too, and takes the
//!   message's attempts with it. The ledger is kept in three generations, and retention
//!   empties a whole generation at a time ([`retain`], [`generations`]): no entry is
//!   deleted one by one.

pub mod generations;

use crate::spi::{self, Statement};
use generations::{Generation, Rotation};
use pgrx::spi::{SpiClient, SpiResult};

/// One confirmed delivery.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub message_id: i64,
    pub attempt: i32,
    /// When the attempt started (µs since the epoch), where the worker knows it.
    pub started_at_us: Option<i64>,
    /// The worker that made the attempt, when it is not the one recording it (recovery).
    pub pid: Option<i32>,
    pub external_id: Option<String>,
    pub http_status: Option<i32>,
    pub outcome: String,
    /// The attempt's row is written already (a send open at the update from 0.1.0).
    pub row_written: bool,
    /// The claim that took the message for this attempt found no ledger entry of its key
    /// (the barrier let it through). While the message stays in that attempt, its queue row
    /// is the key's only one, and an entry is only ever written with the move of that row:
    /// the ledger still holds none, and the record need not look again.
    pub key_unrecorded_at_claim: bool,
}

/// Who confirmed an effect (`outbox._ledger.recorded_by`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorder {
    /// The provider answered the worker's send.
    Worker,
    /// A read-only lookup found the message at the provider.
    Reconcile,
}

impl Recorder {
    pub fn as_str(self) -> &'static str {
        match self {
            Recorder::Worker => "worker",
            Recorder::Reconcile => "reconcile",
        }
    }

    /// A message being sent right now is left alone by a lookup: the send's own answer
    /// records it. The worker records its own sends, which are in `sending`.
    fn leaves_sending(self) -> bool {
        self == Recorder::Reconcile
    }
}

/// One confirmed effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confirmed {
    pub message_id: i64,
    pub external_id: Option<String>,
    pub http_status: Option<i32>,
}

/// Confirms effects through `outbox._record_delivered`; returns the messages it marked
/// delivered (those not delivered before).
static RECORD_DELIVERED: Statement = Statement::planned_once(
    "SELECT d FROM outbox._record_delivered($1::int8[], $2::text[], $3::int4[], $4, $5) AS d",
);

/// Records `confirmed` in the caller's transaction.
pub fn record_delivered(
    client: &mut SpiClient<'_>,
    confirmed: &[Confirmed],
    recorder: Recorder,
) -> SpiResult<Vec<i64>> {
    let rows = spi::run(
        client,
        &RECORD_DELIVERED,
        None,
        &[
            confirmed
                .iter()
                .map(|c| c.message_id)
                .collect::<Vec<_>>()
                .into(),
            confirmed
                .iter()
                .map(|c| c.external_id.clone())
                .collect::<Vec<_>>()
                .into(),
            confirmed
                .iter()
                .map(|c| c.http_status)
                .collect::<Vec<_>>()
                .into(),
            recorder.as_str().into(),
            recorder.leaves_sending().into(),
        ],
    )?;
    rows.map(|row| row.get::<i64>(1).map(|id| id.unwrap_or_default()))
        .collect()
}

/// The worker's confirmed sends of messages still in the attempt that sent them (queued,
/// under the claim that took them, their rows counting the attempts before: `$2` - 1): each
/// moves into its ledger entry (or, when its effect is recorded already, stays marked
/// delivered), with the attempt counted and when it started (`$7`, µs since the epoch) and
/// by which worker. The delivered message is its attempt's row in `outbox.attempts` (when
/// it started, by which worker, the status, the external id, `delivered_at`); a row of
/// `outbox._attempts` is written only for what the message cannot tell: another outcome text
/// (a duplicate a stream reported), an answer without the external id or status the message
/// keeps from before, an attempt that began before the update from 0.1.0 (`$6`: its row is
/// written already). The arrays drive the joins: each message of the batch is one probe of
/// the primary key; the state is compared as text so that the plan cannot start from the
/// partial index of queued messages instead.
/// The claims give the messages up in the same transaction (`crate::worker::record`).
/// Its first three steps are those of `outbox._record_delivered` (sql/ledger.sql), which
/// reconcile, `resolve` and late answers go through, with the worker's own guard (the same
/// attempt still open) and the attempt row in the same statement: a change to what
/// "delivered" writes is made in both. Unlike it, the deletion does not look the key up in
/// the ledger again for a message whose claim found it unrecorded
/// (`Delivery::key_unrecorded_at_claim`): three index probes a delivery fewer.
pub(crate) static RECORD_SENT: Statement = Statement::planned_once(
    "
WITH d AS (
    SELECT d.*, coalesce(timestamptz 'epoch' + d.started_at_us * interval '1 microsecond', now()) AS started_at
      FROM unnest($1::int8[], $2::int4[], $3::text[], $4::int4[], $5::text[], $6::bool[], $7::int8[],
                  $8::bool[])
        AS d(id, attempt, external_id, http_status, outcome, row_written, started_at_us,
             key_unrecorded_at_claim)
), moved AS (
    -- The ledger probed through outbox._ledger_entry: one index probe per message, never a
    -- hash of the whole ledger, which grows with every delivery; and only for a message
    -- whose claim did not find its key unrecorded ($8: the message is still in the attempt
    -- that claim opened, and its queue row, the key's only one, is what an entry of the key
    -- would have moved).
    DELETE FROM outbox._messages m
     USING d
     WHERE m.id = d.id AND m.state::text = 'queued' AND least(m.attempts, 2147483646) = d.attempt - 1
       AND (d.key_unrecorded_at_claim
            OR NOT EXISTS (SELECT 1 FROM outbox._ledger_entry(m.tenant, m.effect_key)))
 RETURNING m.*, coalesce(d.external_id, m.external_id) AS confirmed_external_id,
           coalesce(d.http_status, m.last_http_status) AS confirmed_http_status,
           d.attempt AS sent_attempt, d.started_at AS sent_at
), kept AS (
    -- Only the messages the deletion did not take (an effect recorded already, or a late
    -- answer) are looked up again: a moved message costs no second probe of the queue
    -- table and of the ledger. A message whose claim found its key unrecorded is never
    -- kept (the deletion took it, or it is no longer in its attempt): such a batch, the
    -- usual one, builds no hash of the moved messages.
    UPDATE outbox._messages m
       SET state = 'delivered',
           attempts = d.attempt,
           first_attempt_at = coalesce(m.first_attempt_at, d.started_at),
           attempt_started_at = d.started_at,
           attempt_pid = pg_catalog.pg_backend_pid(),
           delivered_at = now(),
           updated_at = now(),
           external_id = coalesce(d.external_id, m.external_id),
           last_http_status = coalesce(d.http_status, m.last_http_status),
           lease_until = NULL,
           lease_owner = NULL
      FROM d
     WHERE m.id = d.id AND m.state::text = 'queued' AND least(m.attempts, 2147483646) = d.attempt - 1
       AND NOT d.key_unrecorded_at_claim
       AND NOT EXISTS (SELECT 1 FROM moved WHERE moved.id = d.id)
       AND EXISTS (SELECT 1 FROM outbox._ledger_entry(m.tenant, m.effect_key))
 RETURNING m.id, m.tenant, m.effect_key, m.external_id, m.last_http_status, m.attempt_started_at,
           m.attempt_pid
), l AS (
    INSERT INTO outbox._ledger (tenant, effect_key, message_id, external_id, recorded_by,
                                channel_id, ordering_key, payload, headers, not_before,
                                attempts, last_error_class, last_error, last_http_status,
                                owner, created_at, attempt_started_at, attempt_pid, generation)
    SELECT m.tenant, m.effect_key, m.id, m.confirmed_external_id, 'worker',
           m.channel_id, m.ordering_key, m.payload, m.headers, m.not_before,
           m.sent_attempt, m.last_error_class, m.last_error, m.confirmed_http_status,
           m.owner, m.created_at, m.sent_at, pg_catalog.pg_backend_pid(),
           -- The current generation, read once for the whole statement.
           (SELECT coalesce((SELECT g.generation FROM outbox._ledger_generations g
                              WHERE g.closed_at IS NULL), 0::smallint))
      FROM moved m
), m AS (
    SELECT id, tenant, effect_key, confirmed_external_id AS external_id,
           confirmed_http_status AS last_http_status, sent_at AS attempt_started_at,
           pg_catalog.pg_backend_pid() AS attempt_pid
      FROM moved
    UNION ALL
    SELECT * FROM kept
), a AS (
    INSERT INTO outbox._attempts (message_id, tenant, attempt, kind, started_at, finished_at, outcome,
                                  http_status, external_id, effect_key_sent, worker_pid)
    SELECT m.id, m.tenant, d.attempt, 'send', d.started_at, now(), d.outcome,
           d.http_status, d.external_id, outbox._provider_key(m.tenant, m.effect_key), m.attempt_pid
      FROM m JOIN d ON d.id = m.id
     WHERE NOT d.row_written
       -- A plain delivery's row is the delivered message itself (outbox.attempts): written
       -- only when the message cannot tell the attempt whole.
       AND (d.outcome <> 'delivered' OR d.started_at_us IS NULL
            OR m.external_id IS DISTINCT FROM d.external_id
            OR m.last_http_status IS DISTINCT FROM d.http_status)
)
SELECT m.id FROM m",
);

/// Records the worker's confirmed sends that are still in their attempt ([`RECORD_SENT`]);
/// returns the messages it recorded. Any other (a late answer: the message was taken back
/// meanwhile) is left to [`record_delivered`].
pub fn record_sent(
    client: &mut SpiClient<'_>,
    delivered: &[Delivery],
) -> SpiResult<std::collections::HashSet<i64>> {
    let rows = spi::run(
        client,
        &RECORD_SENT,
        None,
        &[
            delivered
                .iter()
                .map(|x| x.message_id)
                .collect::<Vec<_>>()
                .into(),
            delivered
                .iter()
                .map(|x| x.attempt)
                .collect::<Vec<_>>()
                .into(),
            delivered
                .iter()
                .map(|x| x.external_id.clone())
                .collect::<Vec<_>>()
                .into(),
            delivered
                .iter()
                .map(|x| x.http_status)
                .collect::<Vec<_>>()
                .into(),
            delivered
                .iter()
                .map(|x| x.outcome.clone())
                .collect::<Vec<_>>()
                .into(),
            delivered
                .iter()
                .map(|x| x.row_written)
                .collect::<Vec<_>>()
                .into(),
            delivered
                .iter()
                .map(|x| x.started_at_us)
                .collect::<Vec<_>>()
                .into(),
            delivered
                .iter()
                .map(|x| x.key_unrecorded_at_claim)
                .collect::<Vec<_>>()
                .into(),
        ],
    )?;
    rows.map(|row| row.get::<i64>(1).map(|id| id.unwrap_or_default()))
        .collect()
}

/// The generations that hold entries (`outbox._ledger_generations`), and the
/// transaction's clock, in seconds since the epoch.
const READ_GENERATIONS: &str = "
SELECT extract(epoch FROM now())::float8 AS now, g.generation,
       extract(epoch FROM g.opened_at)::float8, extract(epoch FROM g.closed_at)::float8
  FROM (SELECT 1) one
  LEFT JOIN outbox._ledger_generations g ON true";

/// How long emptying a generation waits for the sessions that read the ledger (each
/// enqueue, claim and record does, until its transaction ends). While it waits, its lock
/// queues every new reader behind it, so the wait is short; a session that holds the
/// ledger open for longer (a transaction left idle after an enqueue) makes it try again at
/// a later round. Under the lock the table is only truncated: readers wait for that alone.
const EMPTYING_LOCK_TIMEOUT: &str = "SELECT set_config('lock_timeout', '100ms', true)";

/// The generation's table, locked for emptying, one statement per generation.
const LOCK_GENERATION: [&str; generations::GENERATIONS as usize] = [
    "LOCK TABLE outbox._ledger_0 IN ACCESS EXCLUSIVE MODE",
    "LOCK TABLE outbox._ledger_1 IN ACCESS EXCLUSIVE MODE",
    "LOCK TABLE outbox._ledger_2 IN ACCESS EXCLUSIVE MODE",
];

/// The attempts of the delivered messages generation `$1` holds go with their entries.
/// Deleted before the generation's table is locked, while every reader goes on. Driven by
/// the attempt rows, which only unfinished messages and failed sends have, each probing
/// the generation's message index: never a scan of the whole generation, which may be
/// tried again at every round while its table is held.
const DELETE_GENERATION_ATTEMPTS: &str = "
DELETE FROM outbox._attempts a
 WHERE EXISTS (SELECT 1 FROM outbox._ledger l
                WHERE l.message_id = a.message_id AND l.generation = $1
                  AND l.channel_id IS NOT NULL)";

/// The generation's table emptied whole, one statement per generation.
const TRUNCATE_GENERATION: [&str; generations::GENERATIONS as usize] = [
    "TRUNCATE outbox._ledger_0",
    "TRUNCATE outbox._ledger_1",
    "TRUNCATE outbox._ledger_2",
];

/// A due generation whose table was held: since when its emptying has been put off
/// (outbox.alerts raises `ledger_retention_deferred` after five minutes); whether this is
/// the first time. An emptied generation's row goes, and the stamp with it.
const STAMP_DEFERRAL: &str = "
UPDATE outbox._ledger_generations g
   SET emptying_deferred_since = coalesce(g.emptying_deferred_since, now())
  FROM (SELECT emptying_deferred_since IS NULL AS first
          FROM outbox._ledger_generations WHERE generation = $1) before
 WHERE g.generation = $1
RETURNING before.first";

/// An emptied generation holds no entries: its row goes.
const FORGET_GENERATION: &str = "DELETE FROM outbox._ledger_generations WHERE generation = $1";

/// The current generation stops taking entries. A record that read it as current before
/// this commits may still add an entry a moment later: `generations::CLOSE_MARGIN_S` is
/// added to its age before it is emptied.
const CLOSE_GENERATION: &str = "
UPDATE outbox._ledger_generations SET closed_at = clock_timestamp()
 WHERE generation = $1 AND closed_at IS NULL";

/// Generation `$1` takes new entries from now on (or, when its row was closed while it
/// still took them, again).
const OPEN_GENERATION: &str = "
INSERT INTO outbox._ledger_generations (generation, opened_at) VALUES ($1, now())
ON CONFLICT (generation) DO UPDATE SET closed_at = NULL";

fn read_generations(client: &mut SpiClient<'_>) -> SpiResult<(f64, Vec<Generation>)> {
    let mut now = 0.0;
    let mut rows = Vec::new();
    for row in client.select(READ_GENERATIONS, None, &[])? {
        now = row.get::<f64>(1)?.unwrap_or_default();
        if let (Some(number), Some(opened_at)) = (row.get::<i16>(2)?, row.get::<f64>(3)?) {
            rows.push(Generation {
                number,
                opened_at,
                closed_at: row.get::<f64>(4)?,
            });
        }
    }
    Ok((now, rows))
}

/// A generation whose emptying was put off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deferral {
    pub generation: i16,
    /// The first time since it became due (the rounds after it say nothing new).
    pub first: bool,
    /// The SQLSTATE and message of the lock that was not granted in time.
    pub sqlstate: String,
    pub message: String,
}

/// What one round of the ledger's retention did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Retained {
    /// Another worker's round was under way: this one did nothing.
    pub skipped: bool,
    /// The generation emptied whole, if one was.
    pub emptied: Option<i16>,
    /// A generation due but not emptied this round: its table was held by another session
    /// for longer than the lock timeout.
    pub deferred: Option<Deferral>,
    /// The generation opened, if one was.
    pub opened: Option<i16>,
}

/// One round of the ledger's retention (`generations`): empties the oldest closed
/// generation whose entries are all older than `keep_s`, with the attempts of the
/// delivered messages it held, then closes the current generation if its period is over
/// and opens the next. One generation a round: each round's transaction holds at most one
/// table's lock. The emptying runs in a subtransaction under a lock timeout: one that
/// cannot take its table in time is left for a later round, and the ring does not advance
/// onto it meanwhile.
pub fn retain(client: &mut SpiClient<'_>, keep_s: f64) -> SpiResult<Retained> {
    let mut retained = Retained::default();
    // One round of retention at a time, across workers: a round that empties a generation
    // must not find it opened meanwhile by another. A worker that finds another's round
    // under way skips its own (it never waits for it); records only read the generations,
    // and are never held up. The lock is one no SQL can take (`worker_locks`).
    if !crate::worker_locks::LEDGER_ROUNDS.try_take() {
        retained.skipped = true;
        return Ok(retained);
    }
    let (now, rows) = read_generations(client)?;
    if let Some(&number) = generations::due_for_emptying(&rows, now, keep_s).first() {
        let i = number as usize;
        client.update(DELETE_GENERATION_ATTEMPTS, None, &[number.into()])?;
        let emptied = crate::spi::subtransaction(|| -> SpiResult<()> {
            client.update(EMPTYING_LOCK_TIMEOUT, None, &[])?;
            client.update(LOCK_GENERATION[i], None, &[])?;
            client.update(TRUNCATE_GENERATION[i], None, &[])?;
            client.update(FORGET_GENERATION, None, &[number.into()])?;
            Ok(())
        });
        match emptied {
            Ok(()) => retained.emptied = Some(number),
            Err((sqlstate, message)) => {
                let first = client
                    .update(STAMP_DEFERRAL, None, &[number.into()])?
                    .first()
                    .get_one::<bool>()?
                    .unwrap_or(true);
                retained.deferred = Some(Deferral {
                    generation: number,
                    first,
                    sqlstate,
                    message,
                });
            }
        }
    }
    let rows: Vec<Generation> = rows
        .into_iter()
        .filter(|g| retained.emptied != Some(g.number))
        .collect();
    match generations::rotation(&rows, now, keep_s) {
        Rotation::Stay => {}
        Rotation::Open(number) => {
            client.update(OPEN_GENERATION, None, &[number.into()])?;
            retained.opened = Some(number);
        }
        Rotation::Advance { close, open } => {
            client.update(CLOSE_GENERATION, None, &[close.into()])?;
            client.update(OPEN_GENERATION, None, &[open.into()])?;
            retained.opened = Some(open);
        }
    }
    Ok(retained)
}

/// How long entries are kept, in seconds: `outbox.ledger_retention`, but never shorter than
/// the longest retry horizon of any channel, and never longer than `max_keep_s`.
pub fn keep_s(ledger_retention_s: i64, longest_retry_horizon_ms: u64, max_keep_s: f64) -> f64 {
    (ledger_retention_s as f64)
        .max(longest_retry_horizon_ms as f64 / 1000.0)
        .clamp(0.0, max_keep_s)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CENTURY: f64 = 100.0 * 365.25 * 86_400.0;

    #[test]
    fn the_ledger_outlives_every_retry_horizon_up_to_the_longest_keep() {
        assert_eq!(keep_s(3600, 0, CENTURY), 3600.0);
        assert_eq!(
            keep_s(3600, 7_200_000, CENTURY),
            7200.0,
            "a longer retry horizon wins"
        );
        assert_eq!(keep_s(86_400, 1_000, CENTURY), 86_400.0);
        assert_eq!(
            keep_s(0, u64::MAX, CENTURY),
            CENTURY,
            "any horizon a channel may declare"
        );
        assert_eq!(keep_s(i64::MAX, 0, CENTURY), CENTURY);
        assert_eq!(keep_s(-5, 0, CENTURY), 0.0);
    }

    #[test]
    fn only_a_lookup_leaves_a_message_in_sending_alone() {
        assert!(Recorder::Reconcile.leaves_sending());
        assert!(!Recorder::Worker.leaves_sending());
        assert_eq!(Recorder::Worker.as_str(), "worker");
        assert_eq!(Recorder::Reconcile.as_str(), "reconcile");
    }
}
