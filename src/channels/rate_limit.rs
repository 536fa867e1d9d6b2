//! Rate limits, the `rate_limit` option: sends on a channel, every worker of the database
//! together, stay within `per_second` with bursts of at most `burst`. A token bucket kept in
//! the database (`outbox._channel_flow`, one row per channel, locked by the claim that takes
//! from it), so that the limit holds over all workers; a `Retry-After` answered on such a
//! channel holds the whole channel back. This module is the pure part: the option and the
//! bucket arithmetic.

use super::option_error::OptionError;
use serde_json::{json, Value};

/// Highest `per_second` and `burst`.
pub const MAX_RATE: u64 = 100_000;

/// A channel's `rate_limit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    pub per_second: u32,
    /// Most sends at once after an idle while; default a tenth of a second's worth (at least 1).
    pub burst: u32,
}

impl RateLimit {
    pub fn from_json(v: &Value) -> Result<RateLimit, OptionError> {
        let obj = v.as_object().ok_or_else(|| {
            OptionError::new(
                "rate_limit",
                "must be an object {\"per_second\": n, \"burst\": m}",
            )
        })?;
        if let Some(k) = obj.keys().find(|k| *k != "per_second" && *k != "burst") {
            return Err(OptionError::new(
                format!("rate_limit.{k}"),
                "unknown option; known options are per_second, burst",
            ));
        }
        let int = |key: &str| -> Result<Option<u32>, OptionError> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(n) if (1..=MAX_RATE).contains(&n) => Ok(Some(n as u32)),
                    _ => Err(OptionError::new(
                        format!("rate_limit.{key}"),
                        format!("must be an integer between 1 and {MAX_RATE}"),
                    )),
                },
            }
        };
        let per_second = int("per_second")?.ok_or_else(|| {
            OptionError::new(
                "rate_limit.per_second",
                format!("is required: an integer between 1 and {MAX_RATE}"),
            )
        })?;
        let burst = int("burst")?.unwrap_or((per_second / 10).max(1));
        Ok(RateLimit { per_second, burst })
    }

    pub fn to_json(&self) -> Value {
        json!({"per_second": self.per_second, "burst": self.burst})
    }
}

/// A bucket as stored: tokens at a time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    pub tokens: f64,
    pub at_ms: i64,
}

/// How long after its claim a request may arrive at the provider (a connection to open, the
/// claim to commit): the bucket holds this much of the rate less than `burst`, so that the
/// provider's count in any one second stays within `burst` + `per_second`.
pub const ARRIVAL_SKEW_MS: u32 = 30;

impl RateLimit {
    /// Most tokens the bucket holds: `burst` less [`ARRIVAL_SKEW_MS`] of the rate, at least 1.
    pub fn capacity(&self) -> f64 {
        let skew = (self.per_second as u64 * ARRIVAL_SKEW_MS as u64).div_ceil(1000) as u32;
        self.burst.saturating_sub(skew).max(1) as f64
    }
}

/// The bucket refilled up to `now_ms`.
fn refilled(b: Bucket, r: &RateLimit, now_ms: i64) -> f64 {
    let elapsed_s = (now_ms - b.at_ms).max(0) as f64 / 1000.0;
    (b.tokens + elapsed_s * r.per_second as f64).min(r.capacity())
}

/// Takes up to `want` whole tokens now: how many, and the bucket after.
pub fn take(b: Bucket, r: &RateLimit, now_ms: i64, want: u32) -> (u32, Bucket) {
    let tokens = refilled(b, r, now_ms);
    let granted = (tokens.floor().max(0.0) as u32).min(want);
    (
        granted,
        Bucket {
            tokens: tokens - granted as f64,
            at_ms: now_ms,
        },
    )
}

/// Gives back `unused` tokens taken by a claim that found fewer messages.
pub fn give_back(b: Bucket, r: &RateLimit, unused: u32) -> Bucket {
    Bucket {
        tokens: (b.tokens + unused as f64).min(r.capacity()),
        at_ms: b.at_ms,
    }
}

