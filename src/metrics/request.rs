//! A request to the `/metrics` listener, pure: the head read from a connection, and who may
//! have the exposition (`outbox.metrics_token_file`).
//!
//! With no token file, `GET /metrics` is open to whoever reaches the address. With one, the
//! request must carry `Authorization: Bearer <token>`, the token being the file's content
//! without its trailing line end. The file is read at every request, so a new token takes
//! effect without a restart. A file that cannot be read, or is empty, closes the listener:
//! every `GET /metrics` answers 503 and the server log says why (fail closed: no figure is
//! served while the operator meant them to be protected and the protection is broken).

/// Largest request head read; a longer one is answered 431.
pub const MAX_HEAD_BYTES: usize = 8192;

/// Where a head read so far stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    /// The whole head is there.
    Complete(Head),
    /// More bytes are needed.
    Partial,
    /// Not an HTTP/1.x request head.
    Invalid,
}

/// What the listener uses of a request head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub method: String,
    /// The target's path, without its query.
    pub path: String,
    /// The value of the first `Authorization` header, if any.
    pub authorization: Option<Vec<u8>>,
}

/// Parses the bytes a client sent so far.
pub fn parse(bytes: &[u8]) -> Parsed {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(bytes) {
        Ok(httparse::Status::Complete(_)) => {
            let target = request.path.unwrap_or("");
            Parsed::Complete(Head {
                method: request.method.unwrap_or("").to_string(),
                path: target.split('?').next().unwrap_or("").to_string(),
                authorization: request
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("authorization"))
                    .map(|h| h.value.to_vec()),
            })
        }
        Ok(httparse::Status::Partial) => Parsed::Partial,
        Err(_) => Parsed::Invalid,
    }
}

/// The token a request must present, as read from `outbox.metrics_token_file` now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    /// No token file is set: no authentication.
    Open,
    /// `Authorization: Bearer` with these bytes.
    Token(Vec<u8>),
    /// The file is set but gives no token (missing, unreadable, empty): why.
    Broken(String),
}

impl Access {
    /// The access `outbox.metrics_token_file` (`path`, empty: none) gives, `read` being
    /// the file's content or the reason it could not be read.
    pub fn from_file(path: &str, read: impl FnOnce(&str) -> std::io::Result<Vec<u8>>) -> Access {
        if path.is_empty() {
            return Access::Open;
        }
        match read(path) {
            Err(e) => Access::Broken(format!(
                "cannot read outbox.metrics_token_file {path:?}: {e}"
            )),
            Ok(content) => {
                let token = without_line_end(&content);
                if token.is_empty() {
                    Access::Broken(format!("outbox.metrics_token_file {path:?} is empty"))
                } else {
                    Access::Token(token.to_vec())
                }
            }
        }
    }
}

/// The content of a token file without the line end(s) an editor leaves at its end.
fn without_line_end(content: &[u8]) -> &[u8] {
    let mut end = content.len();
    while end > 0 && matches!(content[end - 1], b'\n' | b'\r') {
        end -= 1;
    }
    &content[..end]
}

/// Whether a request may have the exposition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Allowed,
    /// 401: no token, or not this one.
    Unauthorized,
    /// 503: the token file gives no token.
    Unavailable,
}

/// The verdict on a request's `Authorization` value under `access`.
pub fn verdict(access: &Access, authorization: Option<&[u8]>) -> Verdict {
    match access {
        Access::Open => Verdict::Allowed,
        Access::Broken(_) => Verdict::Unavailable,
        Access::Token(token) => match authorization.and_then(bearer) {
            Some(given) if constant_time_eq(given, token) => Verdict::Allowed,
            _ => Verdict::Unauthorized,
        },
    }
}

/// The credentials of an `Authorization: Bearer <token>` value (the scheme's case does not
/// matter, RFC 9110 11.1).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer ";
    if value.len() < SCHEME.len() || !value[..SCHEME.len()].eq_ignore_ascii_case(SCHEME) {
        return None;
    }
    let rest = &value[SCHEME.len()..];
    let start = rest.iter().position(|b| *b != b' ').unwrap_or(rest.len());
    Some(&rest[start..])
}

