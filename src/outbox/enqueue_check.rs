//! What `outbox.enqueue` refuses before it writes anything: the effect key, the ordering
//! key, `not_before`, the payload's size and the message headers.
//!
//! Pure rules, called by `enqueue` (`super::enqueue`) with everything it has to check; the
//! first problem is raised with its SQLSTATE, detail and hint.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};
use serde_json::value::RawValue;

/// Keys and ordering keys are at most this many bytes.
pub const MAX_KEY_BYTES: usize = 255;
/// Message headers: how many, and how long.
pub const MAX_HEADERS: usize = 32;
pub const MAX_HEADER_NAME_BYTES: usize = 256;
pub const MAX_HEADER_VALUE_BYTES: usize = 8192;
pub const MAX_HEADERS_BYTES: usize = 16384;

const KEY_HINT: &str = "Use outbox.effect_key(source, operation), which returns 64 hex characters.";
const HEADERS_HINT: &str = "Put long or structured data in the payload.";

/// Why an enqueue is refused: SQLSTATE, message, detail and hint, as the caller sees them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub too_large: bool,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<&'static str>,
}

impl Refusal {
    fn invalid(
        message: impl Into<String>,
        detail: Option<String>,
        hint: Option<&'static str>,
    ) -> Self {
        Refusal {
            too_large: false,
            message: message.into(),
            detail,
            hint,
        }
    }

    /// 54000 for a payload over `outbox.max_payload_bytes`, 22023 for everything else.
    pub fn sqlstate(&self) -> PgSqlErrorCode {
        if self.too_large {
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED
        } else {
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE
        }
    }

    pub fn raise(self) -> ! {
        let mut report = ErrorReport::new(self.sqlstate(), self.message, "outbox_delivery");
        if let Some(detail) = self.detail {
            report = report.set_detail(detail);
        }
        if let Some(hint) = self.hint {
            report = report.set_hint(hint);
        }
        report.report(PgLogLevel::ERROR);
        unreachable!("an ERROR report does not return")
    }
}

