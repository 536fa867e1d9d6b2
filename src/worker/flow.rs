//! Flow control of a channel across every worker of the database: `rate_limit` (a token
//! bucket), a `Retry-After` that holds a rate-limited channel back, and `circuit`. The state
//! is a row of `outbox._channel_flow` per channel; the claim transaction locks it, takes what
//! it may (`gate`), claims at most that many messages, and gives back what it did not use
//! (`give_back`); the record transaction moves the circuit by the outcomes (`after_batch`).
//! Times are the database's clock, so that every worker counts alike. The arithmetic is in
//! `channels::rate_limit` and `channels::circuit`.

use super::claimed::{Channels, Job};
use super::record::Outcomes;
use crate::channels::circuit::{self, Circuit, CircuitOptions};
use crate::channels::options::ChannelOptions;
use crate::channels::rate_limit::{self, Bucket, RateLimit};
use crate::classify::Class;
use crate::spi::{self, Statement};
use pgrx::spi::{SpiClient, SpiResult};
use std::collections::HashMap;

/// The row of a channel, made on first use with a full bucket.
static ENSURE_FLOW: Statement = Statement::planned_once(
    "
INSERT INTO outbox._channel_flow (channel_id, tokens, tokens_at)
VALUES ($1, $2, pg_catalog.clock_timestamp())
ON CONFLICT (channel_id) DO NOTHING",
);

/// A channel's flow row and the database's clock; locked by the statements below.
macro_rules! flow_row {
    () => {
        "
SELECT f.tokens, outbox._epoch_ms(f.tokens_at), outbox._epoch_ms(f.hold_until), f.circuit_state,
       outbox._epoch_ms(f.circuit_since), f.circuit_streak, outbox._epoch_ms(f.probe_until),
       outbox._epoch_ms(pg_catalog.clock_timestamp()), f.circuit_tenant
  FROM outbox._channel_flow f
 WHERE f.channel_id = $1"
    };
}

/// The row, locked until the transaction ends, and the database's clock.
static LOCK_FLOW: Statement = Statement::planned_once(concat!(flow_row!(), "\n   FOR UPDATE"));

/// The same row for a claim's gate, passed over while another claim holds it: a claim that
/// waited for it would wait as long as a stalled worker stays inside its claim.
static LOCK_FLOW_FOR_CLAIM: Statement =
    Statement::planned_once(concat!(flow_row!(), "\n   FOR UPDATE SKIP LOCKED"));

static UPDATE_FLOW: Statement = Statement::planned_once(
    "
UPDATE outbox._channel_flow
   SET tokens = $2,
       tokens_at = pg_catalog.to_timestamp($3 / 1000.0),
       hold_until = pg_catalog.to_timestamp($4 / 1000.0),
       circuit_state = $5,
       circuit_since = pg_catalog.to_timestamp($6 / 1000.0),
       circuit_streak = $7,
       probe_until = pg_catalog.to_timestamp($8 / 1000.0),
       circuit_tenant = $9
 WHERE channel_id = $1",
);

/// A change of a circuit, in the operator log, by the worker's role.
static LOG_CIRCUIT: Statement = Statement::planned_once(
    "
INSERT INTO outbox._operator_log (actor, action, channel, reason, detail)
VALUES (CURRENT_USER, $2, $1, $3, $4::jsonb)",
);

/// A channel's flow row as read.
#[derive(Debug, Clone)]
struct Flow {
    bucket: Bucket,
    hold_until_ms: Option<i64>,
    circuit: Circuit,
    now_ms: i64,
}

fn lock(client: &mut SpiClient<'_>, channel_id: i32, burst: f64) -> SpiResult<Flow> {
    lock_with(client, &LOCK_FLOW, channel_id, burst)?.ok_or(pgrx::spi::SpiError::InvalidPosition)
}

/// The row, unless another transaction holds it.
fn lock_unless_held(
    client: &mut SpiClient<'_>,
    channel_id: i32,
    burst: f64,
) -> SpiResult<Option<Flow>> {
    lock_with(client, &LOCK_FLOW_FOR_CLAIM, channel_id, burst)
}

fn lock_with(
    client: &mut SpiClient<'_>,
    statement: &'static Statement,
    channel_id: i32,
    burst: f64,
) -> SpiResult<Option<Flow>> {
    spi::run(
        client,
        &ENSURE_FLOW,
        None,
        &[channel_id.into(), burst.into()],
    )?;
    let rows = spi::run(client, statement, Some(1), &[channel_id.into()])?;
    if rows.is_empty() {
        return Ok(None);
    }
    let row = rows.first();
    let now_ms = row.get::<i64>(8)?.unwrap_or_else(crate::clock::now_ms);
    Ok(Some(Flow {
        bucket: Bucket {
            tokens: row.get::<f64>(1)?.unwrap_or(0.0),
            at_ms: row.get::<i64>(2)?.unwrap_or(now_ms),
        },
        hold_until_ms: row.get::<i64>(3)?,
        circuit: Circuit {
            state: circuit::State::parse(&row.get::<String>(4)?.unwrap_or_default()),
            since_ms: row.get::<i64>(5)?.unwrap_or(now_ms),
            streak: row.get::<i32>(6)?.unwrap_or(0).max(0) as u32,
            probe_until_ms: row.get::<i64>(7)?,
            tenant: row.get::<String>(9)?,
        },
        now_ms,
    }))
}

