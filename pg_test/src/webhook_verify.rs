//! A receiver's check of Standard Webhooks signatures (spec v1), written as a provider
//! would write it and with its own HMAC (the `hmac` crate), so that the tests check the
//! extension's signatures against an implementation that is not the extension's.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Why a request does not verify.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    MissingHeader(&'static str),
    BadSecret,
    BadTimestamp,
    /// The timestamp is further than the tolerance from now.
    Stale,
    NoSignatureMatches,
}

/// The headers of a request (any case) and its body, as received.
pub struct Signed<'a> {
    pub headers: &'a [(String, String)],
    pub body: &'a [u8],
}

fn header<'a>(headers: &'a [(String, String)], name: &'static str) -> Result<&'a str, Rejection> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
        .ok_or(Rejection::MissingHeader(name))
}

/// Verifies `request` with `secret` (`whsec_…`): one of the space-separated `v1,` signatures
/// must be the HMAC-SHA256 of `id.timestamp.body`, and the timestamp within `tolerance_s`
/// of `now_s`. Returns the `webhook-id`.
pub fn verify(
    secret: &str,
    request: &Signed<'_>,
    now_s: u64,
    tolerance_s: u64,
) -> Result<String, Rejection> {
    let id = header(request.headers, "webhook-id")?;
    let timestamp = header(request.headers, "webhook-timestamp")?;
    let signatures = header(request.headers, "webhook-signature")?;
    let ts: u64 = timestamp.parse().map_err(|_| Rejection::BadTimestamp)?;
    if ts.abs_diff(now_s) > tolerance_s {
        return Err(Rejection::Stale);
    }
    let key = BASE64
        .decode(secret.strip_prefix("whsec_").unwrap_or(secret))
        .map_err(|_| Rejection::BadSecret)?;
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).map_err(|_| Rejection::BadSecret)?;
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(request.body);
    let expected = mac.finalize().into_bytes();
    let matches = signatures.split(' ').any(|s| {
        s.strip_prefix("v1,")
            .and_then(|b| BASE64.decode(b).ok())
            .is_some_and(|given| given.as_slice() == expected.as_slice())
    });
    if matches {
        Ok(id.to_string())
    } else {
        Err(Rejection::NoSignatureMatches)
    }
}

/// Seconds since the epoch, now.
pub fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(id: &str, ts: &str, sig: &str) -> Vec<(String, String)> {
        vec![
            ("webhook-id".into(), id.into()),
            ("Webhook-Timestamp".into(), ts.into()),
            ("webhook-signature".into(), sig.into()),
        ]
    }

    /// The specification's example.
    #[test]
    fn the_specification_example_verifies() {
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let body = br#"{"test": 2432232314}"#;
        let h = headers(
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            "1614265330",
            "v1,bm9ldHZhbGlk v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
        );
        let req = Signed { headers: &h, body };
        assert_eq!(
            verify(secret, &req, 1614265330, 300).as_deref(),
            Ok("msg_p5jXN8AQM9LWM0D4loKWxJek")
        );
        assert_eq!(
            verify(secret, &req, 1614265330 + 301, 300),
            Err(Rejection::Stale)
        );
        let tampered = Signed {
            headers: &h,
            body: br#"{"test": 2432232315}"#,
        };
        assert_eq!(
            verify(secret, &tampered, 1614265330, 300),
            Err(Rejection::NoSignatureMatches)
        );
        let h = headers(
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            "1614265330",
            "v1,bm9ldHZhbGlk",
        );
        assert_eq!(
            verify(secret, &Signed { headers: &h, body }, 1614265330, 300),
            Err(Rejection::NoSignatureMatches)
        );
        assert_eq!(
            verify(secret, &Signed { headers: &[], body }, 1614265330, 300),
            Err(Rejection::MissingHeader("webhook-id"))
        );
    }
}
