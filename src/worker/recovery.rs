//! Recovery: a `sending` message whose lease ran out (its worker crashed or the server
//! restarted mid-attempt) is an ambiguous attempt, never a blind resend. At start a worker
//! also takes back the messages its slot had leased, since their worker is gone; and after
//! a promotion, every message claimed on the old primary (`standby`). The interrupted
//! attempt's row is written then, with its outcome, from the message (its start and its
//! worker's pid), followed by a `recovery` row; a send still open from before the update
//! from 0.1.0 has its row already, and that row is closed instead
//! (`record::close_open_rows`).

use crate::spi::{self, Statement};
use pgrx::spi::{SpiClient, SpiResult};

static FIND_LOST_LEASES: Statement = Statement::planned_each_run(
    "
SELECT m.id, m.channel_id, m.attempts,
       outbox._epoch_ms(coalesce(m.budget_started_at, m.created_at)),
       outbox._epoch_ms(coalesce(m.first_attempt_at, m.created_at)),
       m.attempts::int8 - m.budget_base
  FROM outbox._messages m
 WHERE m.state = 'sending'
   -- A lease without an end (written by hand) has ended.
   AND (coalesce(m.lease_until, '-infinity') < now() OR ($1 AND m.lease_owner = $2)
        -- Claimed on the old primary, before this server was promoted (0: it was not).
        OR ($4 > 0 AND m.updated_at < pg_catalog.to_timestamp($4::float8 / 1000)))
 ORDER BY m.id
 LIMIT $3
   FOR UPDATE OF m SKIP LOCKED",
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
        });
    }
    Ok(out)
}