/// Equality whose time depends on the lengths alone, never on where the bytes differ: a
/// client timing the answers learns nothing of the token but its length.
pub fn constant_time_eq(given: &[u8], token: &[u8]) -> bool {
    let mut difference = (given.len() ^ token.len()) as u64;
    for (i, t) in token.iter().enumerate() {
        let g = given.get(i).copied().unwrap_or(0);
        difference |= u64::from(g ^ t);
    }
    std::hint::black_box(difference) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(bytes: &str) -> Head {
        match parse(bytes.as_bytes()) {
            Parsed::Complete(h) => h,
            other => panic!("{bytes:?}: {other:?}"),
        }
    }

    #[test]
    fn a_head_is_complete_only_at_its_blank_line() {
        assert_eq!(
            parse(b"GET /metrics HTTP/1.1\r\nHost: x\r\n"),
            Parsed::Partial
        );
        assert_eq!(parse(b"GET /met"), Parsed::Partial);
        assert_eq!(parse(b""), Parsed::Partial);
        assert_eq!(parse(b"\x16\x03\x01 hello\r\n\r\n"), Parsed::Invalid);
        let h = head("GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\nauthorization: Bearer abc\r\nAuthorization: Bearer other\r\n\r\n");
        assert_eq!(h.method, "GET");
        assert_eq!(h.path, "/metrics");
        assert_eq!(h.authorization.as_deref(), Some(&b"Bearer abc"[..]));
        assert_eq!(head("POST / HTTP/1.0\r\n\r\n").authorization, None);
    }

    #[test]
    fn the_token_file_is_read_without_its_line_end_and_fails_closed() {
        let ok = |text: &'static str| move |_: &str| Ok(text.as_bytes().to_vec());
        assert_eq!(Access::from_file("", ok("t")), Access::Open);
        assert_eq!(
            Access::from_file("/f", ok("s3cret\n")),
            Access::Token(b"s3cret".to_vec())
        );
        assert_eq!(
            Access::from_file("/f", ok("s3cret\r\n\n")),
            Access::Token(b"s3cret".to_vec())
        );
        assert_eq!(
            Access::from_file("/f", ok(" a b ")),
            Access::Token(b" a b ".to_vec())
        );
        assert!(
            matches!(Access::from_file("/f", ok("\n")), Access::Broken(m) if m.contains("empty"))
        );
        let missing = Access::from_file("/nowhere", |p| std::fs::read(p));
        assert!(
            matches!(&missing, Access::Broken(m) if m.contains("/nowhere")),
            "{missing:?}"
        );
        assert_eq!(verdict(&missing, Some(b"Bearer ")), Verdict::Unavailable);
        assert_eq!(verdict(&missing, None), Verdict::Unavailable);
    }

    #[test]
    fn only_the_bearer_token_of_the_file_is_allowed() {
        let access = Access::Token(b"s3cret".to_vec());
        for (authorization, expected) in [
            (Some(&b"Bearer s3cret"[..]), Verdict::Allowed),
            (Some(b"bearer s3cret"), Verdict::Allowed),
            (Some(b"BEARER   s3cret"), Verdict::Allowed),
            (Some(b"Bearer s3cre"), Verdict::Unauthorized),
            (Some(b"Bearer s3cret2"), Verdict::Unauthorized),
            (Some(b"Bearer S3cret"), Verdict::Unauthorized),
            (Some(b"Bearer "), Verdict::Unauthorized),
            (Some(b"Basic s3cret"), Verdict::Unauthorized),
            (Some(b"s3cret"), Verdict::Unauthorized),
            (Some(b"Bearers3cret"), Verdict::Unauthorized),
            (None, Verdict::Unauthorized),
        ] {
            assert_eq!(
                verdict(&access, authorization),
                expected,
                "{authorization:?}"
            );
        }
        assert_eq!(verdict(&Access::Open, None), Verdict::Allowed);
    }

    #[test]
    fn constant_time_equality_is_equality() {
        assert!(constant_time_eq(b"", b""));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"ab", b"abc"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"abc\0", b"abc"));
        assert!(!constant_time_eq(b"", b"a"));
    }
}
