//! Classification of one delivery attempt: an HTTP outcome, or what a `sql` effect did.
//!
//! This module is pure: no Postgres, no pgrx. It maps the facts of an attempt
//! ([`SendFacts`]) to a [`Class`] that the worker acts on:
//!
//! | facts                                                        | class       |
//! |--------------------------------------------------------------|-------------|
//! | status 2xx                                                   | delivered   |
//! | status 408, 425, 429, 500, 502, 503, 504                     | transient   |
//! | status 502, 504 where a resend is not deduplicated by key    | ambiguous   |
//! | status 501, 505, 511                                         | permanent   |
//! | any other 5xx (506..=510, 512..=599)                         | transient   |
//! | any other 4xx                                                | permanent   |
//! | 1xx, 3xx (and anything outside 100..=599)                    | permanent   |
//! | 2xx whose body could not be read completely                  | ambiguous   |
//! | failure before the request was written (DNS, connect, TLS)   | transient   |
//! | timeout or reset after it was written (send, wait, read)     | ambiguous   |
//!
//! 501 (Not Implemented), 505 (HTTP Version Not Supported) and 511 (Network
//! Authentication Required) will not go away by themselves, so they are
//! permanent; every other 5xx is taken as a passing server-side problem.
//! 3xx is permanent because the worker does not follow redirects: a
//! redirected endpoint is a configuration error.
//!
//! 502 (Bad Gateway) and 504 (Gateway Timeout) come from a gateway in front of the
//! provider, which may have passed the request on before its upstream failed or went
//! quiet: the provider may have acted. Where a resend carries a key the provider dedupes
//! by, another try is harmless and they stay transient; elsewhere they are ambiguous, so
//! that a channel that can be asked looks up before it resends, and one that can neither
//! dedupe nor be asked stops for an operator instead of sending a copy.
//!
//! A channel may override the table for responses with the option
//! `classify`, e.g. `{"409": "delivered", "4xx": "transient"}`. Precedence:
//! exact code > range > default table.

use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::fmt;

/// Where in the exchange a failure happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    Dns,
    Connect,
    Tls,
    Send,
    Wait,
    Read,
}

impl Phase {
    /// `"DNS"`, `"connect"`, `"TLS"`, `"send"`, `"wait"`, `"read"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Dns => "DNS",
            Phase::Connect => "connect",
            Phase::Tls => "TLS",
            Phase::Send => "send",
            Phase::Wait => "wait",
            Phase::Read => "read",
        }
    }

    /// Whether the provider may have received (and acted on) the request:
    /// true once we started writing it (`Send`, `Wait`, `Read`).
    pub fn request_may_have_reached_provider(self) -> bool {
        matches!(self, Phase::Send | Phase::Wait | Phase::Read)
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an attempt amounts to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    /// The provider accepted the message.
    Delivered,
    /// Not delivered; retrying may succeed.
    Transient,
    /// Not delivered; retrying will not help.
    Permanent,
    /// The provider may or may not have acted on the message.
    Ambiguous,
}

impl Class {
    /// `"delivered"`, `"transient"`, `"permanent"`, `"ambiguous"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Delivered => "delivered",
            Class::Transient => "transient",
            Class::Permanent => "permanent",
            Class::Ambiguous => "ambiguous",
        }
    }

    /// Inverse of [`Class::as_str`] (exact, lower case).
    pub fn parse(s: &str) -> Option<Class> {
        match s {
            "delivered" => Some(Class::Delivered),
            "transient" => Some(Class::Transient),
            "permanent" => Some(Class::Permanent),
            "ambiguous" => Some(Class::Ambiguous),
            _ => None,
        }
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The facts of one attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum SendFacts {
    /// A status line arrived. `body_complete` is false when the body could
    /// not be read to the end (timeout, reset, decoding error).
    Response { status: u16, body_complete: bool },
    /// No status line: the exchange failed in `phase`.
    Failure { phase: Phase, timed_out: bool },
}

/// Per-channel overrides of the default table (channel option `classify`):
/// exact status codes (100..=599) and class ranges (`1xx`..=`5xx`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    exact: BTreeMap<u16, Class>,
    /// Index 0 is `1xx`, 4 is `5xx`.
    ranges: [Option<Class>; 5],
}

/// A rejected `classify` option; `field` is e.g. `"classify.409"`, or
/// `"classify"` when the whole value is wrong.
#[derive(Debug, Clone, PartialEq)]
pub struct OverrideError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for OverrideError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid option {}: {}", self.field, self.message)
    }
}

impl std::error::Error for OverrideError {}

