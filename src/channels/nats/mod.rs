//! The NATS JetStream transport of a `nats` channel: a connection per channel (made on the
//! first send, held to `outbox.allowed_hosts`), the publish with `Nats-Msg-Id` = the effect
//! key as sent, and the read-only lookup of the last message on a subject. No Postgres.
//!
//! What a publish comes to ([`Publication`]) says how far it got: nothing written (no
//! connection, the stream's configuration could not be read, the message cannot be
//! published), refused by the server before it stored anything (no stream listens on the
//! subject), acknowledged, or written with no acknowledgement — the one outcome after which
//! the stream may or may not hold the message.

pub mod subject;
pub mod target;
pub mod window;

use crate::allow_list::{self, AllowList};
use crate::channels::lookup::Lookup;
use crate::channels::options::ChannelOptions;
use async_nats::jetstream::{self, context::PublishErrorKind};
use std::sync::Arc;
use std::time::{Duration, Instant};
use target::{NatsAuth, NatsTarget};

/// The header JetStream dedupes by.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// What one publish came to.
#[derive(Debug, Clone, PartialEq)]
pub enum Publication {
    /// A stream acknowledged the message (`duplicate`: it already held that `Nats-Msg-Id`,
    /// and `sequence` is the one stored first).
    Acked {
        stream: String,
        sequence: u64,
        duplicate: bool,
        elapsed_ms: u64,
    },
    /// Nothing was written; `permanent` when sending again cannot help.
    NotWritten { error: String, permanent: bool },
    /// The server answered that it stored nothing: no stream listens on the subject (no
    /// responders), the subject belongs to another stream, or the stream refused the
    /// message; `permanent` when sending again cannot help.
    Rejected {
        error: String,
        permanent: bool,
        elapsed_ms: u64,
    },
    /// The attempt's fence had passed before the publish (`fence`): nothing was written,
    /// and the attempt is not counted.
    Fenced { error: String },
    /// Written, and no acknowledgement came: the stream may hold it.
    NoAck {
        error: String,
        timed_out: bool,
        elapsed_ms: u64,
    },
}

/// An open connection with the stream as read when it was made.
#[derive(Clone)]
pub struct Connected {
    jetstream: jetstream::Context,
    pub stream: StreamFacts,
}

/// The endpoint's host and port (4222 unless given).
fn host_port(endpoint: &str) -> Result<(String, u16), String> {
    let url = url::Url::parse(endpoint).map_err(|e| format!("endpoint is not a URL: {e}"))?;
    let host = url.host_str().ok_or("endpoint has no host")?;
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    Ok((host, url.port().unwrap_or(4222)))
}

/// The addresses of the endpoint that `allowed` lets a connection reach.
async fn allowed_addresses(endpoint: &str, allowed: &AllowList) -> Result<Vec<String>, String> {
    let (host, port) = host_port(endpoint)?;
    if !allow_list::host_allowed(allowed, &host) {
        return Err(format!(
            "host \"{host}\" is not allowed by outbox.allowed_hosts"
        ));
    }
    let resolved: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host.as_str(), port))
        .await
        .map_err(|e| format!("dns: {host}: {e}"))?
        .collect();
    let kept = allow_list::filter_resolved(allowed, &host, resolved).map_err(|r| r.to_string())?;
    if kept.is_empty() {
        return Err(format!("dns: {host} has no address"));
    }
    Ok(kept.iter().map(|a| format!("nats://{a}")).collect())
}

/// Connects, and reads the stream's duplicate window. A window shorter than the one the
/// channel was created with refuses the connection: republishing inside the stored window
/// could then store a message twice.
pub async fn connect(
    endpoint: &str,
    options: &ChannelOptions,
    target: &NatsTarget,
    allowed: &AllowList,
) -> Result<Connected, String> {
    let addresses = allowed_addresses(endpoint, allowed).await?;
    let mut connect = async_nats::ConnectOptions::new()
        .name(concat!("outbox_delivery/", env!("CARGO_PKG_VERSION")))
        .connection_timeout(Duration::from_millis(options.connect_timeout_ms))
        .request_timeout(Some(Duration::from_millis(options.timeout_ms)))
        .ignore_discovered_servers();
    connect = match &target.auth {
        None => connect,
        Some(NatsAuth::Token(t)) => connect.token(t.clone()),
        Some(NatsAuth::UserPassword { user, password }) => {
            connect.user_and_password(user.clone(), password.clone())
        }
    };
    let client = async_nats::connect_with_options(addresses, connect)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut context = jetstream::new(client);
    context.set_timeout(Duration::from_millis(options.timeout_ms));
    let stream = read_stream(&context, &target.stream).await?;
    let window_ms = stream.window_ms;
    if let Some(stored) = target.duplicate_window_ms {
        if window_ms < stored {
            return Err(format!(
                "stream \"{}\": its duplicate window is {window_ms} ms, shorter than the {stored} ms the channel was set up with; nothing is published until alter_channel reads it again",
                target.stream
            ));
        }
    }
    Ok(Connected {
        jetstream: context,
        stream,
    })
}

