//! The provider simulator: a scriptable HTTP/1.1 server on loopback that plays the
//! external provider in the extension's end-to-end tests and in the demo.
//!
//! The HTTP handling is written by hand on [`tokio::net::TcpListener`] so that the
//! simulator has full control over each connection: it can answer, answer late, never
//! answer, or reset the connection after having read (and possibly processed) a request.
//!
//! # Usage
//!
//! ```no_run
//! use outbox_e2e::sim::{Action, Simulator};
//! use std::time::Duration;
//!
//! let sim = Simulator::start();
//! sim.set_plan("mail", vec![Action::Status(503), Action::Status(503)]); // then Accept
//! let url = sim.send_url("mail"); // POST here
//! // ... let the worker deliver ...
//! assert!(sim.wait_for_stored("mail", 1, Duration::from_secs(10)));
//! ```
//!
//! [`Simulator`] runs on its own tokio runtime in a background thread, so plain
//! synchronous `#[test]`s can use it; it stops when dropped or on [`Simulator::shutdown`].
//!
//! # Endpoints
//!
//! - `POST /ch/{channel}` (any method but `GET`/`HEAD`): a **send** on `channel`.
//! - `GET /ch/{channel}/by-key/{key}` and `GET /ch/{channel}/by-id/{external_id}`: a
//!   **lookup** (read-only, for reconciliation): `200 {"found": true, "id": ..., "key": ...}`
//!   when a stored message matches, `404 {"found": false}` otherwise. Lookups are recorded
//!   (kind `"lookup"`) and never store anything. Path segments are percent-decoded.
//! - `GET /_stats`: the [`Counters`] as JSON.
//! - `GET /_requests?channel=X`: the recorded requests of channel `X` as JSON.
//! - Any other request under `/ch/{channel}/...` is recorded with kind `"other"` and
//!   answered 404 (405 for `GET /ch/{channel}`); anything else is answered 404.
//!
//! # What a send does
//!
//! Each send on a channel takes the next [`Action`] of the channel's plan
//! ([`Simulator::set_plan`]); when the plan is empty, the channel's default applies
//! ([`Simulator::set_default`], initially [`Action::Accept`]). [`Action::Random`] is
//! resolved on the spot, with the channel's deterministic PRNG, into "drop after read and
//! store", `Status(503)`, `429` with `Retry-After`, or `Accept`.
//!
//! The **key** of a send is, in this order: the value of the channel's dedupe header
//! (when [`Simulator::set_dedupe`] configured one and the request carries it), else the
//! value of `Idempotency-Key`, else the value of `X-Effect-Key`, else none. Header names
//! match case-insensitively.
//!
//! **Dedupe vs plan — the exact rule.** The action is always taken from the plan (or the
//! default) first, exactly once per send, whatever the dedupe outcome. Then:
//!
//! 1. Status actions (`Status`, `StatusWithHeaders`, and the 503/429 branches of
//!    `Random`) are "failures before processing": they are answered as such, nothing is
//!    stored and no dedupe check is made.
//! 2. Storing actions (`Accept`, `AcceptAfter` after its wait, `AcceptLarge`,
//!    `Hang { store: true }`, `DropAfterRead { store: true }`, the drop branch of
//!    `Random`) store the message — unless the channel dedupes, the send carries the
//!    dedupe header, and a message with that key is already stored on the channel. In that
//!    case nothing new is stored and the already stored message's external id is used:
//!    `Accept`/`AcceptAfter`/`AcceptLarge` answer `200` with that id (same body and
//!    `X-Message-Id` as an accept, padded for `AcceptLarge`), outcome `"deduped"`;
//!    `Hang`/`DropAfterRead` still hang/drop (outcome `"hang"`/`"dropped"`, with
//!    `external_id` set to the existing id).
//! 3. `Hang { store: false }` and `DropAfterRead { store: false }` store nothing and make
//!    no dedupe check.
//!
//! On a channel without dedupe every storing send stores a new message, even with a key
//! that is already stored; a by-key lookup then finds the first one stored.
//!
//! # Recording
//!
//! Every request on a channel is kept as a [`Received`] (unless
//! [`Simulator::set_record_requests`]`(false)`, which keeps only the counters and the
//! stored messages). `outcome` is one of `"accepted"`, `"deduped"`, `"status:N"`,
//! `"hang"`, `"dropped"`, `"delayed"` (an `AcceptAfter` still waiting; it becomes
//! `"accepted"`/`"deduped"` when answered), `"lookup:found"`, `"lookup:not_found"`,
//! `"lookup:status:N"`, `"lookup:dropped"`, `"status:404"`/`"status:405"` for other
//! requests. A request is recorded, and a message stored, *before* the response is
//! written (or the connection hung/dropped), so a client that has seen the outcome can
//! inspect the simulator right away.
//!
//! # HTTP
//!
//! HTTP/1.1 with keep-alive (many requests per connection, `Connection: close` honoured;
//! HTTP/1.0 closes unless `Connection: keep-alive`), request bodies by `Content-Length` or
//! `Transfer-Encoding: chunked`, `Expect: 100-continue`. A malformed request (bad request
//! line or header, bad `Content-Length`, both `Content-Length` and `Transfer-Encoding`, an
//! unsupported transfer coding, bad chunk framing) gets `400` and the connection is
//! closed; a head over 64 KiB gets `431`, a body over 16 MiB gets `413`. Every response
//! carries `Content-Length` and is written with one write call, except the answer of
//! [`Action::AcceptLarge`]: its head and the start of its body (up to the id and the
//! opening of `pad`) in one call, then the padding in writes of up to 64 KiB, then the
//! closing `"}`. A client that closes the connection before reading all of it (as a
//! client that bounds how much of a body it reads does) ends that connection only; the
//! send is already recorded as `"accepted"`/`"deduped"` and the message stored.

