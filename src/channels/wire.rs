//! Plain HTTP/1.1 for a channel whose endpoint is `http://`: the channel's own keep-alive
//! connections, each request written in one piece and its answer read with `httparse`.
//! A send through reqwest costs the send thread about twice the CPU (its request and
//! response types, the URL parsed again for every answer, its pool's bookkeeping); HTTPS
//! endpoints, endpoints with credentials in their URL and lookups still go through it
//! (`http`).
//!
//! Held to the same rules as `http::transmit`: the URL's host is checked against
//! `outbox.allowed_hosts` before anything is sent, a name's addresses are filtered as the
//! guarded resolver filters them, and every failure is described by its phase. A request
//! whose write failed before its first byte left, on a pooled connection the provider had
//! closed, goes out once more on a new one: nothing of it was sent. Once a byte is written,
//! nothing is sent again.
//!
//! The transport sets the framing and routing headers (`content-length`, `connection`,
//! `transfer-encoding`, `te`, `trailer`, `upgrade`, `keep-alive`): a channel's own value of
//! one of them is not sent. A channel's `Host` header replaces the URL's.

#[cfg(test)]
use super::http::AGENT;
use super::http::{
    method_and_headers, refusal_phase, Outgoing, Transmission, RESPONSE_MEMORY_BYTES,
};
use super::json_pointer::body_pointer;
use super::options::ExternalIdSource;
use super::pool_budget::IDLE_LIFE;
use crate::allow_list::{self, AllowList};
use crate::classify::Phase;
use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Most bytes of an answer's status line and headers.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most header fields of an answer.
const MAX_HEADERS: usize = 100;
/// Longest line of a chunked body's framing (a chunk's size and its extensions).
const MAX_CHUNK_LINE: usize = 4096;
/// The error of a request that ran out of its channel's `timeout_ms`.
const TIMED_OUT: &str = "operation timed out";
/// Headers the transport writes itself (see the module's documentation).
const TRANSPORT_HEADERS: &[&str] = &[
    "content-length",
    "connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "keep-alive",
];

/// Where an `http://` endpoint's requests go.
#[derive(Debug, Clone, PartialEq)]
pub struct Endpoint {
    url: url::Url,
    /// The `Host` header: the URL's host, and its port when it is not 80.
    host_header: String,
    /// The host to resolve or the address literal, without brackets.
    host: String,
    port: u16,
    /// The request target: the path and the query.
    target: String,
}

impl Endpoint {
    /// The endpoint of `url`, if this transport sends to it: `http://`, a host, no
    /// credentials in the URL.
    pub fn of(url: &url::Url) -> Option<Endpoint> {
        if url.scheme() != "http" || !url.username().is_empty() || url.password().is_some() {
            return None;
        }
        let host = url.host_str()?;
        let port = url.port_or_known_default()?;
        let host_header = match url.port() {
            Some(p) => format!("{host}:{p}"),
            None => host.to_string(),
        };
        let mut target = url.path().to_string();
        if let Some(q) = url.query() {
            target.push('?');
            target.push_str(q);
        }
        Some(Endpoint {
            url: url.clone(),
            host_header,
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port,
            target,
        })
    }
}

/// The bytes of `out` as one HTTP/1.1 request to `endpoint`; `Err` is why it cannot be sent,
/// worded as `http::transmit` words it.
pub fn encode(endpoint: &Endpoint, out: &Outgoing) -> Result<Vec<u8>, String> {
    let (method, headers) = method_and_headers(out)?;
    let mut bytes = Vec::with_capacity(256 + out.body.len());
    bytes.extend_from_slice(method.as_str().as_bytes());
    bytes.push(b' ');
    bytes.extend_from_slice(endpoint.target.as_bytes());
    bytes.extend_from_slice(b" HTTP/1.1\r\n");
    if !headers.contains_key(reqwest::header::HOST) {
        bytes.extend_from_slice(b"host: ");
        bytes.extend_from_slice(endpoint.host_header.as_bytes());
        bytes.extend_from_slice(b"\r\n");
    }
    for (name, value) in &headers {
        if TRANSPORT_HEADERS.contains(&name.as_str()) {
            continue;
        }
        bytes.extend_from_slice(name.as_str().as_bytes());
        bytes.extend_from_slice(b": ");
        bytes.extend_from_slice(value.as_bytes());
        bytes.extend_from_slice(b"\r\n");
    }
    bytes.extend_from_slice(format!("content-length: {}\r\n\r\n", out.body.len()).as_bytes());
    bytes.extend_from_slice(out.body.as_bytes());
    Ok(bytes)
}

/// How an answer's body is delimited (RFC 9112, section 6.3).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Framing {
    /// No body: a `HEAD` request, or a 1xx, 204 or 304 answer.
    Empty,
    Length(u64),
    Chunked,
    /// Until the provider closes the connection.
    UntilClose,
}

/// What an answer's status line and headers say.
#[derive(Debug, Clone, PartialEq)]
pub struct Head {
    pub status: u16,
    pub retry_after: Option<String>,
    /// The value of the header the channel reads its external id from.
    pub external_id: Option<String>,
    pub framing: Framing,
    /// The connection may carry another request once this body is read.
    pub keep_alive: bool,
}

/// A header's value as text: visible ASCII (and tabs) only, trimmed; as `http::header` reads it.
fn text(value: &[u8]) -> Option<String> {
    value
        .iter()
        .all(|&b| b == b'\t' || (0x20..0x7f).contains(&b))
        .then(|| String::from_utf8_lossy(value).trim().to_string())
}

