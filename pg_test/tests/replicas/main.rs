//! A primary with a streaming hot standby on this machine (`pg_basebackup -R`, each on a
//! port of its own, both with the extension preloaded), the primary killed
//! (`pg_ctl stop -m immediate`) and the standby promoted, while the provider simulator runs
//! throughout.
//!
//! - `standby`: on the standby nothing is delivered, `worker_status()` says `standby`, the
//!   views and `status()` answer, and `enqueue` fails with PostgreSQL's read-only error.
//! - `failover`: synchronous replication, 2,000 messages over a deduping, a reconcile-only
//!   and a neither channel, the primary killed in the middle: delivery resumes within 2 s
//!   of the promotion, nothing is lost, and every attempt that was open on the old primary
//!   takes the ambiguous path.
//! - `exposure` (ignored; `bench/bench_failover.sh`): asynchronous replication under a
//!   steady 1,000 messages per second, measured over 5 failovers.
//!
//! The clusters live under `OUTBOX_HA_BASE` (`/tmp/outbox_ha`); the primary on
//! `OUTBOX_HA_PGPORT` (54861), the standby on the next port.

mod exposure;
mod failover;
mod standby;

use outbox_e2e::cluster::{poll, wait_until, Cluster, OwnCluster};
use outbox_e2e::helpers::{count, create_channel};
use outbox_e2e::sim::{Received, Simulator};
use postgres::Client;
use serde_json::json;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

/// Delivery workers of each server.
const WORKERS: u32 = 2;
/// The application_name the standby streams under.
const STANDBY_NAME: &str = "standby1";

/// A primary and its standby.
pub struct Pair {
    pub primary: OwnCluster,
    pub standby: OwnCluster,
}

fn ha_base() -> PathBuf {
    PathBuf::from(std::env::var("OUTBOX_HA_BASE").unwrap_or_else(|_| "/tmp/outbox_ha".into()))
}

fn ha_port() -> u16 {
    outbox_e2e::cluster::env_port("OUTBOX_HA_PGPORT", 54861)
}

/// A new primary serving `app` and a hot standby streaming from it; with `synchronous`,
/// the primary's commits wait for the standby (`synchronous_commit = on`).
pub fn pair(synchronous: bool) -> Pair {
    let conf = "outbox.poll_interval_ms = 100\nwal_sender_timeout = 5s";
    let primary = OwnCluster::fresh(ha_base().join("primary"), ha_port(), "app", WORKERS, conf);
    let standby = OwnCluster::standby_of(
        &primary,
        ha_base().join("standby"),
        ha_port() + 1,
        STANDBY_NAME,
    );
    let mut c = primary.connect();
    if synchronous {
        for statement in [
            format!("ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'"),
            "ALTER SYSTEM SET synchronous_commit = 'on'".to_string(),
            "SELECT pg_reload_conf()".to_string(),
        ] {
            c.batch_execute(&statement)
                .expect("make replication synchronous");
        }
    }
    let wanted = if synchronous { "sync" } else { "async" };
    let ok = wait_until(Duration::from_secs(30), || {
        count(
            &mut c,
            "SELECT count(*) FROM pg_stat_replication
              WHERE application_name = $1 AND state = 'streaming' AND sync_state = $2",
            &[&STANDBY_NAME, &wanted],
        ) == 1
    });
    assert!(
        ok,
        "the standby does not stream ({wanted}); see {}",
        standby.log_path().display()
    );
    Pair { primary, standby }
}

/// The three kinds of channel, by how an ambiguous attempt is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Dedupe,
    Reconcile,
    Neither,
}

pub const KINDS: [Kind; 3] = [Kind::Dedupe, Kind::Reconcile, Kind::Neither];

impl Kind {
    pub fn channel(self) -> &'static str {
        match self {
            Kind::Dedupe => "ha_dedupe",
            Kind::Reconcile => "ha_reconcile",
            Kind::Neither => "ha_neither",
        }
    }
}

/// One channel of each kind on `c` (the primary), sending to `sim`.
pub fn make_channels(c: &mut Client, sim: &Simulator) {
    for kind in KINDS {
        let ch = kind.channel();
        let mut options = match kind {
            Kind::Dedupe => json!({"idempotency_header": "Idempotency-Key"}),
            Kind::Reconcile => json!({
                "reference_header": "X-Effect-Key",
                "reconcile": {"url": sim.lookup_url_by_key(ch), "found": "/found", "external_id": "/id", "settle_ms": 300}
            }),
            Kind::Neither => json!({"max_unverifiable_in_flight": 32}),
        };
        options["external_id"] = json!("/id");
        if kind == Kind::Dedupe {
            sim.set_dedupe(ch, "Idempotency-Key");
        }
        create_channel(c, ch, &sim.send_url(ch), &options.to_string());
    }
}

/// The `key` field of a send's JSON body (every payload names its effect key).
pub fn body_key(r: &Received) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(&r.body).ok()?;
    Some(v.get("key")?.as_str()?.to_string())
}

/// How many sends of each body key the simulator received on `kind`'s channel.
pub fn sends_per_key(sim: &Simulator, kind: Kind) -> HashMap<String, usize> {
    let mut per_key = HashMap::new();
    for r in sim.sends(kind.channel()) {
        if let Some(k) = body_key(&r) {
            *per_key.entry(k).or_insert(0) += 1;
        }
    }
    per_key
}

/// The first request (send or lookup) any channel received after `since`.
pub fn first_request_after(sim: &Simulator, since: SystemTime) -> Option<SystemTime> {
    KINDS
        .iter()
        .flat_map(|k| sim.requests(k.channel()))
        .map(|r| r.received_at)
        .filter(|at| *at >= since)
        .min()
}

/// Waits until nothing is queued or in flight and no reconcile lookup is pending.
pub fn wait_settled(cluster: &Cluster, timeout: Duration) -> bool {
    poll(cluster, timeout, |c| {
        let open: i64 = c
            .query_one(
                "SELECT count(*) FROM outbox.messages
                  WHERE state IN ('queued', 'sending')
                     OR (state = 'uncertain' AND channel = 'ha_reconcile')",
                &[],
            )?
            .get(0);
        Ok((open == 0).then_some(()))
    })
    .is_some()
}
