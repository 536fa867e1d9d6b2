//! Channels whose effect happens outside the database — HTTP and NATS JetStream — behind
//! one trait, [`Channel`]: prepare a send (or say why the message cannot be sent), and look
//! a message up read-only. The worker sorts, sends and decides through it without knowing
//! the kind; `sql` channels are not remote: their effect runs in the record transaction
//! (`sql_effect`).
//!
//! [`Remotes`] keeps one channel object per channel and options version: an HTTP channel's
//! connection pool, a `nats` channel's connection. Every send and lookup is held to the
//! `outbox.allowed_hosts` list of the moment.

use super::guard::{self, AllowList};
use super::http::{self, Transmission, Transport};
use super::lookup::{self, Lookup, Subject};
use super::lookup_url;
use super::nats::{NatsConnection, Publication};
use super::options::{ChannelOptions, Kind};
use super::request;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// A send or lookup under way, run on the worker's (or a backend's) runtime.
pub type Pending<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// What one send came to, by kind; `decide::after_send` turns it into the next state.
#[derive(Debug, Clone, PartialEq)]
pub enum Sent {
    Http(Transmission),
    Nats(Publication),
}

/// A channel the worker sends to outside the database.
pub trait Channel: Send + Sync {
    /// The send of one message, ready to run; `Err` when the message cannot be sent on this
    /// channel at all (nothing is sent; the message fails).
    fn prepare(
        &self,
        message: &request::Message<'_>,
        allowed: Arc<AllowList>,
    ) -> Result<Pending<Sent>, String>;

    /// A read-only lookup of one message at the destination.
    fn lookup(&self, subject: &Subject, allowed: Arc<AllowList>) -> Pending<Lookup>;
}

/// An HTTP channel: its endpoint, options and connection pool.
pub struct HttpChannel {
    pub client: reqwest::Client,
    pub endpoint: String,
    pub options: Arc<ChannelOptions>,
}

impl Channel for HttpChannel {
    fn prepare(
        &self,
        message: &request::Message<'_>,
        allowed: Arc<AllowList>,
    ) -> Result<Pending<Sent>, String> {
        let mut out = request::outgoing(message, &self.endpoint, &self.options)?;
        if let Some(signing) = &self.options.signing {
            let now_s = (crate::clock::now_ms() / 1000) as u64;
            signing.sign(
                &mut out.headers,
                message.effect_key,
                now_s,
                out.body.as_bytes(),
            );
        }
        let client = self.client.clone();
        Ok(Box::pin(async move {
            Sent::Http(http::transmit(client, out, allowed).await)
        }))
    }

    fn lookup(&self, subject: &Subject, allowed: Arc<AllowList>) -> Pending<Lookup> {
        let Some(config) = &self.options.reconcile else {
            return ready(Lookup::Unavailable {
                error: "the channel has no reconcile lookup".into(),
                http_status: None,
            });
        };
        match lookup_url::fill(&config.url, subject) {
            Ok(url) => Box::pin(lookup::lookup(
                self.client.clone(),
                (*self.options).clone(),
                url,
                subject.clone(),
                allowed,
            )),
            Err(error) => ready(Lookup::Unavailable {
                error,
                http_status: None,
            }),
        }
    }
}

/// A `nats` channel: a connection made on its first send.
pub struct NatsChannel {
    pub connection: Arc<NatsConnection>,
}

impl Channel for NatsChannel {
    fn prepare(
        &self,
        message: &request::Message<'_>,
        allowed: Arc<AllowList>,
    ) -> Result<Pending<Sent>, String> {
        let connection = self.connection.clone();
        let (key, payload) = (message.effect_key.to_string(), message.payload.to_string());
        Ok(Box::pin(async move {
            Sent::Nats(connection.send(&allowed, key, payload).await)
        }))
    }

    fn lookup(&self, subject: &Subject, allowed: Arc<AllowList>) -> Pending<Lookup> {
        if !self.connection.target().can_look_up() {
            return ready(Lookup::Unavailable {
                error: "the channel's subject does not name {effect_key}: it cannot be looked up"
                    .into(),
                http_status: None,
            });
        }
        let connection = self.connection.clone();
        let (key, payload) = (subject.effect_key.clone(), subject.payload.clone());
        Box::pin(async move { connection.lookup(&allowed, key, payload).await })
    }
}

fn ready<T: Send + 'static>(value: T) -> Pending<T> {
    Box::pin(std::future::ready(value))
}

/// Builds the channel object of one channel; `Err` for a `sql` channel or a client that
/// cannot be built. `transport` holds the HTTP pools.
pub fn open(
    transport: &mut Transport,
    channel_id: i32,
    version: &str,
    endpoint: &str,
    options: &ChannelOptions,
    batch_size: usize,
) -> Result<Arc<dyn Channel>, String> {
    match &options.kind {
        Kind::Http => Ok(Arc::new(HttpChannel {
            client: transport.client(channel_id, version, options, batch_size)?,
            endpoint: endpoint.to_string(),
            options: Arc::new(options.clone()),
        })),
        Kind::Nats(target) => Ok(Arc::new(NatsChannel {
            connection: Arc::new(NatsConnection::new(
                endpoint,
                Arc::new(options.clone()),
                target.clone(),
            )),
        })),
        Kind::Sql { .. } => Err("a sql channel runs its effect in the database".into()),
    }
}

/// The channel objects of a worker, one per channel and options version, and the HTTP
/// pools they use. A change of `outbox.allowed_hosts` drops them all.
#[derive(Default)]
pub struct Remotes {
    pub transport: Transport,
    open: HashMap<i32, (String, Arc<dyn Channel>)>,
}

impl Remotes {
    /// See [`Transport::set_allowed_hosts`]; every channel object is made again after a change.
    pub fn set_allowed_hosts(&mut self, text: &str) -> Option<Result<(), guard::InvalidEntry>> {
        let changed = self.transport.set_allowed_hosts(text);
        if changed.is_some() {
            self.open.clear();
        }
        changed
    }

    pub fn allowed(&self) -> Arc<AllowList> {
        self.transport.allowed()
    }

    /// The channel object for a channel at `version` of its options.
    pub fn channel(
        &mut self,
        channel_id: i32,
        version: &str,
        endpoint: &str,
        options: &ChannelOptions,
        batch_size: usize,
    ) -> Result<Arc<dyn Channel>, String> {
        if let Some((v, c)) = self.open.get(&channel_id) {
            if v == version {
                return Ok(c.clone());
            }
        }
        let c = open(
            &mut self.transport,
            channel_id,
            version,
            endpoint,
            options,
            batch_size,
        )?;
        self.open
            .insert(channel_id, (version.to_string(), c.clone()));
        Ok(c)
    }

    /// Forgets channels that no longer exist.
    pub fn retain(&mut self, live: impl Fn(i32) -> bool) {
        self.transport.retain(&live);
        self.open.retain(|id, _| live(*id));
    }
}
