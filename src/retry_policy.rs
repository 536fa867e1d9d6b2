//! Retry policy of a channel: bounded, jittered, `Retry-After`-aware retries.
//!
//! This module is pure: no Postgres, no pgrx, no clock and no randomness of
//! its own. Times are plain `i64` unix milliseconds and the random source is
//! injected, so every decision can be reproduced in a test.
//!
//! The policy is configured by the channel option `retry`, a JSON object whose
//! keys are the fields of [`RetryPolicy`]; missing keys take their defaults.
//! After each failed attempt the worker calls [`decide`] with the
//! [`FailureFacts`] of the message, and either schedules the next attempt at
//! [`Decision::RetryAt`] or gives the message up.

use serde_json::{Map, Value};
use std::fmt;

/// How the backoff ceiling is randomised.
///
/// JSON spelling: `"full"`, `"equal"`, `"none"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jitter {
    /// Uniform in `[0, ceiling]`.
    Full,
    /// `ceiling / 2` plus uniform in `[0, ceiling / 2]`.
    Equal,
    /// Exactly the ceiling.
    None,
}

impl Jitter {
    /// The JSON spelling of the jitter mode.
    pub fn as_str(self) -> &'static str {
        match self {
            Jitter::Full => "full",
            Jitter::Equal => "equal",
            Jitter::None => "none",
        }
    }

    /// Parses the JSON spelling (exact, lower case).
    pub fn parse(s: &str) -> Option<Jitter> {
        match s {
            "full" => Some(Jitter::Full),
            "equal" => Some(Jitter::Equal),
            "none" => Some(Jitter::None),
            _ => None,
        }
    }
}

impl fmt::Display for Jitter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The retry policy of a channel (channel option `retry`).
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Total number of send attempts, the first one included (default 8, >= 1).
    pub max_attempts: u32,
    /// Backoff ceiling after the first failure, in ms (default 1000, > 0).
    pub base_ms: u64,
    /// Largest backoff ceiling, in ms (default 300000, >= `base_ms`).
    pub max_ms: u64,
    /// Growth of the ceiling per failure (default 2.0, finite, >= 1.0).
    pub multiplier: f64,
    /// Randomisation of the ceiling (default [`Jitter::Full`]).
    pub jitter: Jitter,
    /// No attempt is scheduled later than this many ms after enqueue
    /// (default 86400000, > 0).
    pub max_age_ms: u64,
    /// Whether the provider's `Retry-After` is honoured (default true).
    pub respect_retry_after: bool,
    /// Upper bound on an honoured `Retry-After`, in ms (default 3600000, > 0).
    pub max_retry_after_ms: u64,
}

/// Attempts a channel's retry budget allows unless its `retry.max_attempts` says otherwise.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 8;

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            base_ms: 1000,
            max_ms: 300_000,
            multiplier: 2.0,
            jitter: Jitter::Full,
            max_age_ms: 86_400_000,
            respect_retry_after: true,
            max_retry_after_ms: 3_600_000,
        }
    }
}

/// A rejected `retry` option. `field` is the full option path, e.g.
/// `"retry.base_ms"`, or `"retry"` when the whole value is wrong.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyError {
    pub field: String,
    pub message: String,
}

impl PolicyError {
    fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        PolicyError {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid option {}: {}", self.field, self.message)
    }
}

impl std::error::Error for PolicyError {}

const KEYS: [&str; 8] = [
    "max_attempts",
    "base_ms",
    "max_ms",
    "multiplier",
    "jitter",
    "max_age_ms",
    "respect_retry_after",
    "max_retry_after_ms",
];

/// Largest integer that an `f64` represents exactly (2^53).
const MAX_EXACT_F64_INT: f64 = 9_007_199_254_740_992.0;

/// Short description of a JSON value for error messages.
fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => {
            let short: String = s.chars().take(40).collect();
            if short.len() < s.len() {
                format!("string {short:?}...")
            } else {
                format!("string {short:?}")
            }
        }
        Value::Array(_) => "an array".to_string(),
        Value::Object(_) => "an object".to_string(),
    }
}

/// Reads a non-negative integer. Integral floats (`1000.0`, as Postgres
/// `jsonb` may keep them) are accepted up to 2^53; fractions are not.
fn read_uint(obj: &Map<String, Value>, key: &str) -> Result<Option<u64>, PolicyError> {
    let Some(v) = obj.get(key) else {
        return Ok(None);
    };
    let field = format!("retry.{key}");
    let bad = || {
        PolicyError::new(
            field.clone(),
            format!("expected an integer, got {}", describe(v)),
        )
    };
    let Value::Number(n) = v else {
        return Err(bad());
    };
    if let Some(u) = n.as_u64() {
        return Ok(Some(u));
    }
    if n.as_i64().is_some() {
        return Err(PolicyError::new(
            field,
            format!("must not be negative, got {n}"),
        ));
    }
    match n.as_f64() {
        Some(f) if f.is_finite() && f.fract() == 0.0 => {
            if f < 0.0 {
                Err(PolicyError::new(
                    field,
                    format!("must not be negative, got {n}"),
                ))
            } else if f > MAX_EXACT_F64_INT {
                Err(PolicyError::new(field, format!("is too large, got {n}")))
            } else {
                Ok(Some(f as u64))
            }
        }
        _ => Err(bad()),
    }
}

/// Reads a strictly positive integer (milliseconds).
fn read_positive(obj: &Map<String, Value>, key: &str, default: u64) -> Result<u64, PolicyError> {
    match read_uint(obj, key)? {
        None => Ok(default),
        Some(0) => Err(PolicyError::new(
            format!("retry.{key}"),
            "must be greater than 0",
        )),
        Some(u) => Ok(u),
    }
}

fn read_bool(obj: &Map<String, Value>, key: &str, default: bool) -> Result<bool, PolicyError> {
    match obj.get(key) {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(PolicyError::new(
            format!("retry.{key}"),
            format!("expected true or false, got {}", describe(v)),
        )),
    }
}

impl RetryPolicy {
    /// Parses and validates the channel option `retry`.
    ///
    /// The value must be a JSON object; missing keys take their defaults, an
    /// unknown key, a value of the wrong JSON type or out of range is an
    /// error naming the field (`"retry.<key>"`, or `"retry"` for the object
    /// itself). Integer fields accept JSON integers and integral floats
    /// (`1000.0`); `null` is not a way to ask for the default. When several
    /// keys are wrong, the first in field order is reported (unknown keys
    /// first, alphabetically).
    pub fn from_json(v: &Value) -> Result<RetryPolicy, PolicyError> {
        let obj = v.as_object().ok_or_else(|| {
            PolicyError::new(
                "retry",
                format!("expected a JSON object, got {}", describe(v)),
            )
        })?;
        let mut unknown: Vec<&String> =
            obj.keys().filter(|k| !KEYS.contains(&k.as_str())).collect();
        unknown.sort();
        if let Some(k) = unknown.first() {
            return Err(PolicyError::new(
                format!("retry.{k}"),
                format!("unknown option; known options are {}", KEYS.join(", ")),
            ));
        }
        let d = RetryPolicy::default();

        let max_attempts = match read_uint(obj, "max_attempts")? {
            None => d.max_attempts,
            Some(0) => return Err(PolicyError::new("retry.max_attempts", "must be at least 1")),
            Some(u) => u32::try_from(u).map_err(|_| {
                PolicyError::new(
                    "retry.max_attempts",
                    format!("must be at most {}, got {u}", u32::MAX),
                )
            })?,
        };
        let base_ms = read_positive(obj, "base_ms", d.base_ms)?;
        let max_ms = read_positive(obj, "max_ms", d.max_ms)?;
        let multiplier = match obj.get("multiplier") {
            None => d.multiplier,
            Some(Value::Number(n)) => match n.as_f64() {
                Some(m) if m.is_finite() && m >= 1.0 => m,
                _ => {
                    return Err(PolicyError::new(
                        "retry.multiplier",
                        format!("must be a finite number >= 1, got {n}"),
                    ))
                }
            },
            Some(v) => {
                return Err(PolicyError::new(
                    "retry.multiplier",
                    format!("expected a number, got {}", describe(v)),
                ))
            }
        };
        let jitter = match obj.get("jitter") {
            None => d.jitter,
            Some(Value::String(s)) => Jitter::parse(s).ok_or_else(|| {
                PolicyError::new(
                    "retry.jitter",
                    format!(
                        "expected \"full\", \"equal\" or \"none\", got {}",
                        describe(&Value::String(s.clone()))
                    ),
                )
            })?,
            Some(v) => {
                return Err(PolicyError::new(
                    "retry.jitter",
                    format!(
                        "expected \"full\", \"equal\" or \"none\", got {}",
                        describe(v)
                    ),
                ))
            }
        };
        let max_age_ms = read_positive(obj, "max_age_ms", d.max_age_ms)?;
        let respect_retry_after = read_bool(obj, "respect_retry_after", d.respect_retry_after)?;
        let max_retry_after_ms = read_positive(obj, "max_retry_after_ms", d.max_retry_after_ms)?;

        if max_ms < base_ms {
            // Blame the key the user actually wrote.
            return Err(if obj.contains_key("max_ms") {
                PolicyError::new(
                    "retry.max_ms",
                    format!("must be >= base_ms ({base_ms}), got {max_ms}"),
                )
            } else {
                PolicyError::new(
                    "retry.base_ms",
                    format!("must be <= max_ms ({max_ms}, the default), got {base_ms}"),
                )
            });
        }

        Ok(RetryPolicy {
            max_attempts,
            base_ms,
            max_ms,
            multiplier,
            jitter,
            max_age_ms,
            respect_retry_after,
            max_retry_after_ms,
        })
    }

