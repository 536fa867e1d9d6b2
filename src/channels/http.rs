//! The HTTP transport: one keep-alive connection pool per channel, requests of a batch sent
//! concurrently, every failure described by the phase it happened in. Runs on the worker's
//! tokio runtime and never touches Postgres: plain Rust data in, plain Rust data out.
//! Through reqwest: `https://` endpoints and lookups; an `http://` endpoint's sends go on
//! the channel's own connections (`wire`), which answer with the same [`Transmission`].
//!
//! Every request is held to `outbox.allowed_hosts` (see `crate::allow_list`) twice: its URL's host is
//! checked before it is sent (an IP literal is never resolved, so its address is checked
//! there too), and every client resolves names with [`GuardedResolver`], which drops the
//! addresses the list refuses. A refused request sends nothing.

use super::json_pointer::body_pointer;
use super::options::{ChannelOptions, ExternalIdSource};
use super::secrets::mask_url_in;
use crate::allow_list::{self, AllowList, Refusal};
use crate::classify::Phase;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, USER_AGENT};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most bytes of response bodies one process holds at once, over all its requests: a
/// request waits for room before it reads its body. Each body is bounded by its channel's
/// `max_response_bytes` (64 KiB by default, so that a batch of 200 fits without waiting);
/// this bounds the sum when channels allow more.
pub const RESPONSE_MEMORY_BYTES: usize = 16 * 1024 * 1024;

/// The room for response bodies (see [`RESPONSE_MEMORY_BYTES`]).
static RESPONSE_MEMORY: tokio::sync::Semaphore =
    tokio::sync::Semaphore::const_new(RESPONSE_MEMORY_BYTES);

/// Room for `limit` bytes of a response body in [`RESPONSE_MEMORY`], held until dropped.
pub(crate) async fn response_room(limit: usize) -> Option<tokio::sync::SemaphorePermit<'static>> {
    RESPONSE_MEMORY
        .acquire_many(limit.clamp(1, RESPONSE_MEMORY_BYTES) as u32)
        .await
        .ok()
}

/// Reads at most `limit` bytes of `response`'s body, holding room for them in
/// [`RESPONSE_MEMORY`] while it does. Returns the bytes read, whether the body went on past
/// the limit (its rest is not read: the connection is closed rather than drained), and a
/// read error.
pub async fn read_body(
    response: &mut reqwest::Response,
    limit: usize,
) -> (Vec<u8>, bool, Option<reqwest::Error>) {
    let limit = limit.clamp(1, RESPONSE_MEMORY_BYTES);
    let _room = response_room(limit).await;
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = limit - body.len();
                if chunk.len() > room {
                    body.extend_from_slice(&chunk[..room]);
                    return (body, true, None);
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return (body, false, None),
            Err(e) => return (body, false, Some(e)),
        }
    }
}
pub(crate) const AGENT: &str = concat!("outbox_delivery/", env!("CARGO_PKG_VERSION"));

/// One request to send.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub channel_id: i32,
    pub method: String,
    pub url: String,
    /// `url` parsed once for its channel (`remote::HttpChannel`); `None`: parsed for this
    /// request, and a parse error fails it.
    pub parsed_url: Option<reqwest::Url>,
    /// Already merged: message headers, then channel headers, then the idempotency header.
    pub headers: Vec<(String, String)>,
    pub body: String,
    pub timeout: Duration,
    pub external_id: Option<ExternalIdSource>,
    /// Most bytes of the answer's body to read (the channel's `max_response_bytes`).
    pub max_response_bytes: usize,
    /// Bytes of a refusing answer's body kept (`answer_excerpt`).
    pub excerpt_bytes: usize,
    /// When the request may no longer start (`fence`).
    pub fence: super::fence::Fence,
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
        /// What a refusing answer's body said (`answer_excerpt`).
        excerpt: Option<String>,
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
    /// The attempt's fence had passed before the request started (`fence`): nothing was
    /// sent, and the attempt is not counted.
    Fenced { error: String },
    /// `outbox.allowed_hosts` refused the destination before anything was written: its host
    /// (phase DNS), its literal address (phase connect) or every address it resolved to
    /// (phase DNS).
    Refused {
        phase: Phase,
        error: String,
        elapsed_ms: u64,
    },
}