/// When the bucket next holds a whole token, unix ms.
pub fn next_token_ms(b: Bucket, r: &RateLimit) -> i64 {
    if b.tokens >= 1.0 {
        return b.at_ms;
    }
    b.at_ms + ((1.0 - b.tokens) * 1000.0 / r.per_second as f64).ceil() as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: RateLimit = RateLimit {
        per_second: 100,
        burst: 10,
    };

    #[test]
    fn a_full_bucket_gives_its_burst_then_the_rate() {
        let b = Bucket {
            tokens: 7.0,
            at_ms: 0,
        };
        let (n, b) = take(b, &R, 0, 200);
        assert_eq!(n, 7);
        let (n, b) = take(b, &R, 5, 200);
        assert_eq!(n, 0, "half a token");
        assert_eq!(next_token_ms(b, &R), 10);
        let (n, b) = take(b, &R, 50, 200);
        assert_eq!(n, 5);
        // Idle for long: never more than the capacity.
        let (n, _) = take(b, &R, 60_000, 200);
        assert_eq!(n, 7);
    }

    #[test]
    fn any_one_second_window_sees_at_most_burst_plus_rate() {
        // Take as fast as possible for 5 s in steps of 3 ms; count grants per window.
        let mut b = Bucket {
            tokens: 7.0,
            at_ms: 0,
        };
        let mut grants = Vec::new();
        for t in (0..5000).step_by(3) {
            let (n, next) = take(b, &R, t, 1000);
            b = next;
            grants.push((t, n));
        }
        for start in 0..4000 {
            let in_window: u32 = grants
                .iter()
                .filter(|(t, _)| *t >= start && *t < start + 1000)
                .map(|(_, n)| n)
                .sum();
            assert!(
                in_window <= 110,
                "{in_window} in the window from {start} ms"
            );
        }
        let total: u32 = grants.iter().map(|(_, n)| n).sum();
        assert!((505..=508).contains(&total), "{total}");
    }

    #[test]
    fn unused_tokens_come_back_up_to_the_capacity() {
        let b = Bucket {
            tokens: 2.0,
            at_ms: 0,
        };
        let (n, b) = take(b, &R, 0, 200);
        assert_eq!(n, 2);
        assert_eq!(give_back(b, &R, 2).tokens, 2.0);
        assert_eq!(
            give_back(
                Bucket {
                    tokens: 6.0,
                    at_ms: 0
                },
                &R,
                5
            )
            .tokens,
            7.0
        );
    }

    #[test]
    fn options_are_validated() {
        let r = RateLimit::from_json(&json!({"per_second": 100, "burst": 20})).unwrap();
        assert_eq!(
            r,
            RateLimit {
                per_second: 100,
                burst: 20
            }
        );
        assert_eq!(RateLimit::from_json(&r.to_json()).unwrap(), r);
        assert_eq!(
            RateLimit::from_json(&json!({"per_second": 5}))
                .unwrap()
                .burst,
            1
        );
        assert_eq!(
            RateLimit::from_json(&json!({"per_second": 300}))
                .unwrap()
                .burst,
            30
        );
        for (bad, option) in [
            (json!({"burst": 1}), "rate_limit.per_second"),
            (json!({"per_second": 0}), "rate_limit.per_second"),
            (json!({"per_second": 1.5}), "rate_limit.per_second"),
            (json!({"per_second": 10, "burst": 0}), "rate_limit.burst"),
            (
                json!({"per_second": 10, "burst": 100_001}),
                "rate_limit.burst",
            ),
            (json!({"per_second": 10, "every": 1}), "rate_limit.every"),
            (json!([]), "rate_limit"),
        ] {
            assert_eq!(
                RateLimit::from_json(&bad).unwrap_err().option,
                option,
                "{bad}"
            );
        }
    }
}
