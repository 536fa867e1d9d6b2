//! What a channel plays: its plan of [`Action`]s, its default, and the stored messages.

use super::*;

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

pub(super) struct Channel {
    pub(super) name: String,
    pub(super) plan: VecDeque<Action>,
    pub(super) default: Action,
    /// Actions for the sends whose key starts with a prefix, in place of `default` (the
    /// plan still comes first): a provider that fails one tenant's messages alone.
    pub(super) by_key_prefix: Vec<(String, Action)>,
    pub(super) lookup_plan: VecDeque<LookupAction>,
    /// Lowercased.
    pub(super) dedupe_header: Option<String>,
    pub(super) rng: Option<SplitMix64>,
    pub(super) next_id: u64,
    pub(super) stored: Vec<Stored>,
    pub(super) by_key: HashMap<String, usize>,
    pub(super) by_id: HashMap<String, usize>,
    pub(super) received: Vec<Received>,
    pub(super) sends: usize,
}

impl Channel {
    pub(super) fn new(name: &str, default: Action, dedupe_header: Option<String>) -> Channel {
        Channel {
            name: name.to_owned(),
            plan: VecDeque::new(),
            default,
            by_key_prefix: Vec::new(),
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

    /// Takes the next action (plan first, then the action for the send's key prefix, then
    /// default) and resolves `Random`.
    pub(super) fn next_step(&mut self, key: Option<&str>) -> Step {
        let popped = self.plan.pop_front();
        let for_key = key.and_then(|k| {
            self.by_key_prefix
                .iter()
                .find(|(prefix, _)| k.starts_with(prefix.as_str()))
                .map(|(_, a)| a)
        });
        let action = popped.as_ref().or(for_key).unwrap_or(&self.default);
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
    pub(super) fn store(
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

    pub(super) fn clear(&mut self, default: Action, dedupe_header: Option<String>) {
        // next_id is kept so that external ids stay unique across resets.
        let next_id = self.next_id;
        *self = Channel::new(&self.name, default, dedupe_header);
        self.next_id = next_id;
    }
}

pub(super) enum Step {
    /// Accept after an optional wait; the answer's body is padded to this many bytes (0:
    /// the plain accept body).
    Accept(Option<Duration>, usize),
    Status(u16, Vec<(String, String)>),
    Hang(bool),
    Drop(bool),
}

/// splitmix64: tiny, deterministic, good enough for fault injection.
#[derive(Debug, Clone, Copy)]
pub(super) struct SplitMix64(u64);

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
