//! Section 2, the calls: random arguments for every public function, drawn from pools.

use super::*;
use outbox_e2e::helpers::source_list;

// ---------------------------------------------------------------------------------------
// 2. fuzz
// ---------------------------------------------------------------------------------------

/// xorshift64: small, deterministic, seedable.
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Rng {
        Rng(if seed == 0 {
            0x9e37_79b9_7f4a_7c15
        } else {
            seed
        })
    }

    pub(super) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub(super) fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    pub(super) fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len() as u64) as usize]
    }
}

/// One argument of a fuzz call.
#[derive(Debug, Clone)]
pub(super) enum Arg {
    Text(Option<String>),
    Int(Option<i64>),
}

impl Arg {
    pub(super) fn as_sql(&self) -> &(dyn ToSql + Sync) {
        match self {
            Arg::Text(t) => t,
            Arg::Int(i) => i,
        }
    }

    pub(super) fn summary(&self) -> String {
        match self {
            Arg::Text(None) | Arg::Int(None) => "NULL".into(),
            Arg::Text(Some(t)) => short(t),
            Arg::Int(Some(i)) => i.to_string(),
        }
    }
}

/// What a successful call adds to the pools.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Effect {
    None,
    Channel,
    Message,
    Binding,
}

pub(super) struct Call {
    pub(super) function: &'static str,
    pub(super) sql: &'static str,
    pub(super) args: Vec<Arg>,
    pub(super) effect: Effect,
}

impl Call {
    pub(super) fn describe(&self) -> String {
        format!(
            "{}({})",
            self.function,
            self.args
                .iter()
                .map(Arg::summary)
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
}

/// What the fuzz draws from besides random values.
pub(super) struct Pools {
    pub(super) tag: String,
    pub(super) serial: u64,
    pub(super) channels: Vec<String>,
    pub(super) ids: Vec<i64>,
    pub(super) roles: Vec<String>,
    pub(super) tenants: Vec<String>,
    pub(super) endpoints: Vec<String>,
    pub(super) lookups: Vec<String>,
    pub(super) hostile: Vec<String>,
    /// Every role of the cluster that is not the fuzz's own: never bound by the fuzz.
    pub(super) foreign_roles: HashSet<String>,
    /// Ids the fuzz must not touch: higher than every message that existed before it.
    pub(super) unknown_base: i64,
}

/// The channel options `create_channel` knows (src/channels/options.rs), and `endpoint`,
/// which `alter_channel` takes among them; read once.
fn known_option_keys() -> &'static [String] {
    static KEYS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    KEYS.get_or_init(|| {
        let mut keys = source_list("src/channels/options.rs", "KNOWN_KEYS");
        keys.push("endpoint".into());
        keys
    })
}

/// The retry keys src/retry_policy.rs knows; read once.
fn retry_keys() -> &'static [String] {
    static KEYS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    KEYS.get_or_init(|| source_list("src/retry_policy.rs", "KEYS"))
}

const MALFORMED_JSON: [&str; 14] = [
    "",
    "{",
    "[1,]",
    "{\"a\" 1}",
    "nul",
    "'{}'",
    "\"\\ud800\"",
    "\"\\u0000\"",
    "{\"a\": \"\\u0000\"}",
    "1e1000000",
    "-1e-1000000",
    "{\"a\": NaN}",
    "[\"\\x41\"]",
    "\u{feff}{}",
];

const TIMESTAMPS: [&str; 12] = [
    "infinity",
    "-infinity",
    "now",
    "epoch",
    "2999-12-31 23:59:59+00",
    "294276-12-31 23:59:59+00",
    "4713-01-01 00:00:00+00 BC",
    "1999-13-45",
    "not a time",
    "2000-01-01T00:00:00Z",
    "allballs",
    "",
];

