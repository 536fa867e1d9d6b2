//! Retention: cancelled messages, and delivered ones that stayed in the queue table, older
//! than `outbox.retention` are removed (with their attempts) in small batches that never
//! hold long locks; ledger entries, which hold the other delivered messages, are kept as
//! the ledger says (`crate::ledger::keep_s`), never shorter than `outbox.retention`, and
//! leave a whole generation at a time (`crate::ledger::retain`). Nothing that is not
//! finished is ever removed.

use crate::ledger;
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

/// Removes one batch of finished queue rows, and the per-minute figures older than a day;
/// returns how many messages it removed.
pub fn purge(client: &mut SpiClient<'_>, retention_s: i64) -> SpiResult<usize> {
    let messages = client.update(
        PURGE_MESSAGES,
        None,
        &[messages_keep_s(retention_s).into(), PURGE_BATCH.into()],
    )?;
    client.update(PURGE_MINUTES, None, &[])?;
    Ok(messages.len())
}

/// How long the ledger keeps its entries, in seconds: as the ledger says, and at least as
/// long as finished messages are kept, since an entry holds its delivered message.
pub fn ledger_keep_s(
    retention_s: i64,
    ledger_retention_s: i64,
    longest_retry_horizon_ms: u64,
) -> f64 {
    ledger::keep_s(ledger_retention_s, longest_retry_horizon_ms, MAX_KEEP_S)
        .max(messages_keep_s(retention_s))
}

/// One round of the ledger's retention (`crate::ledger::retain`).
pub fn retain_ledger(
    client: &mut SpiClient<'_>,
    retention_s: i64,
    ledger_retention_s: i64,
    longest_retry_horizon_ms: u64,
) -> SpiResult<ledger::Retained> {
    ledger::retain(
        client,
        ledger_keep_s(retention_s, ledger_retention_s, longest_retry_horizon_ms),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_kept_for_the_setting_up_to_a_century() {
        assert_eq!(messages_keep_s(604_800), 604_800.0);
        assert_eq!(messages_keep_s(i64::MAX), MAX_KEEP_S);
        assert_eq!(messages_keep_s(-1), 0.0);
        // A century back from now is well inside the range of timestamps (4713 BC).
        const { assert!(MAX_KEEP_S < 2000.0 * 365.25 * 86_400.0) };
    }

    #[test]
    fn the_ledger_keeps_its_entries_as_long_as_their_messages_are_kept() {
        assert_eq!(ledger_keep_s(604_800, 3600, 0), 604_800.0);
        assert_eq!(ledger_keep_s(60, 3600, 0), 3600.0);
        assert_eq!(ledger_keep_s(60, 0, 7_200_000), 7200.0);
        assert_eq!(ledger_keep_s(i64::MAX, i64::MAX, u64::MAX), MAX_KEEP_S);
    }
}