//!
//! # Layout
//!
//! - this file: the [`Simulator`] handle, its shared state and what it records;
//! - `plan`: the [`Action`]s a channel plays (and its deterministic fault PRNG);
//! - `http1`: the hand-written HTTP/1.1 server (framing, limits, keep-alive);
//! - `routes`: which endpoint a request hits, sends, lookups, dedupe and recording;
//! - `tests`: everything over real TCP.

mod http1;
mod plan;
mod routes;
#[cfg(test)]
mod tests;

pub use plan::{Action, LookupAction, RandomFaults};

use http1::*;
use plan::*;
use routes::*;

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// Connections the kernel queues for a listener before `accept`. A worker opens a
/// connection per request of a batch at once, up to two batches per worker; the queue of
/// `std::net::TcpListener::bind` (128) overflows at that, and a connection whose SYN is
/// dropped is retried by its client a whole second later. The kernel caps it at
/// `net.core.somaxconn`.
const LISTEN_BACKLOG: u32 = 4096;

/// A listener on `127.0.0.1:port` (0 for a free port) with [`LISTEN_BACKLOG`], registered
/// with the current tokio runtime.
pub(crate) fn listen_on_loopback(port: u16) -> io::Result<TcpListener> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    // As std's bind does: a fixed port is free again at once after the previous listener.
    socket.set_reuseaddr(true)?;
    socket.bind(SocketAddr::from(([127, 0, 0, 1], port)))?;
    socket.listen(LISTEN_BACKLOG)
}

/// One request received on a channel.
#[derive(Debug, Clone)]
pub struct Received {
    /// Arrival order over the whole simulator, from 1.
    pub seq: u64,
    pub channel: String,
    /// `"send"`, `"lookup"` or `"other"`.
    pub kind: &'static str,
    pub method: String,
    /// The request target as sent (path and query).
    pub path: String,
    /// Header names lowercased, in the order received.
    pub headers: Vec<(String, String)>,
    /// Empty when bodies are not recorded.
    pub body: Vec<u8>,
    pub received_at: SystemTime,
    /// See the module documentation for the values.
    pub outcome: String,
    /// The stored (or deduplicated to, or looked up) message's external id.
    pub external_id: Option<String>,
    /// The key of a send (see the module documentation), or the key of a by-key lookup.
    pub key: Option<String>,
    /// The status answered; `None` when nothing was answered (hang, drop, still delayed).
    pub status: Option<u16>,
}

/// A message the simulated provider has stored (accepted).
#[derive(Debug, Clone)]
pub struct Stored {
    pub external_id: String,
    pub key: Option<String>,
    /// Empty when bodies are not recorded.
    pub body: Vec<u8>,
    pub stored_at: SystemTime,
}

