//! The HTTP transport: one keep-alive connection pool per channel, requests of a batch sent
//! concurrently, every failure described by the phase it happened in. Runs on the worker's
//! tokio runtime and never touches Postgres: plain Rust data in, plain Rust data out.

use super::options::{ChannelOptions, ExternalIdSource};
use crate::classify::Phase;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, USER_AGENT};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Most of a response body the worker reads (to find the external id); the rest is dropped.
const MAX_BODY_BYTES: usize = 1 << 20;
const AGENT: &str = concat!("outbox_delivery/", env!("CARGO_PKG_VERSION"));

/// One request to send.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub channel_id: i32,
    pub method: String,
    pub url: String,
    /// Already merged: message headers, then channel headers, then the idempotency header.
    pub headers: Vec<(String, String)>,
    pub body: String,
    pub timeout: Duration,
    pub external_id: Option<ExternalIdSource>,
}

/// What happened to one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Transmission {
    /// The provider answered with a status line.
    Answered {
        status: u16,
        retry_after: Option<String>,
        external_id: Option<String>,
        body_complete: bool,
        body_error: Option<String>,
        elapsed_ms: u64,
    },
    /// No answer: the phase says how far the request got.
    Failed {
        phase: Phase,
        timed_out: bool,
        error: String,
        elapsed_ms: u64,
    },
    /// The request could not be built (e.g. a header value HTTP cannot carry); nothing was sent.
    NotSent { error: String },
}

/// Connection pools, one per channel, rebuilt when the channel's options change.
#[derive(Default)]
pub struct Transport {
    clients: HashMap<i32, (String, reqwest::Client)>,
}

impl Transport {
    /// The client for a channel; `version` identifies its current options.
    pub fn client(
        &mut self,
        channel_id: i32,
        version: &str,
        options: &ChannelOptions,
    ) -> Result<reqwest::Client, String> {
        if let Some((v, c)) = self.clients.get(&channel_id) {
            if v == version {
                return Ok(c.clone());
            }
        }
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(options.connect_timeout_ms))
            .pool_max_idle_per_host(options.max_in_flight as usize)
            .pool_idle_timeout(Duration::from_secs(60))
            .tcp_nodelay(true)
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .build()
            .map_err(|e| format!("HTTP client could not be built: {e}"))?;
        self.clients
            .insert(channel_id, (version.to_string(), client.clone()));
        Ok(client)
    }

    /// Forgets pools of channels that no longer exist.
    pub fn retain(&mut self, live: impl Fn(i32) -> bool) {
        self.clients.retain(|id, _| live(*id));
    }
}

fn build(client: &reqwest::Client, out: &Outgoing) -> Result<reqwest::Request, String> {
    let method = reqwest::Method::from_bytes(out.method.as_bytes())
        .map_err(|e| format!("method {}: {e}", out.method))?;
    let mut headers = HeaderMap::with_capacity(out.headers.len() + 2);
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(USER_AGENT, HeaderValue::from_static(AGENT));
    for (name, value) in &out.headers {
        let n = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("header name \"{name}\" is not valid HTTP"))?;
        let v = HeaderValue::from_str(value)
            .map_err(|_| format!("header \"{name}\" has a value HTTP cannot carry"))?;
        headers.insert(n, v);
    }
    client
        .request(method, &out.url)
        .headers(headers)
        .timeout(out.timeout)
        .body(out.body.clone())
        .build()
        .map_err(|e| format!("request could not be built: {e}"))
}

/// Sends one request and reads its answer.
pub async fn transmit(client: reqwest::Client, out: Outgoing) -> Transmission {
    let request = match build(&client, &out) {
        Ok(r) => r,
        Err(error) => return Transmission::NotSent { error },
    };
    let started = Instant::now();
    let elapsed = |s: Instant| s.elapsed().as_millis() as u64;
    let mut response = match client.execute(request).await {
        Ok(r) => r,
        Err(e) => {
            let (phase, timed_out) = failure_phase(&e);
            return Transmission::Failed {
                phase,
                timed_out,
                error: error_chain(&e),
                elapsed_ms: elapsed(started),
            };
        }
    };
    let status = response.status().as_u16();
    let retry_after = header(response.headers(), "retry-after");
    let header_id = match &out.external_id {
        Some(ExternalIdSource::Header(name)) => header(response.headers(), name),
        _ => None,
    };
    let mut body = Vec::new();
    let mut body_error = None;
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if body.len() < MAX_BODY_BYTES {
                    let room = MAX_BODY_BYTES - body.len();
                    body.extend_from_slice(&chunk[..chunk.len().min(room)]);
                }
            }
            Ok(None) => break,
            Err(e) => {
                body_error = Some(format!(
                    "{}: {}",
                    if e.is_timeout() {
                        "read timed out"
                    } else {
                        "read failed"
                    },
                    error_chain(&e)
                ));
                break;
            }
        }
    }
    let external_id = match &out.external_id {
        Some(ExternalIdSource::Header(_)) => header_id,
        Some(ExternalIdSource::Body(pointer)) => body_pointer(&body, pointer),
        None => None,
    };
    Transmission::Answered {
        status,
        retry_after,
        external_id,
        body_complete: body_error.is_none(),
        body_error,
        elapsed_ms: elapsed(started),
    }
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_string())
}

/// A string or number at `pointer` in a JSON body.
pub fn body_pointer(body: &[u8], pointer: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    match v.pointer(pointer)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        serde_json::Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}

/// How far a failed request got: before the request could have been written (DNS,
/// connect, TLS) or after (wait, read).
fn failure_phase(e: &reqwest::Error) -> (Phase, bool) {
    let chain = error_chain(e).to_ascii_lowercase();
    let timed_out = e.is_timeout() || chain.contains("timed out") || chain.contains("deadline");
    if e.is_connect() {
        let phase = if chain.contains("dns error")
            || chain.contains("failed to lookup")
            || chain.contains("name or service")
        {
            Phase::Dns
        } else if chain.contains("tls")
            || chain.contains("certificate")
            || chain.contains("handshake")
        {
            Phase::Tls
        } else {
            Phase::Connect
        };
        return (phase, timed_out);
    }
    if e.is_body() || e.is_decode() {
        return (Phase::Read, timed_out);
    }
    (Phase::Wait, timed_out)
}

/// Sends every request concurrently on `runtime` and returns their transmissions in order.
pub fn transmit_all(
    runtime: &tokio::runtime::Runtime,
    requests: Vec<(reqwest::Client, Outgoing)>,
) -> Vec<Transmission> {
    runtime.block_on(async move {
        let handles: Vec<_> = requests
            .into_iter()
            .map(|(client, out)| tokio::spawn(transmit(client, out)))
            .collect();
        let mut results = Vec::with_capacity(handles.len());
        for h in handles {
            results.push(h.await.unwrap_or_else(|e| Transmission::Failed {
                phase: Phase::Wait,
                timed_out: false,
                error: format!("send task ended abnormally: {e}"),
                elapsed_ms: 0,
            }));
        }
        results
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointers() {
        assert_eq!(body_pointer(br#"{"id":"m-1"}"#, "/id"), Some("m-1".into()));
        assert_eq!(
            body_pointer(br#"{"data":{"id":42}}"#, "/data/id"),
            Some("42".into())
        );
        assert_eq!(body_pointer(br#"{"id":null}"#, "/id"), None);
        assert_eq!(body_pointer(b"not json", "/id"), None);
    }
}
