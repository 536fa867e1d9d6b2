//! Channel options: parsed and validated as a whole, normalized with every default filled
//! in. Pure Rust: used by `create_channel` / `alter_channel` and by the worker.

use super::nats::target::{self as nats_options, NatsTarget, NATS_ONLY};
use crate::classify::Overrides;
use crate::retry_policy::RetryPolicy;
use serde_json::{json, Map, Value};

/// Where the provider's id for a delivered message is found in its answer.
#[derive(Debug, Clone, PartialEq)]
pub enum ExternalIdSource {
    /// A JSON pointer into the response body, e.g. `/id` or `/data/message/id`.
    Body(String),
    /// A response header, written `header:Name`.
    Header(String),
}

/// A read-only lookup at the provider, used by reconcile.
#[derive(Debug, Clone, PartialEq)]
pub struct ReconcileConfig {
    /// URL template; placeholders are listed in `reconcile::lookup`.
    pub url: String,
    pub method: String,
    /// JSON pointer to a boolean "found" in the answer; without it, any 2xx means found.
    pub found: Option<String>,
    /// JSON pointer to the provider's id in the answer.
    pub external_id: Option<String>,
    /// How long after an attempt started a "not found" is believed: a provider may still be
    /// processing a request whose answer never came. None: twice the channel's timeout.
    pub settle_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ChannelOptions {
    /// `http` (send to the endpoint) or `sql` (call a function in this database).
    pub kind: Kind,
    pub method: String,
    pub headers: Vec<(String, String)>,
    pub timeout_ms: u64,
    pub connect_timeout_ms: u64,
    pub idempotency_header: Option<String>,
    pub idempotency_window_ms: Option<u64>,
    /// A header that carries the effect key for correlation only (the provider stores it
    /// and can be asked for it by reconcile, but does not dedupe by it).
    pub reference_header: Option<String>,
    pub external_id: Option<ExternalIdSource>,
    pub reconcile: Option<ReconcileConfig>,
    pub retry: RetryPolicy,
    pub classify: Overrides,
    /// Rules that classify a refusing answer by what its body says (`answer_rules`).
    pub classify_answers: super::answer_rules::AnswerRules,
    pub max_in_flight: u32,
    /// Attempts open at once on a channel that can neither dedupe nor be asked
    /// ([`ChannelOptions::can_verify`]): each one a crash interrupts stops in `uncertain`
    /// for an operator, so this bounds what one crash leaves.
    pub max_unverifiable_in_flight: u32,
    /// The tenants that may enqueue on the channel; `["*"]` (the default): every tenant.
    pub tenants: Vec<String>,
    /// Most bytes of a response body the worker reads (for the external id); the rest of a
    /// longer body is not read.
    pub max_response_bytes: u64,
    /// Bytes of a refusing answer's body kept with its attempt (`answer_excerpt`); 0: none.
    pub response_excerpt_bytes: u64,
    /// Standard Webhooks signatures on every request (`signing`).
    pub signing: Option<super::signing::Signing>,
    /// Extra roots and a client certificate (`tls`).
    pub tls: Option<super::tls::TlsOptions>,
    /// Sends per second, all workers together (`rate_limit`).
    pub rate_limit: Option<super::rate_limit::RateLimit>,
    /// Circuit breaking (`circuit`).
    pub circuit: Option<super::circuit::CircuitOptions>,
}

/// Attempts open at once on a channel unless its `max_in_flight` says otherwise.
pub const DEFAULT_MAX_IN_FLIGHT: u32 = 64;

/// Attempts open at once on a channel that can neither dedupe nor be asked, unless its
/// `max_unverifiable_in_flight` says otherwise (BENCHMARKS.md: what it costs).
pub const DEFAULT_MAX_UNVERIFIABLE_IN_FLIGHT: u32 = 8;

/// Why a channel has the bound on attempts open at once it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InFlightBound {
    /// `max_in_flight`: an interrupted attempt is retried with the same key, or looked up.
    Verifiable(u32),
    /// `max_unverifiable_in_flight`: an interrupted attempt waits for an operator.
    Unverifiable(u32),
}

/// What `create_channel` and `alter_channel` say (a NOTICE: message, detail, hint) about
/// a channel that can neither dedupe nor be asked; `None` for any other channel.
pub fn unverifiable_notice(
    name: &str,
    options: &ChannelOptions,
) -> Option<(String, String, String)> {
    let InFlightBound::Unverifiable(limit) = options.in_flight_bound() else {
        return None;
    };
    Some((
        format!("channel \"{name}\" can neither dedupe nor be asked: a crash leaves each of its open attempts uncertain"),
        format!(
            "At most {limit} attempts are open on it at once (max_unverifiable_in_flight). After a crash of a worker or of the server, each of them waits in outbox.work_queue until an operator decides with outbox.resolve or outbox.retry."
        ),
        "Set idempotency_header if the provider dedupes by a key, or reconcile if it answers lookups: interrupted attempts then settle without an operator.".to_string(),
    ))
}

impl InFlightBound {
    pub fn limit(self) -> u32 {
        match self {
            InFlightBound::Verifiable(n) | InFlightBound::Unverifiable(n) => n,
        }
    }

    /// Why, as `outbox.channels` says it.
    pub fn reason(self) -> &'static str {
        match self {
            InFlightBound::Verifiable(_) => "max_in_flight",
            InFlightBound::Unverifiable(_) => "max_unverifiable_in_flight: no dedupe, no lookup",
        }
    }
}

/// The default of `max_response_bytes`: enough for any provider's JSON acknowledgement.
pub const DEFAULT_MAX_RESPONSE_BYTES: u64 = 64 * 1024;
/// The largest `max_response_bytes` a channel may set.
pub const MAX_RESPONSE_BYTES: u64 = 16 * 1024 * 1024;

/// How a channel performs its effect.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    Http,
    /// `function(payload jsonb, effect_key text) → text`, called as `run_as`.
    Sql {
        function: String,
        run_as: String,
    },
    /// Publish to a NATS JetStream stream, acknowledged.
    Nats(NatsTarget),
}

/// Options that only mean something for an HTTP channel.
const HTTP_ONLY: &[&str] = &[
    "method",
    "max_response_bytes",
    "response_excerpt_bytes",
    "max_unverifiable_in_flight",
    "headers",
    "idempotency_header",
    "idempotency_window_ms",
    "reference_header",
    "external_id",
    "reconcile",
    "classify",
    "classify_answers",
    "signing",
    "tls",
    "rate_limit",
    "circuit",
];

pub use super::option_error::OptionError;
use super::secrets::{number_or_shape, shape};

const KNOWN_KEYS: &[&str] = &[
    "kind",
    "method",
    "headers",
    "timeout_ms",
    "connect_timeout_ms",
    "idempotency_header",
    "idempotency_window_ms",
    "reference_header",
    "external_id",
    "reconcile",
    "retry",
    "classify",
    "classify_answers",
    "max_in_flight",
    "max_unverifiable_in_flight",
    "function",
    "run_as",
    "tenants",
    "max_response_bytes",
    "response_excerpt_bytes",
    "subject",
    "stream",
    "auth",
    "duplicate_window_ms",
    "signing",
    "tls",
    "rate_limit",
    "circuit",
];