/// An HTTP header name (RFC 9110 token).
fn is_token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+.^_`|~-".contains(&b))
}

/// A header value may hold a tab, but no other ASCII control character.
fn value_ok(value: &str) -> bool {
    !value.bytes().any(|b| (b < 0x20 && b != b'\t') || b == 0x7f)
}

/// The first `n` characters (a header name in a message is cut to its allowed length).
fn left(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// The JSON type of a jsonb value's text, from its first character (jsonb's text output is
/// always valid JSON).
fn json_type(text: &str) -> &'static str {
    match text.trim_start().bytes().next() {
        Some(b'{') => "object",
        Some(b'[') => "array",
        Some(b'"') => "string",
        Some(b't') | Some(b'f') => "boolean",
        Some(b'n') => "null",
        _ => "number",
    }
}

/// The channel's name: present. An empty or unknown name is a channel that does not exist
/// (42704), a NULL one a missing argument.
pub fn check_channel(name: Option<&str>) -> Result<(), Refusal> {
    match name {
        Some(_) => Ok(()),
        None => Err(Refusal::invalid(
            "channel must not be NULL",
            None,
            Some("Name a channel of outbox.channels."),
        )),
    }
}

/// The effect key: present, without control characters, at most 255 bytes.
pub fn check_effect_key(key: Option<&str>) -> Result<(), Refusal> {
    let key = match key {
        Some(k) if !k.is_empty() => k,
        _ => {
            return Err(Refusal::invalid(
                "effect_key must not be NULL or empty",
                Some("Every message carries the stable key of the side effect it performs.".into()),
                Some("Derive it from the request and the operation: outbox.effect_key(request_id, 'send_reply')."),
            ))
        }
    };
    if key.chars().any(crate::tenancy::acting::is_control) {
        return Err(Refusal::invalid(
            "effect_key must not contain control characters",
            Some("The key travels in an HTTP header, where a control character cannot.".into()),
            Some(KEY_HINT),
        ));
    }
    Ok(())
}

pub fn check_key_length(key: &str) -> Result<(), Refusal> {
    if key.len() > MAX_KEY_BYTES {
        return Err(Refusal::invalid(
            format!(
                "effect_key is {} bytes long; at most {MAX_KEY_BYTES} are allowed",
                key.len()
            ),
            None,
            Some(KEY_HINT),
        ));
    }
    Ok(())
}

pub fn check_ordering_key(key: Option<&str>) -> Result<(), Refusal> {
    match key {
        Some(k) if k.is_empty() || k.len() > MAX_KEY_BYTES => Err(Refusal::invalid(
            "ordering_key must be NULL or 1 to 255 bytes long",
            Some(format!("ordering_key is {} bytes long.", k.len())),
            None,
        )),
        _ => Ok(()),
    }
}

/// The payload: present, and its JSON text at most `max_bytes` bytes.
pub fn check_payload(payload_bytes: Option<i32>, max_bytes: i32) -> Result<(), Refusal> {
    let Some(bytes) = payload_bytes else {
        return Err(Refusal::invalid(
            "payload must not be NULL",
            None,
            Some("Send an empty object '{}' for a message without a body."),
        ));
    };
    if bytes > max_bytes {
        return Err(Refusal {
            too_large: true,
            message: format!("payload is {bytes} bytes; outbox.max_payload_bytes allows {max_bytes}"),
            detail: None,
            hint: Some("Store large content elsewhere and send a reference, or raise outbox.max_payload_bytes."),
        });
    }
    Ok(())
}

/// Message headers (the text of a jsonb value): a JSON object of at most 32 string values
/// under HTTP token names, each name at most 256 bytes, each value at most 8192 bytes
/// without control characters but tab, 16384 bytes in all. Names are visited in the order
/// jsonb keeps them (shorter first, then bytewise), so the first offending name is the one
/// SQL would name. Values are not parsed unless they are strings: a nested or huge value
/// is refused as not a string, never as unreadable JSON.
pub fn check_headers(headers: &str) -> Result<(), Refusal> {
    let kind = json_type(headers);
    if kind != "object" {
        return Err(Refusal::invalid(
            format!("headers must be a JSON object of strings, not {kind}"),
            None,
            Some(r#"Example: '{"X-Request-Id": "r-42"}'."#),
        ));
    }
    let unreadable = |e: serde_json::Error| {
        Refusal::invalid(
            format!("headers could not be read: {e}"),
            None,
            Some(r#"Example: '{"X-Request-Id": "r-42"}'."#),
        )
    };
    let raw: Vec<(String, Box<RawValue>)> =
        serde_json::from_str::<std::collections::BTreeMap<String, Box<RawValue>>>(headers)
            .map_err(unreadable)?
            .into_iter()
            .collect();
    let mut entries: Vec<(String, Option<String>)> = Vec::with_capacity(raw.len());
    for (name, value) in raw {
        let text = match value.get().trim_start().starts_with('"') {
            true => Some(serde_json::from_str::<String>(value.get()).map_err(unreadable)?),
            false => None,
        };
        entries.push((name, text));
    }
    entries.sort_by(|a, b| {
        a.0.len()
            .cmp(&b.0.len())
            .then_with(|| a.0.as_bytes().cmp(b.0.as_bytes()))
    });
    if let Some((name, _)) = entries.iter().find(|(name, value)| {
        value.is_none() || !is_token(name) || name.len() > MAX_HEADER_NAME_BYTES
    }) {
        return Err(Refusal::invalid(
            format!(
                "headers: \"{}\" must be a valid HTTP header name of at most {MAX_HEADER_NAME_BYTES} bytes with a string value",
                left(name, MAX_HEADER_NAME_BYTES)
            ),
            None,
            Some("Header values are strings; names are HTTP tokens."),
        ));
    }
    fn value(v: &Option<String>) -> &str {
        v.as_deref().unwrap_or_default()
    }
    if let Some((name, _)) = entries.iter().find(|(_, v)| {
        let v = value(v);
        v.len() > MAX_HEADER_VALUE_BYTES || !value_ok(v)
    }) {
        return Err(Refusal::invalid(
            format!(
                "headers: the value of \"{name}\" must be at most {MAX_HEADER_VALUE_BYTES} bytes without control characters"
            ),
            Some("A line break in a header value would start another header.".into()),
            Some(HEADERS_HINT),
        ));
    }
    let total: usize = entries
        .iter()
        .map(|(name, v)| name.len() + value(v).len())
        .sum();
    if entries.len() > MAX_HEADERS || total > MAX_HEADERS_BYTES {
        return Err(Refusal::invalid(
            format!(
                "headers: {} headers of {total} bytes; at most {MAX_HEADERS} headers of {MAX_HEADERS_BYTES} bytes in all are allowed",
                entries.len()
            ),
            None,
            Some(HEADERS_HINT),
        ));
    }
    Ok(())
}

/// Headers that frame or route a request. The transport writes them, from the payload and
/// the endpoint; a message that set them could cut its own body short (`Content-Length`),
/// smuggle a second request, or pose as another client to the provider's proxies.
const FRAMING_OR_ROUTING: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "expect",
    "forwarded",
];
/// Prefixes of routing headers (`Proxy-Authorization`, `X-Forwarded-For`, …).
const ROUTING_PREFIXES: &[&str] = &["proxy-", "x-forwarded-"];
/// The headers of a Standard Webhooks signature, written from the channel's secrets.
const SIGNING: &[&str] = &["webhook-id", "webhook-timestamp", "webhook-signature"];

/// Why a message may not set header `name`, if it may not. `key_headers` are the channel's
/// idempotency and reference headers, which carry the effect key and nothing else.
pub fn reserved_header(name: &str, key_headers: &[&str]) -> Option<&'static str> {
    let lower = name.to_ascii_lowercase();
    if FRAMING_OR_ROUTING.contains(&lower.as_str())
        || ROUTING_PREFIXES.iter().any(|p| lower.starts_with(p))
    {
        return Some("frames or routes the request; the transport sets it");
    }
    if SIGNING.contains(&lower.as_str()) {
        return Some("belongs to the request's signature; the channel's signing sets it");
    }
    if key_headers.iter().any(|k| k.eq_ignore_ascii_case(name)) {
        return Some("carries the effect key on this channel; the worker sets it");
    }
    None
}

/// The first header name of `headers` (a JSON object's text, already checked) that a
/// message may not set on a channel with these key headers: refused with 22023.
pub fn check_reserved_headers(headers: &str, key_headers: &[&str]) -> Result<(), Refusal> {
    let Ok(names) =
        serde_json::from_str::<std::collections::BTreeMap<String, serde::de::IgnoredAny>>(headers)
    else {
        return Ok(()); // refused by check_headers already
    };
    let mut names: Vec<&String> = names.keys().collect();
    names.sort_by(|a, b| {
        a.len()
            .cmp(&b.len())
            .then_with(|| a.as_bytes().cmp(b.as_bytes()))
    });
    for name in names {
        if let Some(why) = reserved_header(name, key_headers) {
            return Err(Refusal::invalid(
                format!(
                    "headers: \"{}\" may not be set by a message: it {why}",
                    left(name, 64)
                ),
                Some(
                    "Messages may not set Host, Content-Length, Transfer-Encoding, Connection, \
                     Keep-Alive, Upgrade, TE, Trailer, Expect, Forwarded, Proxy-*, X-Forwarded-*, \
                     the signing headers or the channel's idempotency and reference headers."
                        .into(),
                ),
                Some("Leave it out: the request carries the right value without it."),
            ));
        }
    }
    Ok(())
}

/// Everything `enqueue` checks before it writes, in the order it reports the first problem.
pub fn check(
    effect_key: Option<&str>,
    ordering_key: Option<&str>,
    not_before_infinite: bool,
    payload_bytes: Option<i32>,
    max_payload_bytes: i32,
    headers: Option<&str>,
) -> Result<(), Refusal> {
    check_effect_key(effect_key)?;
    if not_before_infinite {
        return Err(Refusal::invalid(
            "not_before must be a finite time",
            None,
            Some("A message that must never be sent is not enqueued; NULL means now."),
        ));
    }
    check_key_length(effect_key.unwrap_or_default())?;
    check_ordering_key(ordering_key)?;
    check_payload(payload_bytes, max_payload_bytes)?;
    match headers {
        Some(h) => check_headers(h).and_then(|()| check_reserved_headers(h, &[])),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn headers(v: Value) -> Result<(), Refusal> {
        check_headers(&v.to_string())
    }

    fn ok(key: &str) -> Result<(), Refusal> {
        check(Some(key), None, false, Some(2), 100, None)
    }

    #[test]
    fn a_null_channel_is_a_missing_argument_and_any_name_goes_on_to_the_lookup() {
        let refusal = check_channel(None).unwrap_err();
        assert_eq!(refusal.message, "channel must not be NULL");
        assert_eq!(
            refusal.sqlstate(),
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE
        );
        assert!(refusal.hint.is_some());
        for name in ["", "sms", "no such channel"] {
            assert!(check_channel(Some(name)).is_ok(), "{name:?}");
        }
    }

    #[test]
    fn effect_keys() {
        assert!(ok("order-17:reply").is_ok());
        assert!(ok(&"k".repeat(255)).is_ok());
        assert_eq!(
            ok(&"k".repeat(256)).unwrap_err().message,
            "effect_key is 256 bytes long; at most 255 are allowed"
        );
        assert!(ok(&"é".repeat(128)).is_err(), "256 bytes in 128 characters");
        assert!(check(None, None, false, Some(2), 100, None)
            .unwrap_err()
            .message
            .contains("NULL or empty"));
        assert!(ok("").unwrap_err().message.contains("NULL or empty"));
        for bad in [
            "a\nb",
            "a\rb",
            "a\tb",
            "a\u{7f}",
            "a\u{85}",
            "a\u{2028}",
            "\u{1}",
        ] {
            assert!(
                ok(bad).unwrap_err().message.contains("control characters"),
                "{bad:?}"
            );
        }
        assert!(ok("ключ-✓").is_ok());
    }

    #[test]
    fn the_first_problem_is_reported_in_order() {
        // Empty key before an infinite not_before before a long key.
        assert!(check(Some(""), None, true, None, 1, Some("1"))
            .unwrap_err()
            .message
            .contains("NULL or empty"));
        assert!(check(Some(&"k".repeat(300)), None, true, None, 1, None)
            .unwrap_err()
            .message
            .contains("finite"));
        assert!(check(Some("k"), Some(""), false, None, 1, None)
            .unwrap_err()
            .message
            .contains("ordering_key"));
        assert!(check(Some("k"), None, false, None, 1, Some("1"))
            .unwrap_err()
            .message
            .contains("payload must not be NULL"));
    }

    #[test]
    fn ordering_keys() {
        assert!(check_ordering_key(None).is_ok());
        assert!(check_ordering_key(Some("customer-1")).is_ok());
        assert!(check_ordering_key(Some(&"o".repeat(255))).is_ok());
        let e = check_ordering_key(Some(&"o".repeat(256))).unwrap_err();
        assert_eq!(e.detail.as_deref(), Some("ordering_key is 256 bytes long."));
        assert_eq!(
            check_ordering_key(Some("")).unwrap_err().detail.as_deref(),
            Some("ordering_key is 0 bytes long.")
        );
    }

    #[test]
    fn payload_size() {
        assert!(check_payload(Some(100), 100).is_ok());
        let e = check_payload(Some(101), 100).unwrap_err();
        assert!(e.too_large);
        assert_eq!(e.sqlstate(), PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED);
        assert_eq!(
            e.message,
            "payload is 101 bytes; outbox.max_payload_bytes allows 100"
        );
        let e = check_payload(None, 100).unwrap_err();
        assert_eq!(
            e.sqlstate(),
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE
        );
    }

    #[test]
    fn framing_routing_signing_and_key_headers_are_reserved() {
        for name in [
            "Host",
            "host",
            "Content-Length",
            "Transfer-Encoding",
            "Connection",
            "Keep-Alive",
            "Upgrade",
            "TE",
            "Trailer",
            "Expect",
            "Forwarded",
            "Proxy-Authorization",
            "proxy-connection",
            "X-Forwarded-For",
            "x-forwarded-host",
            "webhook-id",
            "Webhook-Signature",
            "webhook-timestamp",
        ] {
            assert!(reserved_header(name, &[]).is_some(), "{name}");
            let e = check(
                Some("k"),
                None,
                false,
                Some(2),
                100,
                Some(&json!({ name: "v" }).to_string()),
            )
            .unwrap_err();
            assert_eq!(
                e.sqlstate(),
                PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE
            );
            assert!(
                e.message.contains(&format!("\"{name}\" may not be set")),
                "{}",
                e.message
            );
        }
        for name in [
            "X-Request-Id",
            "Authorization-Extra",
            "Hostname",
            "X-Forwarded",
            "Tea",
        ] {
            assert_eq!(reserved_header(name, &[]), None, "{name}");
        }
        let keys = ["Idempotency-Key", "X-Ref"];
        assert!(reserved_header("idempotency-key", &keys).is_some());
        assert!(reserved_header("X-REF", &keys).is_some());
        assert_eq!(reserved_header("X-Other", &keys), None);
        assert!(check_reserved_headers(r#"{"X-A": "1", "Idempotency-Key": "x"}"#, &keys).is_err());
        assert!(check_reserved_headers(r#"{"X-A": "1"}"#, &keys).is_ok());
    }

    #[test]
    fn message_headers() {
        assert!(headers(json!({})).is_ok());
        assert!(headers(json!({"X-Request-Id": "r-42", "X-Tab": "a\tb"})).is_ok());
        for (h, kind) in [
            (json!([]), "array"),
            (json!("x"), "string"),
            (json!(1), "number"),
            (json!(true), "boolean"),
            (json!(null), "null"),
        ] {
            assert_eq!(
                headers(h).unwrap_err().message,
                format!("headers must be a JSON object of strings, not {kind}")
            );
        }
        for bad in [
            json!({"X-A": 1}),
            json!({"X A": "v"}),
            json!({"": "v"}),
            json!({"X:A": "v"}),
        ] {
            assert!(
                headers(bad.clone())
                    .unwrap_err()
                    .message
                    .contains("valid HTTP header name"),
                "{bad}"
            );
        }
        let long_name = "X".repeat(257);
        let e = headers(json!({ long_name.clone(): "v" })).unwrap_err();
        assert!(e.message.contains(&format!("\"{}\"", "X".repeat(256))));
        assert!(!e.message.contains(&long_name));
        // The shortest offending name is named, as jsonb orders keys.
        let e = headers(json!({"X-Long-Bad": 1, "X-B": 2})).unwrap_err();
        assert!(e.message.contains("\"X-B\""), "{}", e.message);
        for bad in ["a\nb", "a\rb", "\u{7f}", &"v".repeat(8193)] {
            let e = headers(json!({ "X-A": bad })).unwrap_err();
            assert!(e.message.contains("the value of \"X-A\""), "{bad:?}");
            assert_eq!(
                e.detail.as_deref(),
                Some("A line break in a header value would start another header.")
            );
        }
        assert!(headers(json!({ "X-A": "v".repeat(8192) })).is_ok());
        let many: serde_json::Map<String, Value> =
            (0..33).map(|i| (format!("X-{i}"), json!("v"))).collect();
        assert!(headers(Value::Object(many))
            .unwrap_err()
            .message
            .starts_with("headers: 33 headers of"));
        // What a JSON parser would refuse is refused as a header, not as unreadable JSON.
        for (text, kind) in [("1e400", "number"), (&"[".repeat(10_000), "array")] {
            assert_eq!(
                check_headers(text).unwrap_err().message,
                format!("headers must be a JSON object of strings, not {kind}")
            );
        }
        let deep = format!("{{\"X-A\": {}{}}}", "[".repeat(10_000), "]".repeat(10_000));
        assert!(check_headers(&deep)
            .unwrap_err()
            .message
            .contains("with a string value"));
        assert!(check_headers(r#"{"X-A": 1e400}"#)
            .unwrap_err()
            .message
            .contains("with a string value"));
        let big =
            json!({"X-A": "v".repeat(8000), "X-B": "v".repeat(8000), "X-C": "v".repeat(1000)});
        assert_eq!(
            headers(big).unwrap_err().message,
            "headers: 3 headers of 17009 bytes; at most 32 headers of 16384 bytes in all are allowed"
        );
    }
}
