//! What a claim hands out: the channels as the worker read them with the claim
//! (`Channels`, loaded again after any change of `outbox._channels`) and the claimed
//! messages with their open attempts (`Job`). The claim (`claim`) makes them; the sends
//! (`send`), the flow control (`flow`) and the record (`record`) read them.

use super::claim_cursor::Position;
use crate::channels::fence::Fence;
use crate::channels::options::ChannelOptions;
use crate::spi::{self, Statement};
use pgrx::spi::{SpiClient, SpiResult};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// Every channel, read again after any change of the table (`Channels::load`).
static LOAD_CHANNELS: Statement = Statement::planned_once(
    "\
    SELECT id, name, endpoint, options::text, paused, updated_at::text FROM outbox._channels",
);

/// The table of the channels, whose invalidations say that they changed.
static CHANNELS_TABLE: Statement =
    Statement::planned_once("SELECT 'outbox._channels'::pg_catalog.regclass::pg_catalog.oid");

/// A channel as the worker sees it; options that fail to parse are kept as the error text
/// so that its messages fail readably instead of stopping the worker.
#[derive(Debug, Clone)]
pub struct Channel {
    pub name: String,
    pub endpoint: String,
    pub version: String,
    pub options: Result<ChannelOptions, String>,
}

#[derive(Debug, Default)]
pub struct Channels {
    pub by_id: HashMap<i32, Channel>,
    /// The longest `timeout_ms` and retry horizon of any channel, taken at the load.
    longest_attempt_ms: u64,
    longest_retry_horizon_ms: u64,
}

/// A channel's options as parsed, with the text and the name they were parsed from.
struct ParsedOptions {
    name: String,
    text: String,
    options: Result<ChannelOptions, String>,
}

thread_local! {
    /// The channels as last loaded, with the configuration generation they were loaded in
    /// (`crate::config_cache`): every statement that changes `outbox._channels` moves it, so
    /// a claim reads the table again only after a change. Reading it at each claim cost a
    /// claim about 47 ms with 10,000 channels (BENCHMARKS.md).
    static LOADED: RefCell<Option<(u64, Rc<Channels>)>> = const { RefCell::new(None) };
    /// Each channel's options as last parsed: a change of one channel reads them all again,
    /// and parsing every channel's options again was most of such a read. Parsing is a
    /// function of the text alone (no setting, file or variable of the environment is
    /// read), so options whose text did not change are taken from here.
    static PARSED_OPTIONS: RefCell<HashMap<i32, ParsedOptions>> = RefCell::new(HashMap::new());
}

/// `text`, the options of the channel `name`, parsed; the error says which option is wrong.
fn parse_options(name: &str, text: &str) -> Result<ChannelOptions, String> {
    serde_json::from_str(text)
        .map_err(|e| e.to_string())
        .and_then(|v| {
            ChannelOptions::from_json(&v).map_err(|e| format!("option {}: {}", e.option, e.message))
        })
        .map_err(|e| format!("channel \"{name}\" has invalid options ({e})"))
}

impl Channels {
    /// The channels as committed when the transaction began, or later: read from the table
    /// when a change has been seen since the last read, else the last read shared.
    pub fn load(client: &SpiClient<'_>) -> SpiResult<Rc<Channels>> {
        if !crate::config_cache::channels_watched() {
            if let Some(oid) = spi::run(client, &CHANNELS_TABLE, Some(1), &[])?
                .first()
                .get::<pgrx::pg_sys::Oid>(1)?
            {
                crate::config_cache::watch_channels(oid);
            }
        }
        let generation = crate::config_cache::channels_generation();
        if let Some(channels) = LOADED.with(|l| {
            l.borrow()
                .as_ref()
                .filter(|(at, _)| *at == generation)
                .map(|(_, c)| c.clone())
        }) {
            return Ok(channels);
        }
        let channels = Rc::new(Self::read(client)?);
        LOADED.with(|l| *l.borrow_mut() = Some((generation, channels.clone())));
        Ok(channels)
    }

