//! TLS of an HTTP channel, the `tls` option: roots trusted in addition to the system's
//! (`ca_pem`, a private CA) and a client certificate for mutual TLS (`client_cert_pem` with
//! `client_key_pem`, the key masked like a header value).
//!
//! Without it a channel trusts the operating system's CA store (rustls with
//! `rustls-native-certs`: on Debian the `ca-certificates` bundle in /etc/ssl/certs), so a
//! provider with a public certificate works as it is. Pure Rust: the PEM is checked when the
//! option is set, by building a client with it, and applied to each channel's client.

use super::option_error::OptionError;
use serde_json::{json, Map, Value};

/// Longest PEM text of one field, in bytes (a bundle of a few hundred certificates).
pub const MAX_PEM_BYTES: usize = 1024 * 1024;

const KEYS: &[&str] = &["ca_pem", "client_cert_pem", "client_key_pem"];

/// A channel's `tls`.
#[derive(Clone, PartialEq, Default)]
pub struct TlsOptions {
    /// Certificates (PEM) trusted as roots besides the system's.
    pub ca_pem: Option<String>,
    /// The client certificate chain (PEM), with its key.
    pub client_cert_pem: Option<String>,
    pub client_key_pem: Option<String>,
}

impl std::fmt::Debug for TlsOptions {
    /// Never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TlsOptions {{ ca_pem: {}, client certificate: {} }}",
            self.ca_pem.is_some(),
            self.client_cert_pem.is_some()
        )
    }
}

fn pem_field(obj: &Map<String, Value>, key: &str) -> Result<Option<String>, OptionError> {
    let option = format!("tls.{key}");
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.len() > MAX_PEM_BYTES => Err(OptionError::new(
            option,
            format!("is {} bytes; at most {MAX_PEM_BYTES}", s.len()),
        )),
        Some(Value::String(s)) if s.contains("-----BEGIN ") => Ok(Some(s.clone())),
        Some(Value::String(_)) => Err(OptionError::new(
            option,
            "must be PEM text (\"-----BEGIN …-----\")",
        )),
        Some(_) => Err(OptionError::new(option, "must be a string of PEM text")),
    }
}

impl TlsOptions {
    /// Parses and checks `{"ca_pem": …, "client_cert_pem": …, "client_key_pem": …}`.
    pub fn from_json(v: &Value) -> Result<TlsOptions, OptionError> {
        let obj = v.as_object().ok_or_else(|| {
            OptionError::new(
                "tls",
                "must be an object {\"ca_pem\", \"client_cert_pem\", \"client_key_pem\"}",
            )
        })?;
        if let Some(k) = obj.keys().find(|k| !KEYS.contains(&k.as_str())) {
            return Err(OptionError::new(
                format!("tls.{k}"),
                format!("unknown option; known options are {}", KEYS.join(", ")),
            ));
        }
        let tls = TlsOptions {
            ca_pem: pem_field(obj, "ca_pem")?,
            client_cert_pem: pem_field(obj, "client_cert_pem")?,
            client_key_pem: pem_field(obj, "client_key_pem")?,
        };
        match (&tls.client_cert_pem, &tls.client_key_pem) {
            (Some(_), None) => {
                return Err(OptionError::new(
                    "tls.client_key_pem",
                    "is required with client_cert_pem",
                ))
            }
            (None, Some(_)) => {
                return Err(OptionError::new(
                    "tls.client_cert_pem",
                    "is required with client_key_pem",
                ))
            }
            _ => {}
        }
        Ok(tls)
    }

    /// Builds a client with these certificates alone (no system roots): every certificate
    /// must parse as a trust anchor, and the key must go with a certificate. Done when the
    /// option is set (`create_channel`, `alter_channel`), not each time a worker reads it.
    pub fn check(&self) -> Result<(), OptionError> {
        let builder = reqwest::Client::builder().tls_built_in_root_certs(false);
        let builder = self.apply(builder)?;
        builder.build().map(drop).map_err(|e| {
            OptionError::new(
                "tls",
                format!("cannot be used: {}", crate::error::with_causes(&e)),
            )
        })
    }