    /// The complete, normalized `retry` object (every key present); it
    /// round-trips through [`RetryPolicy::from_json`].
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("max_attempts".into(), Value::from(self.max_attempts));
        m.insert("base_ms".into(), Value::from(self.base_ms));
        m.insert("max_ms".into(), Value::from(self.max_ms));
        m.insert("multiplier".into(), Value::from(self.multiplier));
        m.insert("jitter".into(), Value::from(self.jitter.as_str()));
        m.insert("max_age_ms".into(), Value::from(self.max_age_ms));
        m.insert(
            "respect_retry_after".into(),
            Value::from(self.respect_retry_after),
        );
        m.insert(
            "max_retry_after_ms".into(),
            Value::from(self.max_retry_after_ms),
        );
        Value::Object(m)
    }

    /// The un-jittered backoff after `failures` failed attempts:
    /// `min(max_ms, base_ms * multiplier^(failures - 1))`, `failures == 0`
    /// being treated as 1. Saturates at `max_ms`; never overflows, never
    /// NaNs. Fractional results are rounded down. On a hand-built policy that
    /// bypassed validation, a NaN or < 1 multiplier counts as 1 and a
    /// `base_ms` above `max_ms` is cut to `max_ms`.
    pub fn backoff_ceiling_ms(&self, failures: u32) -> u64 {
        let cap = self.max_ms;
        let base = self.base_ms.min(cap);
        let exponent = failures.max(1) - 1;
        let m = if self.multiplier.is_nan() || self.multiplier < 1.0 {
            1.0
        } else {
            self.multiplier
        };
        if exponent == 0 || base == 0 || m == 1.0 {
            return base;
        }
        // base > 0 and m > 1 (possibly +inf): raw is in [base, +inf], not NaN.
        let raw = base as f64 * m.powf(f64::from(exponent));
        if raw >= cap as f64 {
            cap
        } else {
            // `as` saturates; the clamp guards against rounding of large u64.
            (raw as u64).clamp(base, cap)
        }
    }
}

/// What is known after a failed attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailureFacts {
    /// Failed send attempts so far, including the one just made (>= 1).
    pub failures: u32,
    pub now_ms: i64,
    pub enqueued_at_ms: i64,
    pub first_attempt_at_ms: i64,
    /// The provider's `Retry-After`, already parsed (see [`parse_retry_after`]).
    pub retry_after_ms: Option<u64>,
    /// `Some(w)` when the retry is only safe while the provider remembers the
    /// idempotency key: the previous outcome was ambiguous and the channel
    /// dedupes by key for `w` ms. `None` otherwise.
    pub key_window_ms: Option<u64>,
}

/// Why the retry budget is spent.
#[derive(Debug, Clone, PartialEq)]
pub enum Exhaustion {
    /// `failures >= max_attempts`.
    Attempts { max_attempts: u32 },
    /// The next attempt would be later than `enqueued_at + max_age_ms`.
    Age { max_age_ms: u64 },
}

impl fmt::Display for Exhaustion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exhaustion::Attempts { max_attempts } => write!(
                f,
                "retry budget spent: {max_attempts} of {max_attempts} attempts"
            ),
            Exhaustion::Age { max_age_ms } => write!(
                f,
                "retry budget spent: next attempt would be more than {max_age_ms} ms after enqueue"
            ),
        }
    }
}

/// The outcome of [`decide`].
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Attempt again at `at_ms` (= now + `delay_ms`, saturating).
    /// `retry_after_honoured` is true when a `Retry-After` was present and
    /// respected (it may or may not have lengthened the delay).
    RetryAt {
        at_ms: i64,
        delay_ms: u64,
        retry_after_honoured: bool,
    },
    /// No retry: the budget is spent.
    Exhausted(Exhaustion),
    /// A same-key retry would land after `first_attempt + window_ms`, when the
    /// provider may have forgotten the key: no retry is scheduled.
    KeyWindowClosed { window_ms: u64 },
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decision::RetryAt {
                at_ms,
                delay_ms,
                retry_after_honoured,
            } => {
                write!(f, "retry in {delay_ms} ms (at {at_ms})")?;
                if *retry_after_honoured {
                    f.write_str(", honouring Retry-After")?;
                }
                Ok(())
            }
            Decision::Exhausted(e) => e.fmt(f),
            Decision::KeyWindowClosed { window_ms } => write!(
                f,
                "idempotency key window closed: a retry would land more than {window_ms} ms after the first attempt"
            ),
        }
    }
}

/// `t + ms` without overflow.
fn add_ms(t: i64, ms: u64) -> i128 {
    i128::from(t) + i128::from(ms)
}

/// Saturates an instant into `i64`.
fn saturate(t: i128) -> i64 {
    i64::try_from(t).unwrap_or(if t < 0 { i64::MIN } else { i64::MAX })
}

/// One draw from the injected random source, forced into `[0, 1]`
/// (NaN counts as 0).
fn draw(rng: &mut dyn FnMut() -> f64) -> f64 {
    let r = rng();
    if r.is_nan() {
        0.0
    } else {
        r.clamp(0.0, 1.0)
    }
}

/// `floor(span * r)` for `r` in `[0, 1]`, never above `span`.
fn scale(span: u64, r: f64) -> u64 {
    ((span as f64 * r) as u64).min(span)
}

fn jittered(jitter: Jitter, ceiling: u64, rng: &mut dyn FnMut() -> f64) -> u64 {
    match jitter {
        Jitter::Full => scale(ceiling, draw(rng)),
        Jitter::Equal => {
            let half = ceiling / 2;
            half + scale(ceiling - half, draw(rng))
        }
        Jitter::None => ceiling,
    }
}