const METHODS: &[&str] = &["POST", "PUT", "PATCH", "GET", "DELETE"];

impl Default for ChannelOptions {
    fn default() -> Self {
        ChannelOptions {
            kind: Kind::Http,
            method: "POST".into(),
            headers: Vec::new(),
            timeout_ms: 10_000,
            connect_timeout_ms: 3_000,
            idempotency_header: None,
            idempotency_window_ms: None,
            reference_header: None,
            external_id: None,
            reconcile: None,
            retry: RetryPolicy::default(),
            classify: Overrides::default(),
            classify_answers: Default::default(),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_unverifiable_in_flight: DEFAULT_MAX_UNVERIFIABLE_IN_FLIGHT,
            tenants: vec!["*".into()],
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            response_excerpt_bytes: super::answer_excerpt::DEFAULT_BYTES,
            signing: None,
            tls: None,
            rate_limit: None,
            circuit: None,
        }
    }
}

/// Is `s` an HTTP token (a valid header name or method)?
pub fn is_http_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Is `s` a header value HTTP can carry? No control character but the horizontal tab: CR
/// and LF would inject headers; NUL, DEL and the C1 controls (U+0080..U+009F) are refused
/// too. Other non-ASCII text is allowed (sent as its UTF-8 bytes).
pub fn is_http_header_value(s: &str) -> bool {
    s.chars().all(|c| c == '\t' || !c.is_control())
}

/// Most static headers a channel may have.
pub const MAX_HEADERS: usize = 32;
/// Longest static header name, in bytes.
pub const MAX_HEADER_NAME_BYTES: usize = 256;
/// Longest static header value, in bytes.
pub const MAX_HEADER_VALUE_BYTES: usize = 8192;
/// Most bytes of all static header names and values together.
pub const MAX_HEADERS_TOTAL_BYTES: usize = 16384;

/// Checks that `endpoint` is an absolute http(s) URL with a host.
pub fn validate_endpoint(option: &str, endpoint: &str) -> Result<(), OptionError> {
    let url = reqwest::Url::parse(endpoint).map_err(|e| {
        OptionError::new(
            option,
            format!(
                "\"{}\" is not a valid URL ({e})",
                super::secrets::mask_url(endpoint)
            ),
        )
    })?;
    if url.scheme() != "http" && url.scheme() != "https" {
        return Err(OptionError::new(
            option,
            format!("scheme must be http or https, not \"{}\"", url.scheme()),
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(OptionError::new(option, "URL has no host"));
    }
    Ok(())
}

fn positive_int(key: &str, v: &Value, max: u64) -> Result<u64, OptionError> {
    match v.as_u64() {
        Some(n) if n >= 1 && n <= max => Ok(n),
        Some(_) => Err(OptionError::new(
            key,
            format!("must be between 1 and {max}"),
        )),
        None => Err(OptionError::new(
            key,
            format!("must be a positive integer, not {}", number_or_shape(v)),
        )),
    }
}

fn string<'a>(key: &str, v: &'a Value) -> Result<&'a str, OptionError> {
    v.as_str()
        .ok_or_else(|| OptionError::new(key, format!("must be a string, not {}", shape(v))))
}

/// What `create_channel` says to a `sql` channel without `tenants`.
const SQL_TENANTS_HINT: &str = "Name the tenants whose messages may run the function, e.g. \"tenants\": [\"acme\"]; \"tenants\": [\"*\"] lets every tenant's messages run it, and whoever controls the function then acts for each of them.";

/// Headers that carry credentials: the effect key in one would replace them, or be dropped.
const CREDENTIAL_HEADERS: &[&str] = &["authorization", "cookie"];

/// An `idempotency_header` or `reference_header`: a header name that the worker may set to
/// the effect key, so neither a header that frames, routes, authorizes or signs the request
/// (the transport, the channel's `signing` or its own `headers` set those, and a key there
/// would become the request's Host or be silently not sent), as a message's own headers may
/// not be either (`enqueue_check::reserved_header`).
fn key_header(key: &str, v: &Value) -> Result<String, OptionError> {
    let h = string(key, v)?;
    if !is_http_token(h) {
        return Err(OptionError::new(
            key,
            format!("\"{h}\" is not a valid HTTP header name"),
        ));
    }
    let why = crate::outbox::enqueue_check::reserved_header(h, &[]).or_else(|| {
        CREDENTIAL_HEADERS
            .iter()
            .any(|c| c.eq_ignore_ascii_case(h))
            .then_some("carries the request's credentials")
    });
    if let Some(why) = why {
        return Err(OptionError::new(
            key,
            format!("\"{h}\" cannot carry the effect key: it {why}"),
        )
        .with_hint(
            "Name a header of its own for the key, such as Idempotency-Key or X-Outbox-Reference.",
        ));
    }
    Ok(h.to_string())
}

fn json_pointer(key: &str, v: &Value) -> Result<String, OptionError> {
    let s = string(key, v)?;
    if !s.starts_with('/') {
        return Err(OptionError::new(
            key,
            format!("\"{s}\" must be a JSON pointer starting with \"/\""),
        ));
    }
    Ok(s.to_string())
}

impl ChannelOptions {
    /// Parses a complete option object; missing keys take their defaults.
    pub fn from_json(v: &Value) -> Result<ChannelOptions, OptionError> {
        let obj = v.as_object().ok_or_else(|| {
            OptionError::new(
                "options",
                format!("must be a JSON object, not {}", shape(v)),
            )
        })?;
        if let Some(unknown) = obj.keys().find(|k| !KNOWN_KEYS.contains(&k.as_str())) {
            return Err(OptionError::new(
                unknown.clone(),
                format!(
                    "unknown option; known options are {}",
                    KNOWN_KEYS.join(", ")
                ),
            ));
        }
        let mut o = ChannelOptions::default();
        for (key, value) in obj {
            if value.is_null() {
                continue; // null = default
            }
            o.set(key, value)?;
        }
        let kind = obj.get("kind").and_then(Value::as_str);
        if kind != Some("nats") {
            if let Some(k) = NATS_ONLY
                .iter()
                .find(|k| obj.get(**k).is_some_and(|v| !v.is_null()))
            {
                return Err(OptionError::new(
                    *k,
                    "is only used by channels of kind nats",
                ));
            }
        }
        if kind == Some("sql") {
            o.kind = sql_kind(obj)?;
        } else if kind == Some("nats") {
            o.kind = nats_kind(obj)?;
        } else if let Some(k) = ["function", "run_as"]
            .iter()
            .find(|k| obj.get(**k).is_some_and(|v| !v.is_null()))
        {
            return Err(OptionError::new(*k, "is only used by channels of kind sql"));
        }
        // Unset, the connect timeout is its default or the whole request's, whichever is
        // shorter: a channel that only shortens timeout_ms must not fail on a setting it
        // never wrote.
        if obj.get("connect_timeout_ms").is_none_or(Value::is_null) {
            o.connect_timeout_ms = o.connect_timeout_ms.min(o.timeout_ms);
        }
        if o.connect_timeout_ms > o.timeout_ms {
            return Err(OptionError::new(
                "connect_timeout_ms",
                format!(
                    "{} is longer than timeout_ms ({})",
                    o.connect_timeout_ms, o.timeout_ms
                ),
            ));
        }
        if o.idempotency_window_ms.is_some() && o.idempotency_header.is_none() {
            return Err(OptionError::new(
                "idempotency_window_ms",
                "is set but idempotency_header is not; a key window needs a key",
            ));
        }
        // The rules read the excerpt, cut from the body read: a text longer than either is
        // never found.
        let readable = o.response_excerpt_bytes.min(o.max_response_bytes);
        if o.classify_answers.longest_text() as u64 > readable {
            return Err(OptionError::new(
                "classify_answers",
                format!(
                    "reads the answer's excerpt, which keeps {readable} bytes (response_excerpt_bytes, within max_response_bytes): a rule's text of {} bytes is never found there",
                    o.classify_answers.longest_text()
                ),
            )
            .with_hint("Raise response_excerpt_bytes (and max_response_bytes), or shorten the rule's contains."));
        }
        Ok(o)
    }

