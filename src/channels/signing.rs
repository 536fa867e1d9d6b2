//! Signed requests: the `signing` option of an HTTP channel, Standard Webhooks (spec v1).
//!
//! Every request of a signing channel carries `webhook-id` (the effect key as sent: the same
//! on every attempt, so that a receiver dedupes by it), `webhook-timestamp` (unix seconds
//! when the request was built) and `webhook-signature`: `v1,` + base64 of
//! HMAC-SHA256(secret, `id.timestamp.body`) for each secret, space-separated, so that a
//! receiver that knows either the old or the new secret verifies while secrets rotate.
//! The signature covers the exact bytes of the body sent. Pure Rust.

use super::option_error::OptionError;
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use hmac::{Hmac, KeyInit, Mac};
use serde_json::{json, Value};
use sha2::Sha256;

/// The only scheme there is.
pub const SCHEME: &str = "standard-webhooks";
/// What a secret starts with.
pub const SECRET_PREFIX: &str = "whsec_";
/// Bytes a decoded secret may have.
pub const SECRET_BYTES: std::ops::RangeInclusive<usize> = 24..=64;
/// Most secrets a channel signs with at once (old and new while rotating, and some room).
pub const MAX_SECRETS: usize = 8;

/// The header names, as sent.
pub const ID_HEADER: &str = "webhook-id";
pub const TIMESTAMP_HEADER: &str = "webhook-timestamp";
pub const SIGNATURE_HEADER: &str = "webhook-signature";

/// A channel's signing: its secrets as written (for the options) and decoded (the keys).
#[derive(Clone, PartialEq)]
pub struct Signing {
    pub secrets: Vec<String>,
    keys: Vec<Vec<u8>>,
}

impl std::fmt::Debug for Signing {
    /// Never the secrets: a `Debug` of the options may reach a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Signing {{ {} secret(s) }}", self.secrets.len())
    }
}

/// The key of a `whsec_…` secret, or why it is not one (the message never quotes it).
pub fn decode_secret(secret: &str) -> Result<Vec<u8>, String> {
    let encoded = secret.strip_prefix(SECRET_PREFIX).ok_or_else(|| {
        format!("a secret must start with \"{SECRET_PREFIX}\" followed by base64")
    })?;
    let key = BASE64
        .decode(encoded)
        .map_err(|_| format!("a secret must be \"{SECRET_PREFIX}\" followed by valid base64"))?;
    if !SECRET_BYTES.contains(&key.len()) {
        return Err(format!(
            "a secret must decode to {} to {} bytes, not {}",
            SECRET_BYTES.start(),
            SECRET_BYTES.end(),
            key.len()
        ));
    }
    Ok(key)
}

impl Signing {
    /// Parses `{"scheme": "standard-webhooks", "secrets": ["whsec_…", …]}`.
    pub fn from_json(v: &Value) -> Result<Signing, OptionError> {
        let obj = v.as_object().ok_or_else(|| {
            OptionError::new(
                "signing",
                "must be an object {\"scheme\": \"standard-webhooks\", \"secrets\": [\"whsec_…\"]}",
            )
        })?;
        if let Some(k) = obj.keys().find(|k| *k != "scheme" && *k != "secrets") {
            return Err(OptionError::new(
                format!("signing.{k}"),
                "unknown option; known options are scheme, secrets",
            ));
        }
        match obj.get("scheme") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == SCHEME => {}
            Some(other) => {
                return Err(OptionError::new(
                    "signing.scheme",
                    format!("{other} is not a supported scheme; supported: {SCHEME}"),
                ))
            }
        }
        let items = match obj.get("secrets") {
            Some(Value::Array(items)) if !items.is_empty() && items.len() <= MAX_SECRETS => items,
            _ => {
                return Err(OptionError::new(
                    "signing.secrets",
                    format!("must be an array of 1 to {MAX_SECRETS} secrets \"{SECRET_PREFIX}…\""),
                ))
            }
        };
        let mut signing = Signing {
            secrets: Vec::with_capacity(items.len()),
            keys: Vec::with_capacity(items.len()),
        };
        for (i, item) in items.iter().enumerate() {
            let option = format!("signing.secrets[{i}]");
            let secret = item
                .as_str()
                .ok_or_else(|| OptionError::new(&option, "must be a string"))?;
            let key = decode_secret(secret).map_err(|m| OptionError::new(&option, m))?;
            signing.secrets.push(secret.to_string());
            signing.keys.push(key);
        }
        Ok(signing)
    }

    pub fn to_json(&self) -> Value {
        json!({"scheme": SCHEME, "secrets": self.secrets})
    }

    /// The value of `webhook-signature` for `id`, `timestamp` and `body`.
    pub fn signature(&self, id: &str, timestamp: u64, body: &[u8]) -> String {
        let signed = signed_content(id, timestamp, body);
        self.keys
            .iter()
            .map(|key| format!("v1,{}", BASE64.encode(hmac_sha256(key, &signed))))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Replaces any header of the three names in `headers` with the signed ones.
    pub fn sign(&self, headers: &mut Vec<(String, String)>, id: &str, timestamp: u64, body: &[u8]) {
        headers.retain(|(n, _)| {
            ![ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER]
                .iter()
                .any(|h| n.eq_ignore_ascii_case(h))
        });
        headers.push((ID_HEADER.into(), id.to_string()));
        headers.push((TIMESTAMP_HEADER.into(), timestamp.to_string()));
        headers.push((SIGNATURE_HEADER.into(), self.signature(id, timestamp, body)));
    }
}

