//! The URL of a read-only lookup at the provider: its template, checked when a channel is
//! created, and filled for one message. Pure Rust: no Postgres, no I/O.
//!
//! Placeholders in `reconcile.url` (each value percent-encoded):
//! - `{effect_key}` — the message's effect key as providers receive it (qualified by its
//!   tenant outside tenant default; providers that store the idempotency key);
//! - `{external_id}` — the provider's id from an earlier answer (only when one was recorded);
//! - `{content_sha256}` — hex SHA-256 of the payload's normalized JSON text (jsonb's
//!   canonical form: keys sorted, no insignificant whitespace), for providers that list
//!   messages and let you match by content;
//! - `{created_at}` — enqueue time in unix seconds, to bound a listing's time window;
//! - `{payload:/json/pointer}` — a value from the payload, e.g. the recipient `{payload:/to}`.

use super::json_pointer::body_pointer;
use sha2::{Digest, Sha256};

/// The facts of a message a lookup may use.
#[derive(Debug, Clone)]
pub struct Subject {
    pub effect_key: String,
    pub external_id: Option<String>,
    pub payload: String,
    pub created_at_s: i64,
}

/// Checks a URL template: it must name the message by at least one placeholder, and every
/// placeholder must be known.
pub fn validate_template(url: &str) -> Result<(), String> {
    let mut named = false;
    for p in placeholders(url)? {
        match p.as_str() {
            "effect_key" | "external_id" | "content_sha256" => named = true,
            "created_at" => {}
            other if other.starts_with("payload:/") => named = true,
            other => return Err(format!("unknown placeholder {{{other}}}")),
        }
    }
    if !named {
        return Err("must contain {effect_key}, {external_id}, {content_sha256} or {payload:/pointer} to name the message it looks up".into());
    }
    Ok(())
}

/// Is a placeholder in the scheme or authority (user, host, port) of a template? Those must
/// be fixed: the destination is checked against `outbox.allowed_hosts` when the channel is
/// created, and a value from a message must never choose it. Errs on the safe side: the
/// authority is read as the WHATWG parser reads it (tabs and newlines removed, any run of
/// `/` and `\` after the scheme skipped), and ends at the first `/`, `\`, `?` or `#`.
pub fn placeholder_in_authority(template: &str) -> bool {
    let cleaned: String = template
        .trim_matches(|c: char| c <= ' ')
        .chars()
        .filter(|c| !matches!(c, '\t' | '\n' | '\r'))
        .collect();
    let Some(colon) = cleaned.find(':') else {
        return cleaned.contains('{');
    };
    let (scheme, rest) = cleaned.split_at(colon);
    if scheme.contains('{') {
        return true;
    }
    let rest = rest[1..].trim_start_matches(['/', '\\']);
    let end = rest.find(['/', '\\', '?', '#']).unwrap_or(rest.len());
    rest[..end].contains('{')
}

/// The template filled with sample values: a URL with the template's scheme and host, to
/// validate and to check against `outbox.allowed_hosts`.
pub fn probe(template: &str) -> String {
    fill(
        template,
        &Subject {
            effect_key: "k".into(),
            external_id: Some("e".into()),
            payload: "{}".into(),
            created_at_s: 0,
        },
    )
    .unwrap_or_else(|_| template.replace(['{', '}'], ""))
}

fn placeholders(url: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut rest = url;
    while let Some(start) = rest.find('{') {
        let after = &rest[start + 1..];
        let end = after
            .find('}')
            .ok_or_else(|| "has an unclosed {".to_string())?;
        out.push(after[..end].to_string());
        rest = &after[end + 1..];
    }
    Ok(out)
}

fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Hex SHA-256 of the payload text.
pub fn content_sha256(payload: &str) -> String {
    Sha256::digest(payload.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Fills the template for one message; `Err` when a value it needs is missing (e.g. no
/// external id was ever recorded), or when a value would make a dot segment of the path
/// ([`dot_segment_from_value`]): the lookup is then not possible for that message.
pub fn fill(template: &str, subject: &Subject) -> Result<String, String> {
    let (out, values) = fill_marked(template, subject)?;
    if dot_segment_from_value(&out, &values) {
        return Err("a placeholder's value would make a dot segment (\".\" or \"..\") of the lookup's path, which names another resource".into());
    }
    Ok(out)
}

/// Is a segment of the path of `url` that holds some of a placeholder's value (`values`:
/// the byte ranges of `url` filled from values) a dot segment? A value is percent-encoded,
/// so it holds no `/`, `\\`, `?` or `#` and never moves the path's other segments, but `.`
/// is unreserved: an effect key `..` filling a whole segment would make a URL parser step
/// up one level (`/messages/..` is `/`), and `%2E%2E` is a dot segment to it as well, so
/// no encoding of such a value keeps its segment: the lookup is refused instead.
fn dot_segment_from_value(url: &str, values: &[std::ops::Range<usize>]) -> bool {
    let Some(colon) = url.find(':') else {
        return false;
    };
    let after_scheme = colon + 1;
    let rest = &url[after_scheme..];
    let slashes = rest.len() - rest.trim_start_matches(['/', '\\']).len();
    let authority = after_scheme + slashes;
    let path_start = url[authority..]
        .find(['/', '\\', '?', '#'])
        .map_or(url.len(), |i| authority + i);
    let path_end = url[path_start..]
        .find(['?', '#'])
        .map_or(url.len(), |i| path_start + i);
    let mut start = path_start;
    for (i, c) in url[path_start..path_end].char_indices() {
        let at = path_start + i;
        if c == '/' || c == '\\' {
            if is_dot_segment_from(url, start..at, values) {
                return true;
            }
            start = at + 1;
        }
    }
    is_dot_segment_from(url, start..path_end, values)
}

fn is_dot_segment_from(
    url: &str,
    segment: std::ops::Range<usize>,
    values: &[std::ops::Range<usize>],
) -> bool {
    let touched = values
        .iter()
        .any(|v| v.start < segment.end && segment.start < v.end);
    let text = url[segment].to_ascii_lowercase();
    touched
        && matches!(
            text.as_str(),
            "." | "%2e" | ".." | ".%2e" | "%2e." | "%2e%2e"
        )
}

/// The template filled, and the byte ranges of the result that came from values.
fn fill_marked(
    template: &str,
    subject: &Subject,
) -> Result<(String, Vec<std::ops::Range<usize>>), String> {
    let mut values = Vec::new();
    let mut out = String::with_capacity(template.len() + 64);
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        out.push_str(&rest[..start]);
        let after = &rest[start + 1..];
        let end = after.find('}').ok_or_else(|| "unclosed {".to_string())?;
        let name = &after[..end];
        let value = match name {
            "effect_key" => subject.effect_key.clone(),
            "external_id" => subject.external_id.clone().ok_or_else(|| {
                "the lookup needs {external_id} but none was recorded for this message".to_string()
            })?,
            "content_sha256" => content_sha256(&subject.payload),
            "created_at" => subject.created_at_s.to_string(),
            p if p.starts_with("payload:") => {
                body_pointer(subject.payload.as_bytes(), &p["payload:".len()..]).ok_or_else(
                    || format!("the payload has no value at {}", &p["payload:".len()..]),
                )?
            }
            other => return Err(format!("unknown placeholder {{{other}}}")),
        };
        let from = out.len();
        out.push_str(&percent_encode(&value));
        values.push(from..out.len());
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok((out, values))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subject() -> Subject {
        Subject {
            effect_key: "k 1/ü".into(),
            external_id: None,
            payload: r#"{"text": "hi", "to": "user@x.org"}"#.into(),
            created_at_s: 1700000000,
        }
    }

    #[test]
    fn templates_are_validated() {
        assert!(validate_template("http://h/m/{effect_key}").is_ok());
        assert!(validate_template("http://h/m/{external_id}").is_ok());
        assert!(validate_template(
            "http://h/m?to={payload:/to}&since={created_at}&h={content_sha256}"
        )
        .is_ok());
        assert!(validate_template("http://h/m?since={created_at}").is_err());
        assert!(validate_template("http://h/m").is_err());
        assert!(validate_template("http://h/m/{recipient}").is_err());
        assert!(validate_template("http://h/m/{effect_key").is_err());
    }

    #[test]
    fn placeholders_may_not_choose_the_destination() {
        let in_authority = [
            "http://{payload:/host}/m/{effect_key}",
            "http://{effect_key}.api.example.com/m",
            "http://api.example.com.{effect_key}/m",
            "http://api.example.com:{created_at}/m/{effect_key}",
            "http://user:{effect_key}@api.example.com/m",
            "http://{payload:/user}@api.example.com/m/{effect_key}",
            "https://[{payload:/ip}]/m/{effect_key}",
            "{payload:/scheme}://api.example.com/m/{effect_key}",
            // What the WHATWG parser would also read as the host:
            "http:{effect_key}/m",
            "http:/{effect_key}/m",
            "http:\\\\{effect_key}/m",
            "http:/\t/{effect_key}/m",
            "http://\n{effect_key}/m",
            "  http://{effect_key}/m",
            "{effect_key}",
        ];
        for t in in_authority {
            assert!(placeholder_in_authority(t), "{t:?}");
        }
        let in_path = [
            "http://api.example.com/m/{effect_key}",
            "http://api.example.com:8443/m/{effect_key}",
            "http://api.example.com?key={effect_key}",
            "http://api.example.com#{effect_key}",
            "http://api.example.com\\{effect_key}",
            "https://user:pw@api.example.com/m?to={payload:/to}&since={created_at}",
            "http://[::1]:8080/m/{external_id}",
            "http://api.example.com",
        ];
        for t in in_path {
            assert!(!placeholder_in_authority(t), "{t:?}");
        }
        // Whatever the checker lets through, the url crate agrees the host is fixed.
        for t in in_path {
            let a = url::Url::parse(&probe(t))
                .ok()
                .map(|u| u.host_str().map(str::to_string));
            let b = url::Url::parse(
                &fill(
                    t,
                    &Subject {
                        effect_key: "other".into(),
                        external_id: Some("x".into()),
                        payload: r#"{"to": "y"}"#.into(),
                        created_at_s: 99,
                    },
                )
                .unwrap_or_else(|_| probe(t)),
            )
            .ok()
            .map(|u| u.host_str().map(str::to_string));
            assert_eq!(a, b, "{t}");
        }
    }

    #[test]
    fn fill_encodes_values() {
        let s = subject();
        assert_eq!(
            fill("http://h/m/{effect_key}", &s).unwrap(),
            "http://h/m/k%201%2F%C3%BC"
        );
        assert_eq!(
            fill("http://h/m?to={payload:/to}", &s).unwrap(),
            "http://h/m?to=user%40x.org"
        );
        assert_eq!(
            fill("http://h/m?t={created_at}", &s).unwrap(),
            "http://h/m?t=1700000000"
        );
        assert!(fill("http://h/m/{external_id}", &s).is_err());
        assert!(fill("http://h/m?to={payload:/missing}", &s).is_err());
        let h = fill("http://h/m/{content_sha256}", &s).unwrap();
        assert_eq!(h.len(), "http://h/m/".len() + 64);
    }

    #[test]
    fn a_value_never_makes_a_dot_segment() {
        let with_key = |k: &str| Subject {
            effect_key: k.into(),
            external_id: Some(k.into()),
            payload: format!(r#"{{"to": {}}}"#, serde_json::json!(k)),
            created_at_s: 0,
        };
        let templates = [
            "http://h/messages/{effect_key}",
            "http://h/messages/{effect_key}/status",
            "http://h/{external_id}",
            "http://h/m/{payload:/to}/x",
            "http://h:8080/m/{effect_key}",
            "http://h/m/.{effect_key}",
            "http://h/m/{effect_key}.",
            "http://h/m\\{effect_key}\\x",
        ];
        for t in templates {
            for k in [
                ".", "..", "%2e", "%2E%2E", ".%2e", "...", "a/..", "../x", "..\\x",
            ] {
                let Ok(url) = fill(t, &with_key(k)) else {
                    continue; // refused: the lookup is not possible for that message
                };
                // As many segments as with an ordinary value: none was stepped over.
                let parsed = url::Url::parse(&url).unwrap();
                let ordinary = url::Url::parse(&fill(t, &with_key("k")).unwrap()).unwrap();
                assert_eq!(
                    parsed.path_segments().map(Iterator::count),
                    ordinary.path_segments().map(Iterator::count),
                    "{t} with {k:?}: {url} -> {parsed}"
                );
            }
        }
        // The review's case: `..` as the whole last segment is refused, not sent to /.
        assert!(fill("http://h/messages/{effect_key}", &with_key("..")).is_err());
        assert!(fill("http://h/messages/{effect_key}", &with_key(".")).is_err());
        assert!(fill("http://h/m/{effect_key}.", &with_key(".")).is_err());
        // Dots inside a segment, or in the query, are values like any other.
        assert_eq!(
            fill("http://h/messages/{effect_key}", &with_key("...")).unwrap(),
            "http://h/messages/..."
        );
        assert_eq!(
            fill("http://h/messages/{effect_key}", &with_key("a..b")).unwrap(),
            "http://h/messages/a..b"
        );
        assert_eq!(
            fill("http://h/m?key={effect_key}", &with_key("..")).unwrap(),
            "http://h/m?key=.."
        );
        assert_eq!(
            fill("http://h/m#{effect_key}", &with_key("..")).unwrap(),
            "http://h/m#.."
        );
        // A dot segment the template itself writes is the administrator's, and stays.
        assert_eq!(
            fill("http://h/a/../m/{effect_key}", &with_key("k")).unwrap(),
            "http://h/a/../m/k"
        );
    }
}