/// Characters from the ranges hostile text is made of: ASCII, controls, Latin-1, RTL and
/// zero-width marks, combining marks, CJK, emoji, private use, the last code point.
fn random_char(rng: &mut Rng) -> char {
    let ranges: [(u32, u32); 11] = [
        (0x20, 0x7e),
        (0x20, 0x7e),
        (0x01, 0x1f),
        (0x7f, 0x9f),
        (0xa0, 0xff),
        (0x200b, 0x200f),
        (0x202a, 0x202e),
        (0x0300, 0x036f),
        (0x4e00, 0x9fff),
        (0x1f600, 0x1f64f),
        (0xe000, 0xe0ff),
    ];
    if rng.chance(1) {
        return '\u{10ffff}';
    }
    let (lo, hi) = *rng.pick(&ranges);
    char::from_u32(lo + rng.below(u64::from(hi - lo + 1)) as u32).unwrap_or('?')
}

/// True when `s` holds a word the crash check looks for in the server log (error messages
/// quote their input).
fn looks_like_a_crash(s: &str) -> bool {
    let upper = s.to_uppercase();
    ["PANIC", "TRAP", "SERVER PROCESS", "TERMINATED"]
        .iter()
        .any(|w| upper.contains(w))
}

impl Pools {
    pub(super) fn next_serial(&mut self) -> u64 {
        self.serial += 1;
        self.serial
    }

    /// A random text, NULL included.
    pub(super) fn text(&mut self, rng: &mut Rng) -> Option<String> {
        let s = match rng.below(100) {
            0..=9 => return None,
            10..=17 => String::new(),
            18..=37 => rng.pick(&self.hostile).clone(),
            38..=54 => (0..1 + rng.below(40))
                .map(|_| char::from(0x20 + rng.below(0x5f) as u8))
                .collect(),
            55..=71 => (0..1 + rng.below(60)).map(|_| random_char(rng)).collect(),
            72..=73 => {
                let c = random_char(rng);
                std::iter::repeat_n(c, 10_000 + rng.below(90_000) as usize).collect()
            }
            74..=76 => rng.pick(&[" ", "\t", "\n", "\r\n", " \u{a0} "]).to_string(),
            77 => format!("nul\0{}", rng.below(10)),
            _ => {
                let n = self.next_serial();
                format!("{}_{n}", self.tag)
            }
        };
        if looks_like_a_crash(&s) {
            Some("x".into())
        } else {
            Some(s)
        }
    }

    pub(super) fn json_value(&mut self, rng: &mut Rng, depth: u32) -> Value {
        let kinds = if depth >= 4 { 6 } else { 9 };
        match rng.below(kinds) {
            0 => Value::Null,
            1 => Value::Bool(rng.chance(50)),
            2 => json!(*rng.pick(&[0i64, -1, 1, i64::MIN, i64::MAX, 1 << 53, -(1 << 53) - 1])),
            3 => json!(*rng.pick(&[0.5f64, -0.0, 1e308, -1e308, 5e-324, std::f64::consts::PI])),
            4 | 5 => Value::String(
                self.text(rng)
                    .unwrap_or_default()
                    .replace('\0', "")
                    .chars()
                    .take(20_000)
                    .collect(),
            ),
            6 => Value::Array(
                (0..rng.below(5))
                    .map(|_| self.json_value(rng, depth + 1))
                    .collect(),
            ),
            _ => {
                let mut m = Map::new();
                for _ in 0..rng.below(5) {
                    let k = self.text(rng).unwrap_or_default().replace('\0', "");
                    let v = self.json_value(rng, depth + 1);
                    m.insert(k, v);
                }
                Value::Object(m)
            }
        }
    }