/// Whether a comma-separated header value holds `token` (case-insensitive).
fn has_token(value: &[u8], token: &str) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// Parses an answer's head at the start of `buf`: `Ok(None)` when more bytes are needed,
/// else the head and its length. `head_request`: the request was a `HEAD`; `id_header`:
/// the header the external id is read from, if any.
pub fn parse_head(
    buf: &[u8],
    head_request: bool,
    id_header: Option<&str>,
) -> Result<Option<(Head, usize)>, String> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut fields);
    let length = match response.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD_BYTES => {
            return Err(format!(
                "the answer's head is longer than {MAX_HEAD_BYTES} bytes"
            ))
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(format!("the answer is not HTTP/1.1: {e}")),
    };
    let status = response.code.unwrap_or(0);
    let http10 = response.version == Some(0);
    let (mut retry_after, mut external_id) = (None, None);
    let (mut content_length, mut chunked, mut transfer_encoded) = (None::<u64>, false, false);
    let (mut close, mut keep_alive_token) = (false, false);
    for h in response.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("content-length") {
            let n = std::str::from_utf8(h.value)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .ok_or_else(|| "the answer's content-length is not a number".to_string())?;
            if content_length.is_some_and(|m| m != n) {
                return Err("the answer has two different content-lengths".into());
            }
            content_length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            transfer_encoded = true;
            // Only the last coding says whether the body is chunked.
            chunked = h
                .value
                .rsplit(|&b| b == b',')
                .next()
                .is_some_and(|t| t.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if name.eq_ignore_ascii_case("connection") {
            close |= has_token(h.value, "close");
            keep_alive_token |= has_token(h.value, "keep-alive");
        } else if name.eq_ignore_ascii_case("retry-after") {
            retry_after = retry_after.or_else(|| text(h.value));
        }
        if id_header.is_some_and(|want| name.eq_ignore_ascii_case(want)) && external_id.is_none() {
            external_id = text(h.value);
        }
    }
    let framing = if head_request || (100..200).contains(&status) || status == 204 || status == 304
    {
        Framing::Empty
    } else if transfer_encoded {
        if chunked {
            Framing::Chunked
        } else {
            Framing::UntilClose
        }
    } else if let Some(n) = content_length {
        Framing::Length(n)
    } else {
        Framing::UntilClose
    };
    // An answer framed both ways is read by its chunks, and its connection is not trusted
    // with another request (RFC 9112, section 6.3).
    let framed_twice = transfer_encoded && content_length.is_some();
    let keep_alive = !close
        && !framed_twice
        && (!http10 || keep_alive_token)
        && framing != Framing::UntilClose
        && status != 101;
    Ok(Some((
        Head {
            status,
            retry_after,
            external_id,
            framing,
            keep_alive,
        },
        length,
    )))
}

/// A chunked body's decoding, fed the bytes as they arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Chunk {
    /// Reading a chunk's size line.
    Size,
    /// This many bytes of the chunk's data are still to come.
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    /// The trailer section, after the last chunk.
    Trailer,
    Done,
}

/// Takes what it can from `buf` for a chunked body: data into `body`; returns the bytes
/// consumed. `Err` when the framing is broken.
fn dechunk(state: &mut Chunk, buf: &[u8], body: &mut Vec<u8>) -> Result<usize, String> {
    let mut at = 0;
    loop {
        let rest = &buf[at..];
        match *state {
            Chunk::Done => return Ok(at),
            Chunk::Data(0) => *state = Chunk::DataEnd,
            Chunk::Data(n) => {
                if rest.is_empty() {
                    return Ok(at);
                }
                let take = rest.len().min(n.min(usize::MAX as u64) as usize);
                body.extend_from_slice(&rest[..take]);
                at += take;
                *state = Chunk::Data(n - take as u64);
            }
            Chunk::DataEnd => {
                if rest.len() < 2 {
                    return Ok(at);
                }
                if &rest[..2] != b"\r\n" {
                    return Err("a chunk of the answer's body does not end with CRLF".into());
                }
                at += 2;
                *state = Chunk::Size;
            }
            Chunk::Size | Chunk::Trailer => {
                let Some(end) = rest.windows(2).position(|w| w == b"\r\n") else {
                    if rest.len() > MAX_CHUNK_LINE {
                        return Err("a line of the answer's chunked body is too long".into());
                    }
                    return Ok(at);
                };
                let line = &rest[..end];
                at += end + 2;
                if *state == Chunk::Trailer {
                    if line.is_empty() {
                        *state = Chunk::Done;
                    }
                    continue;
                }
                let size = line
                    .split(|&b| b == b';')
                    .next()
                    .unwrap_or(b"")
                    .trim_ascii();
                let n = std::str::from_utf8(size)
                    .ok()
                    .filter(|s| !s.is_empty() && s.len() <= 16)
                    .and_then(|s| u64::from_str_radix(s, 16).ok())
                    .ok_or_else(|| {
                        "a chunk size of the answer's body is not hexadecimal".to_string()
                    })?;
                *state = if n == 0 {
                    Chunk::Trailer
                } else {
                    Chunk::Data(n)
                };
            }
        }
    }
}

/// Whether an idle connection can carry a request: nothing to read on it, not even its
/// end. Asked of the socket itself (a peek that does not wait), not of the runtime's
/// record of its readiness, which learns of a close only at its next look at the sockets.
fn still_open(stream: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut probe = [0u8; 1];
    // SAFETY: reads at most one byte into a live buffer, without consuming it or waiting.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            probe.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock
}