/// What `create_channel` and `alter_channel` read of a channel's stream.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamFacts {
    /// The duplicate window, in ms.
    pub window_ms: u64,
    /// The subject filters the stream stores (none: the stream's own name).
    pub subjects: Vec<String>,
}

/// The facts of `stream`; an error naming the stream if it cannot be read.
pub async fn read_stream(
    context: &jetstream::Context,
    stream: &str,
) -> Result<StreamFacts, String> {
    let mut s = context
        .get_stream(stream)
        .await
        .map_err(|e| format!("stream \"{stream}\" cannot be read: {e}"))?;
    let info = s
        .info()
        .await
        .map_err(|e| format!("stream \"{stream}\" cannot be read: {e}"))?;
    Ok(StreamFacts {
        window_ms: info.config.duplicate_window.as_millis() as u64,
        subjects: info.config.subjects.clone(),
    })
}

/// Connects and reads the stream once, for `create_channel` and `alter_channel`.
pub async fn probe_stream(
    endpoint: &str,
    options: &ChannelOptions,
    target: &NatsTarget,
    allowed: &AllowList,
) -> Result<StreamFacts, String> {
    let probe = NatsTarget {
        duplicate_window_ms: None,
        ..target.clone()
    };
    Ok(connect(endpoint, options, &probe, allowed).await?.stream)
}

/// How a publish is sent.
pub struct Publish<'a> {
    pub subject: String,
    pub effect_key: &'a str,
    pub payload: String,
    /// The stream that must store it (`Nats-Expected-Stream`): a subject that belongs to
    /// another stream is refused by the server, and nothing is stored.
    pub stream: &'a str,
    /// The subject names the effect key: the message is stored only if the subject holds
    /// no message yet (`Nats-Expected-Last-Subject-Sequence: 0`), whatever the duplicate
    /// window says.
    pub first_on_subject: bool,
}

/// The API error a JetStream answer carried, if the failure was one.
fn api_error(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut source = e.source();
    while let Some(s) = source {
        if let Some(api) = s.downcast_ref::<async_nats::jetstream::Error>() {
            return Some(api.to_string());
        }
        source = s.source();
    }
    None
}

/// Publishes one message with `Nats-Msg-Id` = the effect key and waits for its
/// acknowledgement, at most the channel's timeout.
pub async fn publish(connected: &Connected, p: Publish<'_>) -> Publication {
    let started = Instant::now();
    let elapsed = |s: Instant| s.elapsed().as_millis() as u64;
    let mut message = jetstream::message::PublishMessage::build()
        .payload(p.payload.into())
        .message_id(p.effect_key)
        .expected_stream(p.stream);
    if p.first_on_subject {
        message = message.expected_last_subject_sequence(0);
    }
    let pending = match connected.jetstream.send_publish(p.subject, message).await {
        Ok(pending) => pending,
        Err(e) => {
            let permanent = matches!(e.kind(), PublishErrorKind::MaxPayloadExceeded);
            // A time-out here is the client's queue, not the server: nothing was written.
            return Publication::NotWritten {
                error: format!("publish: {e}"),
                permanent,
            };
        }
    };
    match pending.await {
        Ok(ack) => Publication::Acked {
            stream: ack.stream,
            sequence: ack.sequence,
            duplicate: ack.duplicate,
            elapsed_ms: elapsed(started),
        },
        Err(e) => match (e.kind(), api_error(&e)) {
            (PublishErrorKind::StreamNotFound, _) => Publication::Rejected {
                error: "no stream stored it: no responders on the subject (is the stream deleted, or does it not listen on this subject?)".into(),
                permanent: false,
                elapsed_ms: elapsed(started),
            },
            (PublishErrorKind::WrongLastSequence, _) => Publication::Rejected {
                error: ALREADY_ON_SUBJECT.into(),
                permanent: false,
                elapsed_ms: elapsed(started),
            },
            (_, Some(api)) => Publication::Rejected {
                permanent: api.contains("expected stream"),
                error: if api.contains("expected stream") {
                    format!("wrong stream: the subject is not stored by stream \"{}\" ({api})", p.stream)
                } else {
                    format!("the stream stored nothing: {api}")
                },
                elapsed_ms: elapsed(started),
            },
            (kind, None) => Publication::NoAck {
                error: format!("no acknowledgement: {e}"),
                timed_out: matches!(kind, PublishErrorKind::TimedOut),
                elapsed_ms: elapsed(started),
            },
        },
    }
}

/// What a refused first-on-subject publish means: the subject, which names the effect key,
/// already holds a message.
const ALREADY_ON_SUBJECT: &str = "the subject already holds a message";