    /// Random JSON text: mostly valid, sometimes deep, huge, escaped or malformed.
    pub(super) fn json(&mut self, rng: &mut Rng) -> Option<String> {
        Some(match rng.below(100) {
            0..=4 => return None,
            5..=9 => rng.pick(&MALFORMED_JSON).to_string(),
            10..=12 => {
                let n = *rng.pick(&[100usize, 1000, 5000]);
                if rng.chance(50) {
                    format!("{}{}", "[".repeat(n), "]".repeat(n))
                } else {
                    format!("{}1{}", "{\"a\":".repeat(n), "}".repeat(n))
                }
            }
            13..=15 => rng
                .pick(&[
                    "1e400",
                    "-1e-400",
                    "123456789012345678901234567890123456789012345678901234567890",
                    "{\"n\": 1e308, \"m\": -9223372036854775809}",
                    "\"\\ud83d\\ude00 \\u202e \\u00e9\"",
                    "{\"\\u202e\": \"\\ufeff\"}",
                    "[[], {}, [[]], {\"\": {}}]",
                ])
                .to_string(),
            _ => {
                let text = self.json_value(rng, 0).to_string();
                // Rare nests of long strings: keep a call's size near the payload limit.
                if text.len() > 1_500_000 {
                    format!("{{\"big\": \"{}\"}}", "x".repeat(1_100_000))
                } else {
                    text
                }
            }
        })
    }

    /// Message headers: names a message may set, framing, routing, signing and key headers
    /// it may not, and hostile names.
    pub(super) fn message_headers(&mut self, rng: &mut Rng) -> String {
        let mut m = Map::new();
        for _ in 0..=rng.below(3) {
            let name = match rng.below(3) {
                0 => self.text(rng).unwrap_or_default().replace('\0', ""),
                _ => rng
                    .pick(&[
                        "X-Request-Id",
                        "Host",
                        "content-length",
                        "Transfer-Encoding",
                        "X-Forwarded-For",
                        "Proxy-Authorization",
                        "Forwarded",
                        "webhook-signature",
                        "Idempotency-Key",
                        "X-Effect-Key",
                    ])
                    .to_string(),
            };
            m.insert(name, json!(rng.pick(&["3", "", "v\r\nX-Injected: 1"])));
        }
        Value::Object(m).to_string()
    }