/// Resolves names with the system resolver (`getaddrinfo`, on tokio's blocking pool) and
/// keeps only the addresses `outbox.allowed_hosts` allows; fails with a [`Refusal`] when
/// the name is not allowed or none of its addresses is.
pub struct GuardedResolver {
    allowed: Arc<AllowList>,
}

impl GuardedResolver {
    pub fn new(allowed: Arc<AllowList>) -> GuardedResolver {
        GuardedResolver { allowed }
    }
}

/// What a resolver fails with (reqwest's error type for resolvers).
type ResolveError = Box<dyn std::error::Error + Send + Sync>;

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let allowed = self.allowed.clone();
        let host = name.as_str().to_string();
        Box::pin(async move {
            if !allow_list::host_allowed(&allowed, &host) {
                return Err(Box::new(Refusal {
                    host,
                    reason: allow_list::Reason::NotListed,
                }) as ResolveError);
            }
            let resolved = tokio::net::lookup_host((host.as_str(), 0)).await?;
            let kept = allow_list::filter_resolved(&allowed, &host, resolved)?;
            Ok(Box::new(kept.into_iter()) as Addrs)
        })
    }
}

/// A client builder for requests held to `allowed` (no proxy, no redirects: nothing may
/// carry a request to a destination that was not checked).
pub fn guarded_client(
    allowed: Arc<AllowList>,
    connect_timeout: Duration,
) -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .connect_timeout(connect_timeout)
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .dns_resolver(Arc::new(GuardedResolver::new(allowed)))
}

