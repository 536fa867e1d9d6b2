//! The options of a `nats` channel (NATS JetStream): where each message is published, the
//! stream that must acknowledge it, how the worker authenticates, and the stream's duplicate
//! window as read when the channel was created or altered. Pure Rust.

use super::subject;
use crate::channels::option_error::OptionError;
use crate::channels::secrets::{number_or_shape, shape};
use serde_json::{json, Map, Value};

/// How the worker authenticates to the NATS server.
#[derive(Debug, Clone, PartialEq)]
pub enum NatsAuth {
    Token(String),
    UserPassword { user: String, password: String },
}

/// Where a `nats` channel publishes.
#[derive(Debug, Clone, PartialEq)]
pub struct NatsTarget {
    /// A subject, or a template with `{effect_key}` and `{payload:/pointer}` placeholders.
    pub subject: String,
    /// The stream whose acknowledgement means delivered.
    pub stream: String,
    pub auth: Option<NatsAuth>,
    /// The stream's duplicate window: a message republished with the same `Nats-Msg-Id`
    /// inside it is stored once. Read from the stream's configuration by `create_channel`
    /// and `alter_channel`; None only before that.
    pub duplicate_window_ms: Option<u64>,
}

/// Keys only a `nats` channel uses.
pub const NATS_ONLY: &[&str] = &["subject", "stream", "auth", "duplicate_window_ms"];

/// Longest stream name NATS accepts.
const MAX_STREAM_NAME: usize = 255;

/// Does NATS accept `name` as a stream name (no space, dot, wildcard or path separator)?
pub fn valid_stream_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_STREAM_NAME
        && name
            .chars()
            .all(|c| !c.is_whitespace() && !c.is_control() && !".*>/\\".contains(c))
}

fn required_string<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    what: &str,
) -> Result<&'a str, OptionError> {
    match obj.get(key) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s),
        Some(Value::Null) | None => Err(OptionError::new(
            key,
            format!("is required for kind nats: {what}"),
        )),
        Some(v) => Err(OptionError::new(
            key,
            format!("must be a non-empty string, not {}", shape(v)),
        )),
    }
}

fn parse_auth(v: &Value) -> Result<NatsAuth, OptionError> {
    let hint = "must be {\"token\": \"…\"} or {\"user\": \"…\", \"password\": \"…\"}";
    let obj = v
        .as_object()
        .ok_or_else(|| OptionError::new("auth", format!("{hint}, not {}", shape(v))))?;
    let text = |k: &str| match obj.get(k) {
        Some(Value::String(s)) if !s.is_empty() && !s.chars().any(char::is_control) => {
            Ok(Some(s.clone()))
        }
        None => Ok(None),
        Some(_) => Err(OptionError::new(
            format!("auth.{k}"),
            "must be a non-empty string without control characters",
        )),
    };
    if let Some(unknown) = obj
        .keys()
        .find(|k| !["token", "user", "password"].contains(&k.as_str()))
    {
        return Err(OptionError::new(
            format!("auth.{unknown}"),
            format!("unknown key; auth {hint}"),
        ));
    }
    match (text("token")?, text("user")?, text("password")?) {
        (Some(token), None, None) => Ok(NatsAuth::Token(token)),
        (None, Some(user), Some(password)) => Ok(NatsAuth::UserPassword { user, password }),
        _ => Err(OptionError::new("auth", hint)),
    }
}

/// Parses the `nats` part of an option object (the keys common to every kind are parsed by
/// `ChannelOptions::from_json`).
pub fn parse(obj: &Map<String, Value>) -> Result<NatsTarget, OptionError> {
    let subject = required_string(
        obj,
        "subject",
        "the subject (or template) each message is published to",
    )?;
    subject::check_template(subject).map_err(|e| OptionError::new("subject", e))?;
    let stream = required_string(
        obj,
        "stream",
        "the JetStream stream whose acknowledgement means delivered",
    )?;
    if !valid_stream_name(stream) {
        return Err(OptionError::new(
            "stream",
            format!("\"{stream}\" is not a stream name (no space, '.', '*', '>', '/' or '\\')"),
        ));
    }
    let auth = match obj.get("auth") {
        None | Some(Value::Null) => None,
        Some(v) => Some(parse_auth(v)?),
    };
    let duplicate_window_ms = match obj.get("duplicate_window_ms") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().filter(|n| *n >= 1).ok_or_else(|| {
            OptionError::new(
                "duplicate_window_ms",
                format!("must be a positive integer, not {}", number_or_shape(v)),
            )
        })?),
    };
    Ok(NatsTarget {
        subject: subject.to_string(),
        stream: stream.to_string(),
        auth,
        duplicate_window_ms,
    })
}