fn store(client: &mut SpiClient<'_>, channel_id: i32, f: &Flow) -> SpiResult<()> {
    let c = &f.circuit;
    spi::run(
        client,
        &UPDATE_FLOW,
        None,
        &[
            channel_id.into(),
            f.bucket.tokens.into(),
            (f.bucket.at_ms as f64).into(),
            f.hold_until_ms.map(|t| t as f64).into(),
            c.state.as_str().into(),
            (c.since_ms as f64).into(),
            (c.streak.min(i32::MAX as u32) as i32).into(),
            c.probe_until_ms.map(|t| t as f64).into(),
            c.tenant.clone().into(),
        ],
    )?;
    Ok(())
}

fn log_change(
    client: &mut SpiClient<'_>,
    channel: &str,
    before: &Circuit,
    after: &Circuit,
    options: &CircuitOptions,
    why: &str,
) -> SpiResult<()> {
    // A closed circuit's tenant is only whose failures make its streak: not a change to log.
    fn held(c: &Circuit) -> (circuit::State, Option<&String>) {
        (
            c.state,
            c.tenant
                .as_ref()
                .filter(|_| c.state != circuit::State::Closed),
        )
    }
    if held(before) == held(after) {
        return Ok(());
    }
    // The tenant whose lane alone the circuit holds back (none: the whole channel).
    let tenant = held(after).1.or(held(before).1);
    let detail = serde_json::json!({
        "from": before.state.as_str(), "to": after.state.as_str(),
        "open_after": options.open_after, "open_ms": options.open_ms,
        "tenant": tenant,
    });
    pgrx::log!(
        "outbox_delivery: channel \"{channel}\" circuit {} -> {}{}: {why}",
        before.state.as_str(),
        after.state.as_str(),
        tenant.map_or(String::new(), |t| format!(" for tenant \"{t}\" alone"))
    );
    spi::run(
        client,
        &LOG_CIRCUIT,
        None,
        &[
            channel.into(),
            format!("circuit_{}", after.state.as_str()).into(),
            why.into(),
            detail.to_string().into(),
        ],
    )?;
    Ok(())
}

/// What a claim took from the channels with flow control.
#[derive(Debug, Default)]
pub struct Gates {
    /// Most messages the claim may take per channel.
    pub caps: HashMap<i32, u32>,
    /// Most messages the claim may take of one tenant's lane of a channel: (channel,
    /// tenant, cap), for a circuit open for that tenant alone.
    pub lane_caps: Vec<(i32, String, u32)>,
}

fn flow_options(o: &ChannelOptions) -> Option<(Option<RateLimit>, Option<CircuitOptions>)> {
    (o.rate_limit.is_some() || o.circuit.is_some()).then_some((o.rate_limit, o.circuit))
}

/// Before the claim: for each channel of `due` with `rate_limit` or `circuit`, how many
/// messages it may send now (tokens taken, an open circuit's probe let through). A channel
/// with nothing due is not read: it keeps its tokens.
pub fn gate(
    client: &mut SpiClient<'_>,
    channels: &Channels,
    due: &[i32],
    batch_size: u32,
) -> SpiResult<Gates> {
    let mut gates = Gates::default();
    let mut ids: Vec<&i32> = due.iter().collect();
    ids.sort(); // one locking order for every worker
    for id in ids {
        let Some(channel) = channels.by_id.get(id) else {
            continue;
        };
        let Some((rate, breaker)) = channel.options.as_ref().ok().and_then(flow_options) else {
            continue;
        };
        let burst = rate.map_or(0.0, |r| r.capacity());
        let Some(mut f) = lock_unless_held(client, *id, burst)? else {
            // Another claim holds the channel's flow now: this one takes none of it.
            gates.caps.insert(*id, 0);
            continue;
        };
        let mut cap = batch_size;
        if f.hold_until_ms.is_some_and(|t| f.now_ms < t) {
            cap = 0;
        }
        if let Some(o) = breaker {
            let timeout = channel
                .options
                .as_ref()
                .map_or(10_000, |o| o.timeout_ms as i64);
            let g = circuit::gate(f.circuit.clone(), &o, f.now_ms, timeout + 5_000);
            log_change(
                client,
                &channel.name,
                &f.circuit,
                &g.circuit,
                &o,
                "open_ms passed: one probe",
            )?;
            f.circuit = g.circuit;
            cap = cap.min(g.cap.unwrap_or(u32::MAX));
            if let Some((tenant, lane_cap)) = g.lane_cap {
                gates.lane_caps.push((*id, tenant, lane_cap));
            }
        }
        if let Some(r) = rate {
            let (granted, bucket) = rate_limit::take(f.bucket, &r, f.now_ms, cap);
            f.bucket = bucket;
            cap = granted;
        }
        store(client, *id, &f)?;
        gates.caps.insert(*id, cap);
    }
    Ok(gates)
}