    /// `builder` with the extra roots and the client certificate (the system's roots stay).
    pub fn apply(
        &self,
        mut builder: reqwest::ClientBuilder,
    ) -> Result<reqwest::ClientBuilder, OptionError> {
        if let Some(pem) = &self.ca_pem {
            let certs = reqwest::Certificate::from_pem_bundle(pem.as_bytes()).map_err(|e| {
                OptionError::new(
                    "tls.ca_pem",
                    format!("is not valid PEM: {}", crate::error::with_causes(&e)),
                )
            })?;
            if certs.is_empty() {
                return Err(OptionError::new(
                    "tls.ca_pem",
                    "holds no certificate (\"-----BEGIN CERTIFICATE-----\")",
                ));
            }
            for cert in certs {
                builder = builder.add_root_certificate(cert);
            }
        }
        if let (Some(cert), Some(key)) = (&self.client_cert_pem, &self.client_key_pem) {
            let certs = reqwest::Certificate::from_pem_bundle(cert.as_bytes()).map_err(|e| {
                OptionError::new(
                    "tls.client_cert_pem",
                    format!("is not valid PEM: {}", crate::error::with_causes(&e)),
                )
            })?;
            if certs.is_empty() {
                return Err(OptionError::new(
                    "tls.client_cert_pem",
                    "holds no certificate (\"-----BEGIN CERTIFICATE-----\")",
                ));
            }
            let both = format!("{}\n{}", cert.trim_end(), key.trim_end());
            let identity = reqwest::Identity::from_pem(both.as_bytes()).map_err(|e| {
                OptionError::new(
                    "tls.client_key_pem",
                    format!(
                        "with client_cert_pem is not a usable key and certificate: {}",
                        crate::error::with_causes(&e)
                    ),
                )
            })?;
            builder = builder.identity(identity);
        }
        Ok(builder)
    }

    pub fn to_json(&self) -> Value {
        json!({
            "ca_pem": self.ca_pem,
            "client_cert_pem": self.client_cert_pem,
            "client_key_pem": self.client_key_pem,
        })
    }
}

/// The operating system's CA store, as the roots every channel's client trusts: read and
/// checked once per process (`rustls-native-certs`, which honours `SSL_CERT_FILE` and
/// `SSL_CERT_DIR`), not at each client built, which is once per channel and worker and
/// again after every change of the channel's options or of `outbox.allowed_hosts`. Reading
/// the store parses a few hundred files, milliseconds that would delay the first message of
/// a channel. A change of the store is seen by workers started after it.
pub fn system_roots() -> &'static [reqwest::Certificate] {
    static ROOTS: std::sync::OnceLock<Vec<reqwest::Certificate>> = std::sync::OnceLock::new();
    ROOTS.get_or_init(|| usable_roots(rustls_native_certs::load_native_certs().certs))
}

/// The certificates that are usable as trust anchors, each once. A store holds ancient or
/// malformed certificates, and the same root in a bundle and in a directory; reqwest skips
/// the former when it reads the store itself, but refuses to build a client with one added
/// by hand.
fn usable_roots(
    certs: Vec<rustls::pki_types::CertificateDer<'static>>,
) -> Vec<reqwest::Certificate> {
    let mut seen = std::collections::HashSet::new();
    certs
        .into_iter()
        .filter(|der| seen.insert(der.as_ref().to_vec()))
        .filter(|der| rustls::RootCertStore::empty().add(der.clone()).is_ok())
        .filter_map(|der| reqwest::Certificate::from_der(der.as_ref()).ok())
        .collect()
}

/// `builder` trusting the operating system's roots ([`system_roots`]), read once.
pub fn with_system_roots(builder: reqwest::ClientBuilder) -> reqwest::ClientBuilder {
    system_roots()
        .iter()
        .cloned()
        .fold(builder.tls_built_in_native_certs(false), |b, root| {
            b.add_root_certificate(root)
        })
}

/// The alerts a server sends when it refuses the handshake itself: the client's certificate
/// (or its absence) or the parameters. With TLS 1.3 the client has finished its side of the
/// handshake before the server checks the client certificate, so the refusal arrives while
/// the request is being written or its answer awaited; the server's TLS layer refused the
/// connection before any request on it reached the provider.
const HANDSHAKE_ALERTS: &[&str] = &[
    "CertificateRequired",
    "BadCertificate",
    "UnsupportedCertificate",
    "CertificateRevoked",
    "CertificateExpired",
    "CertificateUnknown",
    "UnknownCA",
    "HandshakeFailure",
];

