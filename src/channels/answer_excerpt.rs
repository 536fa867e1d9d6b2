//! What a provider said when it did not accept a request: the first bytes of its answer's
//! body, kept with the attempt (`outbox.attempts.error`, the work queue's `last_error`).
//! A 404 whose body says `{"error": "unknown recipient +999"}` is the one thing that tells
//! an operator what to fix; the status line alone does not.
//!
//! Bounded by the channel's `response_excerpt_bytes` (1 KiB by default, 0 keeps nothing),
//! cut on a character boundary, its control characters written as spaces so that it stays
//! one line in a log or a psql table, and masked: the request's URL secrets
//! (`secrets::mask_url_in`) and the values of the request's own headers (a bearer token a
//! provider echoes back) never reach the database. A 2xx answer keeps no excerpt: its
//! external id is what a delivery keeps.
//!
//! Pure; the transports call [`excerpt`] with the body they read.

use super::secrets::mask_url_in;

/// The default of the channel option `response_excerpt_bytes`.
pub const DEFAULT_BYTES: u64 = 1024;
/// The largest `response_excerpt_bytes` a channel may set.
pub const MOST_BYTES: u64 = 64 * 1024;

/// Header values shorter than this are not masked: a value such as `json` or `1` would
/// blank ordinary words of the answer, and is no secret.
const SHORTEST_MASKED: usize = 8;

/// What replaces a masked value.
const MASK: &str = "***";

/// The excerpt of an answer with `status` whose body began with `body` (at most `limit`
/// bytes of it are kept); `None` for a 2xx answer, an empty body or a limit of 0. `url` and
/// `headers` are the request's: their secrets are masked in the excerpt.
pub fn excerpt(
    status: u16,
    body: &[u8],
    limit: usize,
    url: &str,
    headers: &[(String, String)],
) -> Option<String> {
    if (200..300).contains(&status) || limit == 0 || body.is_empty() {
        return None;
    }
    let cut = body.len().min(limit);
    let text = String::from_utf8_lossy(&body[..cut]);
    // A multi-byte character cut at the limit reads as U+FFFD: dropped.
    let text = text.trim_end_matches('\u{FFFD}');
    let mut one_line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect::<String>()
        .trim()
        .to_string();
    if one_line.is_empty() {
        return None;
    }
    for (_, value) in headers {
        if value.len() >= SHORTEST_MASKED && one_line.contains(value.as_str()) {
            one_line = one_line.replace(value.as_str(), MASK);
        }
    }
    let mut masked = mask_url_in(&one_line, url);
    if body.len() > limit {
        masked.push_str(" …");
    }
    Some(masked)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(status: u16, body: &str, limit: usize) -> Option<String> {
        excerpt(
            status,
            body.as_bytes(),
            limit,
            "https://p.example/send",
            &[],
        )
    }

    #[test]
    fn a_refusal_keeps_what_the_provider_said() {
        assert_eq!(
            ex(404, r#"{"error": "unknown recipient +999"}"#, 1024).as_deref(),
            Some(r#"{"error": "unknown recipient +999"}"#)
        );
        assert_eq!(ex(503, "busy\r\n", 1024).as_deref(), Some("busy"));
        assert_eq!(
            ex(302, "see elsewhere", 1024).as_deref(),
            Some("see elsewhere")
        );
    }

    #[test]
    fn an_acceptance_an_empty_body_or_a_limit_of_zero_keep_nothing() {
        for status in [200, 201, 204, 299] {
            assert_eq!(ex(status, "ok", 1024), None, "{status}");
        }
        assert_eq!(ex(500, "", 1024), None);
        assert_eq!(ex(500, " \r\n\t", 1024), None);
        assert_eq!(ex(500, "boom", 0), None);
    }

    #[test]
    fn the_excerpt_is_bounded_and_cut_on_a_character_boundary() {
        let long = "x".repeat(5000);
        let e = ex(500, &long, 1024).unwrap();
        assert_eq!(e, format!("{} …", "x".repeat(1024)));
        // "é" is two bytes: a limit inside it drops the half character.
        assert_eq!(ex(400, "abé", 3).as_deref(), Some("ab …"));
        assert_eq!(ex(400, "abé", 4).as_deref(), Some("abé"));
        for limit in 1..=12 {
            let e = ex(400, "ééééé-ü-€-x", limit);
            if let Some(e) = e {
                assert!(e.trim_end_matches(" …").len() <= limit, "{limit}: {e}");
                assert!(!e.contains('\u{FFFD}'), "{limit}: {e}");
            }
        }
    }

    #[test]
    fn control_characters_become_spaces_so_the_excerpt_is_one_line() {
        assert_eq!(
            ex(400, "line one\nline two\u{7}\u{0}end", 1024).as_deref(),
            Some("line one line two  end")
        );
        let bytes = [b'o', b'k', 0xff, 0xfe, b'!'];
        let e = excerpt(400, &bytes, 1024, "http://h/", &[]).unwrap();
        assert!(e.starts_with("ok") && e.ends_with('!'), "{e}");
    }

    #[test]
    fn secrets_of_the_request_are_masked() {
        let headers = vec![
            (
                "Authorization".to_string(),
                "Bearer sk_live_abcdef123".to_string(),
            ),
            ("X-Short".to_string(), "json".to_string()),
        ];
        let e = excerpt(
            401,
            br#"{"error": "token Bearer sk_live_abcdef123 revoked", "format": "json"}"#,
            1024,
            "https://p.example/send?api_key=topsecret99",
            &headers,
        )
        .unwrap();
        assert!(!e.contains("sk_live_abcdef123"), "{e}");
        assert!(e.contains("***"), "{e}");
        assert!(e.contains("\"json\""), "a short value is no secret: {e}");
        let e = excerpt(
            400,
            b"bad request to https://p.example/send?api_key=topsecret99",
            1024,
            "https://p.example/send?api_key=topsecret99",
            &[],
        )
        .unwrap();
        assert!(!e.contains("topsecret99"), "{e}");
    }
}