/// After the claim: tokens the claim did not use go back, and a probe that found no message
/// lets the next claim probe.
pub fn give_back(
    client: &mut SpiClient<'_>,
    channels: &Channels,
    gates: &Gates,
    jobs: &[Job],
) -> SpiResult<()> {
    for (id, cap) in &gates.caps {
        let claimed = jobs.iter().filter(|j| j.channel_id == *id).count() as u32;
        // A probe of one tenant's lane that found none of its messages.
        let lane_probe_unused = gates.lane_caps.iter().any(|(lane, tenant, lane_cap)| {
            lane == id
                && *lane_cap > 0
                && !jobs
                    .iter()
                    .any(|j| j.channel_id == *id && &j.tenant == tenant)
        });
        if claimed >= *cap && !lane_probe_unused {
            continue;
        }
        let Some((rate, _)) = channels.by_id[id]
            .options
            .as_ref()
            .ok()
            .and_then(flow_options)
        else {
            continue;
        };
        let mut f = lock(client, *id, 0.0)?;
        if let Some(r) = rate {
            f.bucket = rate_limit::give_back(f.bucket, &r, cap.saturating_sub(claimed));
        }
        if f.circuit.state == circuit::State::HalfOpen
            && (claimed == 0 || (f.circuit.tenant.is_some() && lane_probe_unused))
        {
            f.circuit.probe_until_ms = None;
        }
        store(client, *id, &f)?;
    }
    Ok(())
}

/// One sent message's outcome as flow control sees it.
struct Seen {
    /// Transient or ambiguous.
    failed: bool,
    /// A Retry-After that asks the whole channel to wait (429 or 503), in ms.
    hold_ms: Option<u64>,
}

fn seen_by_message(outcomes: &Outcomes) -> HashMap<i64, Seen> {
    let mut seen: HashMap<i64, Seen> = outcomes
        .delivered
        .iter()
        .map(|d| {
            (
                d.message_id,
                Seen {
                    failed: false,
                    hold_ms: None,
                },
            )
        })
        .collect();
    for s in &outcomes.settled {
        let v = &s.verdict;
        let failed = matches!(v.class, Some(Class::Transient | Class::Ambiguous));
        let hold_ms = v
            .retry_after_ms
            .filter(|_| matches!(v.http_status, Some(429 | 503)));
        seen.insert(s.message_id, Seen { failed, hold_ms });
    }
    seen
}

/// In the record transaction: the circuit of each channel moves by its outcomes, in the
/// order of the batch; a Retry-After on a rate-limited channel holds the whole channel.
pub fn after_batch(
    client: &mut SpiClient<'_>,
    channels: &Channels,
    jobs: &[Job],
    sent: &[usize],
    outcomes: &Outcomes,
) -> SpiResult<()> {
    let seen = seen_by_message(outcomes);
    let mut per_channel: HashMap<i32, Vec<(&Seen, &str)>> = HashMap::new();
    for i in sent {
        let job = &jobs[*i];
        if let Some(s) = seen.get(&job.message_id) {
            per_channel
                .entry(job.channel_id)
                .or_default()
                .push((s, job.tenant.as_str()));
        }
    }
    let mut ids: Vec<i32> = per_channel.keys().copied().collect();
    ids.sort();
    for id in ids {
        let Some(channel) = channels.by_id.get(&id) else {
            continue;
        };
        let Some((rate, breaker)) = channel.options.as_ref().ok().and_then(flow_options) else {
            continue;
        };
        let list = &per_channel[&id];
        let hold = list
            .iter()
            .filter_map(|(s, _)| s.hold_ms)
            .max()
            .filter(|_| rate.is_some());
        if breaker.is_none() && hold.is_none() {
            continue;
        }
        let mut f = lock(client, id, rate.map_or(0.0, |r| r.capacity()))?;
        let before = (f.circuit.clone(), f.hold_until_ms);
        if let Some(ms) = hold {
            let until = f.now_ms.saturating_add(ms.min(i64::MAX as u64) as i64);
            f.hold_until_ms = Some(f.hold_until_ms.map_or(until, |t| t.max(until)));
        }
        if let Some(o) = breaker {
            let outcomes: Vec<circuit::Outcome<'_>> = list
                .iter()
                .map(|(s, tenant)| circuit::Outcome {
                    failed: s.failed,
                    tenant,
                })
                .collect();
            let next = circuit::after(f.circuit.clone(), &o, &outcomes, f.now_ms);
            let why = match next.state {
                circuit::State::Open if next.tenant.is_some() => {
                    "consecutive transient or ambiguous outcomes, all of one tenant"
                }
                circuit::State::Open => "consecutive transient or ambiguous outcomes",
                _ => "the provider answered",
            };
            log_change(client, &channel.name, &f.circuit, &next, &o, why)?;
            f.circuit = next;
        }
        if (&f.circuit, f.hold_until_ms) != (&before.0, before.1) {
            store(client, id, &f)?;
        }
    }
    Ok(())
}