/// The refusal behind a failed request, if the guarded resolver refused it.
pub fn refusal_in(e: &(dyn std::error::Error + 'static)) -> Option<Refusal> {
    let mut current = Some(e);
    while let Some(err) = current {
        if let Some(r) = err.downcast_ref::<Refusal>() {
            return Some(r.clone());
        }
        current = err.source();
    }
    None
}

/// The phase a refusal is recorded in: a literal address is refused where the connection
/// would start; a name before or after it is resolved.
pub(crate) fn refusal_phase(r: &Refusal) -> Phase {
    match r.reason {
        allow_list::Reason::Sensitive { .. } => Phase::Connect,
        allow_list::Reason::NotListed | allow_list::Reason::OnlySensitiveAddresses { .. } => {
            Phase::Dns
        }
    }
}

/// Checks a request's URL before it is sent: `Err` is the refusal as a transmission.
pub fn check_request(allowed: &AllowList, request: &reqwest::Request) -> Result<(), Refusal> {
    allow_list::check_url(allowed, request.url())
}

/// Connection pools, one per channel, rebuilt when the channel's options change or when
/// `outbox.allowed_hosts` changes (a pooled connection was checked under the old list).
pub struct Transport {
    /// Each channel's client: its options' version, the client, the client's number.
    clients: HashMap<i32, (String, reqwest::Client, u64)>,
    /// The clients by what they are built from, shared by every channel built alike: a
    /// client holds its own copy of the system's root certificates and its own pools, and
    /// one per channel held 40 kB and more each (430 MiB a worker with 10,000 channels).
    /// Channels to one host then share its connections.
    shared: HashMap<ClientShape, Vec<SharedClient>>,
    /// The number of the next client built.
    built: u64,
    /// The text of `outbox.allowed_hosts` the clients were built with.
    allowed_text: Option<String>,
    allowed: Arc<AllowList>,
}

impl Default for Transport {
    /// Allows nothing until [`Transport::set_allowed_hosts`] is called.
    fn default() -> Self {
        Transport {
            clients: HashMap::new(),
            shared: HashMap::new(),
            built: 0,
            allowed_text: None,
            allowed: Arc::new(AllowList::nothing()),
        }
    }
}

impl Transport {
    /// Takes the current text of `outbox.allowed_hosts` (read by the caller on the main
    /// thread, each cycle). When it changed, every pool is dropped so that no connection
    /// made under the old list is reused. `None` when nothing changed; `Some(Err)` when the
    /// new text is invalid, which allows nothing until it is fixed.
    pub fn set_allowed_hosts(
        &mut self,
        text: &str,
    ) -> Option<Result<(), allow_list::InvalidEntry>> {
        if self.allowed_text.as_deref() == Some(text) {
            return None;
        }
        let (list, result) = match AllowList::parse(text) {
            Ok(list) => (list, Ok(())),
            Err(e) => (AllowList::nothing(), Err(e)),
        };
        self.allowed = Arc::new(list);
        self.allowed_text = Some(text.to_string());
        self.clients.clear();
        self.shared.clear();
        Some(result)
    }

    /// The list requests are checked against now.
    pub fn allowed(&self) -> Arc<AllowList> {
        self.allowed.clone()
    }

    /// The client for a channel; `version` identifies its current options. Its pool keeps
    /// at most `batch_size` idle connections (no batch sends more at once), however large
    /// `max_in_flight`: idle sockets count against the descriptors of the worker process.
    pub fn client(
        &mut self,
        channel_id: i32,
        version: &str,
        options: &ChannelOptions,
        batch_size: usize,
    ) -> Result<reqwest::Client, String> {
        if let Some((v, c, _)) = self.clients.get(&channel_id) {
            if v == version {
                return Ok(c.clone());
            }
        }
        let shape = ClientShape {
            connect_timeout_ms: options.connect_timeout_ms,
            max_idle: (options.max_in_flight as usize).min(batch_size),
        };
        let alike = self.shared.entry(shape).or_default();
        if let Some(c) = alike.iter().find(|c| c.tls == options.tls) {
            let client = c.client.clone();
            self.clients
                .insert(channel_id, (version.to_string(), client.clone(), c.number));
            return Ok(client);
        }
        let mut builder = super::tls::with_system_roots(guarded_client(
            self.allowed.clone(),
            Duration::from_millis(options.connect_timeout_ms),
        ));
        if let Some(tls) = &options.tls {
            builder = tls
                .apply(builder)
                .map_err(|e| format!("channel option \"{}\": {}", e.option, e.message))?;
        }
        let client = builder
            .pool_max_idle_per_host(shape.max_idle)
            .pool_idle_timeout(super::pool_budget::IDLE_LIFE)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| format!("HTTP client could not be built: {e}"))?;
        self.built += 1;
        let number = self.built;
        self.shared.entry(shape).or_default().push(SharedClient {
            tls: options.tls.clone(),
            client: client.clone(),
            number,
        });
        self.clients
            .insert(channel_id, (version.to_string(), client.clone(), number));
        Ok(client)
    }

    /// Drops a channel's pool: its idle connections close once no request and no other
    /// channel holds the client any more (`let_go`).
    pub fn forget(&mut self, channel_id: i32) {
        self.clients.remove(&channel_id);
    }

    /// Lets go of the shared clients that no channel uses any more.
    pub fn let_go(&mut self) {
        if self.shared.is_empty() {
            return;
        }
        let used: std::collections::HashSet<u64> =
            self.clients.values().map(|(_, _, n)| *n).collect();
        for alike in self.shared.values_mut() {
            alike.retain(|c| used.contains(&c.number));
        }
        self.shared.retain(|_, alike| !alike.is_empty());
    }

    /// The channels that have a pool, in order.
    #[cfg(test)]
    pub fn pooled(&self) -> Vec<i32> {
        let mut ids: Vec<i32> = self.clients.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Forgets pools of channels that no longer exist.
    pub fn retain(&mut self, live: impl Fn(i32) -> bool) {
        self.clients.retain(|id, _| live(*id));
        self.let_go();
    }
}

/// A client that channels built alike share.
struct SharedClient {
    tls: Option<super::tls::TlsOptions>,
    client: reqwest::Client,
    number: u64,
}

/// What a client is built from besides its TLS options (compared apart: they have no hash).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct ClientShape {
    connect_timeout_ms: u64,
    max_idle: usize,
}