/// A status key of the channel options (`classify`, `classify_answers`): an exact code, or
/// a class range by its index (0 is `1xx`, 4 is `5xx`).
pub(crate) enum Key {
    Exact(u16),
    Range(usize),
}

/// Reads `"100"`..`"599"` or `"1xx"`..`"5xx"` (lower-case `x`).
pub(crate) fn parse_key(k: &str) -> Option<Key> {
    let b = k.as_bytes();
    if b.len() != 3 || !(b'1'..=b'5').contains(&b[0]) {
        return None;
    }
    let hundreds = usize::from(b[0] - b'1');
    if &b[1..] == b"xx" {
        return Some(Key::Range(hundreds));
    }
    if b[1].is_ascii_digit() && b[2].is_ascii_digit() {
        let code =
            u16::from(b[0] - b'0') * 100 + u16::from(b[1] - b'0') * 10 + u16::from(b[2] - b'0');
        return Some(Key::Exact(code));
    }
    None
}

fn range_index(status: u16) -> Option<usize> {
    if (100..=599).contains(&status) {
        Some(usize::from(status / 100 - 1))
    } else {
        None
    }
}

impl Overrides {
    /// Parses the channel option `classify`: an object whose keys are a
    /// status code `"100"`..`"599"` or a range `"1xx"`..`"5xx"` (lower-case
    /// `x`) and whose values are `"delivered"`, `"transient"`, `"permanent"`
    /// or `"ambiguous"`. Anything else is an error naming the key
    /// (`"classify.<key>"`), or `"classify"` if the value is not an object.
    pub fn from_json(v: &Value) -> Result<Overrides, OverrideError> {
        let obj = v.as_object().ok_or_else(|| OverrideError {
            field: "classify".to_string(),
            message: format!("expected a JSON object, got {}", json_type(v)),
        })?;
        let mut out = Overrides::default();
        for (k, val) in obj {
            let err = |message: String| OverrideError {
                field: format!("classify.{k}"),
                message,
            };
            let key = parse_key(k).ok_or_else(|| {
                err(
                    "expected a status code \"100\"..\"599\" or a range \"1xx\"..\"5xx\""
                        .to_string(),
                )
            })?;
            let class = match val {
                Value::String(s) => Class::parse(s),
                _ => None,
            }
            .ok_or_else(|| {
                err(format!(
                    "expected \"delivered\", \"transient\", \"permanent\" or \"ambiguous\", got {}",
                    match val {
                        Value::String(s) => format!("{s:?}"),
                        other => json_type(other).to_string(),
                    }
                ))
            })?;
            match key {
                Key::Exact(code) => {
                    out.exact.insert(code, class);
                }
                Key::Range(i) => out.ranges[i] = Some(class),
            }
        }
        Ok(out)
    }

    /// The normalized `classify` object; round-trips through
    /// [`Overrides::from_json`].
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        for (i, class) in self.ranges.iter().enumerate() {
            if let Some(class) = class {
                m.insert(format!("{}xx", i + 1), Value::from(class.as_str()));
            }
        }
        for (code, class) in &self.exact {
            m.insert(code.to_string(), Value::from(class.as_str()));
        }
        Value::Object(m)
    }

    /// True when nothing is overridden.
    pub fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.ranges.iter().all(Option::is_none)
    }

    /// The overriding class of `status`, if any: exact code, else range.
    pub fn class_for(&self, status: u16) -> Option<Class> {
        self.exact
            .get(&status)
            .copied()
            .or_else(|| range_index(status).and_then(|i| self.ranges[i]))
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The default table for a status code (see the module documentation):
/// 2xx delivered; 408, 425, 429 transient; other 4xx permanent; 501, 505,
/// 511 permanent; every other 5xx transient; 1xx, 3xx and codes outside
/// 100..=599 permanent.
pub fn default_class(status: u16) -> Class {
    match status {
        200..=299 => Class::Delivered,
        408 | 425 | 429 => Class::Transient,
        400..=499 => Class::Permanent,
        501 | 505 | 511 => Class::Permanent,
        500..=599 => Class::Transient,
        _ => Class::Permanent,
    }
}

/// How a second send of the same message would be guarded at the provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resend {
    /// It carries the effect key in a header the provider dedupes by.
    DedupedByKey,
    /// Nothing stops the provider from acting on it a second time.
    Unguarded,
}

/// Whether `status` comes from a gateway that may have passed the request on to the
/// provider before its upstream failed (502) or did not answer in time (504).
pub fn gateway_may_have_passed_on(status: u16) -> bool {
    matches!(status, 502 | 504)
}