/// Counters over the whole simulator since it started (not cleared by `reset`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Every request parsed, of any kind (including `/_stats`).
    pub requests: u64,
    /// Sends received.
    pub sends: u64,
    /// Sends answered 200 with a newly stored message.
    pub accepted: u64,
    /// Sends answered 200 with an already stored message's id (dedupe).
    pub deduped: u64,
    /// Messages newly stored, by accepts and by storing hangs/drops.
    pub stored: u64,
    /// Sends answered by a status action (`Status`, `StatusWithHeaders`, Random 503/429).
    pub status_errors: u64,
    /// Sends left hanging.
    pub hangs: u64,
    /// Sends and lookups whose connection was reset without an answer.
    pub dropped: u64,
    /// Lookups received.
    pub lookups: u64,
    pub lookups_found: u64,
    pub lookups_not_found: u64,
    /// Malformed requests (answered 400/413/431, connection closed).
    pub bad_requests: u64,
    /// Requests that were neither sends nor lookups.
    pub other: u64,
    /// TCP connections accepted.
    pub connections: u64,
}

#[derive(Default)]
struct AtomicCounters {
    requests: AtomicU64,
    sends: AtomicU64,
    accepted: AtomicU64,
    deduped: AtomicU64,
    stored: AtomicU64,
    status_errors: AtomicU64,
    hangs: AtomicU64,
    dropped: AtomicU64,
    lookups: AtomicU64,
    lookups_found: AtomicU64,
    lookups_not_found: AtomicU64,
    bad_requests: AtomicU64,
    other: AtomicU64,
    connections: AtomicU64,
}