/// The method and headers of `out` as HTTP carries them: the defaults (a JSON body, the
/// extension's user agent) first, a later value of a name replacing an earlier one. `Err`
/// says why the request cannot be sent; both transports send what this returns.
pub(crate) fn method_and_headers(out: &Outgoing) -> Result<(reqwest::Method, HeaderMap), String> {
    let method = reqwest::Method::from_bytes(out.method.as_bytes())
        .map_err(|e| format!("method {}: {e}", out.method))?;
    let mut headers = HeaderMap::with_capacity(out.headers.len() + 2);
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(USER_AGENT, HeaderValue::from_static(AGENT));
    for (name, value) in &out.headers {
        let n = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("header name \"{name}\" is not valid HTTP"))?;
        // Bytes, not str: UTF-8 travels as obs-text; control characters are refused.
        let v = HeaderValue::from_bytes(value.as_bytes())
            .map_err(|_| format!("header \"{name}\" has a value HTTP cannot carry"))?;
        headers.insert(n, v);
    }
    Ok((method, headers))
}

fn build(client: &reqwest::Client, out: &Outgoing) -> Result<reqwest::Request, String> {
    let (method, headers) = method_and_headers(out)?;
    let request = match &out.parsed_url {
        Some(url) => client.request(method, url.clone()),
        None => client.request(method, &out.url),
    };
    request
        .headers(headers)
        .timeout(out.timeout)
        .body(out.body.clone())
        .build()
        .map_err(|e| format!("request could not be built: {}", describe(&e)))
}

/// A reqwest error as recorded: its chain of causes, with the URL it quotes masked
/// (`secrets::mask_url`): an endpoint's query may hold an API key.
pub fn describe(e: &reqwest::Error) -> String {
    let text = crate::error::with_causes(e);
    match e.url() {
        Some(url) => mask_url_in(&text, url.as_str()),
        None => text,
    }
}

