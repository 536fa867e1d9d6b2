//! Recovery: a message whose claim's lease was lost (its worker crashed, was stopped for
//! longer than the lease, or the server restarted mid-attempt) is an ambiguous attempt,
//! never a blind resend. A claim's lease is lost when its worker stalled (no beat for
//! longer than the lease, on the boot clock), or when no worker of this server holds it
//! any more and its `lease_until` has passed; never while its worker beats
//! (`liveness`). At start a worker
//! also takes back the messages its slot had leased, since their worker is gone; and after
//! a promotion, every message claimed on the old primary (`standby`). The interrupted
//! attempt's row is written then, with its outcome, from the message (its start and its
//! worker's pid), followed by a `recovery` row; a send still open from before the update
//! from 0.1.0 has its row already, and that row is closed instead
//! (`record::close_open_rows`).

use crate::spi::{self, Statement};
use pgrx::spi::{SpiClient, SpiResult};

/// Whether the lease of claim `w` is lost (`liveness`): its worker stalled (no beat for
/// longer than the claim's own lease, on the boot clock), or no worker of this server holds
/// it any more and its `lease_until` has passed; never while its worker beats. A lease with
/// no finite end asks nothing of the holder's beat (NULL) and waits for `lease_until`.
macro_rules! claim_lost {
    () => {
        "CASE outbox._claim_holder(w.lease_owner, w.worker_pid,
                   CASE WHEN pg_catalog.isfinite(w.lease_until) AND pg_catalog.isfinite(w.started_at)
                        THEN extract(epoch FROM w.lease_until - w.started_at)::float8 * 1000 END)
             WHEN 'live' THEN false
             WHEN 'stalled' THEN true
             ELSE w.lease_until < pg_catalog.now() END"
    };
}

/// The messages of claims whose lease was lost (`liveness`: the holder stalled, or is gone
/// and `lease_until` passed), of this worker's slot from before it
/// started (`$1`, `$2`), or made on an old primary before this server was promoted (`$4`
/// ms, 0: it was not): their attempt under way (the one after those their rows count), when
/// it started and by which worker, and the claim it is taken back from.
/// The claims are read first and their messages reached by id (`= ANY`, one probe of the
/// primary key each): joined to the claims, the message table was read whole in id order,
/// for the `ORDER BY … LIMIT`, whenever the planner expected a lost lease early in it
/// (0.4 s a sweep at a backlog of 1,000,000, four sweeps a second, BENCHMARKS.md).
pub(crate) static FIND_LOST_LEASES: Statement = Statement::planned_each_run(concat!(
    "
WITH lost AS MATERIALIZED (
    SELECT w.id AS claim_id, w.started_at, w.worker_pid, u.id
      FROM outbox._claims w
     CROSS JOIN LATERAL pg_catalog.unnest(w.message_ids) AS u(id)
     WHERE ",
    claim_lost!(),
    "
        OR ($1 AND w.lease_owner = $2 AND w.worker_pid <> pg_catalog.pg_backend_pid())
        OR ($4 > 0 AND w.started_at < pg_catalog.to_timestamp($4::float8 / 1000))
)
SELECT m.id, m.channel_id, least(m.attempts, 2147483646) + 1,
       outbox._epoch_ms(coalesce(m.budget_started_at, m.created_at)),
       outbox._epoch_ms(coalesce(m.first_attempt_at, l.started_at, m.created_at)),
       m.attempts::int8 + 1 - m.budget_base,
       outbox._epoch_us(l.started_at), l.worker_pid, l.claim_id
  FROM outbox._messages m
  JOIN lost l ON l.id = m.id
 WHERE m.id = ANY (ARRAY(SELECT lost.id FROM lost))
   AND m.state = 'queued'
 ORDER BY m.id
 LIMIT $3
   FOR UPDATE OF m SKIP LOCKED"
));

