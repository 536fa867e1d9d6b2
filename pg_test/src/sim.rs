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

/// What the simulator does with one send.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Store the message and answer `200 {"id": "<external id>", "status": "accepted"}`
    /// with header `X-Message-Id: <external id>`.
    Accept,
    /// Wait, then as [`Action::Accept`]. The message is stored after the wait even if the
    /// client has given up in the meantime (as a slow provider would).
    AcceptAfter(Duration),
    /// As [`Action::Accept`] (same storing, dedupe, outcome, external id and
    /// `X-Message-Id`), but the answer's body is about this many bytes:
    /// `{"id": "<external id>", "status": "accepted", "pad": "xxxx…"}`, the padding making
    /// it exactly `N` bytes long (or the shortest such body, with an empty `pad`, when `N`
    /// is smaller). The id comes first. The padding is written from a small static buffer,
    /// never held in memory whole, so a test may ask for many answers of megabytes at
    /// once; a client that closes before the end only ends its own connection.
    AcceptLarge(usize),
    /// Answer this status with `{"error": "..."}`; store nothing.
    Status(u16),
    /// As [`Action::Status`], with extra response headers (e.g. `Retry-After`).
    StatusWithHeaders(u16, Vec<(String, String)>),
    /// Read the whole request, optionally store it, then never answer: the connection stays
    /// open until the client closes it or the simulator shuts down.
    Hang { store: bool },
    /// Read the whole request, optionally store it, then reset the connection without
    /// writing anything (`SO_LINGER` 0, so the client sees a reset).
    DropAfterRead { store: bool },
    /// Random faults, drawn per send from the channel's deterministic PRNG.
    Random(RandomFaults),
}

/// Probabilities of the faults of [`Action::Random`]; the rest of the sends are accepted.
///
/// For each send one number `u` in `[0, 1)` is drawn: `u < drop_after_read_store` →
/// `DropAfterRead { store: true }`; else `u < drop + status_503` → `Status(503)`; else
/// `u < drop + 503 + status_429` → `429` with `Retry-After: retry_after_s`; else `Accept`.
/// Each channel has its own PRNG (splitmix64); it is seeded with `seed` by the first
/// `Random` drawn after the channel's plan or default was last set (or the channel reset),
/// so the same sequence of sends on a channel gets the same sequence of faults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomFaults {
    pub drop_after_read_store: f64,
    pub status_503: f64,
    pub status_429: f64,
    pub retry_after_s: u64,
    pub seed: u64,
}

impl Default for RandomFaults {
    fn default() -> Self {
        RandomFaults {
            drop_after_read_store: 0.0,
            status_503: 0.0,
            status_429: 0.0,
            retry_after_s: 1,
            seed: 1,
        }
    }
}

impl RandomFaults {
    /// Parses `drop=0.05,503=0.05,429=0.02,retry_after=1,seed=7` (any subset, any order;
    /// missing entries keep their [`Default`] values).
    pub fn parse(spec: &str) -> Result<RandomFaults, String> {
        let mut f = RandomFaults::default();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("expected key=value, got {part:?}"))?;
            let (k, v) = (k.trim(), v.trim());
            let prob = |v: &str| -> Result<f64, String> {
                let p: f64 = v.parse().map_err(|_| format!("{k}: not a number: {v:?}"))?;
                if (0.0..=1.0).contains(&p) {
                    Ok(p)
                } else {
                    Err(format!("{k}: probability out of [0, 1]: {v}"))
                }
            };
            let int = |v: &str| -> Result<u64, String> {
                v.parse()
                    .map_err(|_| format!("{k}: not an unsigned integer: {v:?}"))
            };
            match k {
                "drop" => f.drop_after_read_store = prob(v)?,
                "503" => f.status_503 = prob(v)?,
                "429" => f.status_429 = prob(v)?,
                "retry_after" => f.retry_after_s = int(v)?,
                "seed" => f.seed = int(v)?,
                _ => {
                    return Err(format!(
                        "unknown key {k:?} (known: drop, 503, 429, retry_after, seed)"
                    ))
                }
            }
        }
        if f.drop_after_read_store + f.status_503 + f.status_429 > 1.0 + 1e-9 {
            return Err("probabilities add up to more than 1".to_string());
        }
        Ok(f)
    }
}

/// What the simulator does with one lookup (`GET /ch/{channel}/by-key|by-id/...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LookupAction {
    /// The normal lookup: 200 found / 404 not found.
    Answer,
    /// Answer this status with `{"error": "..."}`.
    Status(u16),
    /// Reset the connection without answering.
    Drop,
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

struct Channel {
    name: String,
    plan: VecDeque<Action>,
    default: Action,
    lookup_plan: VecDeque<LookupAction>,
    /// Lowercased.
    dedupe_header: Option<String>,
    rng: Option<SplitMix64>,
    next_id: u64,
    stored: Vec<Stored>,
    by_key: HashMap<String, usize>,
    by_id: HashMap<String, usize>,
    received: Vec<Received>,
    sends: usize,
}

impl Channel {
    fn new(name: &str, default: Action, dedupe_header: Option<String>) -> Channel {
        Channel {
            name: name.to_owned(),
            plan: VecDeque::new(),
            default,
            lookup_plan: VecDeque::new(),
            dedupe_header,
            rng: None,
            next_id: 0,
            stored: Vec::new(),
            by_key: HashMap::new(),
            by_id: HashMap::new(),
            received: Vec::new(),
            sends: 0,
        }
    }

    /// Takes the next action (plan first, then default) and resolves `Random`.
    fn next_step(&mut self) -> Step {
        let popped = self.plan.pop_front();
        let action = popped.as_ref().unwrap_or(&self.default);
        match action {
            Action::Accept => Step::Accept(None, 0),
            Action::AcceptAfter(d) => Step::Accept(Some(*d), 0),
            Action::AcceptLarge(n) => Step::Accept(None, *n),
            Action::Status(s) => Step::Status(*s, Vec::new()),
            Action::StatusWithHeaders(s, h) => Step::Status(*s, h.clone()),
            Action::Hang { store } => Step::Hang(*store),
            Action::DropAfterRead { store } => Step::Drop(*store),
            Action::Random(f) => {
                let f = *f;
                let u = self.rng.get_or_insert(SplitMix64(f.seed)).next_f64();
                let drop = f.drop_after_read_store;
                let s503 = drop + f.status_503;
                let s429 = s503 + f.status_429;
                if u < drop {
                    Step::Drop(true)
                } else if u < s503 {
                    Step::Status(503, Vec::new())
                } else if u < s429 {
                    Step::Status(
                        429,
                        vec![("Retry-After".to_string(), f.retry_after_s.to_string())],
                    )
                } else {
                    Step::Accept(None, 0)
                }
            }
        }
    }

    /// Stores a message, or finds the already stored one under the dedupe rule.
    /// Returns the external id and whether it was deduplicated.
    fn store(
        &mut self,
        key: Option<&str>,
        dedupe: bool,
        body: &[u8],
        record_body: bool,
    ) -> (String, bool) {
        if dedupe {
            if let Some(&i) = key.and_then(|k| self.by_key.get(k)) {
                return (self.stored[i].external_id.clone(), true);
            }
        }
        self.next_id += 1;
        let mut id = String::with_capacity(self.name.len() + 12);
        id.push_str("msg-");
        for c in self.name.chars() {
            id.push(
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                    c
                } else {
                    '_'
                },
            );
        }
        let _ = write!(id, "-{}", self.next_id);
        let idx = self.stored.len();
        if let Some(k) = key {
            if !self.by_key.contains_key(k) {
                self.by_key.insert(k.to_owned(), idx);
            }
        }
        self.by_id.insert(id.clone(), idx);
        self.stored.push(Stored {
            external_id: id.clone(),
            key: key.map(str::to_owned),
            body: if record_body {
                body.to_vec()
            } else {
                Vec::new()
            },
            stored_at: SystemTime::now(),
        });
        (id, false)
    }

    fn clear(&mut self, default: Action, dedupe_header: Option<String>) {
        // next_id is kept so that external ids stay unique across resets.
        let next_id = self.next_id;
        *self = Channel::new(&self.name, default, dedupe_header);
        self.next_id = next_id;
    }
}

enum Step {
    /// Accept after an optional wait; the answer's body is padded to this many bytes (0:
    /// the plain accept body).
    Accept(Option<Duration>, usize),
    Status(u16, Vec<(String, String)>),
    Hang(bool),
    Drop(bool),
}

