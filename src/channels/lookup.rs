//! The read-only lookup at the provider: the request (its URL is filled by `lookup_url`)
//! and what the answer means. Pure Rust plus the async request; no Postgres.

use super::http::{check_request, describe, read_body, refusal_in};
use super::json_pointer::body_pointer;
use super::lookup_url::content_sha256;
pub use super::lookup_url::Subject;
use super::options::{ChannelOptions, ReconcileConfig};
use crate::allow_list::AllowList;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a lookup found out.
#[derive(Debug, Clone, PartialEq)]
pub enum Lookup {
    /// The provider has the message.
    Found {
        external_id: Option<String>,
        http_status: Option<u16>,
    },
    /// The provider answered that it does not have it.
    NotFound { http_status: Option<u16> },
    /// No usable answer: try again later; nothing is concluded.
    Unavailable {
        error: String,
        http_status: Option<u16>,
    },
}

impl Lookup {
    /// The name `outbox.reconcile()` returns and attempt rows record.
    pub fn as_str(&self) -> &'static str {
        match self {
            Lookup::Found { .. } => "delivered",
            Lookup::NotFound { .. } => "not_found",
            Lookup::Unavailable { .. } => "unavailable",
        }
    }

    pub fn http_status(&self) -> Option<u16> {
        match self {
            Lookup::Found { http_status, .. }
            | Lookup::NotFound { http_status }
            | Lookup::Unavailable { http_status, .. } => *http_status,
        }
    }
}

/// What an answer means: 404 = not found; 2xx = found, unless the `found` pointer reads
/// false, null or nothing; anything else concludes nothing.
pub fn interpret(status: u16, body: &[u8], config: &ReconcileConfig) -> Lookup {
    if status == 404 {
        return Lookup::NotFound {
            http_status: Some(status),
        };
    }
    if !(200..300).contains(&status) {
        return Lookup::Unavailable {
            error: format!("lookup answered HTTP {status}"),
            http_status: Some(status),
        };
    }
    let found = match &config.found {
        None => true,
        Some(pointer) => match serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .as_ref()
            .and_then(|v| v.pointer(pointer))
        {
            None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => false,
            Some(serde_json::Value::Array(a)) => !a.is_empty(),
            Some(_) => true,
        },
    };
    if !found {
        return Lookup::NotFound {
            http_status: Some(status),
        };
    }
    Lookup::Found {
        external_id: config
            .external_id
            .as_ref()
            .and_then(|p| body_pointer(body, p)),
        http_status: Some(status),
    }
}