impl NatsTarget {
    /// The normalized keys of the target, added to the channel's option object.
    pub fn to_json(&self) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("subject".into(), json!(self.subject));
        m.insert("stream".into(), json!(self.stream));
        m.insert(
            "auth".into(),
            match &self.auth {
                None => Value::Null,
                Some(NatsAuth::Token(t)) => json!({ "token": t }),
                Some(NatsAuth::UserPassword { user, password }) => {
                    json!({ "user": user, "password": password })
                }
            },
        );
        m.insert(
            "duplicate_window_ms".into(),
            json!(self.duplicate_window_ms),
        );
        m
    }

    /// Can an interrupted publish be looked up (the subject names the effect key)?
    pub fn can_look_up(&self) -> bool {
        subject::names_effect_key(&self.subject)
    }
}

/// Checks that `endpoint` is `nats://host[:port]` with no user, password, path or query
/// (credentials go in `auth`, where they are masked).
pub fn validate_endpoint(endpoint: &str) -> Result<url::Url, OptionError> {
    let url = url::Url::parse(endpoint).map_err(|e| {
        OptionError::new(
            "endpoint",
            format!(
                "\"{}\" is not a valid URL ({e})",
                crate::channels::secrets::mask_url(endpoint)
            ),
        )
    })?;
    if url.scheme() != "nats" {
        return Err(OptionError::new(
            "endpoint",
            format!(
                "scheme must be nats for a channel of kind nats, not \"{}\"",
                url.scheme()
            ),
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(OptionError::new("endpoint", "URL has no host"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(OptionError::new(
            "endpoint",
            "carries credentials; put them in the auth option, where they are masked",
        ));
    }
    if !(url.path().is_empty() || url.path() == "/")
        || url.query().is_some()
        || url.fragment().is_some()
    {
        return Err(OptionError::new(
            "endpoint",
            "must be nats://host:port, with no path or query",
        ));
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn a_target_round_trips() {
        let t = parse(&obj(
            json!({"subject": "o.{effect_key}", "stream": "ORDERS",
            "auth": {"user": "u", "password": "p"}, "duplicate_window_ms": 120000}),
        ))
        .unwrap();
        assert!(t.can_look_up());
        assert_eq!(parse(&t.to_json()).unwrap(), t);
        let fixed = parse(&obj(json!({"subject": "o.created", "stream": "S"}))).unwrap();
        assert!(!fixed.can_look_up());
        assert_eq!(fixed.auth, None);
    }

    #[test]
    fn bad_targets_name_their_option() {
        let cases = [
            (json!({"stream": "S"}), "subject"),
            (json!({"subject": "a.*", "stream": "S"}), "subject"),
            (json!({"subject": "a"}), "stream"),
            (json!({"subject": "a", "stream": "a.b"}), "stream"),
            (json!({"subject": "a", "stream": 3}), "stream"),
            (json!({"subject": "a", "stream": "S", "auth": "x"}), "auth"),
            (
                json!({"subject": "a", "stream": "S", "auth": {"user": "u"}}),
                "auth",
            ),
            (
                json!({"subject": "a", "stream": "S", "auth": {"token": "t", "user": "u", "password": "p"}}),
                "auth",
            ),
            (
                json!({"subject": "a", "stream": "S", "auth": {"tok": "t"}}),
                "auth.tok",
            ),
            (
                json!({"subject": "a", "stream": "S", "auth": {"token": "a\nb"}}),
                "auth.token",
            ),
            (
                json!({"subject": "a", "stream": "S", "duplicate_window_ms": 0}),
                "duplicate_window_ms",
            ),
        ];
        for (v, option) in cases {
            let e = parse(&obj(v.clone())).unwrap_err();
            assert_eq!(e.option, option, "{v}: {e:?}");
        }
    }

    #[test]
    fn endpoints_are_nats_urls_without_credentials() {
        assert!(validate_endpoint("nats://127.0.0.1:4222").is_ok());
        assert!(validate_endpoint("nats://bus.example").is_ok());
        for bad in [
            "http://x",
            "nats://",
            "nats://u:p@h:4222",
            "nats://h:1/path",
            "nats://h:1?q=1",
            "x",
        ] {
            assert!(validate_endpoint(bad).is_err(), "{bad}");
        }
    }
}