/// Ids left in claims whose lease was lost that stand for no attempt under way: their
/// message was recorded otherwise (an operator's `resolve`) or is gone. Messages locked
/// by another transaction (one recovering them right now) stay.
pub(crate) static PRUNE_LOST_CLAIMS: Statement = Statement::planned_each_run(concat!(
    "
WITH lost AS MATERIALIZED (
    SELECT w.id
      FROM outbox._claims w
     WHERE ",
    claim_lost!(),
    "
        OR ($1 AND w.lease_owner = $2 AND w.worker_pid <> pg_catalog.pg_backend_pid())
        OR ($3 > 0 AND w.started_at < pg_catalog.to_timestamp($3::float8 / 1000))
), emptied AS (
    DELETE FROM outbox._claims w USING lost
     WHERE w.id = lost.id
       AND NOT EXISTS (SELECT 1 FROM pg_catalog.unnest(w.message_ids) AS u(id)
                        JOIN outbox._messages m ON m.id = u.id AND m.state = 'queued')
)
UPDATE outbox._claims w
   SET message_ids = ARRAY(SELECT u.id FROM pg_catalog.unnest(w.message_ids) AS u(id)
                            WHERE EXISTS (SELECT 1 FROM outbox._messages m
                                           WHERE m.id = u.id AND m.state = 'queued'))
  FROM lost
 WHERE w.id = lost.id
   AND EXISTS (SELECT 1 FROM pg_catalog.unnest(w.message_ids) AS u(id)
                WHERE NOT EXISTS (SELECT 1 FROM outbox._messages m
                                   WHERE m.id = u.id AND m.state = 'queued'))
   AND EXISTS (SELECT 1 FROM pg_catalog.unnest(w.message_ids) AS u(id)
                JOIN outbox._messages m ON m.id = u.id AND m.state = 'queued')"
));

/// Rows marked `sending` by hand (the worker never writes that state; a message in flight is
/// a queued row in a claim): each becomes queued again in a claim whose lease has ended, of
/// no worker, in the attempt its row counted, so that [`FIND_LOST_LEASES`] takes it back as
/// an interrupted attempt.
static ADOPT_STRAY_SENDING: Statement = Statement::planned_once(
    "
WITH stray AS (
    UPDATE outbox._messages m
       SET state = 'queued', attempts = greatest(m.attempts, 1) - 1
     WHERE m.state = 'sending'
 RETURNING m.id, m.channel_id
)
INSERT INTO outbox._claims (channel_id, lease_owner, worker_pid, lease_until, started_at, message_ids)
SELECT s.channel_id, -1, 0, '-infinity', now(), array_agg(s.id ORDER BY s.id)
  FROM stray s
 GROUP BY s.channel_id",
);

/// A message whose attempt was interrupted.
#[derive(Debug, Clone)]
pub struct LostLease {
    pub message_id: i64,
    pub channel_id: i32,
    pub attempt: i32,
    pub budget_started_at_ms: i64,
    pub first_attempt_at_ms: i64,
    /// Attempts counted against the current budget.
    pub budget_attempt: i64,
    /// When the attempt started (µs since the epoch) and which worker made it.
    pub started_at_us: Option<i64>,
    pub worker_pid: Option<i32>,
    /// The claim it is taken back from.
    pub claim_id: i64,
}

impl LostLease {
    /// What the retry policy needs to know about the interrupted attempt.
    pub fn context(&self, now_ms: i64) -> crate::worker::decide::AttemptContext {
        crate::worker::decide::AttemptContext::new(
            self.budget_attempt,
            now_ms,
            self.budget_started_at_ms,
            self.first_attempt_at_ms,
        )
    }
}

pub fn find_lost_leases(
    client: &mut SpiClient<'_>,
    include_own_slot: bool,
    worker_index: i32,
    limit: i64,
) -> SpiResult<Vec<LostLease>> {
    spi::run(client, &ADOPT_STRAY_SENDING, None, &[])?;
    let promoted_at_ms = crate::worker::standby::claimed_by_old_primary_before_ms();
    let rows = spi::run(
        client,
        &FIND_LOST_LEASES,
        None,
        &[
            include_own_slot.into(),
            worker_index.into(),
            limit.into(),
            promoted_at_ms.into(),
        ],
    )?;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let Some(message_id) = row.get::<i64>(1)? else {
            continue;
        };
        out.push(LostLease {
            message_id,
            channel_id: row.get::<i32>(2)?.unwrap_or_default(),
            attempt: row.get::<i32>(3)?.unwrap_or(1),
            budget_started_at_ms: row.get::<i64>(4)?.unwrap_or_default(),
            first_attempt_at_ms: row.get::<i64>(5)?.unwrap_or_default(),
            budget_attempt: row.get::<i64>(6)?.unwrap_or(1),
            started_at_us: row.get::<i64>(7)?,
            worker_pid: row.get::<i32>(8)?,
            claim_id: row.get::<i64>(9)?.unwrap_or_default(),
        });
    }
    Ok(out)
}

/// Deletes what [`PRUNE_LOST_CLAIMS`] finds.
pub fn prune_lost_claims(
    client: &mut SpiClient<'_>,
    include_own_slot: bool,
    worker_index: i32,
) -> SpiResult<()> {
    let promoted_at_ms = crate::worker::standby::claimed_by_old_primary_before_ms();
    spi::run(
        client,
        &PRUNE_LOST_CLAIMS,
        None,
        &[
            include_own_slot.into(),
            worker_index.into(),
            promoted_at_ms.into(),
        ],
    )?;
    Ok(())
}