impl AtomicCounters {
    fn snapshot(&self) -> Counters {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counters {
            requests: l(&self.requests),
            sends: l(&self.sends),
            accepted: l(&self.accepted),
            deduped: l(&self.deduped),
            stored: l(&self.stored),
            status_errors: l(&self.status_errors),
            hangs: l(&self.hangs),
            dropped: l(&self.dropped),
            lookups: l(&self.lookups),
            lookups_found: l(&self.lookups_found),
            lookups_not_found: l(&self.lookups_not_found),
            bad_requests: l(&self.bad_requests),
            other: l(&self.other),
            connections: l(&self.connections),
        }
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

type Observer = Arc<dyn Fn(&Received) + Send + Sync>;

struct State {
    channels: HashMap<String, Channel>,
    template_default: Action,
    template_dedupe: Option<String>,
    seq: u64,
    observer: Option<Observer>,
    /// Threads blocked in `wait_for_*`; the condvar is only signalled when there are some.
    waiters: usize,
}

impl State {
    fn channel_mut(&mut self, name: &str) -> &mut Channel {
        if !self.channels.contains_key(name) {
            let ch = Channel::new(
                name,
                self.template_default.clone(),
                self.template_dedupe.clone(),
            );
            self.channels.insert(name.to_owned(), ch);
        }
        self.channels.get_mut(name).expect("channel just inserted")
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }
}

struct Shared {
    state: Mutex<State>,
    cond: Condvar,
    counters: AtomicCounters,
    /// TCP connections accepted and not yet closed.
    open_connections: AtomicU64,
    record_requests: AtomicBool,
    record_bodies: AtomicBool,
    has_observer: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock (there should be none) must not take the
        // simulator down with it: the state stays usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `Received` entries need building at all.
    fn building(&self) -> bool {
        self.record_requests.load(Ordering::Relaxed) || self.has_observer.load(Ordering::Relaxed)
    }
}

/// A running simulated provider. Thread-safe; stops when dropped.
pub struct Simulator {
    shared: Arc<Shared>,
    port: u16,
    stop: Mutex<Option<(oneshot::Sender<()>, JoinHandle<()>)>>,
}

impl Simulator {
    /// Starts on `127.0.0.1` on a free port. Panics if that fails.
    pub fn start() -> Simulator {
        Simulator::start_on(0)
    }

    /// Starts on `127.0.0.1:port` (0 for a free port). Panics if that fails.
    pub fn start_on(port: u16) -> Simulator {
        Simulator::try_start_on(port).unwrap_or_else(|e| {
            panic!("provider simulator: cannot listen on 127.0.0.1:{port}: {e}")
        })
    }

    /// Starts on `127.0.0.1:port` (0 for a free port).
    pub fn try_start_on(port: u16) -> io::Result<Simulator> {
        let workers = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
            .clamp(1, 4);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .thread_name("provider-sim-io")
            .enable_all()
            .build()?;
        let listener = {
            let _guard = rt.enter();
            listen_on_loopback(port)?
        };
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                channels: HashMap::new(),
                template_default: Action::Accept,
                template_dedupe: None,
                seq: 0,
                observer: None,
                waiters: 0,
            }),
            cond: Condvar::new(),
            counters: AtomicCounters::default(),
            open_connections: AtomicU64::new(0),
            record_requests: AtomicBool::new(true),
            record_bodies: AtomicBool::new(true),
            has_observer: AtomicBool::new(false),
        });
        let (tx, rx) = oneshot::channel::<()>();
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("provider-sim-{port}"))
            .spawn(move || {
                rt.block_on(accept_loop(listener, sh, rx));
                // Dropping the runtime's tasks closes every connection, hung ones included.
                rt.shutdown_timeout(Duration::from_secs(1));
            })?;
        Ok(Simulator {
            shared,
            port,
            stop: Mutex::new(Some((tx, thread))),
        })
    }

    /// Stops listening and closes every connection. Idempotent; also done on drop.
    pub fn shutdown(&self) {
        let stop = self.stop.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some((tx, thread)) = stop {
            let _ = tx.send(());
            let _ = thread.join();
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://127.0.0.1:PORT`
    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `http://127.0.0.1:PORT/ch/{channel}`: where sends go.
    pub fn send_url(&self, channel: &str) -> String {
        format!("{}/ch/{}", self.base_url(), pct_encode(channel))
    }

    /// `http://127.0.0.1:PORT/ch/{channel}/by-key/{effect_key}`, with the literal
    /// `{effect_key}` placeholder left for the caller to fill in.
    pub fn lookup_url_by_key(&self, channel: &str) -> String {
        format!("{}/by-key/{{effect_key}}", self.send_url(channel))
    }

    /// `http://127.0.0.1:PORT/ch/{channel}/by-id/{external_id}`, with the literal
    /// `{external_id}` placeholder left for the caller to fill in.
    pub fn lookup_url_by_id(&self, channel: &str) -> String {
        format!("{}/by-id/{{external_id}}", self.send_url(channel))
    }

    /// Replaces the channel's plan: one action is consumed per send, then the default
    /// applies. Reseeds the channel's PRNG.
    pub fn set_plan(&self, channel: &str, plan: Vec<Action>) {
        let mut st = self.shared.lock();
        let ch = st.channel_mut(channel);
        ch.plan = plan.into();
        ch.rng = None;
    }

    /// Sets the action for sends when the plan is empty. Reseeds the channel's PRNG.
    pub fn set_default(&self, channel: &str, action: Action) {
        let mut st = self.shared.lock();
        let ch = st.channel_mut(channel);
        ch.default = action;
        ch.rng = None;
    }

    /// Sets the action for the sends whose key starts with `prefix` when the plan is
    /// empty, in place of the channel's default (a provider that fails one tenant's
    /// messages: a tenant's keys start with `<length>:<tenant>:`).
    pub fn set_default_for_keys(&self, channel: &str, prefix: &str, action: Action) {
        let mut st = self.shared.lock();
        let ch = st.channel_mut(channel);
        ch.by_key_prefix.retain(|(p, _)| p != prefix);
        ch.by_key_prefix.push((prefix.to_string(), action));
        ch.rng = None;
    }

    /// Sets the default of every existing channel and of every channel created later
    /// (also what `reset` restores).
    pub fn set_default_all(&self, action: Action) {
        let mut st = self.shared.lock();
        for ch in st.channels.values_mut() {
            ch.default = action.clone();
            ch.rng = None;
        }
        st.template_default = action;
    }

    /// Replaces the channel's lookup plan: one action per lookup, then `Answer`.
    pub fn set_lookup_plan(&self, channel: &str, plan: Vec<LookupAction>) {
        let mut st = self.shared.lock();
        st.channel_mut(channel).lookup_plan = plan.into();
    }

    /// Makes the channel dedupe sends by the value of this header (case-insensitive).
    pub fn set_dedupe(&self, channel: &str, header_name: &str) {
        let mut st = self.shared.lock();
        st.channel_mut(channel).dedupe_header = Some(header_name.to_ascii_lowercase());
    }

    /// Turns dedupe off for the channel.
    pub fn clear_dedupe(&self, channel: &str) {
        let mut st = self.shared.lock();
        st.channel_mut(channel).dedupe_header = None;
    }

    /// Makes every existing channel and every channel created later dedupe by this header
    /// (also what `reset` restores).
    pub fn set_dedupe_all(&self, header_name: &str) {
        let h = header_name.to_ascii_lowercase();
        let mut st = self.shared.lock();
        for ch in st.channels.values_mut() {
            ch.dedupe_header = Some(h.clone());
        }
        st.template_dedupe = Some(h);
    }

    /// Whether request and stored-message bodies are kept (default true). Off for
    /// benchmarks.
    pub fn set_record_bodies(&self, on: bool) {
        self.shared.record_bodies.store(on, Ordering::Relaxed);
    }

    /// Whether requests are kept as [`Received`] (default true). When off, only the
    /// counters, per-channel send counts and stored messages are kept.
    pub fn set_record_requests(&self, on: bool) {
        self.shared.record_requests.store(on, Ordering::Relaxed);
    }

    /// Calls `f` once per request on a channel, with its final outcome, outside the
    /// simulator's lock, on one of its I/O threads. Keep it quick.
    pub fn set_observer<F>(&self, f: F)
    where
        F: Fn(&Received) + Send + Sync + 'static,
    {
        self.shared.lock().observer = Some(Arc::new(f));
        self.shared.has_observer.store(true, Ordering::Relaxed);
    }

    pub fn clear_observer(&self) {
        self.shared.lock().observer = None;
        self.shared.has_observer.store(false, Ordering::Relaxed);
    }

    /// Every recorded request of the channel (sends, lookups and other requests under
    /// `/ch/{channel}/`), in recording order.
    pub fn requests(&self, channel: &str) -> Vec<Received> {
        self.read_channel(channel, |c| c.received.clone())
    }

    /// The recorded sends of the channel.
    pub fn sends(&self, channel: &str) -> Vec<Received> {
        self.read_channel(channel, |c| {
            c.received
                .iter()
                .filter(|r| r.kind == "send")
                .cloned()
                .collect()
        })
    }

    /// Number of sends received on the channel (counted even when requests are not
    /// recorded).
    pub fn send_count(&self, channel: &str) -> usize {
        self.read_channel(channel, |c| c.sends)
    }

    /// The messages stored on the channel, in storing order.
    pub fn stored(&self, channel: &str) -> Vec<Stored> {
        self.read_channel(channel, |c| c.stored.clone())
    }

    /// `read` of the channel's state, under the lock; the default (nothing) for a channel
    /// that has received nothing.
    fn read_channel<T: Default>(&self, channel: &str, read: impl FnOnce(&Channel) -> T) -> T {
        let st = self.shared.lock();
        st.channels.get(channel).map(read).unwrap_or_default()
    }

    /// The values of header `name` (case-insensitive) over the channel's recorded sends,
    /// in order.
    pub fn header_values(&self, channel: &str, name: &str) -> Vec<String> {
        let name = name.to_ascii_lowercase();
        let st = self.shared.lock();
        let Some(ch) = st.channels.get(channel) else {
            return Vec::new();
        };
        ch.received
            .iter()
            .filter(|r| r.kind == "send")
            .flat_map(|r| r.headers.iter().filter(|(n, _)| *n == name))
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Waits until the channel has received at least `n` sends; false on timeout.
    pub fn wait_for_sends(&self, channel: &str, n: usize, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| {
            st.channels.get(channel).map_or(0, |c| c.sends) >= n
        })
    }

    /// Waits until the channel has at least `n` stored messages; false on timeout.
    pub fn wait_for_stored(&self, channel: &str, n: usize, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| {
            st.channels.get(channel).map_or(0, |c| c.stored.len()) >= n
        })
    }

    fn wait_until(&self, timeout: Duration, done: impl Fn(&State) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.lock();
        loop {
            if done(&st) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            st.waiters += 1;
            let (g, _) = self
                .shared
                .cond
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner());
            st = g;
            st.waiters -= 1;
        }
    }

    /// Forgets the channel's traffic and scripting: recorded requests, stored messages,
    /// send count, plan and lookup plan; the default action and dedupe header go back to
    /// the all-channel settings (`Accept` and none unless `set_default_all` /
    /// `set_dedupe_all` said otherwise). External ids stay unique across resets.
    pub fn reset(&self, channel: &str) {
        let mut st = self.shared.lock();
        let (d, h) = (st.template_default.clone(), st.template_dedupe.clone());
        if let Some(ch) = st.channels.get_mut(channel) {
            ch.clear(d, h);
        }
    }

    /// [`Simulator::reset`] for every channel.
    pub fn reset_all(&self) {
        let mut st = self.shared.lock();
        let (d, h) = (st.template_default.clone(), st.template_dedupe.clone());
        for ch in st.channels.values_mut() {
            ch.clear(d.clone(), h.clone());
        }
    }

    pub fn counters(&self) -> Counters {
        self.shared.counters.snapshot()
    }

    /// TCP connections open now: accepted, and not yet closed by either side.
    pub fn open_connections(&self) -> u64 {
        self.shared.open_connections.load(Ordering::Relaxed)
    }
}

impl Drop for Simulator {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl std::fmt::Debug for Simulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Simulator")
            .field("port", &self.port)
            .finish()
    }
}