    fn read(client: &SpiClient<'_>) -> SpiResult<Channels> {
        let mut by_id = HashMap::new();
        for row in spi::run(client, &LOAD_CHANNELS, None, &[])? {
            let Some(id) = row.get::<i32>(1)? else {
                continue;
            };
            let name = row.get::<String>(2)?.unwrap_or_default();
            let endpoint = row.get::<String>(3)?.unwrap_or_default();
            let text = row.get::<String>(4)?.unwrap_or_default();
            let version = row.get::<String>(6)?.unwrap_or_default();
            let options = PARSED_OPTIONS.with(|parsed| {
                let mut parsed = parsed.borrow_mut();
                match parsed.get(&id) {
                    Some(p) if p.text == text && p.name == name => p.options.clone(),
                    _ => {
                        let options = parse_options(&name, &text);
                        let kept = ParsedOptions {
                            name: name.clone(),
                            text,
                            options: options.clone(),
                        };
                        parsed.insert(id, kept);
                        options
                    }
                }
            });
            by_id.insert(
                id,
                Channel {
                    name,
                    endpoint,
                    version,
                    options,
                },
            );
        }
        PARSED_OPTIONS.with(|parsed| parsed.borrow_mut().retain(|id, _| by_id.contains_key(id)));
        Ok(Channels::new(by_id))
    }

    fn new(by_id: HashMap<i32, Channel>) -> Channels {
        let valid = || by_id.values().filter_map(|c| c.options.as_ref().ok());
        let longest_attempt_ms = valid().map(|o| o.timeout_ms).max().unwrap_or(0);
        let longest_retry_horizon_ms = valid()
            .map(ChannelOptions::retry_horizon_ms)
            .max()
            .unwrap_or(0);
        Channels {
            by_id,
            longest_attempt_ms,
            longest_retry_horizon_ms,
        }
    }

    /// The longest request any channel allows (its `timeout_ms`), in ms: a lease must
    /// outlast it (`lease`).
    pub fn longest_attempt_ms(&self) -> u64 {
        self.longest_attempt_ms
    }

    /// The longest retry horizon of any channel, in ms: the ledger must outlive it.
    pub fn longest_retry_horizon_ms(&self) -> u64 {
        self.longest_retry_horizon_ms
    }
}

/// A claimed message with its open attempt.
#[derive(Debug, Clone)]
pub struct Job {
    pub message_id: i64,
    /// When the attempt started (µs since the epoch).
    pub started_at_us: i64,
    pub attempt: i32,
    pub tenant: String,
    pub channel_id: i32,
    /// The effect key as the provider sees it (`crate::effect_key::into_provider`, as
    /// `outbox._provider_key` gives it: qualified by the tenant outside the default tenant).
    pub effect_key: String,
    pub payload: String,
    pub headers: Option<String>,
    /// Start of the current retry budget (enqueue, or an operator's retry).
    pub budget_started_at_ms: i64,
    pub first_attempt_at_ms: i64,
    /// When the message was enqueued (unix ms).
    pub enqueued_at_ms: i64,
    /// Attempts counted against the current budget, this one included.
    pub budget_attempt: i64,
    /// Set when the effect is already in the ledger: (message that recorded it, external id).
    pub ledger: Option<(i64, Option<String>)>,
    /// Where the message stood in its channel's due index when it was claimed.
    pub position: Option<Position>,
    /// When its request may no longer start (`crate::channels::fence`).
    pub fence: Fence,
    /// Its place among the lanes of its channel (`lane_turns`).
    pub turn: Turn,
}

impl Job {
    /// Drops the payload and headers of a job whose outcome is recorded.
    pub fn release_payload(&mut self) {
        self.payload = String::new();
        self.headers = None;
    }
}

/// A claimed message's place among the tenants of its channel: how many lanes the channel
/// had in the claim, and its place in the channel's order of turns (from 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Turn {
    pub lanes: i32,
    pub pick: i64,
}

impl Job {
    /// What the retry policy needs to know about this attempt.
    pub fn context(&self, now_ms: i64) -> crate::worker::decide::AttemptContext {
        crate::worker::decide::AttemptContext::new(
            self.budget_attempt,
            now_ms,
            self.budget_started_at_ms,
            self.first_attempt_at_ms,
        )
    }
}