/// One connection: its socket and the bytes read past what was parsed.
struct Connection {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Connection {
    /// Reads more into `buf`; `Ok(0)` at the end of the stream.
    async fn fill(&mut self) -> std::io::Result<usize> {
        self.buf.reserve(8192);
        self.stream.read_buf(&mut self.buf).await
    }
}

/// An idle connection and since when.
struct Idle {
    connection: Connection,
    since: Instant,
}

/// One `http://` channel in one worker: its endpoint, and the connections to its host and
/// port, which every channel to that origin built alike shares (`Origins`).
pub struct Wire {
    endpoint: Endpoint,
    origin: Arc<Origin>,
}

/// The connections of a worker to one host and port: 10,000 channels to one provider's
/// host send over its warm connections, not over 10,000 connections of their own.
pub struct Origin {
    host: String,
    port: u16,
    connect_timeout: Duration,
    /// Idle connections kept at most.
    max_idle: usize,
    idle: Mutex<VecDeque<Idle>>,
    reaper: AtomicBool,
}

/// What makes two channels' origins one: the host and port, and how connections to them are
/// made and kept.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct OriginKey {
    host: String,
    port: u16,
    connect_timeout: Duration,
    max_idle: usize,
}

/// The origins of a worker's `http://` channels, while a channel uses them: channels built
/// alike to one host and port share one. A change of `outbox.allowed_hosts` drops them all
/// (the connections were made under the old list).
#[derive(Default)]
pub struct Origins(std::collections::HashMap<OriginKey, Weak<Origin>>);

impl Origins {
    /// The connections to `key`'s origin: those in use, or new ones.
    pub fn get(&mut self, key: OriginKey) -> Arc<Origin> {
        if let Some(origin) = self.0.get(&key).and_then(Weak::upgrade) {
            return origin;
        }
        let origin = Arc::new(Origin::new(key.clone()));
        self.0.insert(key, Arc::downgrade(&origin));
        origin
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// Lets go of the origins whose channels are gone.
    pub fn let_go(&mut self) {
        self.0.retain(|_, o| o.strong_count() > 0);
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Why a request ended without an answer.
struct Failure {
    phase: Phase,
    timed_out: bool,
    error: String,
}

impl Failure {
    fn new(phase: Phase, timed_out: bool, error: impl Into<String>) -> Failure {
        Failure {
            phase,
            timed_out,
            error: error.into(),
        }
    }
}

/// A connection could not be had: refused by the list, or failed.
enum NoConnection {
    Refused(allow_list::Refusal),
    Failed(Failure),
}

impl Wire {
    /// A channel's wire with connections of its own.
    pub fn new(endpoint: Endpoint, connect_timeout: Duration, max_idle: usize) -> Wire {
        let origin = Arc::new(Origin::new(Wire::origin_key(
            &endpoint,
            connect_timeout,
            max_idle,
        )));
        Wire { endpoint, origin }
    }

    /// A channel's wire over the connections of `origin` (of the same host and port).
    pub fn on(endpoint: Endpoint, origin: Arc<Origin>) -> Wire {
        Wire { endpoint, origin }
    }

    pub fn origin_key(
        endpoint: &Endpoint,
        connect_timeout: Duration,
        max_idle: usize,
    ) -> OriginKey {
        OriginKey {
            host: endpoint.host.clone(),
            port: endpoint.port,
            connect_timeout,
            max_idle,
        }
    }

    /// The idle connections now.
    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.origin.idle_count()
    }
}

impl Origin {
    pub fn new(key: OriginKey) -> Origin {
        Origin {
            host: key.host,
            port: key.port,
            connect_timeout: key.connect_timeout,
            max_idle: key.max_idle,
            idle: Mutex::new(VecDeque::new()),
            reaper: AtomicBool::new(false),
        }
    }

    /// The idle connections now.
    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.idle.lock().map(|i| i.len()).unwrap_or(0)
    }

    /// The most recently used idle connection that is still open, the others past their
    /// idle life closed.
    fn take_idle(&self) -> Option<Connection> {
        let mut idle = self.idle.lock().ok()?;
        while let Some(Idle { connection, since }) = idle.pop_back() {
            if since.elapsed() >= IDLE_LIFE {
                idle.clear();
                return None;
            }
            if still_open(&connection.stream) {
                return Some(connection);
            }
        }
        None
    }

    /// Closes the idle connections past their idle life.
    fn close_expired(&self) {
        if let Ok(mut idle) = self.idle.lock() {
            idle.retain(|i| i.since.elapsed() < IDLE_LIFE);
        }
    }

    fn put_idle(&self, connection: Connection) {
        if let Ok(mut idle) = self.idle.lock() {
            while idle.front().is_some_and(|i| i.since.elapsed() >= IDLE_LIFE) {
                idle.pop_front();
            }
            if idle.len() < self.max_idle {
                idle.push_back(Idle {
                    connection,
                    since: Instant::now(),
                });
            }
        }
    }

    /// Closes the connections idle for their whole life, once per idle life, for as long as
    /// a channel uses the origin (a task on the send runtime, started by the first request).
    fn start_reaper(self: &Arc<Self>) {
        if self.reaper.swap(true, Ordering::Relaxed) {
            return;
        }
        let wire: Weak<Origin> = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(IDLE_LIFE).await;
                let Some(wire) = wire.upgrade() else { return };
                wire.close_expired();
            }
        });
    }

    /// A new connection: the host resolved (a literal is not) and its addresses filtered by
    /// the list, then each tried in turn within the connect timeout.
    async fn connect(&self, allowed: &AllowList) -> Result<Connection, NoConnection> {
        let host = &self.host;
        let addresses: Vec<SocketAddr> = match host.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, self.port)],
            Err(_) => {
                let found = tokio::net::lookup_host((host.as_str(), self.port))
                    .await
                    .map_err(|e| {
                        NoConnection::Failed(Failure::new(
                            Phase::Dns,
                            false,
                            format!("dns error: failed to lookup address for {host}: {e}"),
                        ))
                    })?;
                allow_list::filter_resolved(allowed, host, found).map_err(NoConnection::Refused)?
            }
        };
        let mut last = Failure::new(
            Phase::Dns,
            false,
            format!("dns error: no addresses for {host}"),
        );
        for address in addresses {
            match tokio::time::timeout(self.connect_timeout, TcpStream::connect(address)).await {
                Ok(Ok(stream)) => {
                    let _ = stream.set_nodelay(true);
                    return Ok(Connection {
                        stream,
                        buf: Vec::new(),
                    });
                }
                Ok(Err(e)) => {
                    last = Failure::new(
                        Phase::Connect,
                        false,
                        format!("tcp connect error: {address}: {e}"),
                    )
                }
                Err(_) => {
                    last = Failure::new(
                        Phase::Connect,
                        true,
                        format!("tcp connect error: {address}: connect timed out"),
                    )
                }
            }
        }
        Err(NoConnection::Failed(last))
    }
}