/// Classifies one attempt.
///
/// * `Response`: exact-code override, else range override, else
///   [`default_class`], where a 502 or 504 is `Ambiguous` unless a resend is
///   [`Resend::DedupedByKey`]. If the body could not be read completely and that
///   class is `Delivered`, the result is `Ambiguous`; other classes stand.
/// * `Failure`: DNS, connect and TLS failures (timed out or not) are
///   `Transient`: the request was never written. Send, wait and read
///   failures are `Ambiguous`. Overrides do not apply.
pub fn classify(facts: &SendFacts, overrides: &Overrides, resend: Resend) -> Class {
    match *facts {
        SendFacts::Response {
            status,
            body_complete,
        } => {
            let class = overrides.class_for(status).unwrap_or_else(|| {
                if resend == Resend::Unguarded && gateway_may_have_passed_on(status) {
                    Class::Ambiguous
                } else {
                    default_class(status)
                }
            });
            if !body_complete && class == Class::Delivered {
                Class::Ambiguous
            } else {
                class
            }
        }
        SendFacts::Failure { phase, .. } => {
            if phase.request_may_have_reached_provider() {
                Class::Ambiguous
            } else {
                Class::Transient
            }
        }
    }
}

/// What calling an effect function did.
#[derive(Debug, Clone, PartialEq)]
pub enum EffectOutcome {
    /// It returned; the text is the external id.
    Returned(Option<String>),
    /// It raised; its writes were rolled back.
    Raised { sqlstate: String, message: String },
    /// It could not be called (e.g. dropped since the channel was created).
    Unavailable(String),
}