/// splitmix64: tiny, deterministic, good enough for fault injection.
#[derive(Debug, Clone, Copy)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

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
        let std_listener = std::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port)))?;
        std_listener.set_nonblocking(true)?;
        let port = std_listener.local_addr()?.port();
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
            TcpListener::from_std(std_listener)?
        };
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
        let st = self.shared.lock();
        st.channels
            .get(channel)
            .map(|c| c.received.clone())
            .unwrap_or_default()
    }

    /// The recorded sends of the channel.
    pub fn sends(&self, channel: &str) -> Vec<Received> {
        let st = self.shared.lock();
        st.channels
            .get(channel)
            .map(|c| {
                c.received
                    .iter()
                    .filter(|r| r.kind == "send")
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Number of sends received on the channel (counted even when requests are not
    /// recorded).
    pub fn send_count(&self, channel: &str) -> usize {
        let st = self.shared.lock();
        st.channels.get(channel).map_or(0, |c| c.sends)
    }

    /// The messages stored on the channel, in storing order.
    pub fn stored(&self, channel: &str) -> Vec<Stored> {
        let st = self.shared.lock();
        st.channels
            .get(channel)
            .map(|c| c.stored.clone())
            .unwrap_or_default()
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

// ---------------------------------------------------------------------------------------
// Server

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, mut stop: oneshot::Receiver<()>) {
    loop {
        tokio::select! {
            _ = &mut stop => return,
            res = listener.accept() => match res {
                Ok((stream, _)) => {
                    bump(&shared.counters.connections);
                    tokio::spawn(serve_connection(shared.clone(), stream));
                }
                // Out of file descriptors and the like: back off instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
        }
    }
}

const MAX_HEAD: usize = 64 * 1024;
const MAX_BODY: usize = 16 * 1024 * 1024;
const MAX_HEADERS: usize = 200;
const MAX_CHUNK_LINE: usize = 4096;

/// `(start, end)` byte offsets into the connection's read buffer.
type Span = (usize, usize);

struct Head {
    method: Span,
    target: Span,
    http10: bool,
    keep_alive: bool,
    content_length: Option<usize>,
    chunked: bool,
    expect_continue: bool,
}

/// What the connection does after a request has been handled.
enum After {
    /// Write the response, then read the next request unless the connection is to close.
    Respond,
    /// Write nothing, keep the connection open until the peer closes it.
    Hang,
    /// Write nothing, reset the connection.
    Drop,
}

/// Response under construction; both buffers are reused across requests.
///
/// The body is `body`, then `pad` bytes `x`, then `tail`; the last two are only used by
/// [`Action::AcceptLarge`], whose padding is written from [`PAD`] rather than held here.
struct Out {
    head: Vec<u8>,
    body: Vec<u8>,
    pad: usize,
    tail: &'static [u8],
}

/// What the padding of a large answer is written from, one slice at a time.
static PAD: [u8; 64 * 1024] = [b'x'; 64 * 1024];

impl Out {
    fn new() -> Out {
        Out {
            head: Vec::with_capacity(512),
            body: Vec::with_capacity(256),
            pad: 0,
            tail: b"",
        }
    }

    fn start(&mut self, status: u16) {
        self.head.clear();
        self.body.clear();
        self.pad = 0;
        self.tail = b"";
        let _ = write!(
            VecWriter(&mut self.head),
            "HTTP/1.1 {} {}\r\n",
            status,
            reason(status)
        );
    }

    fn header(&mut self, name: &str, value: &str) {
        self.head.extend_from_slice(name.as_bytes());
        self.head.extend_from_slice(b": ");
        // Header values given by a test could contain CR/LF; never let them split the head.
        self.head
            .extend(value.bytes().filter(|b| *b != b'\r' && *b != b'\n'));
        self.head.extend_from_slice(b"\r\n");
    }

    /// Adds the framing headers and appends the body (not for a `HEAD` request): `head` is
    /// then the whole response, but for the padding and tail of a large answer
    /// ([`Out::write`] writes those after it).
    fn finish(&mut self, keep_alive: bool, http10: bool, head_request: bool) {
        let _ = write!(
            VecWriter(&mut self.head),
            "Content-Length: {}\r\n",
            self.body.len() + self.pad + self.tail.len()
        );
        if !keep_alive {
            self.head.extend_from_slice(b"Connection: close\r\n");
        } else if http10 {
            self.head.extend_from_slice(b"Connection: keep-alive\r\n");
        }
        self.head.extend_from_slice(b"\r\n");
        if head_request {
            self.pad = 0;
            self.tail = b"";
        } else {
            self.head.extend_from_slice(&self.body);
        }
    }

    /// Writes a finished response: one write call, plus, for a large answer, its padding
    /// in slices of [`PAD`] and its tail. An error (the client went away) ends only this
    /// connection.
    async fn write(&self, stream: &mut TcpStream) -> io::Result<()> {
        stream.write_all(&self.head).await?;
        let mut left = self.pad;
        while left > 0 {
            let n = left.min(PAD.len());
            stream.write_all(&PAD[..n]).await?;
            left -= n;
        }
        if !self.tail.is_empty() {
            stream.write_all(self.tail).await?;
        }
        Ok(())
    }

    fn json_error(&mut self, status: u16, msg: &str) {
        self.start(status);
        self.header("Content-Type", "application/json");
        self.body.extend_from_slice(b"{\"error\":");
        json_str(&mut self.body, msg);
        self.body.push(b'}');
    }
}

/// `fmt::Write` into a byte vector.
struct VecWriter<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for VecWriter<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        301 => "Moved Permanently",
        302 => "Found",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        410 => "Gone",
        413 => "Content Too Large",
        422 => "Unprocessable Content",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}

/// Reads more bytes into `buf`; `Ok(0)` at end of stream.
async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<usize> {
    if buf.capacity() - buf.len() < 2048 {
        buf.reserve(8192);
    }
    stream.read_buf(buf).await
}

async fn serve_connection(shared: Arc<Shared>, mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let mut buf: Vec<u8> = Vec::with_capacity(8192);
    let mut headers: Vec<(Span, Span)> = Vec::with_capacity(16);
    let mut chunk_body: Vec<u8> = Vec::new();
    let mut out = Out::new();
    loop {
        // 1. The head: up to the empty line. Empty lines before a request are skipped.
        let mut scanned = 0;
        let head_end = loop {
            let skip = leading_empty_lines(&buf);
            if skip > 0 {
                buf.drain(..skip);
                scanned = 0;
            }
            if let Some(i) = find_head_end(&buf, scanned) {
                break i;
            }
            if buf.len() > MAX_HEAD {
                reject(
                    &shared,
                    &mut stream,
                    &mut out,
                    431,
                    "request head too large",
                )
                .await;
                return;
            }
            scanned = buf.len().saturating_sub(3);
            match read_more(&mut stream, &mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        };
        if head_end > MAX_HEAD {
            reject(
                &shared,
                &mut stream,
                &mut out,
                431,
                "request head too large",
            )
            .await;
            return;
        }
        let head = match parse_head(&buf, head_end, &mut headers) {
            Ok(h) => h,
            Err(msg) => {
                reject(&shared, &mut stream, &mut out, 400, msg).await;
                return;
            }
        };
        let head_len = head_end + 4;

        // 2. The body.
        let mut sent_continue = !head.expect_continue || head.http10;
        let consumed = if head.chunked {
            chunk_body.clear();
            let mut dec = ChunkDecoder {
                pos: head_len,
                state: ChunkState::Size,
            };
            loop {
                match dec.decode(&buf, &mut chunk_body) {
                    Ok(true) => break,
                    Ok(false) => {}
                    Err((status, msg)) => {
                        reject(&shared, &mut stream, &mut out, status, msg).await;
                        return;
                    }
                }
                if !sent_continue {
                    sent_continue = true;
                    if stream
                        .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                match read_more(&mut stream, &mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
            dec.pos
        } else {
            let len = head.content_length.unwrap_or(0);
            if len > MAX_BODY {
                reject(
                    &shared,
                    &mut stream,
                    &mut out,
                    413,
                    "request body too large",
                )
                .await;
                return;
            }
            if len > 0 && buf.len() < head_len + len {
                buf.reserve(head_len + len - buf.len());
            }
            while buf.len() < head_len + len {
                if !sent_continue {
                    sent_continue = true;
                    if stream
                        .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                match read_more(&mut stream, &mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
            head_len + len
        };

        // 3. Handle it.
        let after = {
            let body: &[u8] = if head.chunked {
                &chunk_body
            } else {
                &buf[head_len..consumed]
            };
            let req = Request {
                buf: &buf,
                // Both were checked to be ASCII by parse_head.
                method: std::str::from_utf8(&buf[head.method.0..head.method.1]).unwrap_or("?"),
                target: std::str::from_utf8(&buf[head.target.0..head.target.1]).unwrap_or("/"),
                headers: &headers,
                body,
            };
            handle(&shared, &req, &mut out).await
        };

        // 4. Answer (or not).
        match after {
            After::Respond => {
                let keep = head.keep_alive;
                out.finish(
                    keep,
                    head.http10,
                    &buf[head.method.0..head.method.1] == b"HEAD",
                );
                if out.write(&mut stream).await.is_err() {
                    return;
                }
                if !keep {
                    let _ = stream.shutdown().await;
                    return;
                }
            }
            After::Hang => {
                // Keep reading (and discarding) until the peer goes away; shutdown of the
                // simulator drops this task and so closes the socket.
                let mut sink = [0u8; 1024];
                loop {
                    match stream.read(&mut sink).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                }
            }
            After::Drop => {
                let _ = stream.set_zero_linger();
                return;
            }
        }
        buf.drain(..consumed);
        // Do not let one huge request pin memory for the life of the connection.
        if buf.capacity() > 1 << 20 {
            buf.shrink_to(64 * 1024);
        }
        if chunk_body.capacity() > 1 << 20 {
            chunk_body = Vec::new();
        }
    }
}

/// Answers a malformed request and closes the connection.
async fn reject(shared: &Shared, stream: &mut TcpStream, out: &mut Out, status: u16, msg: &str) {
    bump(&shared.counters.bad_requests);
    out.json_error(status, msg);
    out.finish(false, false, false);
    if out.write(stream).await.is_ok() {
        let _ = stream.shutdown().await;
        // Give the client a moment to read the answer before the socket goes away with
        // unread input still in it (which would make the kernel send a reset).
        let mut sink = [0u8; 1024];
        let drain = async {
            loop {
                match stream.read(&mut sink).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_millis(200), drain).await;
    }
}

fn leading_empty_lines(buf: &[u8]) -> usize {
    let mut i = 0;
    while buf.len() >= i + 2 && &buf[i..i + 2] == b"\r\n" {
        i += 2;
    }
    i
}

/// Index of the `\r\n\r\n` ending the head, searching from `from`.
fn find_head_end(buf: &[u8], from: usize) -> Option<usize> {
    if buf.len() < 4 {
        return None;
    }
    let mut i = from;
    while i + 4 <= buf.len() {
        // Jump to the next CR quickly.
        match buf[i..buf.len() - 3].iter().position(|&b| b == b'\r') {
            None => return None,
            Some(p) => i += p,
        }
        if &buf[i..i + 4] == b"\r\n\r\n" {
            return Some(i);
        }
        i += 1;
    }
    None
}

fn find_crlf(buf: &[u8], from: usize, to: usize) -> Option<usize> {
    buf[from..to]
        .windows(2)
        .position(|w| w == b"\r\n")
        .map(|p| from + p)
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn trim_ows(buf: &[u8], mut s: usize, mut e: usize) -> Span {
    while s < e && (buf[s] == b' ' || buf[s] == b'\t') {
        s += 1;
    }
    while e > s && (buf[e - 1] == b' ' || buf[e - 1] == b'\t') {
        e -= 1;
    }
    (s, e)
}

fn parse_head(
    buf: &[u8],
    head_end: usize,
    headers: &mut Vec<(Span, Span)>,
) -> Result<Head, &'static str> {
    headers.clear();
    // Request line.
    let line_end = find_crlf(buf, 0, head_end + 2).ok_or("bad request line")?;
    let line = &buf[..line_end];
    let sp1 = line
        .iter()
        .position(|&b| b == b' ')
        .ok_or("bad request line")?;
    let rest = &line[sp1 + 1..];
    let sp2 = rest
        .iter()
        .position(|&b| b == b' ')
        .ok_or("bad request line")?;
    let method = (0, sp1);
    let target = (sp1 + 1, sp1 + 1 + sp2);
    let version = &rest[sp2 + 1..];
    if method.0 == method.1 || !buf[method.0..method.1].iter().all(|&b| is_tchar(b)) {
        return Err("bad method");
    }
    if target.0 == target.1
        || !buf[target.0..target.1]
            .iter()
            .all(|&b| (0x21..0x7f).contains(&b))
    {
        return Err("bad request target");
    }
    let http10 = match version {
        b"HTTP/1.1" => false,
        b"HTTP/1.0" => true,
        _ => return Err("unsupported HTTP version"),
    };

    let mut content_length: Option<usize> = None;
    let mut te_seen = false;
    let mut chunked = false;
    let mut conn_close = false;
    let mut conn_keep_alive = false;
    let mut expect_continue = false;

    let mut pos = line_end + 2;
    while pos < head_end + 2 {
        let e = find_crlf(buf, pos, head_end + 2).ok_or("bad header line")?;
        let line = &buf[pos..e];
        if line.first().is_some_and(|&b| b == b' ' || b == b'\t') {
            return Err("obsolete header line folding");
        }
        let colon = line
            .iter()
            .position(|&b| b == b':')
            .ok_or("header line without colon")?;
        let name = (pos, pos + colon);
        if name.0 == name.1 || !buf[name.0..name.1].iter().all(|&b| is_tchar(b)) {
            return Err("bad header name");
        }
        let value = trim_ows(buf, pos + colon + 1, e);
        if buf[value.0..value.1]
            .iter()
            .any(|&b| (b < 0x20 && b != b'\t') || b == 0x7f)
        {
            return Err("control character in header value");
        }
        if headers.len() >= MAX_HEADERS {
            return Err("too many headers");
        }
        headers.push((name, value));

        let n = &buf[name.0..name.1];
        let v = &buf[value.0..value.1];
        if n.eq_ignore_ascii_case(b"content-length") {
            if v.is_empty() || v.len() > 15 || !v.iter().all(u8::is_ascii_digit) {
                return Err("bad content-length");
            }
            let len = v
                .iter()
                .fold(0usize, |acc, d| acc * 10 + usize::from(d - b'0'));
            if content_length.is_some_and(|l| l != len) {
                return Err("conflicting content-length headers");
            }
            content_length = Some(len);
        } else if n.eq_ignore_ascii_case(b"transfer-encoding") {
            if te_seen || !v.eq_ignore_ascii_case(b"chunked") {
                return Err("unsupported transfer-encoding (only a single 'chunked')");
            }
            te_seen = true;
            chunked = true;
        } else if n.eq_ignore_ascii_case(b"connection") {
            for tok in v.split(|&b| b == b',') {
                let (s, e) = trim_ows(tok, 0, tok.len());
                let tok = &tok[s..e];
                if tok.eq_ignore_ascii_case(b"close") {
                    conn_close = true;
                } else if tok.eq_ignore_ascii_case(b"keep-alive") {
                    conn_keep_alive = true;
                }
            }
        } else if n.eq_ignore_ascii_case(b"expect") && v.eq_ignore_ascii_case(b"100-continue") {
            expect_continue = true;
        }
        pos = e + 2;
    }
    if chunked && content_length.is_some() {
        return Err("both content-length and transfer-encoding");
    }
    if chunked && http10 {
        return Err("chunked transfer-encoding in HTTP/1.0");
    }
    let keep_alive = if http10 {
        conn_keep_alive && !conn_close
    } else {
        !conn_close
    };
    Ok(Head {
        method,
        target,
        http10,
        keep_alive,
        content_length,
        chunked,
        expect_continue,
    })
}

enum ChunkState {
    Size,
    Data(usize),
    DataEnd,
    Trailers,
}

/// Incremental decoder of a chunked body, resumable as more bytes arrive.
struct ChunkDecoder {
    /// Next unread byte of the connection buffer.
    pos: usize,
    state: ChunkState,
}

impl ChunkDecoder {
    /// Decodes what is available; `Ok(true)` once the whole body (with trailers) is read.
    fn decode(&mut self, buf: &[u8], body: &mut Vec<u8>) -> Result<bool, (u16, &'static str)> {
        loop {
            match self.state {
                ChunkState::Size => {
                    let Some(e) = find_crlf(buf, self.pos, buf.len()) else {
                        if buf.len() - self.pos > MAX_CHUNK_LINE {
                            return Err((400, "chunk size line too long"));
                        }
                        return Ok(false);
                    };
                    let line = &buf[self.pos..e];
                    let size_part = match line.iter().position(|&b| b == b';') {
                        Some(p) => &line[..p],
                        None => line,
                    };
                    let (s, t) = trim_ows(size_part, 0, size_part.len());
                    let hex = &size_part[s..t];
                    if hex.is_empty() || hex.len() > 8 {
                        return Err((400, "bad chunk size"));
                    }
                    let mut size = 0usize;
                    for &b in hex {
                        let d = (b as char).to_digit(16).ok_or((400, "bad chunk size"))?;
                        size = size * 16 + d as usize;
                    }
                    if body.len() + size > MAX_BODY {
                        return Err((413, "request body too large"));
                    }
                    self.pos = e + 2;
                    self.state = if size == 0 {
                        ChunkState::Trailers
                    } else {
                        ChunkState::Data(size)
                    };
                }
                ChunkState::Data(rem) => {
                    let avail = (buf.len() - self.pos).min(rem);
                    body.extend_from_slice(&buf[self.pos..self.pos + avail]);
                    self.pos += avail;
                    if avail < rem {
                        self.state = ChunkState::Data(rem - avail);
                        return Ok(false);
                    }
                    self.state = ChunkState::DataEnd;
                }
                ChunkState::DataEnd => {
                    if buf.len() - self.pos < 2 {
                        return Ok(false);
                    }
                    if &buf[self.pos..self.pos + 2] != b"\r\n" {
                        return Err((400, "chunk data not followed by CRLF"));
                    }
                    self.pos += 2;
                    self.state = ChunkState::Size;
                }
                ChunkState::Trailers => {
                    let Some(e) = find_crlf(buf, self.pos, buf.len()) else {
                        if buf.len() - self.pos > MAX_HEAD {
                            return Err((431, "trailers too large"));
                        }
                        return Ok(false);
                    };
                    let empty = e == self.pos;
                    self.pos = e + 2;
                    if empty {
                        return Ok(true);
                    }
                }
            }
        }
    }
}

struct Request<'a> {
    buf: &'a [u8],
    method: &'a str,
    target: &'a str,
    headers: &'a [(Span, Span)],
    body: &'a [u8],
}

impl Request<'_> {
    fn header_iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.headers
            .iter()
            .map(|(n, v)| (&self.buf[n.0..n.1], &self.buf[v.0..v.1]))
    }

    /// First value of header `name` (ASCII case-insensitive).
    fn header(&self, name: &str) -> Option<&[u8]> {
        self.header_iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }

    /// The send's key and whether it came from the channel's dedupe header.
    fn send_key(&self, dedupe_header: Option<&str>) -> (Option<String>, bool) {
        if let Some(v) = dedupe_header.and_then(|h| self.header(h)) {
            return (Some(String::from_utf8_lossy(v).into_owned()), true);
        }
        let v = self
            .header("idempotency-key")
            .or_else(|| self.header("x-effect-key"));
        (v.map(|v| String::from_utf8_lossy(v).into_owned()), false)
    }

    /// A `Received` with everything but the parts known only after handling.
    fn draft(&self, shared: &Shared, channel: &str, kind: &'static str) -> Received {
        Received {
            seq: 0,
            channel: channel.to_owned(),
            kind,
            method: self.method.to_owned(),
            path: self.target.to_owned(),
            headers: self
                .header_iter()
                .map(|(n, v)| {
                    (
                        String::from_utf8_lossy(n).to_ascii_lowercase(),
                        String::from_utf8_lossy(v).into_owned(),
                    )
                })
                .collect(),
            body: if shared.record_bodies.load(Ordering::Relaxed) {
                self.body.to_vec()
            } else {
                Vec::new()
            },
            received_at: SystemTime::now(),
            outcome: String::new(),
            external_id: None,
            key: None,
            status: None,
        }
    }
}

enum Route<'a> {
    Send(Cow<'a, str>),
    Lookup(Cow<'a, str>, LookupBy, Cow<'a, str>),
    /// A request under `/ch/{channel}` that is neither; with the status to answer.
    ChannelOther(Cow<'a, str>, u16),
    Stats,
    Requests(Option<String>),
    NotFound,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum LookupBy {
    Key,
    Id,
}

fn route<'a>(method: &str, target: &'a str) -> Route<'a> {
    // Absolute form (`http://host/path`) as a proxy-style client might send.
    let target = match target.strip_prefix("http://") {
        Some(rest) => rest.find('/').map_or("/", |i| &rest[i..]),
        None => target,
    };
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (target, None),
    };
    let read_only = method == "GET" || method == "HEAD";
    if let Some(rest) = path.strip_prefix("/ch/") {
        let mut parts = rest.splitn(3, '/');
        let channel = parts.next().unwrap_or("");
        if channel.is_empty() {
            return Route::NotFound;
        }
        let channel = pct_decode(channel);
        return match (parts.next(), parts.next()) {
            (None, _) if read_only => Route::ChannelOther(channel, 405),
            (None, _) => Route::Send(channel),
            (Some(by @ ("by-key" | "by-id")), Some(v)) if read_only && !v.is_empty() => {
                let by = if by == "by-key" {
                    LookupBy::Key
                } else {
                    LookupBy::Id
                };
                Route::Lookup(channel, by, pct_decode(v))
            }
            _ => Route::ChannelOther(channel, 404),
        };
    }
    match path {
        "/_stats" if read_only => Route::Stats,
        "/_requests" if read_only => Route::Requests(query.and_then(|q| {
            q.split('&')
                .filter_map(|kv| kv.split_once('='))
                .find(|(k, _)| *k == "channel")
                .map(|(_, v)| pct_decode(&v.replace('+', " ")).into_owned())
        })),
        _ => Route::NotFound,
    }
}

async fn handle(shared: &Shared, req: &Request<'_>, out: &mut Out) -> After {
    bump(&shared.counters.requests);
    match route(req.method, req.target) {
        Route::Send(channel) => handle_send(shared, req, &channel, out).await,
        Route::Lookup(channel, by, value) => handle_lookup(shared, req, &channel, by, &value, out),
        Route::ChannelOther(channel, status) => {
            bump(&shared.counters.other);
            let draft = shared
                .building()
                .then(|| req.draft(shared, &channel, "other"));
            let mut st = shared.lock();
            let seq = st.next_seq();
            let observer = st.observer.clone();
            st.channel_mut(&channel);
            let rec = draft.map(|mut r| {
                r.seq = seq;
                r.outcome = format!("status:{status}");
                r.status = Some(status);
                r
            });
            finish_record(shared, st, &channel, rec, observer);
            out.json_error(
                status,
                if status == 405 {
                    "sends are POSTed to /ch/{channel}"
                } else {
                    "not found"
                },
            );
            After::Respond
        }
        Route::Stats => {
            bump(&shared.counters.other);
            let c = shared.counters.snapshot();
            let v = serde_json::json!({
                "requests": c.requests,
                "sends": c.sends,
                "accepted": c.accepted,
                "deduped": c.deduped,
                "stored": c.stored,
                "status_errors": c.status_errors,
                "hangs": c.hangs,
                "dropped": c.dropped,
                "lookups": c.lookups,
                "lookups_found": c.lookups_found,
                "lookups_not_found": c.lookups_not_found,
                "bad_requests": c.bad_requests,
                "other": c.other,
                "connections": c.connections,
            });
            json_response(out, 200, &v);
            After::Respond
        }
        Route::Requests(channel) => {
            bump(&shared.counters.other);
            let Some(channel) = channel else {
                out.json_error(400, "missing ?channel=");
                return After::Respond;
            };
            let list: Vec<serde_json::Value> = {
                let st = shared.lock();
                st.channels
                    .get(&channel)
                    .map(|c| c.received.iter().map(received_json).collect())
                    .unwrap_or_default()
            };
            json_response(out, 200, &serde_json::Value::Array(list));
            After::Respond
        }
        Route::NotFound => {
            bump(&shared.counters.other);
            out.json_error(404, "not found");
            After::Respond
        }
    }
}

async fn handle_send(shared: &Shared, req: &Request<'_>, channel: &str, out: &mut Out) -> After {
    bump(&shared.counters.sends);
    let record_body = shared.record_bodies.load(Ordering::Relaxed);
    let mut draft = shared
        .building()
        .then(|| req.draft(shared, channel, "send"));

    // Everything decided under one short lock hold, except what AcceptAfter defers.
    let (seq, key, from_dedupe, delay) = {
        let mut st = shared.lock();
        let seq = st.next_seq();
        let observer = st.observer.clone();
        let ch = st.channel_mut(channel);
        ch.sends += 1;
        let step = ch.next_step();
        let (key, from_dedupe) = req.send_key(ch.dedupe_header.as_deref());
        if let Some(r) = draft.as_mut() {
            r.seq = seq;
            r.key = key.clone();
        }
        match step {
            Step::Status(status, extra) => {
                bump(&shared.counters.status_errors);
                let rec = draft.map(|mut r| {
                    r.outcome = format!("status:{status}");
                    r.status = Some(status);
                    r
                });
                finish_record(shared, st, channel, rec, observer);
                out.json_error(status, &format!("simulated status {status}"));
                for (n, v) in &extra {
                    out.header(n, v);
                }
                return After::Respond;
            }
            Step::Hang(store) | Step::Drop(store) => {
                let hang = matches!(step, Step::Hang(_));
                let id = store.then(|| {
                    let (id, deduped) =
                        ch.store(key.as_deref(), from_dedupe, req.body, record_body);
                    if !deduped {
                        bump(&shared.counters.stored);
                    }
                    id
                });
                bump(if hang {
                    &shared.counters.hangs
                } else {
                    &shared.counters.dropped
                });
                let rec = draft.map(|mut r| {
                    r.outcome = if hang { "hang" } else { "dropped" }.to_string();
                    r.external_id = id;
                    r
                });
                finish_record(shared, st, channel, rec, observer);
                return if hang { After::Hang } else { After::Drop };
            }
            Step::Accept(None, size) => {
                let (id, deduped) = ch.store(key.as_deref(), from_dedupe, req.body, record_body);
                let rec = draft.map(|mut r| {
                    r.outcome = if deduped { "deduped" } else { "accepted" }.to_string();
                    r.status = Some(200);
                    r.external_id = Some(id.clone());
                    r
                });
                count_accept(shared, deduped);
                finish_record(shared, st, channel, rec, observer);
                accept_response(out, &id, size);
                return After::Respond;
            }
            Step::Accept(Some(delay), _) => {
                // Recorded now as "delayed" (so waiters see the send), completed later.
                if let Some(r) = draft.as_ref() {
                    let mut r = r.clone();
                    r.outcome = "delayed".to_string();
                    if shared.record_requests.load(Ordering::Relaxed) {
                        ch.received.push(r);
                    }
                }
                notify(shared, &st);
                (seq, key, from_dedupe, delay)
            }
        }
    };

    tokio::time::sleep(delay).await;

    let mut st = shared.lock();
    let observer = st.observer.clone();
    let ch = st.channel_mut(channel);
    let (id, deduped) = ch.store(key.as_deref(), from_dedupe, req.body, record_body);
    count_accept(shared, deduped);
    let outcome = if deduped { "deduped" } else { "accepted" };
    // Complete the "delayed" entry in place (it is gone if the channel was reset).
    if let Some(r) = ch.received.iter_mut().rev().find(|r| r.seq == seq) {
        r.outcome = outcome.to_string();
        r.status = Some(200);
        r.external_id = Some(id.clone());
    }
    notify(shared, &st);
    drop(st);
    if let (Some(obs), Some(mut r)) = (observer, draft) {
        r.outcome = outcome.to_string();
        r.status = Some(200);
        r.external_id = Some(id.clone());
        obs(&r);
    }
    accept_response(out, &id, 0);
    After::Respond
}

fn count_accept(shared: &Shared, deduped: bool) {
    if deduped {
        bump(&shared.counters.deduped);
    } else {
        bump(&shared.counters.accepted);
        bump(&shared.counters.stored);
    }
}

/// The answer of an accept; `size > 0`: padded to `size` bytes (see
/// [`Action::AcceptLarge`]).
fn accept_response(out: &mut Out, id: &str, size: usize) {
    out.start(200);
    out.header("Content-Type", "application/json");
    out.header("X-Message-Id", id);
    out.body.extend_from_slice(b"{\"id\":");
    json_str(&mut out.body, id);
    if size == 0 {
        out.body.extend_from_slice(b",\"status\":\"accepted\"}");
        return;
    }
    out.body
        .extend_from_slice(b",\"status\":\"accepted\",\"pad\":\"");
    out.tail = b"\"}";
    out.pad = size.saturating_sub(out.body.len() + out.tail.len());
}

fn handle_lookup(
    shared: &Shared,
    req: &Request<'_>,
    channel: &str,
    by: LookupBy,
    value: &str,
    out: &mut Out,
) -> After {
    bump(&shared.counters.lookups);
    let draft = shared
        .building()
        .then(|| req.draft(shared, channel, "lookup"));
    let mut st = shared.lock();
    let seq = st.next_seq();
    let observer = st.observer.clone();
    let ch = st.channel_mut(channel);
    let action = ch.lookup_plan.pop_front().unwrap_or(LookupAction::Answer);
    let (outcome, status, external_id, after): (
        Cow<'static, str>,
        Option<u16>,
        Option<String>,
        After,
    ) = match action {
        LookupAction::Answer => {
            let idx = match by {
                LookupBy::Key => ch.by_key.get(value),
                LookupBy::Id => ch.by_id.get(value),
            };
            match idx.map(|&i| &ch.stored[i]) {
                Some(m) => {
                    bump(&shared.counters.lookups_found);
                    out.start(200);
                    out.header("Content-Type", "application/json");
                    out.body.extend_from_slice(b"{\"found\":true,\"id\":");
                    json_str(&mut out.body, &m.external_id);
                    out.body.extend_from_slice(b",\"key\":");
                    match &m.key {
                        Some(k) => json_str(&mut out.body, k),
                        None => out.body.extend_from_slice(b"null"),
                    }
                    out.body.push(b'}');
                    (
                        "lookup:found".into(),
                        Some(200),
                        Some(m.external_id.clone()),
                        After::Respond,
                    )
                }
                None => {
                    bump(&shared.counters.lookups_not_found);
                    out.start(404);
                    out.header("Content-Type", "application/json");
                    out.body.extend_from_slice(b"{\"found\":false}");
                    ("lookup:not_found".into(), Some(404), None, After::Respond)
                }
            }
        }
        LookupAction::Status(s) => {
            out.json_error(s, &format!("simulated status {s}"));
            (
                format!("lookup:status:{s}").into(),
                Some(s),
                None,
                After::Respond,
            )
        }
        LookupAction::Drop => {
            bump(&shared.counters.dropped);
            ("lookup:dropped".into(), None, None, After::Drop)
        }
    };
    let rec = draft.map(|mut r| {
        r.seq = seq;
        r.outcome = outcome.into_owned();
        r.status = status;
        r.external_id = external_id;
        r.key = (by == LookupBy::Key).then(|| value.to_owned());
        r
    });
    finish_record(shared, st, channel, rec, observer);
    after
}

/// Keeps the record (when recording), wakes waiters, releases the lock, then calls the
/// observer.
fn finish_record(
    shared: &Shared,
    mut st: MutexGuard<'_, State>,
    channel: &str,
    rec: Option<Received>,
    observer: Option<Observer>,
) {
    let recording = shared.record_requests.load(Ordering::Relaxed);
    let mut for_observer = None;
    if let Some(r) = rec {
        let r = if observer.is_some() {
            for_observer = Some(r.clone());
            r
        } else {
            r
        };
        if recording {
            if let Some(ch) = st.channels.get_mut(channel) {
                ch.received.push(r);
            }
        }
    }
    notify(shared, &st);
    drop(st);
    if let (Some(obs), Some(r)) = (observer, for_observer) {
        obs(&r);
    }
}

fn notify(shared: &Shared, st: &State) {
    if st.waiters > 0 {
        shared.cond.notify_all();
    }
}

fn json_response(out: &mut Out, status: u16, v: &serde_json::Value) {
    out.start(status);
    out.header("Content-Type", "application/json");
    // Serializing a Value into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut out.body, v);
}

fn received_json(r: &Received) -> serde_json::Value {
    let at_ms = r
        .received_at
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    serde_json::json!({
        "seq": r.seq,
        "channel": r.channel,
        "kind": r.kind,
        "method": r.method,
        "path": r.path,
        "headers": r.headers.iter().map(|(n, v)| serde_json::json!([n, v])).collect::<Vec<_>>(),
        "body": String::from_utf8_lossy(&r.body),
        "received_at_ms": at_ms,
        "outcome": r.outcome,
        "status": r.status,
        "external_id": r.external_id,
        "key": r.key,
    })
}

/// Appends `s` as a JSON string literal.
fn json_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(VecWriter(out), "\\u{:04x}", c as u32);
            }
            c => {
                let mut b = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut b).as_bytes());
            }
        }
    }
    out.push(b'"');
}

fn pct_decode(s: &str) -> Cow<'_, str> {
    if !s.contains('%') {
        return Cow::Borrowed(s);
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 3 <= b.len() {
            let hi = (b[i + 1] as char).to_digit(16);
            let lo = (b[i + 2] as char).to_digit(16);
            if let (Some(hi), Some(lo)) = (hi, lo) {
                out.push((hi * 16 + lo) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

/// Percent-encodes everything but RFC 3986 unreserved characters (for one path segment).
fn pct_encode(s: &str) -> Cow<'_, str> {
    let unreserved = |b: u8| b.is_ascii_alphanumeric() || b"-._~".contains(&b);
    if s.bytes().all(unreserved) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if unreserved(b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    //! Everything over real TCP, with a tiny blocking HTTP/1.1 client.

    use super::*;
    use std::io::{ErrorKind, Read, Write};
    use std::net::TcpStream as StdStream;

    struct Resp {
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    }

    impl Resp {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        }

        fn json(&self) -> serde_json::Value {
            serde_json::from_slice(&self.body).expect("JSON body")
        }
    }

    struct Client {
        s: StdStream,
        buf: Vec<u8>,
    }

    impl Client {
        fn connect(port: u16) -> Client {
            let s = StdStream::connect(("127.0.0.1", port)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s.set_nodelay(true).unwrap();
            Client { s, buf: Vec::new() }
        }

        fn write(&mut self, raw: &[u8]) {
            self.s.write_all(raw).unwrap();
        }

        fn fill(&mut self) -> io::Result<()> {
            let mut tmp = [0u8; 4096];
            let n = self.s.read(&mut tmp)?;
            if n == 0 {
                return Err(io::Error::new(ErrorKind::UnexpectedEof, "eof"));
            }
            self.buf.extend_from_slice(&tmp[..n]);
            Ok(())
        }

        /// Reads one response (skipping 1xx); errors on EOF/reset/timeout before it is whole.
        fn read_response(&mut self) -> io::Result<Resp> {
            loop {
                let end = loop {
                    if let Some(i) = find_head_end(&self.buf, 0) {
                        break i;
                    }
                    self.fill()?;
                };
                let head = String::from_utf8_lossy(&self.buf[..end]).into_owned();
                let mut lines = head.split("\r\n");
                let status: u16 = lines.next().unwrap()[9..12].parse().unwrap();
                let headers: Vec<(String, String)> = lines
                    .map(|l| {
                        let (n, v) = l.split_once(':').unwrap();
                        (n.trim().to_string(), v.trim().to_string())
                    })
                    .collect();
                self.buf.drain(..end + 4);
                if status < 200 {
                    continue;
                }
                let len: usize = headers
                    .iter()
                    .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
                    .expect("every response has Content-Length")
                    .1
                    .parse()
                    .unwrap();
                while self.buf.len() < len {
                    self.fill()?;
                }
                let body = self.buf.drain(..len).collect();
                return Ok(Resp {
                    status,
                    headers,
                    body,
                });
            }
        }

        fn roundtrip(&mut self, raw: &[u8]) -> Resp {
            self.write(raw);
            self.read_response().unwrap()
        }

        /// True when the server closed the connection (EOF or reset) with nothing more sent.
        fn closed(&mut self) -> bool {
            let mut tmp = [0u8; 64];
            match self.s.read(&mut tmp) {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) => matches!(
                    e.kind(),
                    ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted
                ),
            }
        }
    }

    fn post(channel: &str, body: &str, headers: &[(&str, &str)]) -> Vec<u8> {
        let mut r = format!(
            "POST /ch/{channel} HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (n, v) in headers {
            r.push_str(&format!("{n}: {v}\r\n"));
        }
        r.push_str("\r\n");
        r.push_str(body);
        r.into_bytes()
    }

    fn get(path: &str) -> Vec<u8> {
        format!("GET {path} HTTP/1.1\r\nHost: sim\r\n\r\n").into_bytes()
    }

    fn send_once(sim: &Simulator, channel: &str, body: &str, headers: &[(&str, &str)]) -> Resp {
        Client::connect(sim.port()).roundtrip(&post(channel, body, headers))
    }

    #[test]
    fn accept_stores_and_answers_with_id() {
        let sim = Simulator::start();
        assert_eq!(sim.base_url(), format!("http://127.0.0.1:{}", sim.port()));
        assert_eq!(sim.send_url("a"), format!("{}/ch/a", sim.base_url()));
        let r = send_once(&sim, "a", r#"{"to":"x"}"#, &[("Idempotency-Key", "k-1")]);
        assert_eq!(r.status, 200);
        let v = r.json();
        assert_eq!(v["status"], "accepted");
        let id = v["id"].as_str().unwrap().to_string();
        assert_eq!(id, "msg-a-1");
        assert_eq!(r.header("X-Message-Id"), Some(id.as_str()));

        let stored = sim.stored("a");
        assert_eq!(stored.len(), 1);
        assert_eq!(stored[0].external_id, id);
        assert_eq!(stored[0].key.as_deref(), Some("k-1"));
        assert_eq!(stored[0].body, br#"{"to":"x"}"#);

        let sends = sim.sends("a");
        assert_eq!(sends.len(), 1);
        let s = &sends[0];
        assert_eq!(
            (s.kind, s.method.as_str(), s.path.as_str()),
            ("send", "POST", "/ch/a")
        );
        assert_eq!(s.outcome, "accepted");
        assert_eq!(s.status, Some(200));
        assert_eq!(s.external_id.as_deref(), Some(id.as_str()));
        assert!(s
            .headers
            .contains(&("idempotency-key".to_string(), "k-1".to_string())));
        assert_eq!(sim.header_values("a", "IDEMPOTENCY-KEY"), vec!["k-1"]);
        assert_eq!(s.body, br#"{"to":"x"}"#);
        let c = sim.counters();
        assert_eq!((c.sends, c.accepted, c.stored), (1, 1, 1));
        assert!(sim.stored("other").is_empty());
    }

    #[test]
    fn key_falls_back_to_x_effect_key() {
        let sim = Simulator::start();
        send_once(&sim, "k", "{}", &[("X-Effect-Key", "e-1")]);
        send_once(&sim, "k", "{}", &[]);
        let keys: Vec<_> = sim.stored("k").into_iter().map(|s| s.key).collect();
        assert_eq!(keys, vec![Some("e-1".to_string()), None]);
    }

    #[test]
    fn keep_alive_serves_many_requests_on_one_connection() {
        let sim = Simulator::start();
        let mut c = Client::connect(sim.port());
        let mut ids = Vec::new();
        for i in 0..3 {
            let r = c.roundtrip(&post("ka", &format!("{{\"n\":{i}}}"), &[]));
            assert_eq!(r.status, 200);
            assert_eq!(r.header("Connection"), None);
            ids.push(r.json()["id"].as_str().unwrap().to_string());
        }
        assert_eq!(ids, vec!["msg-ka-1", "msg-ka-2", "msg-ka-3"]);
        // Pipelined: two requests in one write.
        let mut two = post("ka", "{}", &[]);
        two.extend(post("ka", "{}", &[]));
        c.write(&two);
        assert_eq!(c.read_response().unwrap().status, 200);
        assert_eq!(c.read_response().unwrap().status, 200);
        // Connection: close is honoured.
        let r = c.roundtrip(&post("ka", "{}", &[("Connection", "close")]));
        assert_eq!(r.status, 200);
        assert_eq!(r.header("Connection"), Some("close"));
        assert!(c.closed());
        assert_eq!(sim.counters().connections, 1);
        assert_eq!(sim.stored("ka").len(), 6);
    }

    #[test]
    fn http10_closes_unless_keep_alive() {
        let sim = Simulator::start();
        let mut c = Client::connect(sim.port());
        let r = c.roundtrip(b"POST /ch/h HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}");
        assert_eq!(r.status, 200);
        assert!(c.closed());
        let mut c = Client::connect(sim.port());
        let req = b"POST /ch/h HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\n{}";
        let r = c.roundtrip(req);
        assert_eq!(r.header("Connection"), Some("keep-alive"));
        assert_eq!(c.roundtrip(req).status, 200);
    }

    #[test]
    fn chunked_body_is_decoded() {
        let sim = Simulator::start();
        let mut c = Client::connect(sim.port());
        c.write(b"POST /ch/chunk HTTP/1.1\r\nHost: sim\r\nTransfer-Encoding: chunked\r\n\r\n");
        // Sent in awkward pieces, with a chunk extension and a trailer.
        for piece in [
            &b"5\r\nhel"[..],
            b"lo\r\n",
            b"7;ext=1\r\n, world\r",
            b"\n0\r\nX-Trailer: t\r\n",
            b"\r\n",
        ] {
            c.write(piece);
            std::thread::sleep(Duration::from_millis(10));
        }
        let r = c.read_response().unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(sim.stored("chunk")[0].body, b"hello, world");
        // The connection is still usable afterwards.
        let r = c.roundtrip(
            b"POST /ch/chunk HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        );
        assert_eq!(r.status, 200);
        assert_eq!(sim.stored("chunk")[1].body, b"abc");
    }

    #[test]
    fn expect_100_continue() {
        let sim = Simulator::start();
        let mut c = Client::connect(sim.port());
        c.write(b"POST /ch/e HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n");
        while find_head_end(&c.buf, 0).is_none() {
            c.fill().unwrap();
        }
        assert!(c.buf.starts_with(b"HTTP/1.1 100 Continue\r\n\r\n"));
        c.write(b"body");
        assert_eq!(c.read_response().unwrap().status, 200);
        assert_eq!(sim.stored("e")[0].body, b"body");
    }

    #[test]
    fn plan_of_503s_then_default_accept() {
        let sim = Simulator::start();
        sim.set_plan("p", vec![Action::Status(503), Action::Status(503)]);
        let mut c = Client::connect(sim.port());
        let statuses: Vec<u16> = (0..4)
            .map(|_| c.roundtrip(&post("p", "{}", &[])).status)
            .collect();
        assert_eq!(statuses, vec![503, 503, 200, 200]);
        let outcomes: Vec<String> = sim.sends("p").into_iter().map(|r| r.outcome).collect();
        assert_eq!(
            outcomes,
            vec!["status:503", "status:503", "accepted", "accepted"]
        );
        assert_eq!(sim.stored("p").len(), 2);
        assert_eq!(sim.counters().status_errors, 2);

        sim.set_default("p", Action::Status(500));
        let r = c.roundtrip(&post("p", "{}", &[]));
        assert_eq!(r.status, 500);
        assert!(r.json()["error"].is_string());
    }

    #[test]
    fn status_429_carries_retry_after() {
        let sim = Simulator::start();
        sim.set_plan(
            "r",
            vec![Action::StatusWithHeaders(
                429,
                vec![("Retry-After".to_string(), "2".to_string())],
            )],
        );
        let r = send_once(&sim, "r", "{}", &[]);
        assert_eq!(r.status, 429);
        assert_eq!(r.header("retry-after"), Some("2"));
        assert!(sim.stored("r").is_empty());
        assert_eq!(sim.sends("r")[0].outcome, "status:429");
    }

    #[test]
    fn drop_after_read_stores_then_dedupe_returns_same_id() {
        let sim = Simulator::start();
        sim.set_dedupe("d", "Idempotency-Key");
        sim.set_plan("d", vec![Action::DropAfterRead { store: true }]);
        let mut c = Client::connect(sim.port());
        c.write(&post("d", r#"{"n":1}"#, &[("idempotency-key", "K")]));
        let err = c.read_response().err().expect("no response after a drop");
        assert!(
            matches!(
                err.kind(),
                ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset
            ),
            "{err:?}"
        );
        assert!(c.buf.is_empty(), "nothing at all was written");
        let stored = sim.stored("d");
        assert_eq!(stored.len(), 1);
        let first_id = stored[0].external_id.clone();

        // The client retries with the same key: same id, nothing new stored.
        let r = send_once(&sim, "d", r#"{"n":1}"#, &[("Idempotency-Key", "K")]);
        assert_eq!(r.status, 200);
        assert_eq!(r.json()["id"], first_id.as_str());
        assert_eq!(r.header("x-message-id"), Some(first_id.as_str()));
        assert_eq!(sim.stored("d").len(), 1);
        let outcomes: Vec<_> = sim
            .sends("d")
            .into_iter()
            .map(|r| (r.outcome, r.external_id))
            .collect();
        assert_eq!(
            outcomes,
            vec![
                ("dropped".to_string(), Some(first_id.clone())),
                ("deduped".to_string(), Some(first_id.clone())),
            ]
        );
        // A different key is stored anew.
        let r = send_once(&sim, "d", "{}", &[("Idempotency-Key", "K2")]);
        assert_ne!(r.json()["id"], first_id.as_str());
        let c = sim.counters();
        assert_eq!((c.dropped, c.deduped, c.accepted, c.stored), (1, 1, 1, 2));
    }

    #[test]
    fn drop_without_store_and_plan_before_dedupe() {
        let sim = Simulator::start();
        sim.set_dedupe("x", "X-Dedupe");
        let first = send_once(&sim, "x", "{}", &[("x-dedupe", "a")]);
        // Status actions come before any dedupe check; then the duplicate is deduped.
        sim.set_plan(
            "x",
            vec![Action::Status(503), Action::DropAfterRead { store: false }],
        );
        assert_eq!(send_once(&sim, "x", "{}", &[("X-Dedupe", "a")]).status, 503);
        let mut c = Client::connect(sim.port());
        c.write(&post("x", "{}", &[("X-Dedupe", "a")]));
        assert!(c.read_response().is_err());
        let again = send_once(&sim, "x", "{}", &[("X-Dedupe", "a")]);
        assert_eq!(again.json()["id"], first.json()["id"]);
        assert_eq!(sim.stored("x").len(), 1);
        // Idempotency-Key is not the configured dedupe header: stored anew.
        send_once(&sim, "x", "{}", &[("Idempotency-Key", "a")]);
        assert_eq!(sim.stored("x").len(), 2);
        let outcomes: Vec<_> = sim.sends("x").into_iter().map(|r| r.outcome).collect();
        assert_eq!(
            outcomes,
            vec!["accepted", "status:503", "dropped", "deduped", "accepted"]
        );
    }

    #[test]
    fn hang_never_answers_and_shutdown_closes() {
        let sim = Simulator::start();
        sim.set_plan("h", vec![Action::Hang { store: true }]);
        let mut c = Client::connect(sim.port());
        c.s.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        c.write(&post("h", "{}", &[("Idempotency-Key", "hk")]));
        let t = Instant::now();
        let err = c.read_response().err().expect("no answer");
        assert!(
            matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "{err:?}"
        );
        assert!(t.elapsed() >= Duration::from_millis(250));
        assert_eq!(sim.stored("h").len(), 1);
        assert_eq!(sim.sends("h")[0].outcome, "hang");
        assert_eq!(sim.counters().hangs, 1);
        // Other connections are unaffected.
        assert_eq!(send_once(&sim, "h", "{}", &[]).status, 200);

        // Shutting down closes the hung connection.
        c.s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let t = Instant::now();
        sim.shutdown();
        assert!(t.elapsed() < Duration::from_secs(3));
        assert!(c.closed());
        assert!(StdStream::connect(("127.0.0.1", sim.port())).is_err());
    }

    #[test]
    fn accept_after_waits() {
        let sim = Simulator::start();
        sim.set_plan(
            "slow",
            vec![Action::AcceptAfter(Duration::from_millis(800))],
        );
        let mut c = Client::connect(sim.port());
        let t = Instant::now();
        c.write(&post("slow", "{}", &[]));
        assert!(sim.wait_for_sends("slow", 1, Duration::from_secs(2)));
        assert_eq!(sim.sends("slow")[0].outcome, "delayed");
        assert!(sim.stored("slow").is_empty());
        let r = c.read_response().unwrap();
        assert!(t.elapsed() >= Duration::from_millis(780));
        assert_eq!(r.status, 200);
        assert_eq!(sim.sends("slow")[0].outcome, "accepted");
        assert_eq!(sim.stored("slow").len(), 1);
    }

    #[test]
    fn accept_large_pads_the_answer_to_its_size() {
        let sim = Simulator::start();
        sim.set_dedupe("big", "Idempotency-Key");
        sim.set_default("big", Action::AcceptLarge(10_000_000));
        let mut c = Client::connect(sim.port());
        let r = c.roundtrip(&post("big", "{}", &[("Idempotency-Key", "k1")]));
        assert_eq!(r.status, 200);
        assert_eq!(r.body.len(), 10_000_000);
        assert!(r
            .body
            .starts_with(br#"{"id":"msg-big-1","status":"accepted","pad":"xx"#));
        assert!(r.body.ends_with(br#"xx"}"#));
        let v = r.json();
        assert_eq!(
            (v["id"].as_str(), v["status"].as_str()),
            (Some("msg-big-1"), Some("accepted"))
        );
        assert_eq!(r.header("X-Message-Id"), Some("msg-big-1"));
        // The connection stays usable, and a duplicate is deduped with the same padding.
        let r = c.roundtrip(&post("big", "{}", &[("Idempotency-Key", "k1")]));
        assert_eq!((r.status, r.body.len()), (200, 10_000_000));
        assert_eq!(r.json()["id"], "msg-big-1");
        let outcomes: Vec<_> = sim.sends("big").into_iter().map(|r| r.outcome).collect();
        assert_eq!(outcomes, vec!["accepted", "deduped"]);
        assert_eq!(sim.stored("big").len(), 1);
        // Too small a size: the shortest body, with an empty pad.
        sim.set_plan("big", vec![Action::AcceptLarge(1)]);
        let r = c.roundtrip(&post("big", "{}", &[]));
        assert_eq!(
            r.body,
            br#"{"id":"msg-big-2","status":"accepted","pad":""}"#
        );
    }

    #[test]
    fn accept_large_survives_clients_that_stop_reading() {
        let sim = Arc::new(Simulator::start());
        sim.set_default("cut", Action::AcceptLarge(10_000_000));
        let threads: Vec<_> = (0..16)
            .map(|_| {
                let port = sim.port();
                std::thread::spawn(move || {
                    // Read the head and some 64 KiB of the body, then hang up.
                    let mut c = Client::connect(port);
                    c.write(&post("cut", "{}", &[]));
                    while c.buf.len() < 64 * 1024 {
                        c.fill().unwrap();
                    }
                    assert!(c.buf.starts_with(b"HTTP/1.1 200 OK\r\n"));
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(sim.stored("cut").len(), 16);
        assert!(sim.sends("cut").iter().all(|r| r.outcome == "accepted"));
        // Still serving, large answers included.
        let r = send_once(&sim, "cut", "{}", &[]);
        assert_eq!((r.status, r.body.len()), (200, 10_000_000));
        sim.set_default("cut", Action::Accept);
        assert_eq!(send_once(&sim, "cut", "{}", &[]).json()["id"], "msg-cut-18");
    }

    #[test]
    fn lookups_by_key_and_id() {
        let sim = Simulator::start();
        let id = send_once(&sim, "l", "{}", &[("Idempotency-Key", "a b/c")]).json()["id"]
            .as_str()
            .unwrap()
            .to_string();
        let by_key = sim.lookup_url_by_key("l");
        assert_eq!(
            by_key,
            format!("http://127.0.0.1:{}/ch/l/by-key/{{effect_key}}", sim.port())
        );
        let by_id = sim.lookup_url_by_id("l");
        assert!(by_id.ends_with("/ch/l/by-id/{external_id}"));
        let path = |url: &str, v: &str| {
            url.replace(&sim.base_url(), "")
                .replace("{effect_key}", v)
                .replace("{external_id}", v)
        };

        let mut c = Client::connect(sim.port());
        let r = c.roundtrip(&get(&path(&by_key, "a%20b%2Fc")));
        assert_eq!(r.status, 200);
        let v = r.json();
        assert_eq!(
            (v["found"].as_bool(), v["id"].as_str(), v["key"].as_str()),
            (Some(true), Some(id.as_str()), Some("a b/c"))
        );
        let r = c.roundtrip(&get(&path(&by_id, &id)));
        assert_eq!(r.status, 200);
        assert_eq!(r.json()["id"], id.as_str());
        let r = c.roundtrip(&get(&path(&by_key, "nope")));
        assert_eq!(r.status, 404);
        assert_eq!(r.json(), serde_json::json!({"found": false}));
        let r = c.roundtrip(&get(&path(&by_id, "msg-l-999")));
        assert_eq!(r.status, 404);

        // Lookups are recorded, never stored.
        assert_eq!(sim.stored("l").len(), 1);
        assert_eq!(sim.sends("l").len(), 1);
        let outcomes: Vec<_> = sim
            .requests("l")
            .into_iter()
            .filter(|r| r.kind == "lookup")
            .map(|r| r.outcome)
            .collect();
        assert_eq!(
            outcomes,
            vec![
                "lookup:found",
                "lookup:found",
                "lookup:not_found",
                "lookup:not_found"
            ]
        );

        // Lookup plan.
        sim.set_lookup_plan("l", vec![LookupAction::Status(500), LookupAction::Drop]);
        assert_eq!(c.roundtrip(&get(&path(&by_id, &id))).status, 500);
        c.write(&get(&path(&by_id, &id)));
        assert!(c.read_response().is_err());
        let mut c = Client::connect(sim.port());
        assert_eq!(c.roundtrip(&get(&path(&by_id, &id))).status, 200);
        let c = sim.counters();
        assert_eq!((c.lookups, c.lookups_found, c.lookups_not_found), (7, 3, 2));
    }

    #[test]
    fn malformed_requests_get_400_and_close() {
        let sim = Simulator::start();
        let bad: &[&[u8]] = &[
            b"garbage\r\n\r\n",
            b"POST /ch/a HTTP/9.9\r\n\r\n",
            b"POST /ch/a HTTP/1.1\r\nNoColonHere\r\n\r\n",
            b"POST /ch/a HTTP/1.1\r\nBad Name: x\r\n\r\n",
            b"POST /ch/a HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
            b"POST /ch/a HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nxx",
            b"POST /ch/a HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"POST /ch/a HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
            b"POST /ch/a HTTP/1.1\r\nX: a\r\n folded\r\n\r\n",
            b"POST /ch/a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"POST /ch/a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabX\r\n",
            b"\x00\xff\xfe binary\r\n\r\n",
        ];
        for raw in bad {
            let mut c = Client::connect(sim.port());
            let r = c.roundtrip(raw);
            assert_eq!(r.status, 400, "{:?}", String::from_utf8_lossy(raw));
            assert_eq!(r.header("connection"), Some("close"));
            assert!(c.closed(), "{:?}", String::from_utf8_lossy(raw));
        }
        assert_eq!(sim.counters().bad_requests, bad.len() as u64);
        assert!(sim.stored("a").is_empty());
        // Too large a head.
        let mut c = Client::connect(sim.port());
        let mut big = b"POST /ch/a HTTP/1.1\r\nX: ".to_vec();
        big.extend(std::iter::repeat_n(b'a', MAX_HEAD + 10));
        c.write(&big);
        assert_eq!(c.read_response().unwrap().status, 431);
        // Still serving.
        assert_eq!(send_once(&sim, "a", "{}", &[]).status, 200);
    }

    #[test]
    fn random_faults_are_deterministic() {
        let faults = RandomFaults {
            drop_after_read_store: 0.2,
            status_503: 0.2,
            status_429: 0.2,
            retry_after_s: 3,
            seed: 42,
        };
        let run = |f: RandomFaults| -> Vec<String> {
            let sim = Simulator::start();
            sim.set_default("rnd", Action::Random(f));
            for i in 0..60 {
                let mut c = Client::connect(sim.port());
                c.write(&post("rnd", "{}", &[("Idempotency-Key", &format!("k{i}"))]));
                match c.read_response() {
                    Ok(r) if r.status == 429 => assert_eq!(r.header("Retry-After"), Some("3")),
                    Ok(_) => {}
                    Err(_) => {}
                }
            }
            let sends = sim.sends("rnd");
            let stored = sim.stored("rnd");
            let expect_stored = sends
                .iter()
                .filter(|r| r.outcome == "accepted" || r.outcome == "dropped")
                .count();
            assert_eq!(stored.len(), expect_stored);
            sends.into_iter().map(|r| r.outcome).collect()
        };
        let a = run(faults);
        let b = run(faults);
        assert_eq!(a, b);
        for o in ["accepted", "dropped", "status:503", "status:429"] {
            assert!(a.iter().any(|x| x == o), "{o} never drawn in {a:?}");
        }
        let c = run(RandomFaults { seed: 43, ..faults });
        assert_ne!(a, c);
    }

    #[test]
    fn random_faults_parse() {
        let f = RandomFaults::parse("drop=0.05,503=0.05,429=0.02,retry_after=1,seed=7").unwrap();
        assert_eq!(
            f,
            RandomFaults {
                drop_after_read_store: 0.05,
                status_503: 0.05,
                status_429: 0.02,
                retry_after_s: 1,
                seed: 7
            }
        );
        assert!(RandomFaults::parse("drop=0.7,503=0.7").is_err());
        assert!(RandomFaults::parse("nope=1").is_err());
        assert!(RandomFaults::parse("drop").is_err());
    }

    #[test]
    fn stats_requests_and_other_paths() {
        let sim = Simulator::start();
        send_once(&sim, "s", "hello", &[("Idempotency-Key", "k")]);
        let mut c = Client::connect(sim.port());
        let stats = c.roundtrip(&get("/_stats")).json();
        assert_eq!(stats["sends"], 1);
        assert_eq!(stats["accepted"], 1);
        let reqs = c.roundtrip(&get("/_requests?channel=s")).json();
        assert_eq!(reqs[0]["body"], "hello");
        assert_eq!(reqs[0]["outcome"], "accepted");
        assert_eq!(reqs[0]["external_id"], "msg-s-1");
        assert_eq!(reqs[0]["key"], "k");
        assert_eq!(c.roundtrip(&get("/nowhere")).status, 404);
        assert_eq!(c.roundtrip(&get("/ch/s")).status, 405);
        assert_eq!(c.roundtrip(&get("/ch/s/by-what/x")).status, 404);
        let kinds: Vec<_> = sim.requests("s").into_iter().map(|r| r.kind).collect();
        assert_eq!(kinds, vec!["send", "other", "other"]);

        // HEAD gets the head only.
        c.write(b"HEAD /ch/s HTTP/1.1\r\n\r\n");
        while find_head_end(&c.buf, 0).is_none() {
            c.fill().unwrap();
        }
        assert!(c.buf.starts_with(b"HTTP/1.1 405 "));
        assert!(
            c.buf.ends_with(b"\r\n\r\n"),
            "no body after a HEAD response"
        );
        c.buf.clear();
        assert_eq!(c.roundtrip(&get("/_stats")).status, 200);
        // Any method but GET is a send.
        let r = c.roundtrip(b"PUT /ch/s HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
        assert_eq!(r.status, 200);
        assert_eq!(sim.sends("s").len(), 2);
    }

    #[test]
    fn reset_forgets_traffic_and_plans() {
        let sim = Simulator::start();
        sim.set_plan("z", vec![Action::Status(503)]);
        send_once(&sim, "z", "{}", &[]);
        send_once(&sim, "z", "{}", &[]);
        sim.set_plan("z", vec![Action::Status(503)]);
        sim.reset("z");
        assert!(sim.requests("z").is_empty() && sim.stored("z").is_empty());
        assert_eq!(sim.send_count("z"), 0);
        let r = send_once(&sim, "z", "{}", &[]);
        assert_eq!(r.status, 200);
        // Ids stay unique across a reset.
        assert_eq!(r.json()["id"], "msg-z-2");
    }

    #[test]
    fn recording_switches_keep_counters() {
        let sim = Simulator::start();
        sim.set_record_bodies(false);
        send_once(&sim, "b", "secret", &[]);
        assert!(sim.sends("b")[0].body.is_empty());
        assert!(sim.stored("b")[0].body.is_empty());
        sim.set_record_requests(false);
        send_once(&sim, "b", "x", &[]);
        assert_eq!(sim.sends("b").len(), 1);
        assert_eq!(sim.send_count("b"), 2);
        assert!(sim.wait_for_sends("b", 2, Duration::from_millis(10)));
        assert_eq!(sim.stored("b").len(), 2);
        assert_eq!(sim.counters().accepted, 2);
    }

    #[test]
    fn wait_for_stored_wakes_up() {
        let sim = Arc::new(Simulator::start());
        assert!(!sim.wait_for_stored("w", 1, Duration::from_millis(50)));
        let s2 = sim.clone();
        let t = std::thread::spawn(move || s2.wait_for_stored("w", 3, Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(50));
        for _ in 0..3 {
            send_once(&sim, "w", "{}", &[]);
        }
        assert!(t.join().unwrap());
    }

    #[test]
    fn observer_sees_final_outcomes() {
        let sim = Simulator::start();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        sim.set_observer(move |r| s2.lock().unwrap().push((r.outcome.clone(), r.status)));
        sim.set_plan("o", vec![Action::Status(503)]);
        send_once(&sim, "o", "{}", &[]);
        send_once(&sim, "o", "{}", &[]);
        assert_eq!(
            *seen.lock().unwrap(),
            vec![
                ("status:503".to_string(), Some(503)),
                ("accepted".to_string(), Some(200))
            ]
        );
    }

    #[test]
    fn concurrent_keep_alive_clients() {
        let sim = Arc::new(Simulator::start());
        sim.set_record_bodies(false);
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let port = sim.port();
                std::thread::spawn(move || {
                    let mut c = Client::connect(port);
                    for i in 0..250 {
                        let key = format!("t{t}-{i}");
                        let r = c.roundtrip(&post("load", "{}", &[("Idempotency-Key", &key)]));
                        assert_eq!(r.status, 200);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let stored = sim.stored("load");
        assert_eq!(stored.len(), 2000);
        let ids: std::collections::HashSet<_> = stored.iter().map(|s| &s.external_id).collect();
        assert_eq!(ids.len(), 2000);
        assert_eq!(sim.counters().connections, 8);
    }

    /// Throughput of `Accept` over many keep-alive connections. Not part of the normal run:
    /// `cargo test -p outbox_e2e --release --lib -- --ignored bench --nocapture`.
    #[test]
    #[ignore]
    fn bench_accept_throughput() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        const CONNS: usize = 300;
        const PER_CONN: usize = 300;
        let sim = Simulator::start();
        sim.set_record_bodies(false);
        sim.set_record_requests(false);
        let port = sim.port();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let t = Instant::now();
        rt.block_on(async move {
            let mut tasks = Vec::new();
            for c in 0..CONNS {
                tasks.push(tokio::spawn(async move {
                    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
                        .await
                        .unwrap();
                    s.set_nodelay(true).unwrap();
                    let mut buf = vec![0u8; 4096];
                    for i in 0..PER_CONN {
                        let key = format!("c{c}-{i}");
                        s.write_all(&post(
                            "bench",
                            r#"{"payload":"x"}"#,
                            &[("Idempotency-Key", &key)],
                        ))
                        .await
                        .unwrap();
                        // Responses are small and arrive whole: read until the body end.
                        let mut got = 0;
                        loop {
                            let n = s.read(&mut buf[got..]).await.unwrap();
                            assert!(n > 0);
                            got += n;
                            if let Some(h) = find_head_end(&buf[..got], 0) {
                                let head = std::str::from_utf8(&buf[..h]).unwrap();
                                let len: usize = head
                                    .split("\r\n")
                                    .find_map(|l| l.strip_prefix("Content-Length: "))
                                    .unwrap()
                                    .parse()
                                    .unwrap();
                                if got >= h + 4 + len {
                                    assert!(head.starts_with("HTTP/1.1 200"));
                                    break;
                                }
                            }
                        }
                    }
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
        });
        let el = t.elapsed();
        let n = CONNS * PER_CONN;
        assert_eq!(sim.counters().accepted, n as u64);
        println!(
            "{n} requests over {CONNS} connections in {el:?}: {:.0} req/s",
            n as f64 / el.as_secs_f64()
        );
    }
}