/// `id.timestamp.body`, the bytes signed.
fn signed_content(id: &str, timestamp: u64, body: &[u8]) -> Vec<u8> {
    let mut signed = Vec::with_capacity(id.len() + 21 + body.len());
    signed.extend_from_slice(id.as_bytes());
    signed.push(b'.');
    signed.extend_from_slice(timestamp.to_string().as_bytes());
    signed.push(b'.');
    signed.extend_from_slice(body);
    signed
}

/// HMAC-SHA256 (RFC 2104, the `hmac` crate).
pub fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(message);
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of the Standard Webhooks specification (its libraries' shared test case).
    const SPEC_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const SPEC_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const SPEC_TIMESTAMP: u64 = 1614265330;
    const SPEC_BODY: &str = r#"{"test": 2432232314}"#;
    const SPEC_SIGNATURE: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    fn signing(secrets: &[&str]) -> Result<Signing, OptionError> {
        Signing::from_json(&json!({ "secrets": secrets }))
    }

    #[test]
    fn the_specification_example_is_reproduced() {
        let s = signing(&[SPEC_SECRET]).unwrap();
        assert_eq!(
            s.signature(SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY.as_bytes()),
            SPEC_SIGNATURE
        );
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test case 2 (short key) and 6 (a key longer than the block).
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        assert_eq!(
            hex(&hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_eq!(
            hex(&hmac_sha256(
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn one_signature_per_secret_for_rotation() {
        let other = format!("whsec_{}", BASE64.encode([7u8; 32]));
        let s = signing(&[SPEC_SECRET, &other]).unwrap();
        let sig = s.signature(SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY.as_bytes());
        let parts: Vec<&str> = sig.split(' ').collect();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0], SPEC_SIGNATURE);
        assert!(parts[1].starts_with("v1,") && parts[1] != SPEC_SIGNATURE);
    }

    #[test]
    fn signing_replaces_headers_of_the_same_names() {
        let s = signing(&[SPEC_SECRET]).unwrap();
        let mut headers = vec![
            ("Webhook-Id".to_string(), "forged".to_string()),
            ("X-Other".to_string(), "kept".to_string()),
            ("WEBHOOK-SIGNATURE".to_string(), "v1,forged".to_string()),
        ];
        s.sign(&mut headers, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY.as_bytes());
        assert_eq!(
            headers,
            vec![
                ("X-Other".to_string(), "kept".to_string()),
                (ID_HEADER.to_string(), SPEC_ID.to_string()),
                (TIMESTAMP_HEADER.to_string(), "1614265330".to_string()),
                (SIGNATURE_HEADER.to_string(), SPEC_SIGNATURE.to_string()),
            ]
        );
    }

    #[test]
    fn malformed_secrets_are_refused_without_being_quoted() {
        let short = format!("whsec_{}", BASE64.encode([1u8; 23]));
        let long = format!("whsec_{}", BASE64.encode([1u8; 65]));
        let ok24 = format!("whsec_{}", BASE64.encode([1u8; 24]));
        let ok64 = format!("whsec_{}", BASE64.encode([1u8; 64]));
        assert!(signing(&[&ok24]).is_ok() && signing(&[&ok64]).is_ok());
        for bad in [
            "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            "whsec_not base64!!",
            "whsec_",
            short.as_str(),
            long.as_str(),
        ] {
            let e = signing(&[bad]).unwrap_err();
            assert_eq!(e.option, "signing.secrets[0]", "{bad}");
            assert!(!e.message.contains(bad), "{}", e.message);
        }
        let e = Signing::from_json(&json!({"secrets": []})).unwrap_err();
        assert_eq!(e.option, "signing.secrets");
        let e = Signing::from_json(&json!({"secrets": [SPEC_SECRET, 1]})).unwrap_err();
        assert_eq!(e.option, "signing.secrets[1]");
        let nine = vec![SPEC_SECRET; 9];
        assert_eq!(signing(&nine).unwrap_err().option, "signing.secrets");
        let e = Signing::from_json(&json!({"scheme": "hmac", "secrets": [SPEC_SECRET]}));
        assert_eq!(e.unwrap_err().option, "signing.scheme");
        let e = Signing::from_json(&json!({"secret": SPEC_SECRET}));
        assert_eq!(e.unwrap_err().option, "signing.secret");
        assert_eq!(
            Signing::from_json(&json!("whsec_x")).unwrap_err().option,
            "signing"
        );
    }

    #[test]
    fn round_trip_and_debug_hides_secrets() {
        let s = signing(&[SPEC_SECRET]).unwrap();
        assert_eq!(Signing::from_json(&s.to_json()).unwrap(), s);
        assert!(!format!("{s:?}").contains("MfKQ"));
    }
}
