//! Channels whose effect happens outside the database — HTTP and NATS JetStream — behind
//! one trait, [`Channel`]: prepare a send (or say why the message cannot be sent), and look
//! a message up read-only. The worker sorts, sends and decides through it without knowing
//! the kind; `sql` channels are not remote: their effect runs in the record transaction
//! (`sql_effect`).
//!
//! [`Remotes`] keeps one channel object per channel and options version: an HTTP channel's
//! connection pool, a `nats` channel's connection. Every send and lookup is held to the
//! `outbox.allowed_hosts` list of the moment. [`Remotes::trim`] closes the pools of
//! channels no longer in use once they hold more than the worker's budget of idle
//! connections (`pool_budget`).

use super::connection_slots::ConnectionSlots;
use super::http::{self, Transmission, Transport};
use super::lookup::{self, Lookup, Subject};
use super::lookup_url;
use super::nats::{NatsConnection, Publication};
use super::options::{ChannelOptions, Kind};
use super::pool_budget::{self, Demand, PoolUse};
use super::request;
use super::wire::{self, Wire};
use crate::allow_list::{self, AllowList};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A send or lookup under way, run on the worker's (or a backend's) runtime.
pub type Pending<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// What one send came to, by kind; `decide::after_send` turns it into the next state.
#[derive(Debug, Clone, PartialEq)]
pub enum Sent {
    Http(Transmission),
    Nats(Publication),
}

impl Sent {
    /// Why the send did not start, when its fence had passed first (`fence`).
    pub fn fenced(&self) -> Option<&str> {
        match self {
            Sent::Http(Transmission::Fenced { error })
            | Sent::Nats(Publication::Fenced { error }) => Some(error),
            _ => None,
        }
    }

    /// How long the send took, from its start to its answer or failure; None when nothing
    /// was sent (fenced, or the request could not be built).
    pub fn elapsed_ms(&self) -> Option<u64> {
        match self {
            Sent::Http(
                Transmission::Answered { elapsed_ms, .. }
                | Transmission::Failed { elapsed_ms, .. }
                | Transmission::Refused { elapsed_ms, .. },
            )
            | Sent::Nats(
                Publication::Acked { elapsed_ms, .. }
                | Publication::Rejected { elapsed_ms, .. }
                | Publication::NoAck { elapsed_ms, .. },
            ) => Some(*elapsed_ms),
            Sent::Http(Transmission::NotSent { .. } | Transmission::Fenced { .. })
            | Sent::Nats(Publication::NotWritten { .. } | Publication::Fenced { .. }) => None,
        }
    }
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

    /// The requests of the channel's connection pool, for the worker's budget of idle
    /// connections; `None` for a channel without a pool of its own.
    fn demand(&self) -> Option<&Arc<Demand>> {
        None
    }
}

/// An HTTP channel: its endpoint, options and connection pool.
pub struct HttpChannel {
    pub client: reqwest::Client,
    pub endpoint: String,
    /// `endpoint` parsed once, not for every request; `None` when it does not parse (each
    /// request then fails with the parser's error).
    pub url: Option<reqwest::Url>,
    pub options: Arc<ChannelOptions>,
    /// Requests under way on `client`'s pool.
    pub demand: Arc<Demand>,
    /// The requests sent at once on `client`'s pool before one goes on a connection of
    /// its own (`connection_slots`).
    pub slots: Arc<ConnectionSlots>,
    /// The channel's own HTTP/1.1 connections, for an `http://` endpoint (`wire`): its
    /// sends go there, not through `client`, which still makes its lookups.
    pub wire: Option<Arc<Wire>>,
}