    /// [`ChannelOptions::from_json`], and what is checked only when options are set, not
    /// each time a worker reads them: that the `tls` certificates and key can be used.
    /// A `sql` channel names its tenants: its function reads and writes as the tenant of each
    /// message it runs for, so the default, every tenant, is taken only when written out.
    /// (Stored options always hold `tenants`: they are written normalized.)
    pub fn from_json_checked(v: &Value) -> Result<ChannelOptions, OptionError> {
        let o = ChannelOptions::from_json(v)?;
        if matches!(o.kind, Kind::Sql { .. }) && v.get("tenants").is_none_or(Value::is_null) {
            return Err(OptionError::new(
                "tenants",
                "is required for kind sql: its function acts as the tenant of each message it runs for",
            )
            .with_hint(SQL_TENANTS_HINT));
        }
        if let Some(tls) = &o.tls {
            tls.check()?;
        }
        Ok(o)
    }

    /// Sets one option (not null) from its JSON value, validated.
    fn set(&mut self, key: &str, value: &Value) -> Result<(), OptionError> {
        let o = self;
        match key {
            "kind" => {
                let kind = string(key, value)?;
                if !["http", "sql", "nats"].contains(&kind) {
                    return Err(OptionError::new(
                        key,
                        format!("\"{kind}\" is not a supported kind; supported: http, sql, nats"),
                    ));
                }
            }
            "function" | "run_as" => {} // read below, with kind
            "subject" | "stream" | "auth" | "duplicate_window_ms" => {} // read below, with kind
            "method" => {
                let m = string(key, value)?.to_ascii_uppercase();
                if !METHODS.contains(&m.as_str()) {
                    return Err(OptionError::new(
                        key,
                        format!("\"{m}\" is not one of {}", METHODS.join(", ")),
                    ));
                }
                o.method = m;
            }
            "headers" => o.headers = parse_headers(value)?,
            "timeout_ms" => o.timeout_ms = positive_int(key, value, 3_600_000)?,
            "connect_timeout_ms" => o.connect_timeout_ms = positive_int(key, value, 600_000)?,
            "idempotency_header" => o.idempotency_header = Some(key_header(key, value)?),
            "idempotency_window_ms" => {
                o.idempotency_window_ms = Some(positive_int(key, value, i64::MAX as u64)?)
            }
            "reference_header" => o.reference_header = Some(key_header(key, value)?),
            "external_id" => {
                let s = string(key, value)?;
                o.external_id = Some(if let Some(name) = s.strip_prefix("header:") {
                    if !is_http_token(name) {
                        return Err(OptionError::new(
                            key,
                            format!("\"{name}\" is not a valid HTTP header name"),
                        ));
                    }
                    ExternalIdSource::Header(name.to_string())
                } else {
                    ExternalIdSource::Body(json_pointer(key, value)?)
                });
            }
            "reconcile" => o.reconcile = Some(parse_reconcile(value)?),
            "retry" => {
                o.retry = RetryPolicy::from_json(value)
                    .map_err(|e| OptionError::new(e.field, e.message))?
            }
            "classify" => {
                o.classify =
                    Overrides::from_json(value).map_err(|e| OptionError::new(e.field, e.message))?
            }
            "classify_answers" => {
                o.classify_answers = super::answer_rules::AnswerRules::from_json(value)?
            }
            "max_in_flight" => o.max_in_flight = positive_int(key, value, 10_000)? as u32,
            "max_unverifiable_in_flight" => {
                o.max_unverifiable_in_flight = positive_int(key, value, 10_000)? as u32
            }
            "tenants" => o.tenants = parse_tenants(value)?,
            "max_response_bytes" => {
                o.max_response_bytes = positive_int(key, value, MAX_RESPONSE_BYTES)?
            }
            "response_excerpt_bytes" => {
                o.response_excerpt_bytes = match value.as_u64() {
                    Some(0) => 0,
                    _ => positive_int(key, value, super::answer_excerpt::MOST_BYTES)?,
                }
            }
            "signing" => o.signing = Some(super::signing::Signing::from_json(value)?),
            "tls" => o.tls = Some(super::tls::TlsOptions::from_json(value)?),
            "rate_limit" => o.rate_limit = Some(super::rate_limit::RateLimit::from_json(value)?),
            "circuit" => o.circuit = Some(super::circuit::CircuitOptions::from_json(value)?),
            _ => unreachable!("unknown keys were rejected above"),
        }
        Ok(())
    }

    /// The complete normalized object; `from_json(to_json(o)) == o`.
    pub fn to_json(&self) -> Value {
        let headers: Map<String, Value> = self
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        if let Kind::Sql { function, run_as } = &self.kind {
            return json!({
                "kind": "sql",
                "function": function,
                "run_as": run_as,
                "timeout_ms": self.timeout_ms,
                "connect_timeout_ms": self.connect_timeout_ms,
                "retry": self.retry.to_json(),
                "max_in_flight": self.max_in_flight,
                "tenants": self.tenants,
            });
        }
        if let Kind::Nats(target) = &self.kind {
            let mut m = target.to_json();
            m.insert("kind".into(), json!("nats"));
            m.insert("timeout_ms".into(), json!(self.timeout_ms));
            m.insert("connect_timeout_ms".into(), json!(self.connect_timeout_ms));
            m.insert("retry".into(), self.retry.to_json());
            m.insert("max_in_flight".into(), json!(self.max_in_flight));
            m.insert("tenants".into(), json!(self.tenants));
            return Value::Object(m);
        }
        json!({
            "kind": "http",
            "method": self.method,
            "headers": headers,
            "timeout_ms": self.timeout_ms,
            "connect_timeout_ms": self.connect_timeout_ms,
            "idempotency_header": self.idempotency_header,
            "idempotency_window_ms": self.idempotency_window_ms,
            "reference_header": self.reference_header,
            "external_id": self.external_id.as_ref().map(|e| match e {
                ExternalIdSource::Body(p) => p.clone(),
                ExternalIdSource::Header(h) => format!("header:{h}"),
            }),
            "reconcile": self.reconcile.as_ref().map(|r| json!({
                "url": r.url, "method": r.method, "found": r.found, "external_id": r.external_id,
                "settle_ms": r.settle_ms,
            })),
            "retry": self.retry.to_json(),
            "classify": self.classify.to_json(),
            "classify_answers": self.classify_answers.to_json(),
            "max_in_flight": self.max_in_flight,
            "max_unverifiable_in_flight": self.max_unverifiable_in_flight,
            "tenants": self.tenants,
            "max_response_bytes": self.max_response_bytes,
            "response_excerpt_bytes": self.response_excerpt_bytes,
            "signing": self.signing.as_ref().map(|s| s.to_json()),
            "tls": self.tls.as_ref().map(|t| t.to_json()),
            "rate_limit": self.rate_limit.as_ref().map(|r| r.to_json()),
            "circuit": self.circuit.as_ref().map(|c| c.to_json()),
        })
    }