/// Runs the lookup. Read-only: the message itself is never sent. The request is held to
/// `allowed` (`outbox.allowed_hosts`): a refused destination concludes nothing, so the
/// message stays uncertain and is looked up again once the list allows it. `client` must
/// resolve names with `http::GuardedResolver` over the same list.
pub async fn lookup(
    client: reqwest::Client,
    options: ChannelOptions,
    url: String,
    subject: Subject,
    allowed: Arc<AllowList>,
) -> Lookup {
    let Some(config) = options.reconcile.clone() else {
        return Lookup::Unavailable {
            error: "the channel has no reconcile lookup".into(),
            http_status: None,
        };
    };
    let started = Instant::now();
    let method =
        reqwest::Method::from_bytes(config.method.as_bytes()).unwrap_or(reqwest::Method::GET);
    let mut request = client
        .request(method.clone(), &url)
        .timeout(Duration::from_millis(options.timeout_ms));
    for (name, value) in &options.headers {
        request = request.header(name, value);
    }
    if method == reqwest::Method::POST {
        let body = serde_json::json!({
            "effect_key": subject.effect_key,
            "external_id": subject.external_id,
            "content_sha256": content_sha256(&subject.payload),
            "created_at": subject.created_at_s,
        });
        request = request
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string());
    }
    let request = match request.build() {
        Ok(r) => r,
        Err(e) => {
            return Lookup::Unavailable {
                error: format!("lookup request could not be built: {}", describe(&e)),
                http_status: None,
            }
        }
    };
    if let Err(refusal) = check_request(&allowed, &request) {
        return Lookup::Unavailable {
            error: format!("lookup not sent: {refusal}"),
            http_status: None,
        };
    }
    let response = match client.execute(request).await {
        Ok(r) => r,
        Err(e) => {
            let error = match refusal_in(&e) {
                Some(refusal) => format!("lookup not sent: {refusal}"),
                None => format!(
                    "lookup failed after {} ms: {}",
                    started.elapsed().as_millis(),
                    describe(&e)
                ),
            };
            return Lookup::Unavailable {
                error,
                http_status: None,
            };
        }
    };
    let status = response.status().as_u16();
    let mut response = response;
    let (body, over_limit, read_error) =
        read_body(&mut response, options.max_response_bytes as usize).await;
    drop(response);
    match read_error {
        // A "found" read from a body cut short could be wrong: no verdict.
        None if over_limit && config.found.is_some() => Lookup::Unavailable {
            error: format!(
                "lookup answer longer than max_response_bytes ({}); its \"found\" was not read",
                options.max_response_bytes
            ),
            http_status: Some(status),
        },
        None => interpret(status, &body, &config),
        Some(e) => Lookup::Unavailable {
            error: format!(
                "lookup answer unreadable after {} ms: {}",
                started.elapsed().as_millis(),
                describe(&e)
            ),
            http_status: Some(status),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(found: Option<&str>, external_id: Option<&str>) -> ReconcileConfig {
        ReconcileConfig {
            url: "http://h/{effect_key}".into(),
            method: "GET".into(),
            found: found.map(str::to_string),
            external_id: external_id.map(str::to_string),
            settle_ms: None,
        }
    }

    #[test]
    fn answers_are_interpreted() {
        let c = config(None, Some("/id"));
        assert_eq!(
            interpret(404, b"", &c),
            Lookup::NotFound {
                http_status: Some(404)
            }
        );
        assert_eq!(
            interpret(200, br#"{"id": "m-9"}"#, &c),
            Lookup::Found {
                external_id: Some("m-9".into()),
                http_status: Some(200)
            }
        );
        assert!(matches!(
            interpret(503, b"", &c),
            Lookup::Unavailable {
                http_status: Some(503),
                ..
            }
        ));
        assert!(matches!(
            interpret(401, b"", &c),
            Lookup::Unavailable { .. }
        ));
        let f = config(Some("/found"), None);
        assert_eq!(
            interpret(200, br#"{"found": false}"#, &f),
            Lookup::NotFound {
                http_status: Some(200)
            }
        );
        assert_eq!(
            interpret(200, br#"{"found": null}"#, &f),
            Lookup::NotFound {
                http_status: Some(200)
            }
        );
        assert_eq!(
            interpret(200, br#"{}"#, &f),
            Lookup::NotFound {
                http_status: Some(200)
            }
        );
        assert_eq!(
            interpret(200, b"garbage", &f),
            Lookup::NotFound {
                http_status: Some(200)
            }
        );
        assert!(matches!(
            interpret(200, br#"{"found": true}"#, &f),
            Lookup::Found { .. }
        ));
        let list = config(Some("/items"), Some("/items/0/id"));
        assert_eq!(
            interpret(200, br#"{"items": []}"#, &list),
            Lookup::NotFound {
                http_status: Some(200)
            }
        );
        assert_eq!(
            interpret(200, br#"{"items": [{"id": 7}]}"#, &list),
            Lookup::Found {
                external_id: Some("7".into()),
                http_status: Some(200)
            }
        );
    }

    #[test]
    fn names() {
        assert_eq!(
            Lookup::NotFound {
                http_status: Some(404)
            }
            .as_str(),
            "not_found"
        );
        assert_eq!(
            Lookup::Found {
                external_id: None,
                http_status: Some(200)
            }
            .as_str(),
            "delivered"
        );
    }
}