/// Writes `request`: `Err` with whether any of it was written.
async fn write(connection: &mut Connection, request: &[u8]) -> Result<(), (bool, std::io::Error)> {
    let mut written = 0;
    while written < request.len() {
        match connection.stream.write(&request[written..]).await {
            Ok(0) => {
                return Err((
                    written > 0,
                    std::io::Error::new(
                        std::io::ErrorKind::WriteZero,
                        "the connection took no bytes",
                    ),
                ))
            }
            Ok(n) => written += n,
            Err(e) => return Err((written > 0, e)),
        }
    }
    Ok(())
}

/// Reads the answer's final head (1xx interim answers skipped).
async fn read_head(
    connection: &mut Connection,
    head_request: bool,
    id_header: Option<&str>,
) -> Result<Head, String> {
    loop {
        if !connection.buf.is_empty() {
            if let Some((head, length)) = parse_head(&connection.buf, head_request, id_header)? {
                connection.buf.drain(..length);
                if (100..200).contains(&head.status) && head.status != 101 {
                    continue;
                }
                return Ok(head);
            }
        }
        match connection.fill().await {
            Ok(0) if connection.buf.is_empty() => {
                return Err("connection closed before an answer".into())
            }
            Ok(0) => return Err("connection closed in the middle of the answer's head".into()),
            Ok(_) => {}
            Err(e) => return Err(format!("reading the answer: {e}")),
        }
    }
}

/// Reads at most `limit` bytes of the body into `body`: whether it went on past the limit,
/// an error, and whether the connection may carry another request.
async fn read_body(
    connection: &mut Connection,
    framing: Framing,
    limit: usize,
    body: &mut Vec<u8>,
) -> (bool, Option<String>, bool) {
    let mut chunk = Chunk::Size;
    let mut left = match framing {
        Framing::Empty => return (false, None, connection.buf.is_empty()),
        Framing::Length(n) => n,
        _ => u64::MAX,
    };
    loop {
        // What has arrived.
        match framing {
            Framing::Chunked => match dechunk(&mut chunk, &connection.buf, body) {
                Ok(used) => {
                    connection.buf.drain(..used);
                }
                Err(e) => return (false, Some(e), false),
            },
            _ => {
                let take = connection
                    .buf
                    .len()
                    .min(left.min(usize::MAX as u64) as usize);
                body.extend(connection.buf.drain(..take));
                left -= take as u64;
            }
        }
        if body.len() > limit {
            body.truncate(limit);
            return (true, None, false);
        }
        let complete = match framing {
            Framing::Chunked => chunk == Chunk::Done,
            Framing::Length(_) => left == 0,
            _ => false,
        };
        if complete {
            return (false, None, connection.buf.is_empty());
        }
        match connection.fill().await {
            Ok(0) if framing == Framing::UntilClose => return (false, None, false),
            Ok(0) => {
                return (
                    false,
                    Some("connection closed before the body ended".into()),
                    false,
                )
            }
            Ok(_) => {}
            Err(e) => return (false, Some(e.to_string()), false),
        }
    }
}

/// How long a read of the answer whose deadline has passed still waits for what already
/// arrived. A worker that was stopped (a paused VM, `kill -STOP`) while its provider
/// answered finds, when it runs again, the answer in the socket and the deadline passed at
/// the same instant; the timer must not win that race and turn an answer into a timeout.
/// A read that has nothing waiting ends after this grace, as timed out.
const ARRIVED_GRACE: Duration = Duration::from_millis(10);

/// `read` until `deadline`, then for [`ARRIVED_GRACE`] more.
async fn answer_within<F: std::future::Future>(
    deadline: tokio::time::Instant,
    read: F,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    let mut read = std::pin::pin!(read);
    match tokio::time::timeout_at(deadline, &mut read).await {
        Ok(answer) => Ok(answer),
        Err(_) => tokio::time::timeout(ARRIVED_GRACE, &mut read).await,
    }
}

/// Sends one request on `wire` and reads its answer, as `http::transmit` does.
/// Tests only: for each request written, the time from the fence's check to the end of the
/// write of the whole request, in µs (the window `fence` cannot close, measured).
#[cfg(test)]
pub(crate) static CHECK_TO_WRITTEN_US: Mutex<Vec<u64>> = Mutex::new(Vec::new());