    /// A value for a channel option `key`: the right type or deliberately the wrong one.
    pub(super) fn option_value(&mut self, rng: &mut Rng, key: &str) -> Value {
        if rng.chance(30) {
            return self.json_value(rng, 2);
        }
        let int = |rng: &mut Rng| -> Value {
            json!(*rng.pick(&[0i64, -1, 1, 100, 3_600_000, 3_600_001, i64::MAX, i64::MIN]))
        };
        match key {
            "kind" => json!(rng.pick(&["http", "sql", "smtp", "", "HTTP"])),
            "method" => json!(rng.pick(&["POST", "get", "DELETE", "TRACE", "", "P OST"])),
            "headers" => {
                let mut m = Map::new();
                for _ in 0..rng.below(4) {
                    let name = if rng.chance(50) {
                        rng.pick(&["X-A", "Authorization", "Content-Type", "X Bad"])
                            .to_string()
                    } else {
                        self.text(rng).unwrap_or_default().replace('\0', "")
                    };
                    let value = self.text(rng).unwrap_or_default().replace('\0', "");
                    m.insert(name, json!(value));
                }
                Value::Object(m)
            }
            "tenants" => match rng.below(7) {
                0 => json!(["*"]),
                1 => json!(["default"]),
                2 => json!([]),
                3 => json!(["*", "default"]),
                4 => json!("default"),
                5 => json!([1, null]),
                _ => json!([self.text(rng).unwrap_or_default()]),
            },
            "timeout_ms"
            | "connect_timeout_ms"
            | "max_in_flight"
            | "max_unverifiable_in_flight"
            | "idempotency_window_ms"
            | "max_response_bytes" => {
                if rng.chance(20) {
                    json!(rng.pick(&["100", "1.5", "-0"]))
                } else {
                    int(rng)
                }
            }
            "idempotency_header" | "reference_header" => {
                json!(rng.pick(&["Idempotency-Key", "X-Effect-Key", "X Bad", "", "é"]))
            }
            "external_id" => {
                json!(rng.pick(&["/id", "header:X-Message-Id", "header:", "id", "/", "~"]))
            }
            "reconcile" => {
                let mut m = Map::new();
                if rng.chance(90) {
                    m.insert("url".into(), json!(rng.pick(&self.lookups).clone()));
                }
                for k in ["method", "found", "external_id", "settle_ms", "nope"] {
                    if rng.chance(25) {
                        let v = match k {
                            "method" => json!(rng.pick(&["GET", "HEAD", "POST", "PUT", ""])),
                            "found" | "external_id" => json!(rng.pick(&["/found", "/id", "x", ""])),
                            "settle_ms" => int(rng),
                            _ => self.json_value(rng, 3),
                        };
                        m.insert(k.into(), v);
                    }
                }
                Value::Object(m)
            }
            "retry" => {
                let mut m = Map::new();
                // The retry keys src/retry_policy.rs knows, and one it does not.
                for k in retry_keys().iter().map(String::as_str).chain(["nope"]) {
                    if rng.chance(30) {
                        let v = match k {
                            "multiplier" => json!(*rng.pick(&[0.0f64, 1.0, 2.0, 1e308, -1.0])),
                            "jitter" => json!(rng.pick(&["full", "equal", "none", "some"])),
                            "respect_retry_after" => json!(rng.chance(50)),
                            "nope" => self.json_value(rng, 3),
                            _ => int(rng),
                        };
                        m.insert(k.into(), v);
                    }
                }
                Value::Object(m)
            }
            "classify" => {
                let mut m = Map::new();
                for _ in 0..rng.below(3) {
                    let status = rng
                        .pick(&["409", "404", "200", "999", "4xx", "abc", "-1"])
                        .to_string();
                    m.insert(
                        status,
                        json!(rng.pick(&[
                            "transient",
                            "permanent",
                            "ambiguous",
                            "delivered",
                            "nope"
                        ])),
                    );
                }
                Value::Object(m)
            }
            "classify_answers" => {
                let mut rules = Vec::new();
                for _ in 0..rng.below(4) {
                    let mut m = Map::new();
                    for k in ["status", "contains", "class", "nope"] {
                        if rng.chance(75) {
                            let v = match k {
                                "status" => {
                                    json!(rng.pick(&["409", "4xx", "2xx", "200", "6xx", ""]))
                                }
                                "contains" => json!(self.text(rng).unwrap_or_default()),
                                "class" => json!(rng.pick(&["transient", "delivered", "nope"])),
                                _ => self.json_value(rng, 2),
                            };
                            m.insert(k.into(), v);
                        }
                    }
                    rules.push(Value::Object(m));
                }
                Value::Array(rules)
            }
            "function" => json!(rng.pick(&[
                "public.e2e_nope",
                "pg_catalog.now",
                "outbox.enqueue",
                "x",
                ""
            ])),
            "run_as" => json!(rng.pick(&["postgres", "outbox_worker", "no_such_role", ""])),
            "tls" => {
                let mut pem = |rng: &mut Rng| match rng.below(5) {
                    0 => json!("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"),
                    1 => json!("-----BEGIN PRIVATE KEY-----\n!!\n-----END PRIVATE KEY-----\n"),
                    2 => json!("not pem"),
                    3 => json!(null),
                    _ => json!(format!(
                        "-----BEGIN CERTIFICATE-----{}",
                        self.text(rng).unwrap_or_default()
                    )),
                };
                let mut m = Map::new();
                for k in ["ca_pem", "client_cert_pem", "client_key_pem", "nope"] {
                    if rng.chance(40) {
                        m.insert(k.into(), pem(rng));
                    }
                }
                Value::Object(m)
            }
            "rate_limit" | "circuit" => {
                let keys: &[&str] = if key == "rate_limit" {
                    &["per_second", "burst", "nope"]
                } else {
                    &["open_after", "open_ms", "nope"]
                };
                let mut m = Map::new();
                for k in keys {
                    if rng.chance(70) {
                        let v = if rng.chance(20) {
                            self.json_value(rng, 2)
                        } else {
                            int(rng)
                        };
                        m.insert(k.to_string(), v);
                    }
                }
                Value::Object(m)
            }
            "signing" => {
                let mut secret = |rng: &mut Rng| match rng.below(6) {
                    0 => json!("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
                    1 => json!("whsec_c2hvcnQ="),
                    2 => json!("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
                    3 => json!("whsec_"),
                    4 => json!(null),
                    _ => json!(self.text(rng).unwrap_or_default()),
                };
                let mut m = Map::new();
                if rng.chance(80) {
                    let n = rng.below(4);
                    m.insert(
                        "secrets".into(),
                        Value::Array((0..n).map(|_| secret(rng)).collect()),
                    );
                }
                if rng.chance(30) {
                    m.insert(
                        "scheme".into(),
                        json!(rng.pick(&["standard-webhooks", "v2", ""])),
                    );
                }
                if rng.chance(10) {
                    m.insert("nope".into(), self.json_value(rng, 2));
                }
                Value::Object(m)
            }
            "endpoint" => json!(rng.pick(&self.endpoints).clone()),
            _ => self.json_value(rng, 2),
        }
    }

    /// A random option object (or, sometimes, any JSON at all).
    pub(super) fn options(&mut self, rng: &mut Rng) -> Option<String> {
        if rng.chance(10) {
            return self.json(rng);
        }
        let mut m = Map::new();
        for _ in 0..rng.below(5) {
            let key = if rng.chance(85) {
                rng.pick(known_option_keys()).clone()
            } else {
                self.text(rng).unwrap_or_default().replace('\0', "")
            };
            let value = self.option_value(rng, &key);
            m.insert(key, value);
        }
        Some(Value::Object(m).to_string())
    }

    /// A channel name to use: mostly one the fuzz created.
    pub(super) fn channel(&mut self, rng: &mut Rng) -> Option<String> {
        if !self.channels.is_empty() && rng.chance(75) {
            Some(rng.pick(&self.channels).clone())
        } else {
            self.text(rng)
        }
    }

    /// A name for a new channel: always starts with the run's tag (so the cleanup finds
    /// it), unless NULL or empty.
    pub(super) fn new_channel(&mut self, rng: &mut Rng) -> Option<String> {
        match rng.below(100) {
            0..=4 => None,
            5..=9 => Some(String::new()),
            _ => {
                let n = self.next_serial();
                let suffix = if rng.chance(50) {
                    self.text(rng).unwrap_or_default()
                } else {
                    String::new()
                };
                Some(format!("{}_c{n}{suffix}", self.tag))
            }
        }
    }

    pub(super) fn endpoint(&mut self, rng: &mut Rng) -> Option<String> {
        if rng.chance(70) {
            Some(rng.pick(&self.endpoints).clone())
        } else {
            // Never an http(s) URL with a host: at worst a refused endpoint.
            self.text(rng).map(|t| t.replace("//", "/"))
        }
    }

    /// An id: a message of the fuzz, an extreme, or one that does not exist. Never a small
    /// positive id, which may belong to another test's message.
    pub(super) fn id(&mut self, rng: &mut Rng) -> Option<i64> {
        match rng.below(100) {
            0..=4 => None,
            5..=24 => Some(*rng.pick(&[
                i64::MIN,
                i64::MIN + 1,
                -1,
                0,
                i64::MAX,
                i64::MAX - 1,
                -(1 << 31),
                1 << 31,
                1 << 32,
            ])),
            25..=79 if !self.ids.is_empty() => Some(*rng.pick(&self.ids)),
            _ => Some(self.unknown_base + rng.below(1_000_000) as i64),
        }
    }

    pub(super) fn role(&mut self, rng: &mut Rng) -> Option<String> {
        let r = if rng.chance(50) {
            Some(rng.pick(&self.roles).clone())
        } else {
            self.text(rng)
        };
        // Never bind a role the fuzz does not own (another test's, or outbox_writer itself).
        match r {
            Some(name) if self.foreign_roles.contains(&name) => Some(self.roles[0].clone()),
            other => other,
        }
    }

    pub(super) fn tenant(&mut self, rng: &mut Rng) -> Option<String> {
        if rng.chance(40) {
            Some(rng.pick(&self.tenants).clone())
        } else if rng.chance(5) {
            Some("*".into())
        } else {
            self.text(rng)
        }
    }

    pub(super) fn timestamp(&mut self, rng: &mut Rng) -> Option<String> {
        if rng.chance(40) {
            None
        } else if rng.chance(80) {
            Some(rng.pick(&TIMESTAMPS).to_string())
        } else {
            self.text(rng)
        }
    }

    pub(super) fn payload(&mut self, rng: &mut Rng) -> Option<String> {
        if rng.chance(50) {
            Some(json!({"fuzz": self.next_serial(), "text": self.text(rng).map(|t| t.replace('\0', ""))}).to_string())
        } else {
            self.json(rng)
        }
    }

    pub(super) fn effect_key(&mut self, rng: &mut Rng) -> Option<String> {
        if rng.chance(50) {
            let n = self.next_serial();
            Some(format!("{}_k{n}", self.tag))
        } else {
            self.text(rng)
        }
    }

    /// The next call, drawn with fixed weights over every public function.
    pub(super) fn call(&mut self, rng: &mut Rng) -> Call {
        use Arg::{Int, Text};
        let r = rng.below(1000);
        match r {
            0..=79 => Call {
                function: "effect_key",
                sql: "SELECT outbox.effect_key($1::text, $2::text)",
                args: vec![Text(self.text(rng)), Text(self.text(rng))],
                effect: Effect::None,
            },
            80..=159 => Call {
                function: "create_channel",
                sql: "SELECT outbox.create_channel($1::text, $2::text, $3::text::jsonb)",
                args: vec![
                    Text(self.new_channel(rng)),
                    Text(self.endpoint(rng)),
                    Text(if rng.chance(40) { Some("{}".into()) } else { self.options(rng) }),
                ],
                effect: Effect::Channel,
            },
            160..=179 => Call {
                function: "create_channel/2",
                sql: "SELECT outbox.create_channel($1::text, $2::text)",
                args: vec![Text(self.new_channel(rng)), Text(self.endpoint(rng))],
                effect: Effect::Channel,
            },
            180..=239 => Call {
                function: "alter_channel",
                sql: "SELECT outbox.alter_channel($1::text, $2::text::jsonb)",
                args: vec![Text(self.channel(rng)), Text(self.options(rng))],
                effect: Effect::None,
            },
            240..=264 => Call {
                function: "pause_channel",
                sql: "SELECT outbox.pause_channel($1::text, $2::text)",
                args: vec![Text(self.channel(rng)), Text(self.text(rng))],
                effect: Effect::None,
            },
            265..=284 => Call {
                function: "resume_channel",
                sql: "SELECT outbox.resume_channel($1::text)",
                args: vec![Text(self.channel(rng))],
                effect: Effect::None,
            },
            285..=429 => Call {
                function: "enqueue",
                sql: "SELECT outbox.enqueue($1::text, $2::text::jsonb, $3::text, $4::text, $5::text::timestamptz, $6::text::jsonb)",
                args: vec![
                    Text(self.channel(rng)),
                    Text(self.payload(rng)),
                    Text(self.effect_key(rng)),
                    Text(if rng.chance(60) { None } else { self.text(rng) }),
                    Text(self.timestamp(rng)),
                    Text(match rng.below(4) {
                        0 | 1 => None,
                        2 => self.json(rng),
                        _ => Some(self.message_headers(rng)),
                    }),
                ],
                effect: Effect::Message,
            },
            430..=479 => Call {
                function: "enqueue/3",
                sql: "SELECT outbox.enqueue($1::text, $2::text::jsonb, $3::text)",
                args: vec![
                    Text(self.channel(rng)),
                    Text(self.payload(rng)),
                    Text(self.effect_key(rng)),
                ],
                effect: Effect::Message,
            },
            480..=529 => Call {
                function: "status",
                sql: "SELECT outbox.status($1::int8)::text",
                args: vec![Int(self.id(rng))],
                effect: Effect::None,
            },
            530..=569 => Call {
                function: "reconcile(id)",
                sql: "SELECT outbox.reconcile($1::int8)",
                args: vec![Int(self.id(rng))],
                effect: Effect::None,
            },
            570..=572 => Call {
                function: "reconcile()",
                sql: "SELECT * FROM outbox.reconcile()",
                args: vec![],
                effect: Effect::None,
            },
            573..=619 => Call {
                function: "retry",
                sql: "SELECT outbox.retry($1::int8, $2::text)::text",
                args: vec![Int(self.id(rng)), Text(self.text(rng))],
                effect: Effect::None,
            },
            620..=669 => Call {
                function: "resolve",
                sql: "SELECT outbox.resolve($1::int8, $2::text, $3::text, $4::text)::text",
                args: vec![
                    Int(self.id(rng)),
                    Text(if rng.chance(60) {
                        Some(rng.pick(&["delivered", "failed", "cancelled"]).to_string())
                    } else {
                        self.text(rng)
                    }),
                    Text(self.text(rng)),
                    Text(if rng.chance(50) { None } else { self.text(rng) }),
                ],
                effect: Effect::None,
            },
            670..=709 => Call {
                function: "cancel",
                sql: "SELECT outbox.cancel($1::int8, $2::text)::text",
                args: vec![Int(self.id(rng)), Text(self.text(rng))],
                effect: Effect::None,
            },
            710..=749 => Call {
                function: "assign",
                sql: "SELECT outbox.assign($1::int8, $2::text)",
                args: vec![Int(self.id(rng)), Text(self.text(rng))],
                effect: Effect::None,
            },
            750..=799 => Call {
                function: "bind_tenant",
                sql: "SELECT outbox.bind_tenant($1::text::name, $2::text)",
                args: vec![Text(self.role(rng)), Text(self.tenant(rng))],
                effect: Effect::Binding,
            },
            800..=829 => Call {
                function: "unbind_tenant",
                sql: "SELECT outbox.unbind_tenant($1::text::name, $2::text)",
                args: vec![Text(self.role(rng)), Text(self.tenant(rng))],
                effect: Effect::None,
            },
            830..=849 => Call {
                function: "prometheus",
                sql: "SELECT length(outbox.prometheus())",
                args: vec![],
                effect: Effect::None,
            },
            850..=869 => Call {
                function: "worker_status",
                sql: "SELECT * FROM outbox.worker_status()",
                args: vec![],
                effect: Effect::None,
            },
            870..=919 => Call {
                function: "set outbox.tenant",
                sql: "SELECT pg_catalog.set_config('outbox.tenant', $1::text, false)",
                args: vec![Text(self.tenant(rng))],
                effect: Effect::None,
            },
            _ => {
                let (function, sql): (&'static str, &'static str) = *rng.pick(&[
                    ("read messages", "SELECT count(*) FROM outbox.messages WHERE effect_key = $1::text OR channel = $1::text"),
                    ("read attempts", "SELECT count(*) FROM outbox.attempts WHERE error = $1::text OR true"),
                    ("read ledger", "SELECT count(*) FROM outbox.ledger WHERE effect_key = $1::text"),
                    ("read work_queue", "SELECT count(*) FROM outbox.work_queue WHERE owner = $1::text OR true"),
                    ("read operator_log", "SELECT count(*) FROM outbox.operator_log WHERE reason = $1::text"),
                    ("read channels", "SELECT count(*) FROM outbox.channels WHERE name = $1::text"),
                    ("read metrics", "SELECT count(*) FROM outbox.metrics WHERE channel = $1::text OR true"),
                    ("read alerts", "SELECT count(*) FROM outbox.alerts WHERE channel = $1::text OR true"),
                ]);
                Call {
                    function,
                    sql,
                    args: vec![Text(self.text(rng))],
                    effect: Effect::None,
                }
            }
        }
    }
}