/// Does an error text (a reqwest error with its causes) say that the server refused the TLS
/// handshake with one of [`HANDSHAKE_ALERTS`]?
pub fn refused_handshake(chain: &str) -> bool {
    chain
        .split("received fatal alert: ")
        .skip(1)
        .any(|rest| HANDSHAKE_ALERTS.iter().any(|alert| rest.starts_with(alert)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CA: &str = include_str!("testdata/unit_ca.pem");
    const CLIENT: &str = include_str!("testdata/unit_client.pem");
    const CLIENT_KEY: &str = include_str!("testdata/unit_client.key");

    /// The DER of the first certificate of a PEM text.
    fn der_of(pem: &str) -> rustls::pki_types::CertificateDer<'static> {
        use base64::Engine;
        let body: String = pem
            .lines()
            .skip_while(|l| !l.starts_with("-----BEGIN CERTIFICATE"))
            .skip(1)
            .take_while(|l| !l.starts_with("-----END"))
            .collect();
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(body)
            .expect("test PEM is base64");
        rustls::pki_types::CertificateDer::from(bytes)
    }

    #[test]
    fn the_system_roots_keep_each_usable_certificate_once() {
        let ca = der_of(CA);
        let junk = rustls::pki_types::CertificateDer::from(b"not a certificate".to_vec());
        let roots = usable_roots(vec![ca.clone(), junk, ca.clone()]);
        assert_eq!(
            roots.len(),
            1,
            "the junk is skipped and the duplicate kept once"
        );
        // A client trusting them builds, as it would fail to with the junk added.
        let builder = reqwest::Client::builder().tls_built_in_root_certs(false);
        let builder = roots
            .into_iter()
            .fold(builder, |b, r| b.add_root_certificate(r));
        assert!(builder.build().is_ok());
        assert!(usable_roots(Vec::new()).is_empty());
    }

    #[test]
    fn the_system_store_is_read_once_and_builds_a_client() {
        let first = system_roots();
        assert!(
            !first.is_empty(),
            "the operating system's CA store has roots (ca-certificates)"
        );
        assert!(std::ptr::eq(first, system_roots()), "read once");
        let builder = with_system_roots(reqwest::Client::builder());
        assert!(builder.build().is_ok());
    }

    fn parse_and_check(v: &Value) -> Result<TlsOptions, OptionError> {
        let t = TlsOptions::from_json(v)?;
        t.check()?;
        Ok(t)
    }

    fn err(v: Value) -> OptionError {
        parse_and_check(&v).unwrap_err()
    }

    #[test]
    fn invalid_pem_is_refused_naming_the_field() {
        assert_eq!(err(json!({"ca_pem": "not pem"})).option, "tls.ca_pem");
        assert_eq!(err(json!({"ca_pem": 1})).option, "tls.ca_pem");
        assert_eq!(
            err(json!({"ca_pem": "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----"}))
                .option
                .split('.')
                .next(),
            Some("tls")
        );
        let truncated = &CA[..CA.len() / 2];
        assert!(err(json!({ "ca_pem": truncated }))
            .option
            .starts_with("tls"));
        let key_as_cert = json!({"client_cert_pem": CLIENT_KEY, "client_key_pem": CLIENT_KEY});
        assert!(err(key_as_cert).option.starts_with("tls.client_"));
        let e = err(json!({"client_cert_pem": CLIENT, "client_key_pem": CA}));
        assert_eq!(e.option, "tls.client_key_pem");
        assert!(!e.message.contains("BEGIN"), "{}", e.message);
        assert_eq!(
            err(json!({"client_cert_pem": CA})).option,
            "tls.client_key_pem"
        );
        assert_eq!(
            err(json!({"client_key_pem": "-----BEGIN PRIVATE KEY-----"})).option,
            "tls.client_cert_pem"
        );
        assert_eq!(err(json!({"cafile": "/etc/x"})).option, "tls.cafile");
        assert_eq!(err(json!("pem")).option, "tls");
        let huge = format!("-----BEGIN CERTIFICATE-----{}", "A".repeat(MAX_PEM_BYTES));
        assert_eq!(err(json!({ "ca_pem": huge })).option, "tls.ca_pem");
    }

    #[test]
    fn a_ca_and_a_client_certificate_are_accepted() {
        let t = parse_and_check(&json!({
            "ca_pem": CA, "client_cert_pem": CLIENT, "client_key_pem": CLIENT_KEY
        }))
        .unwrap();
        assert_eq!(t.ca_pem.as_deref(), Some(CA));
        assert_eq!(TlsOptions::from_json(&t.to_json()).unwrap(), t);
        // A bundle of two roots.
        let bundle = format!("{CA}\n{CA}");
        assert!(parse_and_check(&json!({ "ca_pem": bundle })).is_ok());
    }

    #[test]
    fn a_refused_handshake_is_recognised_by_its_alert() {
        assert!(refused_handshake("client error (SendRequest): connection error: received fatal alert: CertificateRequired"));
        assert!(refused_handshake("x: received fatal alert: UnknownCA"));
        assert!(!refused_handshake("x: received fatal alert: DecodeError"));
        assert!(!refused_handshake("connection reset by peer"));
        assert!(!refused_handshake("CertificateRequired"));
    }

    #[test]
    fn an_empty_object_changes_nothing_and_debug_hides_the_key() {
        let t = TlsOptions::from_json(&json!({})).unwrap();
        assert_eq!(t, TlsOptions::default());
        assert_eq!(TlsOptions::from_json(&t.to_json()).unwrap(), t);
        let t = TlsOptions {
            client_key_pem: Some("SECRET".into()),
            ..Default::default()
        };
        assert!(!format!("{t:?}").contains("SECRET"));
    }
}