    /// Applies `changes` on top of `current` (both option objects). A key set to null
    /// returns to its default; `retry` is merged key by key, every other key is replaced.
    pub fn merge(current: &Value, changes: &Value) -> Result<Value, OptionError> {
        let changes = changes.as_object().ok_or_else(|| {
            OptionError::new(
                "options",
                format!("must be a JSON object, not {}", shape(changes)),
            )
        })?;
        let mut merged = current.as_object().cloned().unwrap_or_default();
        for (k, v) in changes {
            match (k.as_str(), merged.get_mut(k), v) {
                (_, _, Value::Null) => {
                    merged.remove(k);
                }
                ("retry", Some(Value::Object(cur)), Value::Object(new)) => {
                    for (rk, rv) in new {
                        if rv.is_null() {
                            cur.remove(rk);
                        } else {
                            cur.insert(rk.clone(), rv.clone());
                        }
                    }
                }
                _ => {
                    merged.insert(k.clone(), v.clone());
                }
            }
        }
        Ok(Value::Object(merged))
    }

    /// How long after an attempt started a reconcile "not found" is believed.
    /// Can an attempt that a crash interrupted be settled without an operator? An HTTP
    /// channel can when its provider dedupes by key (`idempotency_header`: resent with the
    /// same key) or answers lookups (`reconcile`); a `sql` effect runs in the record
    /// transaction, so a crash leaves nothing half done.
    pub fn can_verify(&self) -> bool {
        match self.kind {
            Kind::Sql { .. } | Kind::Nats(_) => true,
            Kind::Http => self.idempotency_header.is_some() || self.reconcile.is_some(),
        }
    }

    /// Does the destination store a message resent with the same key once? `Some(window)`
    /// if so (None: no known end); an HTTP channel with `idempotency_header`, and a `nats`
    /// channel (`Nats-Msg-Id`, inside the stream's duplicate window).
    pub fn key_dedupe(&self) -> Option<Option<u64>> {
        match &self.kind {
            Kind::Http => self
                .idempotency_header
                .as_ref()
                .map(|_| self.idempotency_window_ms),
            Kind::Nats(t) => Some(Some(t.duplicate_window_ms.unwrap_or(0))),
            Kind::Sql { .. } => None,
        }
    }

    /// Can the destination be asked, read-only, whether it has a message? An HTTP channel
    /// with `reconcile`; a `nats` channel whose subject names the effect key.
    pub fn can_look_up(&self) -> bool {
        match &self.kind {
            Kind::Http => self.reconcile.is_some(),
            Kind::Nats(t) => t.can_look_up(),
            Kind::Sql { .. } => false,
        }
    }

    /// The bound on attempts open at once, all workers together, and why
    /// (`outbox._in_flight_bound` in SQL says the same; a test holds them equal).
    pub fn in_flight_bound(&self) -> InFlightBound {
        match self.can_verify() {
            true => InFlightBound::Verifiable(self.max_in_flight),
            false => InFlightBound::Unverifiable(self.max_unverifiable_in_flight),
        }
    }

    pub fn reconcile_settle_ms(&self) -> u64 {
        self.reconcile
            .as_ref()
            .and_then(|r| r.settle_ms)
            .unwrap_or(self.timeout_ms.saturating_mul(2))
    }

    /// The longest time a message of this channel may keep being retried.
    pub fn retry_horizon_ms(&self) -> u64 {
        self.retry.max_age_ms
    }
}

/// Is `name` a plain (optionally schema-qualified) function name? Quoted identifiers and
/// argument lists are not accepted: the channel names the function, the signature is fixed.
pub fn is_function_name(name: &str) -> bool {
    let part = |p: &str| {
        let mut chars = p.chars();
        matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$')
            && p.len() <= 63
    };
    let parts: Vec<&str> = name.split('.').collect();
    (1..=2).contains(&parts.len()) && parts.iter().all(|p| part(p))
}

fn nats_kind(obj: &Map<String, Value>) -> Result<Kind, OptionError> {
    if let Some(k) = HTTP_ONLY
        .iter()
        .find(|k| obj.get(**k).is_some_and(|v| !v.is_null()))
    {
        return Err(OptionError::new(*k, "is not used by channels of kind nats"));
    }
    Ok(Kind::Nats(nats_options::parse(obj)?))
}

fn sql_kind(obj: &Map<String, Value>) -> Result<Kind, OptionError> {
    if let Some(k) = HTTP_ONLY
        .iter()
        .find(|k| obj.get(**k).is_some_and(|v| !v.is_null()))
    {
        return Err(OptionError::new(*k, "is not used by channels of kind sql"));
    }
    let function = match obj.get("function") {
        Some(Value::String(f)) if is_function_name(f) => f.clone(),
        Some(Value::String(f)) => {
            return Err(OptionError::new(
                "function",
                format!("\"{f}\" is not a function name (schema.name, without arguments)"),
            ))
        }
        _ => return Err(OptionError::new(
            "function",
            "is required for kind sql: the function (payload jsonb, effect_key text) returns text",
        )),
    };
    let run_as = match obj.get("run_as") {
        Some(Value::String(r)) if !r.is_empty() && r.len() <= 63 => r.clone(),
        _ => {
            return Err(OptionError::new(
                "run_as",
                "is required for kind sql: the role the function runs as (not a superuser)",
            ))
        }
    };
    Ok(Kind::Sql { function, run_as })
}

/// Most tenants a channel may list.
pub const MAX_TENANTS: usize = 1000;

/// `tenants`: `["*"]`, or a non-empty array of distinct tenant names (the rule of
/// `tenancy::acting::check_tenant_name`).
fn parse_tenants(v: &Value) -> Result<Vec<String>, OptionError> {
    let hint = "must be [\"*\"] (every tenant) or an array of tenant names";
    let items = v
        .as_array()
        .ok_or_else(|| OptionError::new("tenants", format!("{hint}, not {}", shape(v))))?;
    if items.is_empty() || items.len() > MAX_TENANTS {
        return Err(OptionError::new(
            "tenants",
            format!(
                "{hint} (1 to {MAX_TENANTS} of them), not {} entries",
                items.len()
            ),
        ));
    }
    let mut tenants: Vec<String> = Vec::with_capacity(items.len());
    for item in items {
        let name = item.as_str().ok_or_else(|| {
            OptionError::new(
                "tenants",
                format!("{hint}; an element is {}, not a string", shape(item)),
            )
        })?;
        if crate::tenancy::acting::check_tenant_name(Some(name), "tenants", true).is_err() {
            return Err(OptionError::new(
                "tenants",
                format!(
                    "\"{}\" is not a tenant name (1 to {} bytes, no control characters)",
                    name.escape_debug(),
                    crate::tenancy::acting::MAX_TENANT_BYTES
                ),
            ));
        }
        if !tenants.iter().any(|t| t == name) {
            tenants.push(name.to_string());
        }
    }
    if tenants.len() > 1 && tenants.iter().any(|t| t == "*") {
        return Err(OptionError::new(
            "tenants",
            "\"*\" already means every tenant; list it alone",
        ));
    }
    Ok(tenants)
}

