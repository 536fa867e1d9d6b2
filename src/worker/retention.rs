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

/// The longest anything is kept, in seconds: a century. A channel may declare a retry
/// horizon of any length, and `now()` minus a longer interval leaves the range of
/// timestamps (22008), which would stop retention for good.
pub const MAX_KEEP_S: f64 = 100.0 * 365.25 * 86_400.0;

/// How long finished messages are kept, in seconds.
pub fn messages_keep_s(retention_s: i64) -> f64 {
    (retention_s as f64).clamp(0.0, MAX_KEEP_S)
}

/// How long ledger entries are kept, in seconds: `outbox.ledger_retention`, but never
/// shorter than the longest retry horizon of any channel (a message may still be retried
/// that long after it was enqueued, and its ledger entry is what stops a second send), and
/// never longer than `MAX_KEEP_S`.
pub fn ledger_keep_s(ledger_retention_s: i64, longest_retry_horizon_ms: u64) -> f64 {
    (ledger_retention_s as f64)
        .max(longest_retry_horizon_ms as f64 / 1000.0)
        .clamp(0.0, MAX_KEEP_S)
}

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
        &[messages_keep_s(retention_s).into(), PURGE_BATCH.into()],
    )?;
    let ledger_s = ledger_keep_s(ledger_retention_s, longest_retry_horizon_ms);
    let ledger = client.update(PURGE_LEDGER, None, &[ledger_s.into(), PURGE_BATCH.into()])?;
    client.update(PURGE_MINUTES, None, &[])?;
    Ok((messages.len(), ledger.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ledger_outlives_every_retry_horizon_up_to_a_century() {
        assert_eq!(ledger_keep_s(3600, 0), 3600.0);
        assert_eq!(
            ledger_keep_s(3600, 7_200_000),
            7200.0,
            "a longer retry horizon wins"
        );
        assert_eq!(ledger_keep_s(86_400, 1_000), 86_400.0);
        assert_eq!(
            ledger_keep_s(0, u64::MAX),
            MAX_KEEP_S,
            "any horizon a channel may declare"
        );
        assert_eq!(ledger_keep_s(i64::MAX, 0), MAX_KEEP_S);
        assert_eq!(ledger_keep_s(-5, 0), 0.0);
    }

    #[test]
    fn messages_are_kept_for_the_setting_up_to_a_century() {
        assert_eq!(messages_keep_s(604_800), 604_800.0);
        assert_eq!(messages_keep_s(i64::MAX), MAX_KEEP_S);
        assert_eq!(messages_keep_s(-1), 0.0);
        // A century back from now is well inside the range of timestamps (4713 BC).
        assert!(MAX_KEEP_S < 2000.0 * 365.25 * 86_400.0);
    }
}