/// Decides what happens after a failed attempt.
///
/// 1. `failures >= max_attempts` → [`Exhaustion::Attempts`].
/// 2. The delay is the jittered [`RetryPolicy::backoff_ceiling_ms`]
///    (`rng` returns an `f64` in `[0, 1)`; anything else is clamped, and it
///    is only called for `Full`/`Equal` jitter). With `respect_retry_after`
///    and a `Retry-After`, the delay is at least
///    `min(retry_after, max_retry_after_ms)`.
/// 3. `at = now + delay` (saturating). `at > enqueued_at + max_age_ms` →
///    [`Exhaustion::Age`].
/// 4. `key_window_ms = Some(w)` and `at > first_attempt_at + w` →
///    [`Decision::KeyWindowClosed`].
/// 5. Otherwise [`Decision::RetryAt`].
pub fn decide(
    policy: &RetryPolicy,
    facts: &FailureFacts,
    rng: &mut dyn FnMut() -> f64,
) -> Decision {
    if facts.failures >= policy.max_attempts {
        return Decision::Exhausted(Exhaustion::Attempts {
            max_attempts: policy.max_attempts,
        });
    }
    let ceiling = policy.backoff_ceiling_ms(facts.failures);
    let mut delay_ms = jittered(policy.jitter, ceiling, rng);
    let mut retry_after_honoured = false;
    if policy.respect_retry_after {
        if let Some(ra) = facts.retry_after_ms {
            delay_ms = delay_ms.max(ra.min(policy.max_retry_after_ms));
            retry_after_honoured = true;
        }
    }
    // Compared exactly (i128); only the reported instant saturates.
    let at = add_ms(facts.now_ms, delay_ms);
    if at > add_ms(facts.enqueued_at_ms, policy.max_age_ms) {
        return Decision::Exhausted(Exhaustion::Age {
            max_age_ms: policy.max_age_ms,
        });
    }
    if let Some(window_ms) = facts.key_window_ms {
        if at > add_ms(facts.first_attempt_at_ms, window_ms) {
            return Decision::KeyWindowClosed { window_ms };
        }
    }
    Decision::RetryAt {
        at_ms: saturate(at),
        delay_ms,
        retry_after_honoured,
    }
}

/// A `Retry-After` value that is neither delta-seconds nor an HTTP-date.
/// The worker records it and ignores the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryAfterError {
    /// The header value as received.
    pub value: String,
    pub reason: &'static str,
}

impl fmt::Display for RetryAfterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unusable Retry-After {:?}: {}", self.value, self.reason)
    }
}

impl std::error::Error for RetryAfterError {}

const MS_PER_DAY: i64 = 86_400_000;

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's
/// `days_from_civil`). `month` is 1..=12, `day` 1..=31.
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400; // [0, 399]
    let m = i64::from(month);
    let mp = if m > 2 { m - 3 } else { m + 9 }; // March = 0
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1; // [0, 365]
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy; // [0, 146096]
    era * 146_097 + doe - 719_468
}

/// The proleptic Gregorian year containing `days` since 1970-01-01.
fn year_from_days(days: i64) -> i64 {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let y = yoe + era * 400;
    if mp >= 10 {
        y + 1
    } else {
        y
    }
}

fn is_leap(year: i64) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

fn days_in_month(year: i64, month: u32) -> u32 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

const SHORT_DAYS: [&str; 7] = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"];
const LONG_DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

type DateResult<T> = Result<T, &'static str>;

fn digits(b: &[u8], reason: &'static str) -> DateResult<u32> {
    if b.is_empty() || !b.iter().all(u8::is_ascii_digit) {
        return Err(reason);
    }
    Ok(b.iter().fold(0, |acc, d| acc * 10 + u32::from(d - b'0')))
}

fn expect(b: &[u8], at: usize, c: u8) -> DateResult<()> {
    if b.get(at) == Some(&c) {
        Ok(())
    } else {
        Err("not an HTTP-date")
    }
}

fn month(b: &[u8]) -> DateResult<u32> {
    MONTHS
        .iter()
        .position(|m| m.as_bytes().eq_ignore_ascii_case(b))
        .map(|i| i as u32 + 1)
        .ok_or("unknown month name")
}

fn day_name(b: &[u8], names: &[&str; 7]) -> DateResult<()> {
    if names.iter().any(|n| n.as_bytes().eq_ignore_ascii_case(b)) {
        Ok(())
    } else {
        Err("unknown day name")
    }
}

/// `HH:MM:SS` → seconds of the day.
fn time_of_day(b: &[u8]) -> DateResult<i64> {
    if b.len() != 8 || b[2] != b':' || b[5] != b':' {
        return Err("bad time of day");
    }
    let h = digits(&b[0..2], "bad time of day")?;
    let m = digits(&b[3..5], "bad time of day")?;
    let s = digits(&b[6..8], "bad time of day")?;
    if h > 23 || m > 59 || s > 60 {
        return Err("time of day out of range");
    }
    Ok(i64::from(h * 3600 + m * 60 + s))
}

fn gmt(b: &[u8]) -> DateResult<()> {
    if b.eq_ignore_ascii_case(b"GMT") {
        Ok(())
    } else {
        Err("time zone is not GMT")
    }
}

fn to_unix_ms(year: i64, month: u32, day: u32, secs: i64) -> DateResult<i64> {
    if day == 0 || day > days_in_month(year, month) {
        return Err("day out of range for the month");
    }
    Ok(days_from_civil(year, month, day) * MS_PER_DAY + secs * 1000)
}

/// IMF-fixdate: `Sun, 06 Nov 1994 08:49:37 GMT`.
fn imf_fixdate(b: &[u8]) -> DateResult<i64> {
    if b.len() != 29 {
        return Err("not an HTTP-date");
    }
    day_name(&b[0..3], &SHORT_DAYS)?;
    expect(b, 3, b',')?;
    expect(b, 4, b' ')?;
    let day = digits(&b[5..7], "bad day of month")?;
    expect(b, 7, b' ')?;
    let mon = month(&b[8..11])?;
    expect(b, 11, b' ')?;
    let year = digits(&b[12..16], "bad year")?;
    expect(b, 16, b' ')?;
    let secs = time_of_day(&b[17..25])?;
    expect(b, 25, b' ')?;
    gmt(&b[26..29])?;
    to_unix_ms(i64::from(year), mon, day, secs)
}

/// Obsolete RFC 850 form: `Sunday, 06-Nov-94 08:49:37 GMT`. The two-digit
/// year is read per RFC 9110: one more than 50 years after `now` means the
/// most recent past year with those digits.
fn rfc850(b: &[u8], now_ms: i64) -> DateResult<i64> {
    let comma = b
        .iter()
        .position(|&c| c == b',')
        .ok_or("not an HTTP-date")?;
    day_name(&b[..comma], &LONG_DAYS)?;
    let rest = &b[comma..];
    // ", DD-Mon-YY HH:MM:SS GMT"
    if rest.len() != 24 {
        return Err("not an HTTP-date");
    }
    expect(rest, 1, b' ')?;
    let day = digits(&rest[2..4], "bad day of month")?;
    expect(rest, 4, b'-')?;
    let mon = month(&rest[5..8])?;
    expect(rest, 8, b'-')?;
    let yy = i64::from(digits(&rest[9..11], "bad year")?);
    expect(rest, 11, b' ')?;
    let secs = time_of_day(&rest[12..20])?;
    expect(rest, 20, b' ')?;
    gmt(&rest[21..24])?;
    let now_year = year_from_days(now_ms.div_euclid(MS_PER_DAY));
    let mut year = now_year - now_year.rem_euclid(100) + yy;
    if year - now_year > 50 {
        year -= 100;
    }
    to_unix_ms(year, mon, day, secs)
}

/// asctime form: `Sun Nov  6 08:49:37 1994` (day padded with a space, or
/// two digits).
fn asctime(b: &[u8]) -> DateResult<i64> {
    if b.len() != 24 {
        return Err("not an HTTP-date");
    }
    day_name(&b[0..3], &SHORT_DAYS)?;
    expect(b, 3, b' ')?;
    let mon = month(&b[4..7])?;
    expect(b, 7, b' ')?;
    let day = if b[8] == b' ' {
        digits(&b[9..10], "bad day of month")?
    } else {
        digits(&b[8..10], "bad day of month")?
    };
    expect(b, 10, b' ')?;
    let secs = time_of_day(&b[11..19])?;
    expect(b, 19, b' ')?;
    let year = digits(&b[20..24], "bad year")?;
    to_unix_ms(i64::from(year), mon, day, secs)
}