/// `headers.<name>` for messages, the name cut short if it is very long.
fn header_option(name: &str) -> String {
    const SHOWN: usize = 64;
    match name.char_indices().nth(SHOWN) {
        Some((cut, _)) => format!("headers.{}…", &name[..cut]),
        None => format!("headers.{name}"),
    }
}

/// Static headers: at most [`MAX_HEADERS`], each name a token of at most
/// [`MAX_HEADER_NAME_BYTES`], each value at most [`MAX_HEADER_VALUE_BYTES`] with no control
/// character but tab, all names and values together at most [`MAX_HEADERS_TOTAL_BYTES`].
fn parse_headers(v: &Value) -> Result<Vec<(String, String)>, OptionError> {
    let obj = v.as_object().ok_or_else(|| {
        OptionError::new(
            "headers",
            format!("must be a JSON object of strings, not {}", shape(v)),
        )
    })?;
    if obj.len() > MAX_HEADERS {
        return Err(OptionError::new(
            "headers",
            format!(
                "has {} headers; at most {MAX_HEADERS} are allowed",
                obj.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(obj.len());
    let mut total = 0usize;
    for (name, value) in obj {
        let key = header_option(name);
        if name.len() > MAX_HEADER_NAME_BYTES {
            return Err(OptionError::new(
                key,
                format!(
                    "header name is {} bytes long; at most {MAX_HEADER_NAME_BYTES} are allowed",
                    name.len()
                ),
            ));
        }
        if !is_http_token(name) {
            return Err(OptionError::new(key, "is not a valid HTTP header name"));
        }
        let value = string(&key, value)?;
        if value.len() > MAX_HEADER_VALUE_BYTES {
            return Err(OptionError::new(
                key,
                format!(
                    "value is {} bytes long; at most {MAX_HEADER_VALUE_BYTES} are allowed",
                    value.len()
                ),
            ));
        }
        if !is_http_header_value(value) {
            return Err(OptionError::new(
                key,
                "value contains a control character (only tab is allowed; CR and LF would inject headers)",
            ));
        }
        total += name.len() + value.len();
        if total > MAX_HEADERS_TOTAL_BYTES {
            return Err(OptionError::new(
                key,
                format!(
                    "headers together exceed {MAX_HEADERS_TOTAL_BYTES} bytes (names and values) with this one"
                ),
            ));
        }
        out.push((name.clone(), value.to_string()));
    }
    Ok(out)
}

fn parse_reconcile(v: &Value) -> Result<ReconcileConfig, OptionError> {
    let obj = v.as_object().ok_or_else(|| {
        OptionError::new(
            "reconcile",
            format!("must be a JSON object, not {}", shape(v)),
        )
    })?;
    const KEYS: &[&str] = &["url", "method", "found", "external_id", "settle_ms"];
    if let Some(unknown) = obj.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(OptionError::new(
            format!("reconcile.{unknown}"),
            format!("unknown option; known options are {}", KEYS.join(", ")),
        ));
    }
    let url = obj
        .get("url")
        .ok_or_else(|| OptionError::new("reconcile.url", "is required"))?;
    let url = string("reconcile.url", url)?.to_string();
    crate::channels::lookup_url::validate_template(&url)
        .map_err(|m| OptionError::new("reconcile.url", m))?;
    if crate::channels::lookup_url::placeholder_in_authority(&url) {
        return Err(OptionError::new(
            "reconcile.url",
            "a placeholder may not stand in the scheme, host or port: the lookup's destination is fixed (and checked against outbox.allowed_hosts); put placeholders in the path or query",
        ));
    }
    validate_endpoint("reconcile.url", &crate::channels::lookup_url::probe(&url))?;
    let method = match obj.get("method") {
        None | Some(Value::Null) => "GET".to_string(),
        Some(m) => {
            let m = string("reconcile.method", m)?.to_ascii_uppercase();
            if m != "GET" && m != "HEAD" && m != "POST" {
                return Err(OptionError::new(
                    "reconcile.method",
                    "must be GET, HEAD or POST (a read-only lookup)",
                ));
            }
            m
        }
    };
    let found = match obj.get("found") {
        None | Some(Value::Null) => None,
        Some(p) => Some(json_pointer("reconcile.found", p)?),
    };
    let external_id = match obj.get("external_id") {
        None | Some(Value::Null) => None,
        Some(p) => Some(json_pointer("reconcile.external_id", p)?),
    };
    let settle_ms = match obj.get("settle_ms") {
        None | Some(Value::Null) => None,
        Some(v) => Some(positive_int("reconcile.settle_ms", v, 86_400_000)?),
    };
    Ok(ReconcileConfig {
        url,
        method,
        found,
        external_id,
        settle_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(v: Value) -> OptionError {
        ChannelOptions::from_json(&v).unwrap_err()
    }

    #[test]
    fn response_bodies_are_bounded() {
        let o = ChannelOptions::from_json(&json!({})).unwrap();
        assert_eq!(o.max_response_bytes, 65536);
        let o = ChannelOptions::from_json(&json!({"max_response_bytes": 1})).unwrap();
        assert_eq!(o.max_response_bytes, 1);
        // The excerpt of a refusing answer: 1 KiB by default, 0 keeps none, at most 64 KiB.
        assert_eq!(
            ChannelOptions::from_json(&json!({}))
                .unwrap()
                .response_excerpt_bytes,
            1024
        );
        for n in [0u64, 1, 65536] {
            let o = ChannelOptions::from_json(&json!({"response_excerpt_bytes": n})).unwrap();
            assert_eq!(o.response_excerpt_bytes, n);
        }
        for bad in [json!(65537), json!(-1), json!("1k"), json!(1.5)] {
            assert_eq!(
                err(json!({ "response_excerpt_bytes": bad })).option,
                "response_excerpt_bytes"
            );
        }
        assert_eq!(ChannelOptions::from_json(&o.to_json()).unwrap(), o);
        for bad in [json!(0), json!(16 * 1024 * 1024 + 1), json!("1"), json!(-1)] {
            assert_eq!(
                err(json!({ "max_response_bytes": bad })).option,
                "max_response_bytes"
            );
        }
        let sql =
            json!({"kind": "sql", "function": "a.f", "run_as": "r", "max_response_bytes": 10});
        assert_eq!(err(sql).option, "max_response_bytes");
    }

    #[test]
    fn function_names() {
        assert!(is_function_name("app.create_task"));
        assert!(is_function_name("create_task"));
        assert!(is_function_name("_x.f$1"));
        assert!(!is_function_name(""));
        assert!(!is_function_name("app.create_task(jsonb, text)"));
        assert!(!is_function_name("a.b.c"));
        assert!(!is_function_name("app;drop table x"));
        assert!(!is_function_name("\"App\".f"));
        assert!(!is_function_name("1abc"));
    }

    #[test]
    fn tenants_lists_who_may_enqueue() {
        let o = ChannelOptions::from_json(&json!({})).unwrap();
        assert_eq!(o.tenants, vec!["*".to_string()]);
        let o = ChannelOptions::from_json(&json!({"tenants": ["b", "a", "b"]})).unwrap();
        assert_eq!(o.tenants, vec!["b".to_string(), "a".to_string()]);
        assert_eq!(ChannelOptions::from_json(&o.to_json()).unwrap(), o);
        let sql = json!({"kind": "sql", "function": "app.f", "run_as": "r", "tenants": ["a"]});
        let o = ChannelOptions::from_json(&sql).unwrap();
        assert_eq!(o.tenants, vec!["a".to_string()]);
        assert_eq!(ChannelOptions::from_json(&o.to_json()).unwrap(), o);
        for bad in [
            json!("a"),
            json!([]),
            json!([1]),
            json!([""]),
            json!(["a\nb"]),
            json!(["*", "a"]),
            json!(["t".repeat(129)]),
            json!({"a": true}),
        ] {
            let e = err(json!({ "tenants": bad.clone() }));
            assert_eq!(e.option, "tenants", "{bad}");
        }
    }

    #[test]
    fn defaults_from_empty_object() {
        let o = ChannelOptions::from_json(&json!({})).unwrap();
        assert_eq!(o, ChannelOptions::default());
        assert_eq!(o.max_in_flight, 64);
        assert_eq!(o.timeout_ms, 10_000);
        assert_eq!(o.connect_timeout_ms, 3_000);
    }

    #[test]
    fn a_channel_that_can_neither_dedupe_nor_be_asked_has_the_small_bound() {
        let bound = |v: Value| ChannelOptions::from_json(&v).unwrap().in_flight_bound();
        assert_eq!(bound(json!({})), InFlightBound::Unverifiable(8));
        assert_eq!(
            bound(json!({"max_unverifiable_in_flight": 3, "max_in_flight": 100})),
            InFlightBound::Unverifiable(3)
        );
        // A reference header carries the key for correlation only: not a dedupe.
        assert_eq!(
            bound(json!({"reference_header": "X-Ref"})),
            InFlightBound::Unverifiable(8)
        );
        assert_eq!(
            bound(json!({"idempotency_header": "Idempotency-Key"})),
            InFlightBound::Verifiable(64)
        );
        assert_eq!(
            bound(
                json!({"reconcile": {"url": "http://127.0.0.1:1/m/{effect_key}"}, "max_in_flight": 5})
            ),
            InFlightBound::Verifiable(5)
        );
        assert_eq!(
            bound(json!({"kind": "sql", "function": "app.f", "run_as": "r"})),
            InFlightBound::Verifiable(64),
            "an effect in the record transaction leaves nothing half done"
        );
        assert_eq!(InFlightBound::Unverifiable(8).limit(), 8);
        assert!(InFlightBound::Unverifiable(8)
            .reason()
            .contains("no dedupe, no lookup"));
        assert_eq!(InFlightBound::Verifiable(64).reason(), "max_in_flight");
        for bad in [json!(0), json!(10_001), json!(1.5), json!("8")] {
            assert_eq!(
                err(json!({"max_unverifiable_in_flight": bad})).option,
                "max_unverifiable_in_flight"
            );
        }
        assert_eq!(
            err(json!({"kind": "sql", "function": "app.f", "run_as": "r", "max_unverifiable_in_flight": 2})).option,
            "max_unverifiable_in_flight",
            "an HTTP option"
        );
    }

    #[test]
    fn only_a_channel_that_can_neither_dedupe_nor_be_asked_gets_a_notice() {
        let notice = |v: Value| unverifiable_notice("sms", &ChannelOptions::from_json(&v).unwrap());
        let (message, detail, hint) = notice(json!({"max_unverifiable_in_flight": 4})).unwrap();
        assert!(
            message.contains("\"sms\"") && message.contains("uncertain"),
            "{message}"
        );
        assert!(detail.contains("At most 4 attempts"), "{detail}");
        assert!(
            hint.contains("idempotency_header") && hint.contains("reconcile"),
            "{hint}"
        );
        assert_eq!(notice(json!({"idempotency_header": "K"})), None);
        assert_eq!(
            notice(json!({"reconcile": {"url": "http://127.0.0.1:1/m/{effect_key}"}})),
            None
        );
        assert_eq!(
            notice(json!({"kind": "sql", "function": "app.f", "run_as": "r"})),
            None
        );
    }

    #[test]
    fn normalized_round_trip() {
        let o = ChannelOptions::from_json(&json!({
            "method": "put",
            "headers": {"Authorization": "Bearer x"},
            "idempotency_header": "Idempotency-Key",
            "idempotency_window_ms": 86400000,
            "reference_header": "X-Client-Reference",
            "external_id": "header:X-Message-Id",
            "reconcile": {"url": "http://127.0.0.1:1/m/{effect_key}", "found": "/found", "external_id": "/id"},
            "retry": {"max_attempts": 3},
            "classify": {"409": "delivered"},
            "max_in_flight": 8,
            "max_unverifiable_in_flight": 2
        }))
        .unwrap();
        assert_eq!(o.method, "PUT");
        assert_eq!(o.max_unverifiable_in_flight, 2);
        assert_eq!(o.retry.max_attempts, 3);
        let again = ChannelOptions::from_json(&o.to_json()).unwrap();
        assert_eq!(o, again);
    }

    #[test]
    fn webhook_options_round_trip_and_are_http_only() {
        let o = ChannelOptions::from_json(&json!({
            "signing": {"secrets": ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]},
            "rate_limit": {"per_second": 100, "burst": 20},
            "circuit": {"open_after": 5, "open_ms": 30000},
            "tls": {}
        }))
        .unwrap();
        assert_eq!(o.rate_limit.unwrap().per_second, 100);
        assert_eq!(o.circuit.unwrap().open_ms, 30000);
        assert!(o.signing.is_some() && o.tls.is_some());
        assert_eq!(ChannelOptions::from_json(&o.to_json()).unwrap(), o);
        assert_eq!(
            ChannelOptions::from_json(&json!({})).unwrap().to_json()["circuit"],
            Value::Null
        );
        for (key, value) in [
            (
                "signing",
                json!({"secrets": ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]}),
            ),
            ("tls", json!({})),
            ("rate_limit", json!({"per_second": 1})),
            ("circuit", json!({"open_after": 1, "open_ms": 1})),
        ] {
            let mut v = json!({"kind": "sql", "function": "app.f", "run_as": "r"});
            v[key] = value;
            assert_eq!(err(v).option, key, "{key} is an http option");
        }
        assert_eq!(
            err(json!({"rate_limit": {"per_second": 0}})).option,
            "rate_limit.per_second"
        );
        assert_eq!(
            err(json!({"circuit": {"open_after": 1}})).option,
            "circuit.open_ms"
        );
    }

    #[test]
    fn rejections_name_the_option() {
        assert_eq!(err(json!({"colour": 1})).option, "colour");
        assert_eq!(err(json!({"kind": "smtp"})).option, "kind");
        assert_eq!(err(json!({"method": "BREW"})).option, "method");
        assert_eq!(err(json!({"timeout_ms": "10"})).option, "timeout_ms");
        assert_eq!(err(json!({"timeout_ms": 0})).option, "timeout_ms");
        assert_eq!(err(json!({"timeout_ms": -5})).option, "timeout_ms");
        assert_eq!(err(json!({"max_in_flight": 1.5})).option, "max_in_flight");
        assert_eq!(err(json!({"headers": ["a"]})).option, "headers");
        assert_eq!(err(json!({"headers": {"X-A": 1}})).option, "headers.X-A");
        assert_eq!(
            err(json!({"headers": {"bad name": "v"}})).option,
            "headers.bad name"
        );
        assert_eq!(
            err(json!({"headers": {"X-A": "a\r\nb"}})).option,
            "headers.X-A"
        );
        assert_eq!(
            err(json!({"idempotency_header": "no spaces"})).option,
            "idempotency_header"
        );
        assert_eq!(
            err(json!({"idempotency_window_ms": 5})).option,
            "idempotency_window_ms"
        );
        assert_eq!(err(json!({"external_id": "id"})).option, "external_id");
        assert_eq!(
            err(json!({"reconcile": {"method": "GET"}})).option,
            "reconcile.url"
        );
        assert_eq!(
            err(json!({"reconcile": {"url": "http://h/x"}})).option,
            "reconcile.url"
        );
        assert_eq!(
            err(json!({"reconcile": {"url": "ftp://h/{effect_key}"}})).option,
            "reconcile.url"
        );
        assert_eq!(
            err(json!({"reconcile": {"url": "http://h/{effect_key}", "x": 1}})).option,
            "reconcile.x"
        );
        assert_eq!(
            err(json!({"reconcile": {"url": "http://h/{effect_key}", "method": "DELETE"}})).option,
            "reconcile.method"
        );
        assert_eq!(
            err(json!({"connect_timeout_ms": 5000, "timeout_ms": 1000})).option,
            "connect_timeout_ms"
        );
        // Unset, it follows a shorter timeout_ms instead of failing on its default.
        for (timeout, connect) in [(1000, 1000), (2999, 2999), (3000, 3000), (60000, 3000)] {
            let o = ChannelOptions::from_json(&json!({"timeout_ms": timeout})).unwrap();
            assert_eq!(o.connect_timeout_ms, connect, "timeout_ms {timeout}");
            let again = ChannelOptions::from_json(&o.to_json()).unwrap();
            assert_eq!(again.connect_timeout_ms, connect, "stored and read again");
        }
        assert_eq!(
            err(json!({"retry": {"base_ms": 0}})).option,
            "retry.base_ms"
        );
        assert_eq!(
            err(json!({"retry": {"jitter": "some"}})).option,
            "retry.jitter"
        );
        assert!(err(json!({"classify": {"999": "transient"}}))
            .option
            .starts_with("classify"));
        assert_eq!(err(json!([])).option, "options");
    }

    #[test]
    fn sql_channels() {
        let o = ChannelOptions::from_json(
            &json!({"kind": "sql", "function": "app.create_task", "run_as": "app_effects"}),
        )
        .unwrap();
        assert_eq!(
            o.kind,
            Kind::Sql {
                function: "app.create_task".into(),
                run_as: "app_effects".into()
            }
        );
        assert_eq!(ChannelOptions::from_json(&o.to_json()).unwrap(), o);
        assert_eq!(
            err(json!({"kind": "sql", "run_as": "r"})).option,
            "function"
        );
        assert_eq!(
            err(json!({"kind": "sql", "function": "f(jsonb)", "run_as": "r"})).option,
            "function"
        );
        assert_eq!(
            err(json!({"kind": "sql", "function": "app.f"})).option,
            "run_as"
        );
        assert_eq!(err(json!({"kind": "sql", "function": "app.f", "run_as": "r", "idempotency_header": "K"})).option, "idempotency_header");
        assert_eq!(err(json!({"function": "app.f"})).option, "function");
    }

    #[test]
    fn merge_replaces_keys_and_merges_retry() {
        let cur = ChannelOptions::default().to_json();
        let merged = ChannelOptions::merge(
            &cur,
            &json!({"retry": {"max_attempts": 2}, "max_in_flight": 3}),
        )
        .unwrap();
        let o = ChannelOptions::from_json(&merged).unwrap();
        assert_eq!(o.retry.max_attempts, 2);
        assert_eq!(o.retry.base_ms, 1000);
        assert_eq!(o.max_in_flight, 3);
        let reset = ChannelOptions::merge(&merged, &json!({"max_in_flight": null})).unwrap();
        assert_eq!(ChannelOptions::from_json(&reset).unwrap().max_in_flight, 64);
    }

    #[test]
    fn endpoints() {
        assert!(validate_endpoint("endpoint", "http://127.0.0.1:8080/x").is_ok());
        assert!(validate_endpoint("endpoint", "https://api.example.com/v1/messages").is_ok());
        assert!(validate_endpoint("endpoint", "ftp://x").is_err());
        assert!(validate_endpoint("endpoint", "not a url").is_err());
        assert!(validate_endpoint("endpoint", "").is_err());
    }

    #[test]
    fn header_limits() {
        fn headers(pairs: Vec<(String, String)>) -> Result<ChannelOptions, OptionError> {
            let map: Map<String, Value> = pairs
                .into_iter()
                .map(|(k, v)| (k, Value::String(v)))
                .collect();
            ChannelOptions::from_json(&json!({ "headers": map }))
        }
        let n = |i: usize| format!("X-H{i:02}");
        // Counts: 32 fit, 33 do not.
        assert!(headers((0..32).map(|i| (n(i), "v".into())).collect()).is_ok());
        let e = headers((0..33).map(|i| (n(i), "v".into())).collect()).unwrap_err();
        assert_eq!(e.option, "headers");
        assert!(
            e.message.contains("33") && e.message.contains("32"),
            "{}",
            e.message
        );
        // Name length: 256 bytes fit, 257 do not; the option names the header, cut short.
        assert!(headers(vec![("N".repeat(256), "v".into())]).is_ok());
        let e = headers(vec![("N".repeat(257), "v".into())]).unwrap_err();
        assert_eq!(e.option, format!("headers.{}…", "N".repeat(64)));
        assert!(e.message.contains("257"), "{}", e.message);
        // Value length: 8192 bytes fit, 8193 do not (counted in bytes, not characters).
        assert!(headers(vec![("X-A".into(), "v".repeat(8192))]).is_ok());
        let e = headers(vec![("X-A".into(), "v".repeat(8193))]).unwrap_err();
        assert_eq!(e.option, "headers.X-A");
        let e = headers(vec![("X-A".into(), "é".repeat(4097))]).unwrap_err();
        assert_eq!(e.option, "headers.X-A");
        assert!(e.message.contains("8194"), "{}", e.message);
        // Total: names plus values at most 16384 bytes.
        let big = |i: usize, len: usize| (n(i), "v".repeat(len));
        assert!(headers(vec![big(0, 8192 - 5), big(1, 8192 - 5)]).is_ok());
        let e = headers(vec![big(0, 8192 - 5), big(1, 8192 - 4)]).unwrap_err();
        assert_eq!(e.option, "headers.X-H01");
        assert!(e.message.contains("16384"), "{}", e.message);
        let e = headers((0..3).map(|i| big(i, 8000)).collect()).unwrap_err();
        assert_eq!(e.option, "headers.X-H02");
        // Control characters: only tab.
        let cases: &[(&str, bool)] = &[
            ("Bearer abc.def", true),
            ("a\tb", true),
            ("ünïcödé ✓", true),
            ("", true),
            ("a\r\nX-Injected: 1", false),
            ("a\nb", false),
            ("a\rb", false),
            ("a\0b", false),
            ("a\u{7f}b", false),
            ("a\u{1b}[31m", false),
            ("a\u{85}b", false),
            ("a\u{9f}b", false),
        ];
        for (value, ok) in cases {
            let r = headers(vec![("X-A".into(), value.to_string())]);
            assert_eq!(r.is_ok(), *ok, "{value:?}");
            if let Err(e) = r {
                assert_eq!(e.option, "headers.X-A");
                assert!(e.message.contains("control character"), "{}", e.message);
            }
        }
        // Names must be tokens.
        for bad in ["X A", "X:A", "X\nA", "", "Ü"] {
            let e = headers(vec![(bad.into(), "v".into())]).unwrap_err();
            assert_eq!(e.option, format!("headers.{bad}"));
        }
    }

    #[test]
    fn reconcile_url_placeholders_stay_out_of_the_host() {
        for url in [
            "http://{payload:/host}/m/{effect_key}",
            "http://{effect_key}.example.com/m",
            "http://h:{created_at}/m/{effect_key}",
            "http:{effect_key}/m",
        ] {
            let e = err(json!({"reconcile": {"url": url}}));
            assert_eq!(e.option, "reconcile.url", "{url}");
            assert!(e.message.contains("host"), "{}", e.message);
        }
        assert!(ChannelOptions::from_json(
            &json!({"reconcile": {"url": "http://h:8080/m/{effect_key}?t={created_at}"}})
        )
        .is_ok());
    }

    #[test]
    fn tokens_and_values() {
        assert!(is_http_token("Idempotency-Key"));
        assert!(!is_http_token(""));
        assert!(!is_http_token("a b"));
        assert!(!is_http_token("a:b"));
        assert!(is_http_header_value("Bearer abc.def"));
        assert!(!is_http_header_value("a\nb"));
        assert!(!is_http_header_value("a\0b"));
    }

    #[test]
    fn a_sql_channel_names_its_tenants() {
        let sql = json!({"kind": "sql", "function": "app.f", "run_as": "r"});
        let e = ChannelOptions::from_json_checked(&sql).unwrap_err();
        assert_eq!(e.option, "tenants");
        assert!(e.hint.is_some_and(|h| h.contains("[\"*\"]")), "{e:?}");
        let mut null = sql.clone();
        null["tenants"] = json!(null);
        assert_eq!(
            ChannelOptions::from_json_checked(&null).unwrap_err().option,
            "tenants"
        );
        for tenants in [json!(["*"]), json!(["acme"]), json!(["a", "b"])] {
            let mut named = sql.clone();
            named["tenants"] = tenants.clone();
            let o = ChannelOptions::from_json_checked(&named).unwrap();
            // Stored normalized, the list is there when the options are read again.
            assert_eq!(ChannelOptions::from_json_checked(&o.to_json()).unwrap(), o);
        }
        // Other kinds keep their default, every tenant.
        let o = ChannelOptions::from_json_checked(&json!({})).unwrap();
        assert_eq!(o.tenants, vec!["*".to_string()]);
    }

    #[test]
    fn the_key_headers_may_not_frame_route_authorize_or_sign() {
        for key in ["idempotency_header", "reference_header"] {
            for name in [
                "Host",
                "host",
                "Content-Length",
                "Transfer-Encoding",
                "Connection",
                "Keep-Alive",
                "Upgrade",
                "TE",
                "Trailer",
                "Expect",
                "Proxy-Authorization",
                "Proxy-Connection",
                "Forwarded",
                "X-Forwarded-For",
                "x-forwarded-host",
                "Authorization",
                "AUTHORIZATION",
                "Cookie",
                "webhook-id",
                "Webhook-Timestamp",
                "webhook-signature",
            ] {
                let e = err(json!({ key: name }));
                assert_eq!(e.option, key, "{name}");
                assert!(e.message.contains("cannot carry the effect key"), "{e:?}");
                assert!(e.hint.is_some(), "{name}");
            }
            for name in [
                "Idempotency-Key",
                "X-Request-Id",
                "X-Ref",
                "Hostname",
                "Authorization-Key",
            ] {
                assert!(
                    ChannelOptions::from_json(&json!({ key: name })).is_ok(),
                    "{key} {name}"
                );
            }
        }
    }

    #[test]
    fn values_refused_for_their_shape_are_not_quoted() {
        const SECRET: &str = "Bearer SECRET-7f3a";
        let wrong_shapes = [
            json!([SECRET]),
            json!({ "x": SECRET }),
            json!([{ "Authorization": SECRET }]),
            json!(SECRET),
        ];
        for key in KNOWN_KEYS {
            for value in &wrong_shapes {
                let mut options = json!({ *key: value });
                if NATS_ONLY.contains(key) {
                    options = json!({"kind": "nats", "subject": "s", "stream": "S", *key: value});
                }
                if let Err(e) = ChannelOptions::from_json(&options) {
                    let text = format!("{} {}", e.option, e.message);
                    // A string where a string belongs may be quoted when its option holds
                    // no secret (a kind, a method, a header name); never any other shape.
                    if !value.is_string() {
                        assert!(!text.contains("SECRET"), "{key} = {value}: {text}");
                    }
                }
            }
        }
        // The review's cases: a bearer token inside a headers array, a NATS token written as
        // a plain string, a header value that is no string.
        for options in [
            json!({"headers": [format!("Authorization: {SECRET}")]}),
            json!({"headers": {"Authorization": [SECRET]}}),
            json!({"kind": "nats", "subject": "s", "stream": "S", "auth": SECRET}),
            json!({"kind": "nats", "subject": "s", "stream": "S", "auth": {"token": [SECRET]}}),
            json!({"reconcile": SECRET}),
            json!({"signing": SECRET}),
            json!({"tls": SECRET}),
            json!(SECRET),
        ] {
            let e = ChannelOptions::from_json(&options).unwrap_err();
            let text = format!("{} {}", e.option, e.message);
            assert!(!text.contains("SECRET"), "{options}: {text}");
        }
        assert_eq!(
            err(json!({"headers": [SECRET]})).message,
            "must be a JSON object of strings, not an array of 1 element"
        );
    }
}