/// Sends one request and reads its answer; `allowed` is the list the request is held to.
pub async fn transmit(
    client: reqwest::Client,
    out: Outgoing,
    allowed: Arc<AllowList>,
) -> Transmission {
    let request = match build(&client, &out) {
        Ok(r) => r,
        Err(error) => return Transmission::NotSent { error },
    };
    if let Err(refusal) = check_request(&allowed, &request) {
        return Transmission::Refused {
            phase: refusal_phase(&refusal),
            error: refusal.to_string(),
            elapsed_ms: 0,
        };
    }
    // reqwest connects and writes in one call: the fence is looked at right before it.
    if out.fence.passed() {
        return Transmission::Fenced {
            error: super::fence::not_sent_text(&out.fence),
        };
    }
    let started = Instant::now();
    let elapsed = |s: Instant| s.elapsed().as_millis() as u64;
    let mut response = match client.execute(request).await {
        Ok(r) => r,
        Err(e) => {
            if let Some(refusal) = refusal_in(&e) {
                return Transmission::Refused {
                    phase: refusal_phase(&refusal),
                    error: refusal.to_string(),
                    elapsed_ms: elapsed(started),
                };
            }
            let (phase, timed_out) = failure_phase(&e);
            return Transmission::Failed {
                phase,
                timed_out,
                error: describe(&e),
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
    let (body, over_limit, read_error) = read_body(&mut response, out.max_response_bytes).await;
    drop(response);
    let external_id = match &out.external_id {
        Some(ExternalIdSource::Header(_)) => header_id,
        Some(ExternalIdSource::Body(pointer)) => body_pointer(&body, pointer),
        None => None,
    };
    // A body longer than the channel reads is not a failure: the status line is the
    // provider's answer. It is noted, since an external id past the limit is not found.
    let body_error = match (&read_error, over_limit) {
        (Some(e), _) => Some(format!(
            "{}: {}",
            if e.is_timeout() {
                "read timed out"
            } else {
                "read failed"
            },
            describe(e)
        )),
        (None, true) => Some(format!(
            "body longer than max_response_bytes ({}); the rest was not read",
            out.max_response_bytes
        )),
        (None, false) => None,
    };
    let excerpt =
        super::answer_excerpt::excerpt(status, &body, out.excerpt_bytes, &out.url, &out.headers);
    Transmission::Answered {
        status,
        retry_after,
        external_id,
        body_complete: read_error.is_none(),
        body_error,
        excerpt,
        elapsed_ms: elapsed(started),
    }
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_string())
}

/// How far a failed request got: before the request could have been written (DNS,
/// connect, TLS) or after (wait, read).
fn failure_phase(e: &reqwest::Error) -> (Phase, bool) {
    let chain = crate::error::with_causes(e).to_ascii_lowercase();
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
    if super::tls::refused_handshake(&crate::error::with_causes(e)) {
        return (Phase::Tls, timed_out);
    }
    if e.is_body() || e.is_decode() {
        return (Phase::Read, timed_out);
    }
    (Phase::Wait, timed_out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    fn list(s: &str) -> Arc<AllowList> {
        Arc::new(AllowList::parse(s).unwrap())
    }

    fn outgoing(url: &str) -> Outgoing {
        Outgoing {
            channel_id: 1,
            method: "POST".into(),
            url: url.into(),
            parsed_url: None,
            headers: vec![],
            body: "{}".into(),
            timeout: Duration::from_secs(2),
            external_id: None,
            max_response_bytes: 65536,
            excerpt_bytes: 1024,
            fence: crate::channels::fence::Fence::open(),
        }
    }

    fn send(allowed: &str, url: &str) -> Transmission {
        let allowed = list(allowed);
        let client = guarded_client(allowed.clone(), Duration::from_secs(1))
            .build()
            .unwrap();
        runtime().block_on(transmit(client, outgoing(url), allowed))
    }

    fn refused_error(t: &Transmission) -> (Phase, &str) {
        match t {
            Transmission::Refused { phase, error, .. } => (*phase, error.as_str()),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn literal_addresses_are_refused_before_sending() {
        // No network is touched: each is refused before a connection is attempted.
        let cases: &[(&str, &str, Phase, &str)] = &[
            (
                "*",
                "http://169.254.169.254/latest/meta-data",
                Phase::Connect,
                "host 169.254.169.254 is IPv4 link-local",
            ),
            (
                "*",
                "http://0xa9fea9fe/",
                Phase::Connect,
                "host 169.254.169.254 is",
            ),
            (
                "*",
                "http://[::ffff:169.254.169.254]/",
                Phase::Connect,
                "host [::ffff:169.254.169.254] is",
            ),
            (
                "*",
                "http://[fd00:ec2::254]/",
                Phase::Connect,
                "host [fd00:ec2::254] is",
            ),
            (
                "*",
                "http://100.100.100.200/",
                Phase::Connect,
                "host 100.100.100.200 is",
            ),
            ("*", "http://0.0.0.0:9/", Phase::Connect, "host 0.0.0.0 is"),
            ("*", "http://[::]:9/", Phase::Connect, "host [::] is"),
            (
                "api.example.com",
                "http://127.0.0.1:9/",
                Phase::Dns,
                "host 127.0.0.1 is not listed",
            ),
            (
                "api.example.com",
                "http://evil.example.com/",
                Phase::Dns,
                "host evil.example.com is not listed",
            ),
            (
                "",
                "http://api.example.com/",
                Phase::Dns,
                "host api.example.com is not listed",
            ),
        ];
        for (allowed, url, phase, text) in cases {
            let t = send(allowed, url);
            let (p, error) = refused_error(&t);
            assert_eq!(p, *phase, "{url}");
            assert!(
                error.starts_with(&format!(
                    "destination refused by outbox.allowed_hosts: {text}"
                )),
                "{url}: {error}"
            );
        }
    }

    #[test]
    fn the_resolver_refuses_names_and_refused_addresses() {
        let rt = runtime();
        let resolve = |allowed: &str, host: &str| {
            let r = GuardedResolver::new(list(allowed));
            rt.block_on(r.resolve(host.parse().unwrap()))
                .map(|a| a.collect::<Vec<_>>())
        };
        let e = resolve("api.example.com", "other.example.com").unwrap_err();
        assert_eq!(
            refusal_in(e.as_ref()).map(|r| r.reason),
            Some(allow_list::Reason::NotListed)
        );
        // localhost resolves from /etc/hosts, without DNS.
        let addrs = resolve("localhost", "localhost").unwrap();
        assert!(
            !addrs.is_empty() && addrs.iter().all(|a| a.ip().is_loopback()),
            "{addrs:?}"
        );
        let e = resolve("*", "0.0.0.0").unwrap_err();
        let r = refusal_in(e.as_ref()).unwrap();
        assert!(
            matches!(r.reason, allow_list::Reason::OnlySensitiveAddresses { .. }),
            "{r}"
        );
        assert_eq!(resolve("*, 0.0.0.0", "0.0.0.0").unwrap().len(), 1);
    }

    /// A resolver that refuses every name, standing in for one whose name resolved only to
    /// refused addresses: the refusal must survive reqwest's and hyper's error wrapping.
    struct Refusing;

    impl Resolve for Refusing {
        fn resolve(&self, name: Name) -> Resolving {
            let host = name.as_str().to_string();
            Box::pin(async move {
                Err(Box::new(Refusal {
                    host,
                    reason: allow_list::Reason::OnlySensitiveAddresses {
                        addresses: vec!["169.254.169.254".parse().unwrap()],
                    },
                }) as ResolveError)
            })
        }
    }

    #[test]
    fn a_refusal_from_the_resolver_is_a_refused_transmission() {
        let client = reqwest::Client::builder()
            .no_proxy()
            .dns_resolver(Arc::new(Refusing))
            .build()
            .unwrap();
        let t = runtime().block_on(transmit(
            client,
            outgoing("http://metadata.example.internal/latest"),
            list("*"),
        ));
        let (phase, error) = refused_error(&t);
        assert_eq!(phase, Phase::Dns);
        assert_eq!(
            error,
            "destination refused by outbox.allowed_hosts: host metadata.example.internal resolves only to refused addresses (169.254.169.254)"
        );
    }

    #[test]
    fn channels_built_alike_share_one_client_until_none_uses_it() {
        let mut t = Transport::default();
        assert_eq!(t.set_allowed_hosts("*"), Some(Ok(())));
        let o = ChannelOptions::default();
        for id in 1..=100 {
            t.client(id, "v1", &o, 200).unwrap();
        }
        let slow = ChannelOptions {
            connect_timeout_ms: 9_000,
            ..ChannelOptions::default()
        };
        t.client(101, "v1", &slow, 200).unwrap();
        let built = |t: &Transport| t.shared.values().map(Vec::len).sum::<usize>();
        assert_eq!(
            built(&t),
            2,
            "one client for the 100 alike, one for the other"
        );
        assert_eq!(t.clients.len(), 101);
        for id in 1..=99 {
            t.forget(id);
        }
        t.let_go();
        assert_eq!(built(&t), 2, "channel 100 still uses the first");
        t.forget(100);
        t.let_go();
        assert_eq!(built(&t), 1);
        t.retain(|_| false);
        assert_eq!(built(&t), 0);
    }

    #[test]
    fn a_changed_list_drops_the_pools() {
        let mut t = Transport::default();
        assert!(t.allowed().entries().is_empty());
        assert_eq!(t.set_allowed_hosts("*"), Some(Ok(())));
        let o = ChannelOptions::default();
        t.client(1, "v1", &o, 200).unwrap();
        assert_eq!(t.clients.len(), 1);
        assert_eq!(t.set_allowed_hosts("*"), None);
        assert_eq!(t.clients.len(), 1);
        assert_eq!(t.set_allowed_hosts("api.example.com"), Some(Ok(())));
        assert!(t.clients.is_empty());
        assert_eq!(t.allowed().source(), "api.example.com");
        let e = t
            .set_allowed_hosts("api.example.com:443")
            .unwrap()
            .unwrap_err();
        assert_eq!(e.entry, "api.example.com:443");
        assert!(
            t.allowed().entries().is_empty(),
            "an invalid list allows nothing"
        );
        assert_eq!(
            t.set_allowed_hosts("api.example.com:443"),
            None,
            "reported once"
        );
    }
}
