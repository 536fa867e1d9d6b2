//! How long a claim leases its messages to the worker.
//!
//! A `sending` message whose lease ran out is taken back by another worker as an
//! interrupted attempt (`recovery`). That is right for a worker that stopped, and wrong
//! for one that is still waiting for an answer it is allowed to wait for: the message
//! would be sent a second time with the same key, or stop in `uncertain`, while the first
//! attempt is still open. So a lease lasts `outbox.lease_ms`, and never less than the
//! longest `timeout_ms` of any channel plus `MARGIN_MS` for the claim and the record
//! around the request. A batch sends its HTTP requests side by side (a claim takes no
//! more of a channel than its `max_in_flight` allows), each after waiting at most
//! `connection_slots::OVERFLOW_AFTER` for one of its channel's connection slots, so one
//! timeout and that wait bound them all.

/// Time allowed around the longest request: the claim before it, the record after it.
pub const MARGIN_MS: u64 = 5_000;

/// The lease of a claim, in ms: `configured` (`outbox.lease_ms`), or the longest attempt
/// any channel allows plus `MARGIN_MS` when that is longer.
pub fn lease_ms(configured: i64, longest_attempt_ms: u64) -> i64 {
    let needed = longest_attempt_ms.saturating_add(MARGIN_MS);
    configured.max(i64::try_from(needed).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setting_holds_while_it_covers_every_timeout() {
        assert_eq!(lease_ms(60_000, 10_000), 60_000);
        assert_eq!(lease_ms(60_000, 55_000), 60_000);
        assert_eq!(lease_ms(60_000, 0), 60_000);
    }

    #[test]
    fn a_longer_timeout_lengthens_the_lease_by_the_margin() {
        assert_eq!(lease_ms(60_000, 55_001), 60_001);
        assert_eq!(lease_ms(1_000, 4_000), 9_000);
        assert_eq!(lease_ms(60_000, 3_600_000), 3_605_000);
    }

    #[test]
    fn the_margin_covers_the_wait_for_a_connection_slot() {
        let wait = crate::channels::connection_slots::OVERFLOW_AFTER.as_millis() as u64;
        assert!(wait * 100 <= MARGIN_MS, "{wait} ms of {MARGIN_MS}");
    }

    #[test]
    fn no_timeout_overflows_the_lease() {
        assert_eq!(lease_ms(1_000, u64::MAX), i64::MAX);
        assert_eq!(lease_ms(1_000, i64::MAX as u64), i64::MAX);
    }
}
