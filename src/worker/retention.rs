//! Retention: delivered and cancelled messages (with their attempts) older than
//! `outbox.retention` are removed in small batches that never hold long locks; ledger
//! entries live for `outbox.ledger_retention`, never shorter than the longest retry horizon
//! of any channel. Nothing that is not finished is ever removed.

use pgrx::spi::{SpiClient, SpiResult};

/// Rows removed per statement; small so that locks are short.
pub const PURGE_BATCH: i64 = 1000;

const PURGE_MESSAGES: &str = "
WITH old AS (
    SELECT m.id FROM outbox._messages m
     WHERE m.state IN ('delivered', 'cancelled')
       AND m.updated_at < now() - make_interval(secs => $1)
     ORDER BY m.updated_at
     LIMIT $2
       FOR UPDATE SKIP LOCKED
), gone_attempts AS (
    DELETE FROM outbox._attempts a WHERE a.message_id IN (SELECT id FROM old)
)
DELETE FROM outbox._messages m WHERE m.id IN (SELECT id FROM old)";

const PURGE_LEDGER: &str = "
DELETE FROM outbox._ledger l
 WHERE l.ctid = ANY (ARRAY(
       SELECT x.ctid FROM outbox._ledger x
        WHERE x.recorded_at < now() - make_interval(secs => $1)
        ORDER BY x.recorded_at
        LIMIT $2))";

/// Per-minute figures older than a day.
const PURGE_MINUTES: &str =
    "DELETE FROM outbox._channel_minutes WHERE minute < now() - interval '1 day'";

/// Removes one batch of each; returns (messages, ledger entries) removed.
pub fn purge(
    client: &mut SpiClient<'_>,
    retention_s: i64,
    ledger_retention_s: i64,
    longest_retry_horizon_ms: u64,
) -> SpiResult<(usize, usize)> {
    let messages = client.update(
        PURGE_MESSAGES,
        None,
        &[(retention_s as f64).into(), PURGE_BATCH.into()],
    )?;
    let ledger_s = (ledger_retention_s as f64).max(longest_retry_horizon_ms as f64 / 1000.0);
    let ledger = client.update(PURGE_LEDGER, None, &[ledger_s.into(), PURGE_BATCH.into()])?;
    client.update(PURGE_MINUTES, None, &[])?;
    Ok((messages.len(), ledger.len()))
}