pub async fn transmit(wire: Arc<Wire>, out: Outgoing, allowed: Arc<AllowList>) -> Transmission {
    let request = match encode(&wire.endpoint, &out) {
        Ok(r) => r,
        Err(error) => return Transmission::NotSent { error },
    };
    if let Err(refusal) = allow_list::check_url(&allowed, &wire.endpoint.url) {
        return Transmission::Refused {
            phase: refusal_phase(&refusal),
            error: refusal.to_string(),
            elapsed_ms: 0,
        };
    }
    wire.origin.start_reaper();
    let started = Instant::now();
    let elapsed = || started.elapsed().as_millis() as u64;
    let deadline = tokio::time::Instant::now() + out.timeout;
    let failed = |f: Failure, elapsed_ms: u64| Transmission::Failed {
        phase: f.phase,
        timed_out: f.timed_out,
        error: f.error,
        elapsed_ms,
    };
    let timed_out = |phase: Phase| Failure::new(phase, true, TIMED_OUT);
    let mut pooled = wire.origin.take_idle();
    let mut connection = loop {
        let (mut connection, reused) = match pooled.take() {
            Some(c) => (c, true),
            None => match tokio::time::timeout_at(deadline, wire.origin.connect(&allowed)).await {
                Ok(Ok(c)) => (c, false),
                Ok(Err(NoConnection::Refused(refusal))) => {
                    return Transmission::Refused {
                        phase: refusal_phase(&refusal),
                        error: refusal.to_string(),
                        elapsed_ms: elapsed(),
                    }
                }
                Ok(Err(NoConnection::Failed(f))) => return failed(f, elapsed()),
                Err(_) => return failed(timed_out(Phase::Connect), elapsed()),
            },
        };
        // The last moment before the first byte: an attempt whose lease ran out meanwhile
        // (its worker was stopped) is not started (`fence`).
        if out.fence.passed() {
            return Transmission::Fenced {
                error: super::fence::not_sent_text(&out.fence),
            };
        }
        #[cfg(test)]
        let checked = Instant::now();
        match tokio::time::timeout_at(deadline, write(&mut connection, &request)).await {
            Ok(Ok(())) => {
                #[cfg(test)]
                CHECK_TO_WRITTEN_US
                    .lock()
                    .unwrap()
                    .push(checked.elapsed().as_micros() as u64);
                break connection;
            }
            // A pooled connection the provider had closed, and nothing of the request left.
            Ok(Err((false, _))) if reused => continue,
            Ok(Err((_, e))) => {
                return failed(
                    Failure::new(Phase::Send, false, format!("writing the request: {e}")),
                    elapsed(),
                )
            }
            Err(_) => return failed(timed_out(Phase::Send), elapsed()),
        }
    };
    let id_header = match &out.external_id {
        Some(ExternalIdSource::Header(name)) => Some(name.as_str()),
        _ => None,
    };
    let head_request = out.method.eq_ignore_ascii_case("HEAD");
    let head = match answer_within(
        deadline,
        read_head(&mut connection, head_request, id_header),
    )
    .await
    {
        Ok(Ok(head)) => head,
        Ok(Err(e)) => return failed(Failure::new(Phase::Wait, false, e), elapsed()),
        Err(_) => return failed(timed_out(Phase::Wait), elapsed()),
    };
    let limit = out.max_response_bytes.clamp(1, RESPONSE_MEMORY_BYTES);
    let mut body = Vec::new();
    let (over_limit, read_error, reusable) = {
        let _room = super::http::response_room(limit).await;
        let read = read_body(&mut connection, head.framing, limit, &mut body);
        match answer_within(deadline, read).await {
            Ok(read) => read,
            Err(_) => (false, Some(TIMED_OUT.to_string()), false),
        }
    };
    if reusable && head.keep_alive && read_error.is_none() && !over_limit {
        wire.origin.put_idle(connection);
    }
    let external_id = match &out.external_id {
        Some(ExternalIdSource::Header(_)) => head.external_id,
        Some(ExternalIdSource::Body(pointer)) => body_pointer(&body, pointer),
        None => None,
    };
    let body_error = match (&read_error, over_limit) {
        (Some(e), _) if e == TIMED_OUT => Some(format!("read timed out: {e}")),
        (Some(e), _) => Some(format!("read failed: {e}")),
        (None, true) => Some(format!(
            "body longer than max_response_bytes ({}); the rest was not read",
            out.max_response_bytes
        )),
        (None, false) => None,
    };
    let excerpt = super::answer_excerpt::excerpt(
        head.status,
        &body,
        out.excerpt_bytes,
        &out.url,
        &out.headers,
    );
    Transmission::Answered {
        status: head.status,
        retry_after: head.retry_after,
        external_id,
        body_complete: read_error.is_none(),
        body_error,
        excerpt,
        elapsed_ms: elapsed(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_to_one_origin_share_its_connections_while_one_uses_them() {
        let mut t = Origins::default();
        let key = |url: &str| {
            let e = Endpoint::of(&url::Url::parse(url).unwrap()).unwrap();
            Wire::origin_key(&e, Duration::from_secs(3), 200)
        };
        let a = t.get(key("http://10.0.0.1:8080/ch/a"));
        let b = t.get(key("http://10.0.0.1:8080/ch/b?x=1"));
        let other = t.get(key("http://10.0.0.1:8081/ch/a"));
        assert!(
            Arc::ptr_eq(&a, &b),
            "one host and port, two paths: one origin"
        );
        assert!(!Arc::ptr_eq(&a, &other));
        drop((a, other));
        t.let_go();
        assert_eq!(t.len(), 1, "b still uses the first");
        drop(b);
        t.let_go();
        assert!(t.is_empty());
    }
    use std::io::{Read, Write};
    use std::sync::atomic::AtomicUsize;

    fn endpoint(url: &str) -> Endpoint {
        Endpoint::of(&url::Url::parse(url).unwrap()).unwrap()
    }

    fn outgoing(headers: &[(&str, &str)]) -> Outgoing {
        Outgoing {
            channel_id: 1,
            method: "POST".into(),
            url: String::new(),
            parsed_url: None,
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            body: r#"{"a":1}"#.into(),
            timeout: Duration::from_secs(2),
            external_id: None,
            max_response_bytes: 65536,
            excerpt_bytes: 1024,
            fence: crate::channels::fence::Fence::open(),
        }
    }

    fn head(text: &str) -> Head {
        parse_head(text.as_bytes(), false, Some("x-id"))
            .unwrap()
            .unwrap()
            .0
    }

    #[test]
    fn an_endpoint_is_an_http_url_with_a_host_and_no_credentials() {
        let e = endpoint("http://api.example.com/send?k=1#frag");
        assert_eq!(
            (
                e.host.as_str(),
                e.port,
                e.host_header.as_str(),
                e.target.as_str()
            ),
            ("api.example.com", 80, "api.example.com", "/send?k=1")
        );
        let e = endpoint("http://[::1]:8080");
        assert_eq!(
            (
                e.host.as_str(),
                e.port,
                e.host_header.as_str(),
                e.target.as_str()
            ),
            ("::1", 8080, "[::1]:8080", "/")
        );
        for other in [
            "https://h/x",
            "http://u:p@h/x",
            "http://u@h/x",
            "unix:/run/x",
        ] {
            assert_eq!(
                Endpoint::of(&url::Url::parse(other).unwrap()),
                None,
                "{other}"
            );
        }
    }

    #[test]
    fn a_request_is_written_whole_with_the_channels_headers_over_the_defaults() {
        let e = endpoint("http://127.0.0.1:9/ch/x?y=2");
        let bytes = encode(
            &e,
            &outgoing(&[
                ("Content-Type", "application/vnd+json"),
                ("Idempotency-Key", "k-1"),
                ("Content-Length", "999"),
                ("Connection", "close"),
                ("X-Two", "first"),
                ("x-two", "second"),
            ]),
        )
        .unwrap();
        let text = String::from_utf8(bytes).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let lines: Vec<&str> = head.split("\r\n").collect();
        assert_eq!(lines[0], "POST /ch/x?y=2 HTTP/1.1");
        assert_eq!(lines[1], "host: 127.0.0.1:9");
        let mut rest = lines[2..].to_vec();
        rest.sort();
        assert_eq!(
            rest,
            [
                "content-length: 7",
                "content-type: application/vnd+json",
                "idempotency-key: k-1",
                &format!("user-agent: {AGENT}"),
                "x-two: second",
            ]
        );
        assert_eq!(body, r#"{"a":1}"#);
        let own_host = encode(&e, &outgoing(&[("Host", "api.internal")])).unwrap();
        let own_host = String::from_utf8(own_host).unwrap();
        assert!(
            own_host.contains("\r\nhost: api.internal\r\n"),
            "{own_host}"
        );
        assert_eq!(own_host.matches("host:").count(), 1, "{own_host}");
    }

    #[test]
    fn a_request_http_cannot_carry_is_not_sent() {
        let e = endpoint("http://h/x");
        assert_eq!(
            encode(&e, &outgoing(&[("bad name", "v")])),
            Err("header name \"bad name\" is not valid HTTP".into())
        );
        assert_eq!(
            encode(&e, &outgoing(&[("X-Split", "a\r\nX-Injected: 1")])),
            Err("header \"X-Split\" has a value HTTP cannot carry".into())
        );
        let mut bad_method = outgoing(&[]);
        bad_method.method = "PO ST".into();
        assert!(encode(&e, &bad_method)
            .unwrap_err()
            .starts_with("method PO ST"));
    }

    #[test]
    fn a_head_says_how_its_body_ends_and_whether_the_connection_stays() {
        let h = head(
            "HTTP/1.1 200 OK\r\nContent-Length: 12\r\nRetry-After:  30 \r\nX-ID: ext-7\r\n\r\n",
        );
        assert_eq!(
            h,
            Head {
                status: 200,
                retry_after: Some("30".into()),
                external_id: Some("ext-7".into()),
                framing: Framing::Length(12),
                keep_alive: true,
            }
        );
        let cases: &[(&str, Framing, bool)] = &[
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                Framing::Chunked,
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
                Framing::UntilClose,
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 5\r\n\r\n",
                Framing::Chunked,
                false,
            ),
            ("HTTP/1.1 200 OK\r\n\r\n", Framing::UntilClose, false),
            (
                "HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n",
                Framing::Empty,
                true,
            ),
            ("HTTP/1.1 304 Not Modified\r\n\r\n", Framing::Empty, true),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: Close\r\n\r\n",
                Framing::Length(0),
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: upgrade, close\r\n\r\n",
                Framing::Length(0),
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n",
                Framing::Length(0),
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\nContent-Length: 0\r\nConnection: keep-alive\r\n\r\n",
                Framing::Length(0),
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\n",
                Framing::Length(3),
                true,
            ),
        ];
        for (text, framing, keep_alive) in cases {
            let h = head(text);
            assert_eq!(
                (h.framing, h.keep_alive),
                (*framing, *keep_alive),
                "{text:?}"
            );
        }
        let (h, _) = parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", true, None)
            .unwrap()
            .unwrap();
        assert_eq!(
            h.framing,
            Framing::Empty,
            "the answer to a HEAD has no body"
        );
    }

    #[test]
    fn a_head_is_parsed_once_complete_and_refused_when_broken() {
        let full = b"HTTP/1.1 503 Busy\r\nRetry-After: 5\r\nContent-Length: 2\r\n\r\nok";
        for cut in 0..full.len() - 2 {
            assert_eq!(
                parse_head(&full[..cut], false, None),
                Ok(None),
                "cut at {cut}"
            );
        }
        let (h, length) = parse_head(full, false, None).unwrap().unwrap();
        assert_eq!((h.status, length), (503, full.len() - 2));
        for broken in [
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: three\r\n\r\n",
            "SSH-2.0-OpenSSH\r\n\r\n",
        ] {
            assert!(
                parse_head(broken.as_bytes(), false, None).is_err(),
                "{broken:?}"
            );
        }
        let endless = format!("HTTP/1.1 200 OK\r\nX-Long: {}", "a".repeat(MAX_HEAD_BYTES));
        assert!(parse_head(endless.as_bytes(), false, None).is_err());
        let non_ascii = head("HTTP/1.1 200 OK\r\nX-ID: caf\u{e9}\r\nContent-Length: 0\r\n\r\n");
        assert_eq!(non_ascii.external_id, None);
    }

    #[test]
    fn a_chunked_body_decodes_the_same_whole_or_byte_by_byte() {
        let wire = b"4;ext=1\r\nWiki\r\n5\r\npedia\r\nE\r\n in\r\n\r\nchunks.\r\n0\r\nX-Trailer: t\r\n\r\n";
        let mut state = Chunk::Size;
        let mut body = Vec::new();
        assert_eq!(dechunk(&mut state, wire, &mut body), Ok(wire.len()));
        assert_eq!(
            (state, body.as_slice()),
            (Chunk::Done, &b"Wikipedia in\r\n\r\nchunks."[..])
        );

        let mut state = Chunk::Size;
        let mut body = Vec::new();
        let mut pending: Vec<u8> = Vec::new();
        for &b in wire.iter() {
            pending.push(b);
            let used = dechunk(&mut state, &pending, &mut body).unwrap();
            pending.drain(..used);
        }
        assert_eq!(
            (state, body.as_slice()),
            (Chunk::Done, &b"Wikipedia in\r\n\r\nchunks."[..])
        );
        assert!(pending.is_empty());

        for broken in [&b"zz\r\n"[..], b"4\r\nWikiXX", b"\r\n"] {
            let mut state = Chunk::Size;
            assert!(
                dechunk(&mut state, broken, &mut Vec::new()).is_err(),
                "{broken:?}"
            );
        }
    }

    /// What the scripted provider does with the `n`th request of its `c`th connection.
    enum Act {
        Answer(&'static str),
        AnswerAndClose(&'static str),
        /// Reads the request and closes without answering.
        Close,
        /// Reads the request and never answers.
        Hang,
    }

    /// A provider on a port of its own: each connection's requests are answered by `script`;
    /// counts the connections it accepted.
    fn provider(script: fn(usize, usize) -> Act) -> (u16, Arc<AtomicUsize>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        std::thread::spawn(move || {
            for (c, stream) in listener.incoming().enumerate() {
                let Ok(mut stream) = stream else { return };
                count.fetch_add(1, Ordering::SeqCst);
                std::thread::spawn(move || {
                    for n in 0.. {
                        // The request: its head, then its content-length of body.
                        let mut got = Vec::new();
                        let mut byte = [0u8; 1];
                        while !got.ends_with(b"\r\n\r\n") {
                            if stream.read(&mut byte).unwrap_or(0) == 0 {
                                // The client closed: the connection is closed a little later.
                                std::thread::sleep(Duration::from_millis(300));
                                return;
                            }
                            got.push(byte[0]);
                        }
                        let text = String::from_utf8_lossy(&got).to_lowercase();
                        let length: usize = text
                            .split("content-length: ")
                            .nth(1)
                            .and_then(|r| r.split("\r\n").next())
                            .and_then(|v| v.parse().ok())
                            .unwrap_or(0);
                        let mut body = vec![0u8; length];
                        stream.read_exact(&mut body).unwrap();
                        match script(c, n) {
                            Act::Answer(a) => stream.write_all(a.as_bytes()).unwrap(),
                            Act::AnswerAndClose(a) => {
                                stream.write_all(a.as_bytes()).unwrap();
                                return;
                            }
                            Act::Close => return,
                            Act::Hang => std::thread::sleep(Duration::from_secs(30)),
                        }
                    }
                });
            }
        });
        (port, accepted)
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    fn wire_to(port: u16) -> Arc<Wire> {
        Arc::new(Wire::new(
            endpoint(&format!("http://127.0.0.1:{port}/send")),
            Duration::from_secs(1),
            8,
        ))
    }

    fn send(rt: &tokio::runtime::Runtime, wire: &Arc<Wire>, out: Outgoing) -> Transmission {
        let allowed = Arc::new(AllowList::parse("127.0.0.1").unwrap());
        rt.block_on(transmit(wire.clone(), out, allowed))
    }

    fn status(t: &Transmission) -> u16 {
        match t {
            Transmission::Answered { status, .. } => *status,
            other => panic!("expected an answer, got {other:?}"),
        }
    }

    fn failure(t: &Transmission) -> (Phase, bool, &str) {
        match t {
            Transmission::Failed {
                phase,
                timed_out,
                error,
                ..
            } => (*phase, *timed_out, error.as_str()),
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    const OK: &str = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";

    /// The window between the fence's check and the request's last byte written, over 2,000
    /// requests on loopback connections kept open: what a stop must hit to send an attempt
    /// after its fence. Printed with `--nocapture`; held far below the least margin (a lease
    /// is at least 5 s, its margin at least 1.25 s, `fence::margin_ms`).
    #[test]
    fn the_window_between_the_fence_check_and_the_written_request_is_microseconds() {
        let (port, _) = provider(|_, _| Act::Answer(OK));
        let (rt, wire) = (runtime(), wire_to(port));
        CHECK_TO_WRITTEN_US.lock().unwrap().clear();
        for _ in 0..2_000 {
            assert_eq!(status(&send(&rt, &wire, outgoing(&[]))), 200);
        }
        let mut us = CHECK_TO_WRITTEN_US.lock().unwrap().clone();
        us.sort_unstable();
        assert!(us.len() >= 2_000);
        let at = |q: f64| us[((us.len() - 1) as f64 * q) as usize];
        eprintln!(
            "fence check -> request written: p50 {} µs, p99 {} µs, max {} µs over {} requests",
            at(0.5),
            at(0.99),
            us[us.len() - 1],
            us.len()
        );
        assert!(at(0.99) < 10_000, "p99 {} µs", at(0.99));
        assert!(us[us.len() - 1] < 1_250_000, "max {} µs", us[us.len() - 1]);
    }

    #[test]
    fn requests_after_the_first_go_on_its_connection() {
        let (port, accepted) = provider(|_, _| Act::Answer(OK));
        let (rt, wire) = (runtime(), wire_to(port));
        for _ in 0..3 {
            assert_eq!(status(&send(&rt, &wire, outgoing(&[]))), 200);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        assert_eq!(wire.idle_count(), 1);
    }

    #[test]
    fn a_connection_the_provider_closed_while_idle_is_not_used_again() {
        let (port, accepted) = provider(|_, _| Act::AnswerAndClose(OK));
        let (rt, wire) = (runtime(), wire_to(port));
        for _ in 0..3 {
            assert_eq!(status(&send(&rt, &wire, outgoing(&[]))), 200);
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn a_request_that_could_not_leave_on_a_pooled_connection_goes_out_once_on_a_new_one() {
        static REQUESTS: AtomicUsize = AtomicUsize::new(0);
        let (port, accepted) = provider(|_, _| {
            REQUESTS.fetch_add(1, Ordering::SeqCst);
            Act::Answer(OK)
        });
        let (rt, wire) = (runtime(), wire_to(port));
        assert_eq!(status(&send(&rt, &wire, outgoing(&[]))), 200);
        {
            // The pooled connection still reads as open, but takes no byte any more.
            use std::os::fd::AsRawFd;
            let idle = wire.origin.idle.lock().unwrap();
            let fd = idle.back().unwrap().connection.stream.as_raw_fd();
            // SAFETY: shuts down the writing side of a socket the pool owns.
            assert_eq!(unsafe { libc::shutdown(fd, libc::SHUT_WR) }, 0);
        }
        assert_eq!(status(&send(&rt, &wire, outgoing(&[]))), 200);
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        assert_eq!(
            REQUESTS.load(Ordering::SeqCst),
            2,
            "each request reached the provider once"
        );
    }

    #[test]
    fn an_answer_that_says_close_leaves_its_connection_closed() {
        let (port, accepted) = provider(|_, _| {
            Act::Answer("HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
        });
        let (rt, wire) = (runtime(), wire_to(port));
        assert_eq!(status(&send(&rt, &wire, outgoing(&[]))), 200);
        assert_eq!(status(&send(&rt, &wire, outgoing(&[]))), 200);
        assert_eq!((accepted.load(Ordering::SeqCst), wire.idle_count()), (2, 0));
    }

    #[test]
    fn interim_answers_are_skipped_and_a_chunked_body_yields_its_external_id() {
        let (port, _) = provider(|_, _| {
            Act::Answer(
                "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 202 Accepted\r\nTransfer-Encoding: chunked\r\n\r\n6\r\n{\"id\":\r\n7\r\n\"m-42\"}\r\n0\r\n\r\n",
            )
        });
        let (rt, wire) = (runtime(), wire_to(port));
        let mut out = outgoing(&[]);
        out.external_id = Some(ExternalIdSource::Body("/id".into()));
        match send(&rt, &wire, out) {
            Transmission::Answered {
                status,
                external_id,
                body_complete,
                body_error,
                ..
            } => assert_eq!(
                (status, external_id.as_deref(), body_complete, body_error),
                (202, Some("m-42"), true, None)
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            wire.idle_count(),
            1,
            "a whole chunked body leaves the connection usable"
        );
    }

    #[test]
    fn a_body_past_the_limit_is_cut_and_its_connection_closed() {
        let (port, _) =
            provider(|_, _| Act::Answer("HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789"));
        let (rt, wire) = (runtime(), wire_to(port));
        let mut out = outgoing(&[]);
        out.max_response_bytes = 4;
        match send(&rt, &wire, out) {
            Transmission::Answered {
                status,
                body_complete,
                body_error,
                ..
            } => {
                assert_eq!((status, body_complete), (200, true));
                assert!(body_error
                    .unwrap()
                    .starts_with("body longer than max_response_bytes (4)"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(wire.idle_count(), 0);
    }

    #[test]
    fn a_provider_that_closes_or_hangs_after_the_request_is_a_failure_after_sending() {
        let rt = runtime();
        let (port, _) = provider(|_, _| Act::Close);
        let t = send(&rt, &wire_to(port), outgoing(&[]));
        let (phase, timed_out, error) = failure(&t);
        assert_eq!((phase, timed_out), (Phase::Wait, false), "{error}");
        assert!(phase.request_may_have_reached_provider());

        let (port, _) = provider(|_, _| Act::Hang);
        let mut out = outgoing(&[]);
        out.timeout = Duration::from_millis(200);
        let t = send(&rt, &wire_to(port), out);
        assert_eq!(failure(&t), (Phase::Wait, true, TIMED_OUT));
    }

    #[test]
    fn a_body_that_ends_early_is_an_answer_with_a_read_error() {
        let (port, _) = provider(|_, _| {
            Act::AnswerAndClose("HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234")
        });
        let (rt, wire) = (runtime(), wire_to(port));
        match send(&rt, &wire, outgoing(&[])) {
            Transmission::Answered {
                status,
                body_complete,
                body_error,
                ..
            } => {
                assert_eq!((status, body_complete), (200, false));
                assert!(body_error.unwrap().starts_with("read failed: "));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn nothing_listening_is_a_connect_failure_and_a_refused_host_sends_nothing() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let rt = runtime();
        let (phase, timed_out, _) = failure(&send(&rt, &wire_to(port), outgoing(&[])));
        assert_eq!((phase, timed_out), (Phase::Connect, false));
        assert!(!phase.request_may_have_reached_provider());

        let (port, accepted) = provider(|_, _| Act::Answer(OK));
        let only_other = Arc::new(AllowList::parse("api.example.com").unwrap());
        match rt.block_on(transmit(wire_to(port), outgoing(&[]), only_other)) {
            Transmission::Refused { .. } => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 0);
    }
}