impl Channel for HttpChannel {
    fn prepare(
        &self,
        message: &request::Message<'_>,
        allowed: Arc<AllowList>,
    ) -> Result<Pending<Sent>, String> {
        let mut out = request::outgoing(message, &self.endpoint, &self.options)?;
        out.parsed_url = self.url.clone();
        if let Some(signing) = &self.options.signing {
            let now_s = (crate::clock::now_ms() / 1000) as u64;
            signing.sign(
                &mut out.headers,
                message.effect_key,
                now_s,
                out.body.as_bytes(),
            );
        }
        let (demand, slots) = (self.demand.clone(), self.slots.clone());
        let (wire, client) = (self.wire.clone(), self.client.clone());
        Ok(Box::pin(async move {
            // Taken before the request is built: its timeout starts once it is written.
            let _slot = slots.take().await;
            let _under_way = demand.start();
            Sent::Http(match wire {
                Some(wire) => wire::transmit(wire, out, allowed).await,
                None => http::transmit(client, out, allowed).await,
            })
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
            Ok(url) => {
                let looked_up = lookup::lookup(
                    self.client.clone(),
                    (*self.options).clone(),
                    url,
                    subject.clone(),
                    allowed,
                );
                let demand = self.demand.clone();
                Box::pin(async move {
                    let _under_way = demand.start();
                    looked_up.await
                })
            }
            Err(error) => ready(Lookup::Unavailable {
                error,
                http_status: None,
            }),
        }
    }

    fn demand(&self) -> Option<&Arc<Demand>> {
        Some(&self.demand)
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
        let fence = message.fence;
        Ok(Box::pin(async move {
            Sent::Nats(connection.send(&allowed, key, payload, fence).await)
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
/// cannot be built. `transport` holds the HTTP pools, `origins` the connections of
/// `http://` channels; `connections` is what the worker's batches under way may send at once.
pub fn open(
    transport: &mut Transport,
    origins: &mut wire::Origins,
    channel_id: i32,
    version: &str,
    endpoint: &str,
    options: &ChannelOptions,
    connections: usize,
) -> Result<Arc<dyn Channel>, String> {
    match &options.kind {
        Kind::Http => {
            let url = reqwest::Url::parse(endpoint).ok();
            // Channels to one host and port share its connections (`wire::Origin`).
            let wire = url.as_ref().and_then(wire::Endpoint::of).map(|e| {
                let key = Wire::origin_key(
                    &e,
                    Duration::from_millis(options.connect_timeout_ms),
                    (options.max_in_flight as usize).min(connections),
                );
                Arc::new(Wire::on(e, origins.get(key)))
            });
            Ok(Arc::new(HttpChannel {
                client: transport.client(channel_id, version, options, connections)?,
                endpoint: endpoint.to_string(),
                url,
                wire,
                options: Arc::new(options.clone()),
                demand: Arc::new(Demand::default()),
                slots: Arc::new(ConnectionSlots::new(
                    (options.in_flight_bound().limit() as usize).min(connections),
                )),
            }))
        }
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
    origins: wire::Origins,
    open: HashMap<i32, Open>,
    /// When the pools' demand windows last turned (`pool_budget::IDLE_LIFE`).
    window_started: Option<Instant>,
}

/// One channel object, at a version of the channel's options, and when it was last used:
/// opened, or named by a claim ([`Remotes::trim`]'s `in_use`).
struct Open {
    version: String,
    channel: Arc<dyn Channel>,
    used_at: Instant,
}

impl Remotes {
    /// See [`Transport::set_allowed_hosts`]; every channel object is made again after a change.
    pub fn set_allowed_hosts(
        &mut self,
        text: &str,
    ) -> Option<Result<(), allow_list::InvalidEntry>> {
        let changed = self.transport.set_allowed_hosts(text);
        if changed.is_some() {
            self.open.clear();
            self.origins.clear();
        }
        changed
    }

    pub fn allowed(&self) -> Arc<AllowList> {
        self.transport.allowed()
    }

    /// The channel object for a channel at `version` of its options (`connections`: see
    /// [`open`]).
    pub fn channel(
        &mut self,
        channel_id: i32,
        version: &str,
        endpoint: &str,
        options: &ChannelOptions,
        connections: usize,
    ) -> Result<Arc<dyn Channel>, String> {
        if let Some(o) = self.open.get(&channel_id) {
            if o.version == version {
                return Ok(o.channel.clone());
            }
        }
        let c = open(
            &mut self.transport,
            &mut self.origins,
            channel_id,
            version,
            endpoint,
            options,
            connections,
        )?;
        self.open.insert(
            channel_id,
            Open {
                version: version.to_string(),
                channel: c.clone(),
                used_at: Instant::now(),
            },
        );
        Ok(c)
    }

    /// Holds the idle connections of the pools to `budget` (`pool_budget::to_close`):
    /// closes the pools of the channels used least recently. The channels of `in_use` (a
    /// claim's, about to be sent to) count as used now. Returns the channels whose pools
    /// were closed.
    pub fn trim(&mut self, now: Instant, budget: usize, in_use: &[i32]) -> Vec<i32> {
        let started = *self.window_started.get_or_insert(now);
        // Every window that ended since the last look turns, up to all of them.
        let ended = (now.saturating_duration_since(started).as_secs_f64()
            / pool_budget::IDLE_LIFE.as_secs_f64()) as u32;
        let turns = ended.min(pool_budget::WINDOWS);
        if ended > 0 {
            self.window_started = Some(started + pool_budget::IDLE_LIFE * ended);
        }
        self.touch(now, in_use);
        let pools: Vec<PoolUse> = self
            .open
            .iter()
            .filter_map(|(id, o)| {
                let demand = o.channel.demand()?;
                for _ in 0..turns {
                    demand.new_window();
                }
                Some(PoolUse {
                    channel_id: *id,
                    idle_for: now.saturating_duration_since(o.used_at),
                    connections: demand.connections(),
                    in_flight: demand.in_flight(),
                })
            })
            .collect();
        let closed = pool_budget::to_close(&pools, budget, pool_budget::GRACE);
        for id in &closed {
            self.open.remove(id);
            self.transport.forget(*id);
        }
        if !closed.is_empty() {
            self.transport.let_go();
            self.origins.let_go();
        }
        closed
    }

    /// Marks the pools of `in_use` (a claim's channels) used now, as [`Remotes::trim`] does.
    pub fn touch(&mut self, now: Instant, in_use: &[i32]) {
        for id in in_use {
            if let Some(o) = self.open.get_mut(id) {
                o.used_at = now;
            }
        }
    }

    /// Forgets channels that no longer exist.
    pub fn retain(&mut self, live: impl Fn(i32) -> bool) {
        self.transport.retain(&live);
        self.open.retain(|id, _| live(*id));
        self.origins.let_go();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn remotes_with_bursts(bursts: &[(i32, usize)]) -> Remotes {
        let mut r = Remotes::default();
        assert_eq!(r.set_allowed_hosts("*"), Some(Ok(())));
        let o = ChannelOptions::default();
        for &(id, n) in bursts {
            let c = r
                .channel(id, "v1", "http://127.0.0.1:9/x", &o, 400)
                .unwrap();
            let demand = c.demand().expect("an HTTP channel has a pool");
            let burst: Vec<_> = (0..n).map(|_| demand.start()).collect();
            drop(burst);
        }
        r
    }

    fn open_ids(r: &Remotes) -> Vec<i32> {
        let mut ids: Vec<i32> = r.open.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn trim_closes_the_least_recently_used_pools_beyond_the_budget() {
        // Four channels drained one after the other, 400 requests under way at once each.
        let mut r = remotes_with_bursts(&[(1, 400), (2, 400), (3, 400), (4, 400)]);
        let now = Instant::now();
        // Within the grace nothing closes, however far over the budget.
        assert!(r.trim(now, 800, &[]).is_empty());
        assert_eq!(open_ids(&r), vec![1, 2, 3, 4]);
        let later = now + Duration::from_secs(2);
        assert_eq!(r.trim(later, 800, &[]), vec![1, 2]);
        assert_eq!(open_ids(&r), vec![3, 4]);
        assert_eq!(r.transport.pooled(), vec![3, 4]);
        assert!(r.trim(later, 800, &[]).is_empty(), "the rest fits");
        // A closed channel's next send opens a new pool.
        let o = ChannelOptions::default();
        let c = r.channel(1, "v1", "http://127.0.0.1:9/x", &o, 400).unwrap();
        assert_eq!(c.demand().unwrap().connections(), 0);
        assert_eq!(r.transport.pooled(), vec![1, 3, 4]);
    }

    #[test]
    fn trim_keeps_a_pool_with_a_request_under_way() {
        let mut r = remotes_with_bursts(&[(1, 500), (2, 500)]);
        let busy = r.open[&1].channel.demand().unwrap().start();
        let later = Instant::now() + Duration::from_secs(2);
        assert_eq!(r.trim(later, 800, &[]), vec![2]);
        assert_eq!(open_ids(&r), vec![1]);
        drop(busy);
        assert_eq!(r.trim(later, 400, &[]), vec![1]);
        assert!(open_ids(&r).is_empty());
        assert!(r.transport.pooled().is_empty());
    }

    #[test]
    fn a_burst_counts_until_its_connections_must_have_been_closed() {
        let mut r = remotes_with_bursts(&[(1, 500), (2, 500)]);
        let start = Instant::now();
        let life = pool_budget::IDLE_LIFE;
        // The first trim starts the windows; a burst counts in its window and the two after.
        assert!(r.trim(start, 1_000, &[]).is_empty());
        assert!(r.trim(start + life, 1_000, &[]).is_empty());
        assert!(r.trim(start + life * 2, 1_000, &[]).is_empty());
        assert_eq!(r.open[&1].channel.demand().unwrap().connections(), 500);
        // Three idle lives later no connection of the bursts can still be pooled.
        assert!(r.trim(start + life * 3, 0, &[]).is_empty());
        assert_eq!(r.open[&1].channel.demand().unwrap().connections(), 0);
        assert_eq!(open_ids(&r), vec![1, 2]);

        // After a long gap every window that ended turns at once.
        let mut r = remotes_with_bursts(&[(1, 500), (2, 500)]);
        assert!(r.trim(start, 1_000, &[]).is_empty());
        assert!(r.trim(start + life * 10, 0, &[]).is_empty());
        assert_eq!(r.open[&2].channel.demand().unwrap().connections(), 0);

        let mut r = remotes_with_bursts(&[(1, 500), (2, 500)]);
        assert!(r.trim(start, 1_000, &[]).is_empty());
        assert_eq!(
            r.trim(start + life, 999, &[]),
            vec![1],
            "the least recently used goes"
        );
    }

    #[test]
    fn a_channel_about_to_be_sent_to_keeps_its_pool() {
        // Channel 1 was used long ago, but this cycle's claim took messages of it.
        let mut r = remotes_with_bursts(&[(1, 400), (2, 400), (3, 400)]);
        let later = Instant::now() + Duration::from_secs(5);
        assert_eq!(r.trim(later, 800, &[1]), vec![2]);
        assert_eq!(open_ids(&r), vec![1, 3]);
    }
}
