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
/// external id was ever recorded): the lookup is then not possible for that message.
pub fn fill(template: &str, subject: &Subject) -> Result<String, String> {
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
        out.push_str(&percent_encode(&value));
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
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
}