/// Parses an HTTP `Retry-After` value (RFC 9110 §10.2.3) into a delay in ms
/// from `now_ms`.
///
/// * delta-seconds: ASCII digits only (surrounding whitespace is trimmed),
///   huge values saturate at `u64::MAX` ms;
/// * HTTP-date in IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`), obsolete
///   RFC 850 (`Sunday, 06-Nov-94 08:49:37 GMT`) or asctime
///   (`Sun Nov  6 08:49:37 1994`) form; a date in the past gives 0. Day and
///   month names are matched case-insensitively and the day name is not
///   checked against the date; seconds may be 60 (leap second).
///
/// Anything else (signs, decimals, empty, invalid dates such as Feb 30 or
/// hour 25) is a [`RetryAfterError`].
pub fn parse_retry_after(value: &str, now_ms: i64) -> Result<u64, RetryAfterError> {
    let err = |reason| RetryAfterError {
        value: value.to_string(),
        reason,
    };
    let v = value.trim_matches(|c: char| c.is_ascii_whitespace());
    if v.is_empty() {
        return Err(err("empty value"));
    }
    let b = v.as_bytes();
    if b.iter().all(u8::is_ascii_digit) {
        let secs = b.iter().fold(0u64, |acc, d| {
            acc.saturating_mul(10).saturating_add(u64::from(d - b'0'))
        });
        return Ok(secs.saturating_mul(1000));
    }
    if b[0].is_ascii_digit() || matches!(b[0], b'-' | b'+' | b'.') {
        return Err(err("not a non-negative integer number of seconds"));
    }
    if !v.is_ascii() {
        return Err(err("not an HTTP-date"));
    }
    let date_ms = if b.get(3) == Some(&b',') {
        imf_fixdate(b)
    } else if b.contains(&b',') {
        rfc850(b, now_ms)
    } else {
        asctime(b)
    }
    .map_err(err)?;
    let delta = i128::from(date_ms) - i128::from(now_ms);
    Ok(u64::try_from(delta.max(0)).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    type Prng = crate::random::SplitMix64;

    fn random_policy(p: &mut Prng) -> RetryPolicy {
        let base_ms = if p.chance(10) {
            p.range(1, 1 << 40)
        } else {
            p.range(1, 10_000)
        };
        let max_ms = if p.chance(10) {
            base_ms
        } else if p.chance(5) {
            u64::MAX
        } else {
            base_ms.saturating_add(p.range(0, 10_000_000))
        };
        let multiplier = match p.range(0, 6) {
            0 => 1.0,
            1 => 1.5,
            2 => 2.0,
            3 => 3.0,
            4 => 1e300,
            _ => 1.0 + p.unit() * 9.0,
        };
        RetryPolicy {
            max_attempts: if p.chance(5) {
                p.range(1, u64::from(u32::MAX)) as u32
            } else {
                p.range(1, 20) as u32
            },
            base_ms,
            max_ms,
            multiplier,
            jitter: p.pick(&[Jitter::Full, Jitter::Equal, Jitter::None]),
            max_age_ms: if p.chance(5) {
                u64::MAX
            } else {
                p.range(1, 1_000_000_000)
            },
            respect_retry_after: p.chance(70),
            max_retry_after_ms: p.range(1, 10_000_000),
        }
    }

    fn random_facts(p: &mut Prng, policy: &RetryPolicy) -> FailureFacts {
        let now_ms = match p.range(0, 9) {
            0 => i64::MAX - p.range(0, 1_000_000) as i64,
            1 => i64::MIN + p.range(0, 1_000_000) as i64,
            _ => p.range(0, 4_000_000_000_000) as i64,
        };
        let age = p.range(0, policy.max_age_ms.min(1 << 40).saturating_mul(2));
        let enqueued_at_ms = now_ms.saturating_sub(age as i64);
        let first_attempt_at_ms = enqueued_at_ms.saturating_add(p.range(0, age) as i64);
        let failures = if p.chance(5) {
            p.next_u64() as u32
        } else {
            p.range(0, u64::from(policy.max_attempts.min(30)) + 2) as u32
        };
        FailureFacts {
            failures,
            now_ms,
            enqueued_at_ms,
            first_attempt_at_ms,
            retry_after_ms: if p.chance(40) {
                Some(if p.chance(5) {
                    u64::MAX
                } else {
                    p.range(0, 20_000_000)
                })
            } else {
                None
            },
            key_window_ms: if p.chance(30) {
                Some(p.range(0, 20_000_000))
            } else {
                None
            },
        }
    }

    fn facts(failures: u32) -> FailureFacts {
        FailureFacts {
            failures,
            now_ms: 1_000_000,
            enqueued_at_ms: 1_000_000,
            first_attempt_at_ms: 1_000_000,
            retry_after_ms: None,
            key_window_ms: None,
        }
    }

    fn no_jitter() -> RetryPolicy {
        RetryPolicy {
            jitter: Jitter::None,
            ..RetryPolicy::default()
        }
    }

    fn retry_delay(d: &Decision) -> u64 {
        match d {
            Decision::RetryAt { delay_ms, .. } => *delay_ms,
            other => panic!("expected RetryAt, got {other:?}"),
        }
    }

    /// Independent oracle for `decide` given the single random draw `r`,
    /// computed in i128 without saturation helpers.
    fn oracle(policy: &RetryPolicy, f: &FailureFacts, r: f64) -> Decision {
        if f.failures >= policy.max_attempts {
            return Decision::Exhausted(Exhaustion::Attempts {
                max_attempts: policy.max_attempts,
            });
        }
        let c = policy.backoff_ceiling_ms(f.failures);
        let j = match policy.jitter {
            Jitter::None => c,
            Jitter::Full => ((c as f64 * r).floor() as u64).min(c),
            Jitter::Equal => c / 2 + (((c - c / 2) as f64 * r).floor() as u64).min(c - c / 2),
        };
        let ra = if policy.respect_retry_after {
            f.retry_after_ms.map(|ra| ra.min(policy.max_retry_after_ms))
        } else {
            None
        };
        let delay = j.max(ra.unwrap_or(0));
        let at = i128::from(f.now_ms) + i128::from(delay);
        if at > i128::from(f.enqueued_at_ms) + i128::from(policy.max_age_ms) {
            return Decision::Exhausted(Exhaustion::Age {
                max_age_ms: policy.max_age_ms,
            });
        }
        if let Some(w) = f.key_window_ms {
            if at > i128::from(f.first_attempt_at_ms) + i128::from(w) {
                return Decision::KeyWindowClosed { window_ms: w };
            }
        }
        Decision::RetryAt {
            at_ms: at.min(i128::from(i64::MAX)) as i64,
            delay_ms: delay,
            retry_after_honoured: ra.is_some(),
        }
    }

    #[test]
    fn defaults() {
        let d = RetryPolicy::default();
        assert_eq!(d.max_attempts, 8);
        assert_eq!(d.base_ms, 1000);
        assert_eq!(d.max_ms, 300_000);
        assert_eq!(d.multiplier, 2.0);
        assert_eq!(d.jitter, Jitter::Full);
        assert_eq!(d.max_age_ms, 86_400_000);
        assert!(d.respect_retry_after);
        assert_eq!(d.max_retry_after_ms, 3_600_000);
    }

    #[test]
    fn random_decisions_respect_every_invariant() {
        let mut p = Prng::new(0x5EED_0001);
        let mut seen = [0usize; 4];
        for _ in 0..200_000 {
            let policy = random_policy(&mut p);
            let f = random_facts(&mut p, &policy);
            let r = p.unit();
            let mut calls = 0;
            let d = decide(&policy, &f, &mut || {
                calls += 1;
                r
            });
            assert!(calls <= 1);
            assert_eq!(d, oracle(&policy, &f, r), "{policy:?} {f:?} r={r}");
            let c = policy.backoff_ceiling_ms(f.failures);
            let ra = if policy.respect_retry_after {
                f.retry_after_ms.map(|ra| ra.min(policy.max_retry_after_ms))
            } else {
                None
            };
            match d {
                Decision::RetryAt {
                    at_ms,
                    delay_ms,
                    retry_after_honoured,
                } => {
                    seen[0] += 1;
                    assert!(f.failures < policy.max_attempts);
                    assert!(at_ms >= f.now_ms);
                    // The exact instant; at_ms is it, saturated.
                    let at = i128::from(f.now_ms) + i128::from(delay_ms);
                    assert_eq!(i128::from(at_ms), at.min(i128::from(i64::MAX)));
                    assert!(delay_ms <= c.max(ra.unwrap_or(0)));
                    assert_eq!(retry_after_honoured, ra.is_some());
                    if let Some(ra) = ra {
                        assert!(delay_ms >= ra);
                    }
                    let lo = match policy.jitter {
                        Jitter::Full => 0,
                        Jitter::Equal => c / 2,
                        Jitter::None => c,
                    };
                    assert!(delay_ms >= lo);
                    assert!(at <= i128::from(f.enqueued_at_ms) + i128::from(policy.max_age_ms));
                    if let Some(w) = f.key_window_ms {
                        assert!(at <= i128::from(f.first_attempt_at_ms) + i128::from(w));
                    }
                }
                Decision::Exhausted(Exhaustion::Attempts { max_attempts }) => {
                    seen[1] += 1;
                    assert_eq!(max_attempts, policy.max_attempts);
                    assert!(f.failures >= policy.max_attempts);
                }
                Decision::Exhausted(Exhaustion::Age { max_age_ms }) => {
                    seen[2] += 1;
                    assert_eq!(max_age_ms, policy.max_age_ms);
                }
                Decision::KeyWindowClosed { window_ms } => {
                    seen[3] += 1;
                    assert_eq!(Some(window_ms), f.key_window_ms);
                }
            }
        }
        // The generator covers every outcome.
        assert!(seen.iter().all(|&n| n > 1000), "{seen:?}");
    }

    #[test]
    fn jitter_stays_in_its_band() {
        let mut p = Prng::new(0x5EED_0002);
        let odd = [
            -1.0,
            -0.0,
            0.0,
            0.999_999_999_999,
            1.0,
            2.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ];
        for i in 0..100_000 {
            let mut policy = random_policy(&mut p);
            policy.max_attempts = u32::MAX;
            policy.max_age_ms = u64::MAX;
            policy.respect_retry_after = false;
            let mut f = facts(p.range(1, 100) as u32);
            f.now_ms = 0;
            f.enqueued_at_ms = 0;
            let r = if i % 10 == 0 { p.pick(&odd) } else { p.unit() };
            let c = policy.backoff_ceiling_ms(f.failures);
            let delay = retry_delay(&decide(&policy, &f, &mut || r));
            match policy.jitter {
                Jitter::Full => assert!(delay <= c),
                Jitter::Equal => assert!(c / 2 <= delay && delay <= c),
                Jitter::None => assert_eq!(delay, c),
            }
        }
        // The ends of the bands are reachable.
        let mut policy = no_jitter();
        policy.jitter = Jitter::Full;
        assert_eq!(retry_delay(&decide(&policy, &facts(3), &mut || 0.0)), 0);
        assert_eq!(retry_delay(&decide(&policy, &facts(3), &mut || 1.0)), 4000);
        assert_eq!(retry_delay(&decide(&policy, &facts(3), &mut || 0.5)), 2000);
        policy.jitter = Jitter::Equal;
        assert_eq!(retry_delay(&decide(&policy, &facts(3), &mut || 0.0)), 2000);
        assert_eq!(retry_delay(&decide(&policy, &facts(3), &mut || 1.0)), 4000);
        assert_eq!(
            retry_delay(&decide(&policy, &facts(3), &mut || f64::NAN)),
            2000
        );
        // Jitter::None never draws.
        let d = decide(&no_jitter(), &facts(1), &mut || panic!("drew"));
        assert_eq!(retry_delay(&d), 1000);
    }

    #[test]
    fn ceiling_is_monotone_and_reaches_max() {
        let mut p = Prng::new(0x5EED_0003);
        for _ in 0..20_000 {
            let mut policy = random_policy(&mut p);
            if p.chance(20) {
                policy.multiplier = 1.0 + p.unit() * 1e-3;
            }
            assert_eq!(policy.backoff_ceiling_ms(0), policy.base_ms);
            assert_eq!(policy.backoff_ceiling_ms(1), policy.base_ms);
            let mut prev = 0;
            for failures in 1..=300 {
                let c = policy.backoff_ceiling_ms(failures);
                assert!(c >= prev, "{policy:?} at {failures}");
                assert!(policy.base_ms <= c && c <= policy.max_ms);
                prev = c;
            }
            for failures in [1000, 100_000, u32::MAX / 2, u32::MAX - 1, u32::MAX] {
                let c = policy.backoff_ceiling_ms(failures);
                assert!(c >= prev);
                prev = c;
            }
            if policy.multiplier > 1.0 {
                assert_eq!(policy.backoff_ceiling_ms(u32::MAX), policy.max_ms);
            } else {
                assert_eq!(policy.backoff_ceiling_ms(u32::MAX), policy.base_ms);
            }
            if policy.multiplier >= 1.5 && policy.max_ms <= 1 << 50 {
                assert_eq!(policy.backoff_ceiling_ms(200), policy.max_ms);
            }
            // decide() with no jitter uses the ceiling itself.
            policy.jitter = Jitter::None;
            policy.max_attempts = u32::MAX;
            policy.max_age_ms = u64::MAX;
            let f = facts(p.range(1, 200) as u32);
            let d = decide(&policy, &f, &mut || 0.0);
            assert_eq!(retry_delay(&d), policy.backoff_ceiling_ms(f.failures));
        }
        let d = RetryPolicy::default();
        let seq: Vec<u64> = (1..=11).map(|n| d.backoff_ceiling_ms(n)).collect();
        assert_eq!(
            seq,
            [1000, 2000, 4000, 8000, 16_000, 32_000, 64_000, 128_000, 256_000, 300_000, 300_000]
        );
        let p15 = RetryPolicy {
            multiplier: 1.5,
            ..RetryPolicy::default()
        };
        assert_eq!(p15.backoff_ceiling_ms(4), 3375);
        assert_eq!(p15.backoff_ceiling_ms(5), 5062);
    }

    #[test]
    fn attempt_budget_ends_exactly_at_max_attempts() {
        for max in 1..=50u32 {
            let policy = RetryPolicy {
                max_attempts: max,
                max_age_ms: u64::MAX,
                ..no_jitter()
            };
            for failures in 0..max {
                assert!(matches!(
                    decide(&policy, &facts(failures), &mut || 0.5),
                    Decision::RetryAt { .. }
                ));
            }
            for failures in [max, max + 1, max + 100, u32::MAX] {
                assert_eq!(
                    decide(&policy, &facts(failures), &mut || 0.5),
                    Decision::Exhausted(Exhaustion::Attempts { max_attempts: max })
                );
            }
        }
        let policy = RetryPolicy {
            max_attempts: u32::MAX,
            ..no_jitter()
        };
        assert!(matches!(
            decide(&policy, &facts(u32::MAX - 1), &mut || 0.5),
            Decision::RetryAt { .. }
        ));
    }

    #[test]
    fn age_budget_boundary_is_exact() {
        let mut p = Prng::new(0x5EED_0004);
        for _ in 0..20_000 {
            let mut policy = random_policy(&mut p);
            policy.jitter = Jitter::None;
            policy.max_attempts = u32::MAX;
            policy.max_ms = policy.max_ms.min(1 << 45);
            policy.base_ms = policy.base_ms.min(policy.max_ms);
            policy.max_age_ms = u64::MAX;
            let mut f = facts(p.range(1, 40) as u32);
            f.now_ms = p.range(0, 1 << 50) as i64;
            f.enqueued_at_ms = f.now_ms;
            f.first_attempt_at_ms = f.now_ms;
            f.retry_after_ms = if p.chance(50) {
                Some(p.range(0, 1 << 24))
            } else {
                None
            };
            let d = decide(&policy, &f, &mut || 0.0);
            let delay = retry_delay(&d) as i64;
            policy.max_age_ms = p.range(1, 1 << 45);
            // at == enqueued + max_age: still retries.
            f.enqueued_at_ms = f.now_ms + delay - policy.max_age_ms as i64;
            f.first_attempt_at_ms = f.enqueued_at_ms;
            assert_eq!(retry_delay(&decide(&policy, &f, &mut || 0.0)), delay as u64);
            // One ms more: exhausted by age.
            f.enqueued_at_ms -= 1;
            assert_eq!(
                decide(&policy, &f, &mut || 0.0),
                Decision::Exhausted(Exhaustion::Age {
                    max_age_ms: policy.max_age_ms
                })
            );
        }
    }

    #[test]
    fn key_window_boundary_is_exact_and_never_overrun() {
        let mut p = Prng::new(0x5EED_0005);
        for _ in 0..20_000 {
            let mut policy = random_policy(&mut p);
            policy.jitter = Jitter::None;
            policy.max_attempts = u32::MAX;
            policy.max_ms = policy.max_ms.min(1 << 45);
            policy.base_ms = policy.base_ms.min(policy.max_ms);
            policy.max_age_ms = u64::MAX;
            let mut f = facts(p.range(1, 40) as u32);
            f.now_ms = p.range(0, 1 << 50) as i64;
            f.enqueued_at_ms = 0;
            let delay = retry_delay(&decide(&policy, &f, &mut || 0.0)) as i64;
            let w = p.range(0, 1 << 40);
            f.key_window_ms = Some(w);
            f.first_attempt_at_ms = f.now_ms + delay - w as i64;
            match decide(&policy, &f, &mut || 0.0) {
                Decision::RetryAt { at_ms, .. } => {
                    assert_eq!(at_ms, f.first_attempt_at_ms + w as i64)
                }
                other => panic!("{other:?}"),
            }
            f.first_attempt_at_ms -= 1;
            assert_eq!(
                decide(&policy, &f, &mut || 0.0),
                Decision::KeyWindowClosed { window_ms: w }
            );
        }
        // Age is checked before the key window.
        let policy = RetryPolicy {
            max_age_ms: 10,
            ..no_jitter()
        };
        let f = FailureFacts {
            key_window_ms: Some(10),
            ..facts(1)
        };
        assert_eq!(
            decide(&policy, &f, &mut || 0.0),
            Decision::Exhausted(Exhaustion::Age { max_age_ms: 10 })
        );
    }

    #[test]
    fn retry_after_is_honoured_capped_or_ignored() {
        let policy = no_jitter();
        let with = |ra: u64| FailureFacts {
            retry_after_ms: Some(ra),
            ..facts(1)
        };
        let run = |policy: &RetryPolicy, f: &FailureFacts| decide(policy, f, &mut || 0.0);
        assert_eq!(
            run(&policy, &with(5000)),
            Decision::RetryAt {
                at_ms: 1_005_000,
                delay_ms: 5000,
                retry_after_honoured: true
            }
        );
        // Shorter than the backoff: the backoff stands, still honoured.
        assert_eq!(
            run(&policy, &with(10)),
            Decision::RetryAt {
                at_ms: 1_001_000,
                delay_ms: 1000,
                retry_after_honoured: true
            }
        );
        // Capped at max_retry_after_ms.
        assert_eq!(retry_delay(&run(&policy, &with(10_000_000))), 3_600_000);
        assert_eq!(retry_delay(&run(&policy, &with(u64::MAX))), 3_600_000);
        // Ignored when not respected.
        let deaf = RetryPolicy {
            respect_retry_after: false,
            ..no_jitter()
        };
        assert_eq!(
            run(&deaf, &with(5000)),
            Decision::RetryAt {
                at_ms: 1_001_000,
                delay_ms: 1000,
                retry_after_honoured: false
            }
        );
        // A capped Retry-After beyond the age budget exhausts it.
        let short = RetryPolicy {
            max_age_ms: 60_000,
            ..no_jitter()
        };
        assert_eq!(
            run(&short, &with(120_000)),
            Decision::Exhausted(Exhaustion::Age { max_age_ms: 60_000 })
        );
    }

    #[test]
    fn extremes_saturate_without_panic() {
        let multipliers = [
            1.0,
            2.0,
            1e10,
            1e308,
            f64::MAX,
            f64::INFINITY,
            f64::NAN,
            0.5,
            -3.0,
        ];
        let big = [0, 1, u64::MAX / 2, i64::MAX as u64, u64::MAX];
        let times = [i64::MIN, -1, 0, 1, i64::MAX - 1, i64::MAX];
        for &multiplier in &multipliers {
            for &base_ms in &big {
                for &max_ms in &big {
                    let policy = RetryPolicy {
                        max_attempts: u32::MAX,
                        base_ms,
                        max_ms,
                        multiplier,
                        jitter: Jitter::Full,
                        max_age_ms: u64::MAX,
                        respect_retry_after: true,
                        max_retry_after_ms: u64::MAX,
                    };
                    for failures in [0, 1, 2, 64, 65, 1000, u32::MAX - 1, u32::MAX] {
                        let c = policy.backoff_ceiling_ms(failures);
                        assert!(c <= max_ms);
                        for &now_ms in &times {
                            let f = FailureFacts {
                                failures,
                                now_ms,
                                enqueued_at_ms: i64::MIN,
                                first_attempt_at_ms: now_ms,
                                retry_after_ms: Some(u64::MAX),
                                key_window_ms: Some(u64::MAX),
                            };
                            match decide(&policy, &f, &mut || 0.999) {
                                Decision::RetryAt { at_ms, .. } => assert!(at_ms >= now_ms),
                                Decision::Exhausted(_) | Decision::KeyWindowClosed { .. } => {}
                            }
                        }
                    }
                }
            }
        }
        let huge = RetryPolicy {
            multiplier: f64::MAX,
            max_ms: u64::MAX,
            ..RetryPolicy::default()
        };
        assert_eq!(huge.backoff_ceiling_ms(2), u64::MAX);
        assert_eq!(huge.backoff_ceiling_ms(u32::MAX), u64::MAX);
        let nan = RetryPolicy {
            multiplier: f64::NAN,
            ..RetryPolicy::default()
        };
        assert_eq!(nan.backoff_ceiling_ms(5), 1000);
    }

    #[test]
    fn from_json_defaults_and_normalization() {
        assert_eq!(
            RetryPolicy::from_json(&json!({})).unwrap(),
            RetryPolicy::default()
        );
        let p = RetryPolicy::from_json(&json!({
            "max_attempts": 3,
            "base_ms": 250.0,
            "multiplier": 3,
            "jitter": "equal",
            "respect_retry_after": false
        }))
        .unwrap();
        assert_eq!(
            p,
            RetryPolicy {
                max_attempts: 3,
                base_ms: 250,
                multiplier: 3.0,
                jitter: Jitter::Equal,
                respect_retry_after: false,
                ..RetryPolicy::default()
            }
        );
        // max_ms == base_ms and multiplier == 1 are fine.
        let flat = RetryPolicy::from_json(&json!({"base_ms": 500, "max_ms": 500, "multiplier": 1}))
            .unwrap();
        assert_eq!(flat.backoff_ceiling_ms(10), 500);
        // Large but valid integers.
        let p = RetryPolicy::from_json(&json!({
            "max_attempts": u32::MAX,
            "max_ms": u64::MAX,
            "max_age_ms": u64::MAX,
            "max_retry_after_ms": u64::MAX
        }))
        .unwrap();
        assert_eq!(p.max_attempts, u32::MAX);
        assert_eq!(p.max_ms, u64::MAX);
        assert_eq!(
            RetryPolicy::default().to_json(),
            json!({
                "max_attempts": 8,
                "base_ms": 1000,
                "max_ms": 300000,
                "multiplier": 2.0,
                "jitter": "full",
                "max_age_ms": 86400000,
                "respect_retry_after": true,
                "max_retry_after_ms": 3600000
            })
        );
    }

    #[test]
    fn from_json_rejects_each_bad_field_by_name() {
        let cases: Vec<(Value, &str)> = vec![
            (json!(null), "retry"),
            (json!("full"), "retry"),
            (json!([1, 2]), "retry"),
            (json!(8), "retry"),
            (json!({"bogus": 1}), "retry.bogus"),
            (json!({"Base_ms": 1}), "retry.Base_ms"),
            (json!({"max_attempts": 8, "zzz": 1, "aaa": 2}), "retry.aaa"),
            (json!({"max_attempts": 0}), "retry.max_attempts"),
            (json!({"max_attempts": -1}), "retry.max_attempts"),
            (json!({"max_attempts": 1.5}), "retry.max_attempts"),
            (json!({"max_attempts": "8"}), "retry.max_attempts"),
            (json!({"max_attempts": true}), "retry.max_attempts"),
            (json!({"max_attempts": null}), "retry.max_attempts"),
            (
                json!({"max_attempts": 4_294_967_296u64}),
                "retry.max_attempts",
            ),
            (json!({"base_ms": 0}), "retry.base_ms"),
            (json!({"base_ms": -1000}), "retry.base_ms"),
            (json!({"base_ms": -1000.0}), "retry.base_ms"),
            (json!({"base_ms": 0.5}), "retry.base_ms"),
            (json!({"base_ms": 1e300}), "retry.base_ms"),
            (json!({"base_ms": "1000"}), "retry.base_ms"),
            (json!({"base_ms": [1000]}), "retry.base_ms"),
            (json!({"base_ms": 400_000}), "retry.base_ms"),
            (json!({"max_ms": 0}), "retry.max_ms"),
            (json!({"max_ms": -1}), "retry.max_ms"),
            (json!({"max_ms": 999}), "retry.max_ms"),
            (json!({"base_ms": 2000, "max_ms": 1999}), "retry.max_ms"),
            (json!({"multiplier": 0.99}), "retry.multiplier"),
            (json!({"multiplier": 0}), "retry.multiplier"),
            (json!({"multiplier": -2}), "retry.multiplier"),
            (json!({"multiplier": "2"}), "retry.multiplier"),
            (json!({"multiplier": true}), "retry.multiplier"),
            (json!({"multiplier": null}), "retry.multiplier"),
            (json!({"jitter": "random"}), "retry.jitter"),
            (json!({"jitter": "FULL"}), "retry.jitter"),
            (json!({"jitter": ""}), "retry.jitter"),
            (json!({"jitter": 1}), "retry.jitter"),
            (json!({"jitter": null}), "retry.jitter"),
            (json!({"max_age_ms": 0}), "retry.max_age_ms"),
            (json!({"max_age_ms": -86_400_000}), "retry.max_age_ms"),
            (json!({"max_age_ms": "1d"}), "retry.max_age_ms"),
            (
                json!({"respect_retry_after": "true"}),
                "retry.respect_retry_after",
            ),
            (
                json!({"respect_retry_after": 1}),
                "retry.respect_retry_after",
            ),
            (
                json!({"respect_retry_after": null}),
                "retry.respect_retry_after",
            ),
            (json!({"max_retry_after_ms": 0}), "retry.max_retry_after_ms"),
            (
                json!({"max_retry_after_ms": -1}),
                "retry.max_retry_after_ms",
            ),
            (
                json!({"max_retry_after_ms": 2.5}),
                "retry.max_retry_after_ms",
            ),
        ];
        for (v, field) in cases {
            let e = RetryPolicy::from_json(&v).expect_err(&v.to_string());
            assert_eq!(e.field, field, "{v}: {e}");
            assert!(!e.message.is_empty());
            assert!(e.to_string().contains(field));
        }
        // NaN and infinity are not representable in JSON, but a hand-built
        // Value can carry neither either: from_f64 refuses them.
        assert!(serde_json::Number::from_f64(f64::NAN).is_none());
    }

    #[test]
    fn to_json_round_trips() {
        let mut p = Prng::new(0x5EED_0006);
        for i in 0..20_000 {
            let policy = random_policy(&mut p);
            let v = policy.to_json();
            assert_eq!(v.as_object().unwrap().len(), 8);
            assert_eq!(RetryPolicy::from_json(&v).unwrap(), policy);
            if i % 10 == 0 && [1.0, 1.5, 2.0, 3.0].contains(&policy.multiplier) {
                let text = serde_json::to_string(&v).unwrap();
                let back: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(RetryPolicy::from_json(&back).unwrap(), policy);
            }
        }
    }

    #[test]
    fn displays() {
        assert_eq!(
            Exhaustion::Attempts { max_attempts: 8 }.to_string(),
            "retry budget spent: 8 of 8 attempts"
        );
        assert_eq!(
            Decision::Exhausted(Exhaustion::Age {
                max_age_ms: 86_400_000
            })
            .to_string(),
            "retry budget spent: next attempt would be more than 86400000 ms after enqueue"
        );
        assert_eq!(
            Decision::RetryAt {
                at_ms: 5000,
                delay_ms: 4000,
                retry_after_honoured: true
            }
            .to_string(),
            "retry in 4000 ms (at 5000), honouring Retry-After"
        );
        assert!(Decision::KeyWindowClosed { window_ms: 60_000 }
            .to_string()
            .contains("60000 ms"));
        let e = PolicyError::new("retry.base_ms", "must be greater than 0");
        assert_eq!(
            e.to_string(),
            "invalid option retry.base_ms: must be greater than 0"
        );
        let e = parse_retry_after("soon", 0).unwrap_err();
        assert!(e.to_string().contains("\"soon\""));
        assert_eq!(Jitter::parse(Jitter::Equal.as_str()), Some(Jitter::Equal));
    }

    // ---- dates -------------------------------------------------------------

    /// 1994-11-06T08:49:37Z
    const RFC_EXAMPLE_MS: i64 = 784_111_777_000;

    fn leap(y: i64) -> bool {
        (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
    }

    fn month_len(y: i64, m: usize) -> i64 {
        [
            31,
            if leap(y) { 29 } else { 28 },
            31,
            30,
            31,
            30,
            31,
            31,
            30,
            31,
            30,
            31,
        ][m - 1]
    }

    #[test]
    fn days_from_civil_matches_day_counting() {
        // Days from 1600-01-01 to 1970-01-01, by counting years.
        let mut day: i64 = -(1600..1970)
            .map(|y| if leap(y) { 366 } else { 365 })
            .sum::<i64>();
        for y in 1600..=2400 {
            for m in 1..=12 {
                for d in 1..=month_len(y, m) {
                    assert_eq!(days_from_civil(y, m as u32, d as u32), day);
                    assert_eq!(year_from_days(day), y);
                    day += 1;
                }
            }
        }
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
    }

    fn fmt2(n: i64) -> String {
        format!("{n:02}")
    }

    #[test]
    fn every_day_parses_in_all_three_forms() {
        let short = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
        let long = [
            "Thursday",
            "Friday",
            "Saturday",
            "Sunday",
            "Monday",
            "Tuesday",
            "Wednesday",
        ];
        let months = [
            "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
        ];
        let mut p = Prng::new(0x5EED_0007);
        let mut day: i64 = 0; // 1970-01-01, a Thursday
        for y in 1970..=2100 {
            for m in 1..=12 {
                for d in 1..=month_len(y, m) {
                    let (h, mi, s) = (
                        p.range(0, 23) as i64,
                        p.range(0, 59) as i64,
                        p.range(0, 59) as i64,
                    );
                    let expect = ((day * 24 + h) * 60 + mi) * 60_000 + s * 1000;
                    let hms = format!("{}:{}:{}", fmt2(h), fmt2(mi), fmt2(s));
                    let wd = day.rem_euclid(7) as usize;
                    let mon = months[m - 1];
                    let imf = format!("{}, {} {mon} {y} {hms} GMT", short[wd], fmt2(d));
                    let rfc850 = format!(
                        "{}, {}-{mon}-{} {hms} GMT",
                        long[wd],
                        fmt2(d),
                        fmt2(y % 100)
                    );
                    let asc = format!("{} {mon} {:>2} {hms} {y}", short[wd], d);
                    let now = expect - p.range(0, 10_000_000) as i64;
                    for text in [&imf, &rfc850, &asc] {
                        assert_eq!(
                            parse_retry_after(text, now),
                            Ok((expect - now) as u64),
                            "{text}"
                        );
                    }
                    day += 1;
                }
            }
        }
    }

    #[test]
    fn retry_after_examples() {
        let now = RFC_EXAMPLE_MS - 60_000;
        for text in [
            "Sun, 06 Nov 1994 08:49:37 GMT",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08:49:37 1994",
            "Sun Nov 06 08:49:37 1994",
            "  Sun, 06 Nov 1994 08:49:37 GMT\t",
            "sun, 06 nov 1994 08:49:37 gmt",
        ] {
            assert_eq!(parse_retry_after(text, now), Ok(60_000), "{text}");
        }
        // Past or present dates → 0.
        for now in [RFC_EXAMPLE_MS, RFC_EXAMPLE_MS + 1, i64::MAX] {
            assert_eq!(
                parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", now),
                Ok(0)
            );
        }
        assert_eq!(
            parse_retry_after("Thu, 01 Jan 1970 00:00:00 GMT", i64::MIN),
            Ok(i64::MAX as u64 + 1)
        );
        // Leap days and a leap second.
        assert_eq!(
            parse_retry_after("Tue, 29 Feb 2000 00:00:00 GMT", 0),
            Ok(951_782_400_000)
        );
        assert_eq!(
            parse_retry_after("Sat, 31 Dec 2016 23:59:60 GMT", 0),
            Ok(1_483_228_800_000)
        );
        // Two-digit years (RFC 850): more than 50 years ahead means the past.
        let jan_2026 = 1_767_225_600_000; // 2026-01-01T00:00:00Z
        assert_eq!(
            parse_retry_after("Thursday, 01-Jan-26 00:01:00 GMT", jan_2026),
            Ok(60_000)
        );
        assert_eq!(
            parse_retry_after("Tuesday, 01-Jan-76 00:00:00 GMT", jan_2026),
            Ok(days_from_civil(2076, 1, 1) as u64 * 86_400_000 - jan_2026 as u64)
        );
        assert_eq!(
            parse_retry_after("Wednesday, 01-Jan-77 00:00:00 GMT", jan_2026),
            Ok(0)
        );
        assert_eq!(
            parse_retry_after("Sunday, 06-Nov-94 08:49:37 GMT", jan_2026),
            Ok(0)
        );
        // delta-seconds.
        for (text, ms) in [
            ("0", 0),
            ("1", 1000),
            ("120", 120_000),
            ("007", 7000),
            (" 120 ", 120_000),
            ("\t3600\r\n", 3_600_000),
            ("18446744073709551", 18_446_744_073_709_551_000),
            ("18446744073709552", u64::MAX),
            ("99999999999999999999999999999999999999", u64::MAX),
        ] {
            assert_eq!(parse_retry_after(text, 123), Ok(ms), "{text:?}");
        }
    }

    #[test]
    fn retry_after_garbage_is_rejected() {
        for text in [
            "",
            "   ",
            "-1",
            "-0",
            "+5",
            "1.5",
            "1.",
            ".5",
            "1e3",
            "0x10",
            "12 34",
            "12s",
            "soon",
            "١٢",
            "１２",
            "Sun, 06 Nov 1994 08:49:37 GMT junk",
            "Sun, 06 Nov 1994 08:49:37",
            "Sun, 06 Nov 1994 08:49:37 UTC",
            "Sun, 06 Nov 1994 08:49:37 +0000",
            "Sun, 6 Nov 1994 08:49:37 GMT",
            "Sun, 06 Nov 94 08:49:37 GMT",
            "Sun,  06 Nov 1994 08:49:37 GMT",
            "Sun, 06 Nov 1994 8:49:37 GMT",
            "Sun, 06-Nov-1994 08:49:37 GMT",
            "Xyz, 06 Nov 1994 08:49:37 GMT",
            "Sunday, 06 Nov 1994 08:49:37 GMT",
            "Sun, 06 Foo 1994 08:49:37 GMT",
            "Sun, 00 Nov 1994 08:49:37 GMT",
            "Sun, 31 Nov 1994 08:49:37 GMT",
            "Wed, 30 Feb 1994 08:49:37 GMT",
            "Thu, 29 Feb 1900 00:00:00 GMT",
            "Sat, 29 Feb 2025 00:00:00 GMT",
            "Sun, 06 Nov 1994 25:49:37 GMT",
            "Sun, 06 Nov 1994 24:00:00 GMT",
            "Sun, 06 Nov 1994 08:60:37 GMT",
            "Sun, 06 Nov 1994 08:49:61 GMT",
            "Sun, 06 Nov 1994 08-49-37 GMT",
            "Sun, 06 Nov 19x4 08:49:37 GMT",
            "Sün, 06 Nov 1994 08:49:37 GMT",
            "Sunday, 06-Nov-94 08:49:37",
            "Sun, 06-Nov-94 08:49:37 GMT",
            "Sunday, 32-Dec-94 08:49:37 GMT",
            "Sunday, 06/Nov/94 08:49:37 GMT",
            "Sunday,06-Nov-94 08:49:37 GMT",
            "Sun Nov 6 08:49:37 1994",
            "Sun Nov  6 08:49:37 94",
            "Sun Nov  6 08:49:37 1994 GMT",
            "Sun Nov 31 08:49:37 1994",
            "Sun Nov  6 25:49:37 1994",
            "Sun Nov  0 08:49:37 1994",
            "Sunday Nov  6 08:49:37 1994",
            "2024-01-01T00:00:00Z",
            "Mon, 1 Jan 2024",
        ] {
            let e = parse_retry_after(text, RFC_EXAMPLE_MS).expect_err(text);
            assert_eq!(e.value, text);
            assert!(!e.reason.is_empty());
        }
    }

    #[test]
    fn random_strings_never_panic() {
        let alphabet = b"0123456789 ,:-+.GMTSunNovFebday\t";
        let mut p = Prng::new(0x5EED_0008);
        for _ in 0..100_000 {
            let len = p.range(0, 34) as usize;
            let s: String = (0..len)
                .map(|_| alphabet[p.range(0, alphabet.len() as u64 - 1) as usize] as char)
                .collect();
            let now = p.next_u64() as i64;
            match parse_retry_after(&s, now) {
                Ok(_) => assert!(!s.trim().is_empty()),
                Err(e) => assert_eq!(e.value, s),
            }
        }
        // Mutations of a valid date only ever parse to a valid date or fail.
        let base = "Sun, 06 Nov 1994 08:49:37 GMT".as_bytes().to_vec();
        for i in 0..base.len() {
            for c in 0u8..128 {
                let mut b = base.clone();
                b[i] = c;
                let s = String::from_utf8(b).unwrap();
                let _ = parse_retry_after(&s, 0);
            }
        }
    }
}