/// Asks the stream, read-only, for the last message on `subject`: found when it carries
/// `Nats-Msg-Id` = `effect_key` (external id `stream:sequence`), not found when the subject
/// has no message or its last one is another's.
pub async fn look_up(
    connected: &Connected,
    stream: &str,
    subject: &str,
    effect_key: &str,
) -> Lookup {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    let s = match connected.jetstream.get_stream_no_info(stream).await {
        Ok(s) => s,
        Err(e) => {
            return Lookup::Unavailable {
                error: format!("lookup: stream \"{stream}\": {e}"),
                http_status: None,
            }
        }
    };
    match s.get_last_raw_message_by_subject(subject).await {
        Ok(m) => {
            let id = m.headers.get(MSG_ID_HEADER).map(|v| v.as_str().to_string());
            if id.as_deref() == Some(effect_key) {
                Lookup::Found {
                    external_id: Some(format!("{stream}:{}", m.sequence)),
                    http_status: None,
                }
            } else {
                Lookup::NotFound { http_status: None }
            }
        }
        Err(e) if matches!(e.kind(), LastRawMessageErrorKind::NoMessageFound) => {
            Lookup::NotFound { http_status: None }
        }
        Err(e) => Lookup::Unavailable {
            error: format!("lookup: {e}"),
            http_status: None,
        },
    }
}

/// A `nats` channel's connection, made on the first send and made again after a failure.
pub struct NatsConnection {
    endpoint: String,
    options: Arc<ChannelOptions>,
    target: NatsTarget,
    connected: tokio::sync::Mutex<Option<Connected>>,
}

impl NatsConnection {
    pub fn new(endpoint: &str, options: Arc<ChannelOptions>, target: NatsTarget) -> Self {
        NatsConnection {
            endpoint: endpoint.to_string(),
            options,
            target,
            connected: tokio::sync::Mutex::new(None),
        }
    }

    pub fn target(&self) -> &NatsTarget {
        &self.target
    }

    /// The open connection, or a new one (held to `allowed`).
    pub async fn get(&self, allowed: &AllowList) -> Result<Connected, String> {
        let mut slot = self.connected.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let c = connect(&self.endpoint, &self.options, &self.target, allowed).await?;
        *slot = Some(c.clone());
        Ok(c)
    }

    /// Sends one message: its subject, the publish, the acknowledgement.
    pub async fn send(
        &self,
        allowed: &AllowList,
        effect_key: String,
        payload: String,
        fence: crate::channels::fence::Fence,
    ) -> Publication {
        let subject = match subject::fill(&self.target.subject, &effect_key, &payload) {
            Ok(s) => s,
            Err(error) => {
                return Publication::NotWritten {
                    error,
                    permanent: true,
                }
            }
        };
        let connected = match self.get(allowed).await {
            Ok(c) => c,
            Err(error) => {
                return Publication::NotWritten {
                    error,
                    permanent: false,
                }
            }
        };
        // The last moment before the publish: an attempt whose lease ran out meanwhile (its
        // worker was stopped) is not started (`fence`).
        if fence.passed() {
            return Publication::Fenced {
                error: crate::channels::fence::not_sent_text(&fence),
            };
        }
        let first_on_subject = self.target.can_look_up();
        let published = publish(
            &connected,
            Publish {
                subject: subject.clone(),
                effect_key: &effect_key,
                payload,
                stream: &self.target.stream,
                first_on_subject,
            },
        )
        .await;
        match published {
            // An earlier attempt stored it (past the duplicate window, or the
            // acknowledgement was lost): the stream's copy is the delivery.
            Publication::Rejected {
                ref error,
                elapsed_ms,
                ..
            } if error == ALREADY_ON_SUBJECT => {
                match look_up(&connected, &self.target.stream, &subject, &effect_key).await {
                    Lookup::Found { external_id, .. } => Publication::Acked {
                        stream: self.target.stream.clone(),
                        sequence: external_id
                            .and_then(|id| id.rsplit(':').next().and_then(|n| n.parse().ok()))
                            .unwrap_or(0),
                        duplicate: true,
                        elapsed_ms,
                    },
                    other => Publication::NoAck {
                        error: format!(
                            "{ALREADY_ON_SUBJECT}, and the lookup of it gave {}",
                            other.as_str()
                        ),
                        timed_out: false,
                        elapsed_ms,
                    },
                }
            }
            other => other,
        }
    }

    /// Looks a message up by its subject (the subject names the effect key).
    pub async fn lookup(&self, allowed: &AllowList, effect_key: String, payload: String) -> Lookup {
        let subject = match subject::fill(&self.target.subject, &effect_key, &payload) {
            Ok(s) => s,
            Err(error) => {
                return Lookup::Unavailable {
                    error,
                    http_status: None,
                }
            }
        };
        match self.get(allowed).await {
            Ok(c) => look_up(&c, &self.target.stream, &subject, &effect_key).await,
            Err(error) => Lookup::Unavailable {
                error,
                http_status: None,
            },
        }
    }
}