/// Serialization failures, deadlocks, lock timeouts and query cancels are worth another
/// try; every other error of an effect is permanent.
pub fn classify_sqlstate(sqlstate: &str) -> Class {
    match sqlstate {
        "40001" | "40P01" | "55P03" | "57014" => Class::Transient,
        _ => Class::Permanent,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effect_sqlstates() {
        for code in ["40001", "40P01", "55P03", "57014"] {
            assert_eq!(classify_sqlstate(code), Class::Transient, "{code}");
        }
        for code in ["23514", "23505", "42883", "P0001", "22P02", "XX000"] {
            assert_eq!(classify_sqlstate(code), Class::Permanent, "{code}");
        }
    }
    use serde_json::json;

    const ALL_CLASSES: [Class; 4] = [
        Class::Delivered,
        Class::Transient,
        Class::Permanent,
        Class::Ambiguous,
    ];
    const ALL_PHASES: [Phase; 6] = [
        Phase::Dns,
        Phase::Connect,
        Phase::Tls,
        Phase::Send,
        Phase::Wait,
        Phase::Read,
    ];

    /// The default table, written out independently of `default_class`:
    /// inclusive ranges, later rows win.
    fn expected_default(status: u16) -> Class {
        let rows: &[(u16, u16, Class)] = &[
            (0, u16::MAX, Class::Permanent),
            (200, 299, Class::Delivered),
            (500, 599, Class::Transient),
            (408, 408, Class::Transient),
            (425, 425, Class::Transient),
            (429, 429, Class::Transient),
            (501, 501, Class::Permanent),
            (505, 505, Class::Permanent),
            (511, 511, Class::Permanent),
        ];
        let mut class = None;
        for &(lo, hi, c) in rows {
            if lo <= status && status <= hi {
                class = Some(c);
            }
        }
        class.unwrap()
    }

    type Prng = crate::random::SplitMix64;

    fn response(status: u16, body_complete: bool) -> SendFacts {
        SendFacts::Response {
            status,
            body_complete,
        }
    }

    #[test]
    fn default_table_for_every_status() {
        let none = Overrides::default();
        for status in 0..=u16::MAX {
            let want = expected_default(status);
            assert_eq!(default_class(status), want, "{status}");
            assert_eq!(
                classify(&response(status, true), &none, Resend::DedupedByKey),
                want,
                "{status}"
            );
            let incomplete = if want == Class::Delivered {
                Class::Ambiguous
            } else {
                want
            };
            assert_eq!(
                classify(&response(status, false), &none, Resend::DedupedByKey),
                incomplete,
                "{status}"
            );
        }
        // Spot checks of the table's reading.
        for (status, class) in [
            (100, Class::Permanent),
            (200, Class::Delivered),
            (204, Class::Delivered),
            (301, Class::Permanent),
            (400, Class::Permanent),
            (404, Class::Permanent),
            (408, Class::Transient),
            (409, Class::Permanent),
            (425, Class::Transient),
            (429, Class::Transient),
            (500, Class::Transient),
            (501, Class::Permanent),
            (502, Class::Transient),
            (503, Class::Transient),
            (504, Class::Transient),
            (505, Class::Permanent),
            (507, Class::Transient),
            (511, Class::Permanent),
            (599, Class::Transient),
            (600, Class::Permanent),
        ] {
            assert_eq!(default_class(status), class, "{status}");
        }
    }

    /// Where a resend is not deduplicated by key, 502 and 504 are ambiguous, every other
    /// status is classified as where it is, and an override still decides.
    #[test]
    fn a_gateway_answer_is_ambiguous_where_a_resend_is_unguarded() {
        let none = Overrides::default();
        for status in 0..=u16::MAX {
            for complete in [true, false] {
                let guarded = classify(&response(status, complete), &none, Resend::DedupedByKey);
                let unguarded = classify(&response(status, complete), &none, Resend::Unguarded);
                if gateway_may_have_passed_on(status) {
                    assert_eq!(guarded, Class::Transient, "{status}");
                    assert_eq!(unguarded, Class::Ambiguous, "{status}");
                } else {
                    assert_eq!(guarded, unguarded, "{status}");
                }
            }
        }
        assert!(gateway_may_have_passed_on(502) && gateway_may_have_passed_on(504));
        assert!(!gateway_may_have_passed_on(500) && !gateway_may_have_passed_on(503));
        let o = Overrides::from_json(&json!({"502": "transient", "5xx": "permanent"})).unwrap();
        assert_eq!(
            classify(&response(502, true), &o, Resend::Unguarded),
            Class::Transient
        );
        assert_eq!(
            classify(&response(504, true), &o, Resend::Unguarded),
            Class::Permanent
        );
        for phase in ALL_PHASES {
            let f = SendFacts::Failure {
                phase,
                timed_out: true,
            };
            assert_eq!(
                classify(&f, &none, Resend::Unguarded),
                classify(&f, &none, Resend::DedupedByKey)
            );
        }
    }

    #[test]
    fn every_phase_and_timeout() {
        let everything_delivered = Overrides::from_json(&json!({
            "1xx": "delivered", "2xx": "delivered", "3xx": "delivered",
            "4xx": "delivered", "5xx": "delivered"
        }))
        .unwrap();
        for phase in ALL_PHASES {
            let reached = matches!(phase, Phase::Send | Phase::Wait | Phase::Read);
            assert_eq!(phase.request_may_have_reached_provider(), reached);
            let want = if reached {
                Class::Ambiguous
            } else {
                Class::Transient
            };
            for timed_out in [false, true] {
                let f = SendFacts::Failure { phase, timed_out };
                assert_eq!(
                    classify(&f, &Overrides::default(), Resend::DedupedByKey),
                    want,
                    "{phase} {timed_out}"
                );
                assert_eq!(
                    classify(&f, &everything_delivered, Resend::DedupedByKey),
                    want
                );
            }
        }
        let names: Vec<&str> = ALL_PHASES.iter().map(|p| p.as_str()).collect();
        assert_eq!(names, ["DNS", "connect", "TLS", "send", "wait", "read"]);
    }

    #[test]
    fn overrides_and_their_precedence() {
        let o = Overrides::from_json(&json!({
            "409": "transient",
            "4xx": "ambiguous",
            "2xx": "permanent",
            "200": "delivered",
            "503": "permanent",
            "3xx": "delivered"
        }))
        .unwrap();
        let cases = [
            (409, true, Class::Transient),  // exact
            (404, true, Class::Ambiguous),  // range
            (429, true, Class::Ambiguous),  // range beats default
            (200, true, Class::Delivered),  // exact beats range
            (201, true, Class::Permanent),  // range
            (503, true, Class::Permanent),  // exact beats default
            (502, true, Class::Transient),  // default
            (501, true, Class::Permanent),  // default
            (302, true, Class::Delivered),  // range
            (100, true, Class::Permanent),  // default
            (200, false, Class::Ambiguous), // exact delivered, body lost
            (201, false, Class::Permanent), // stands
            (302, false, Class::Ambiguous), // range delivered, body lost
            (409, false, Class::Transient), // stands
            (404, false, Class::Ambiguous), // stands
        ];
        for (status, complete, want) in cases {
            assert_eq!(
                classify(&response(status, complete), &o, Resend::DedupedByKey),
                want,
                "{status} {complete}"
            );
        }
        assert_eq!(o.class_for(409), Some(Class::Transient));
        assert_eq!(o.class_for(500), None);
        assert_eq!(o.class_for(600), None);
        assert!(!o.is_empty());
        assert!(Overrides::default().is_empty());
    }

    #[test]
    fn random_overrides_against_an_oracle() {
        let mut p = Prng::new(0xC1A5_0001);
        for _ in 0..2000 {
            let mut exact: Vec<(u16, Class)> = Vec::new();
            let mut ranges: Vec<(u16, Class)> = Vec::new();
            let mut obj = Map::new();
            for _ in 0..p.below(12) {
                let code = 100 + p.below(500) as u16;
                let class = ALL_CLASSES[p.below(4) as usize];
                exact.retain(|&(c, _)| c != code);
                exact.push((code, class));
                obj.insert(code.to_string(), json!(class.as_str()));
            }
            for _ in 0..p.below(4) {
                let hundreds = 1 + p.below(5) as u16;
                let class = ALL_CLASSES[p.below(4) as usize];
                ranges.retain(|&(h, _)| h != hundreds);
                ranges.push((hundreds, class));
                obj.insert(format!("{hundreds}xx"), json!(class.as_str()));
            }
            let v = Value::Object(obj);
            let o = Overrides::from_json(&v).unwrap();
            assert_eq!(o.to_json(), v);
            assert_eq!(Overrides::from_json(&o.to_json()).unwrap(), o);
            for status in 0..=700u16 {
                let base = exact
                    .iter()
                    .find(|&&(c, _)| c == status)
                    .map(|&(_, c)| c)
                    .or_else(|| {
                        ranges
                            .iter()
                            .find(|&&(h, _)| (100..=599).contains(&status) && h == status / 100)
                            .map(|&(_, c)| c)
                    })
                    .unwrap_or_else(|| expected_default(status));
                assert_eq!(
                    classify(&response(status, true), &o, Resend::DedupedByKey),
                    base
                );
                let lost = if base == Class::Delivered {
                    Class::Ambiguous
                } else {
                    base
                };
                assert_eq!(
                    classify(&response(status, false), &o, Resend::DedupedByKey),
                    lost
                );
            }
        }
    }

    #[test]
    fn from_json_errors_name_the_key() {
        for v in [json!(null), json!([]), json!("5xx"), json!(409)] {
            let e = Overrides::from_json(&v).unwrap_err();
            assert_eq!(e.field, "classify");
        }
        let bad_keys = [
            "600", "099", "99", "1000", "0", "", "6xx", "0xx", "4XX", "4Xx", "40x", "4x0", "x00",
            " 409", "409 ", "+40", "-40", "abc", "4 9", "٤٠٩", "xx",
        ];
        for k in bad_keys {
            let mut m = Map::new();
            m.insert(k.to_string(), json!("transient"));
            let e = Overrides::from_json(&Value::Object(m)).unwrap_err();
            assert_eq!(e.field, format!("classify.{k}"));
            assert!(e.to_string().contains(&format!("classify.{k}")));
        }
        let bad_values = [
            json!("Transient"),
            json!("retry"),
            json!(""),
            json!(" delivered"),
            json!(1),
            json!(true),
            json!(null),
            json!(["transient"]),
            json!({"class": "transient"}),
        ];
        for val in bad_values {
            let e = Overrides::from_json(&json!({ "200": "delivered", "409": val })).unwrap_err();
            assert_eq!(e.field, "classify.409", "{val}");
            let e = Overrides::from_json(&json!({ "4xx": val })).unwrap_err();
            assert_eq!(e.field, "classify.4xx", "{val}");
        }
        // Every valid key is accepted.
        for code in 100..=599u16 {
            let o = Overrides::from_json(&json!({ code.to_string(): "ambiguous" })).unwrap();
            assert_eq!(o.class_for(code), Some(Class::Ambiguous));
        }
        for h in 1..=5 {
            let o = Overrides::from_json(&json!({ format!("{h}xx"): "permanent" })).unwrap();
            assert_eq!(o.class_for(h * 100 + 42), Some(Class::Permanent));
        }
        assert_eq!(
            Overrides::from_json(&json!({})).unwrap(),
            Overrides::default()
        );
    }

    #[test]
    fn class_names_round_trip() {
        for c in ALL_CLASSES {
            assert_eq!(Class::parse(c.as_str()), Some(c));
            assert_eq!(c.to_string(), c.as_str());
        }
        let names: Vec<&str> = ALL_CLASSES.iter().map(|c| c.as_str()).collect();
        assert_eq!(names, ["delivered", "transient", "permanent", "ambiguous"]);
        for s in ["", "Delivered", "DELIVERED", "retry", "ok", " transient"] {
            assert_eq!(Class::parse(s), None);
        }
        let e = OverrideError {
            field: "classify.409".into(),
            message: "bad".into(),
        };
        assert_eq!(e.to_string(), "invalid option classify.409: bad");
    }
}
