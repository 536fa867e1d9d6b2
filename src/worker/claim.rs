//! Claim: one short transaction takes up to `batch_size` due messages under a lease before
//! anything is sent: it locks them and writes one row of `outbox._claims` per channel,
//! which makes them `sending` in the attempt after those their rows count. That row is the
//! open attempt (when it started, the sending worker's pid); the message row and the
//! attempt's row of `outbox._attempts` are written once, with the outcome, by the record or
//! by recovery.

use super::claim_cursor::{channels_cut, rest_claim_may_take, ClaimCursors, Floors, Position};
use super::claimed::{Job, Turn};
use super::flow::Gates;
use super::lane_turns::{LaneTurns, Picked};
use crate::channels::fence::Fence;
use crate::spi::{self, Statement};
use pgrx::spi::{SpiClient, SpiResult};
use std::collections::{BTreeSet, HashMap};

/// Due messages of the channels `$10` (those with due work, `due_channels`), per unpaused
/// channel up to its free bound of attempts open at once
/// (`max_in_flight`, or `max_unverifiable_in_flight`); a
/// message with an ordering key waits while an earlier one with that key is pending.
/// Within a channel, each tenant's messages (a lane) are taken oldest due first, and the
/// lanes take turns, from the tenant after the one this worker served last (`$11`, `$12`;
/// `lane_turns`), each at most its cap (`$13`–`$15`).
/// The batch is shared evenly among the channels that have a due message, taken in a
/// random order, so that a channel with a deep backlog cannot hold back another channel's
/// next message for longer than one batch.
/// A channel named in `$5` is read from the position (`$6` µs since the epoch, `$7` id)
/// on, not from the head of its due index (`claim_cursor`).
/// The claim locks the messages it takes and writes one row of `outbox._claims` for each
/// channel, which makes them `sending`; it writes no message row. A message already in a
/// claim is passed over: claims are serialized by the claim lock, so this statement's
/// snapshot holds every claim before it.
/// The ledger lookup at the end is the barrier: such a message is not sent again.
pub(crate) static CLAIM_DUE: Statement = Statement::planned_once("
WITH flying AS MATERIALIZED (
    -- The messages in flight, read once: the claims table is read nowhere else.
    SELECT w.channel_id, pg_catalog.unnest(w.message_ids) AS id FROM outbox._claims w
), flying_per_channel AS (
    -- Counted once for all channels: a count in `room` below, for each channel, read all
    -- the messages in flight once a channel (more where `room` is written out again).
    SELECT flying.channel_id, count(*) AS n FROM flying GROUP BY flying.channel_id
), ch AS (
    SELECT c.id,
           -- max_in_flight, or max_unverifiable_in_flight on a channel that can neither
           -- dedupe nor be asked (sql/channels.sql). An option changed by hand into no
           -- number counts as the default; the worker then fails that channel's messages
           -- readably.
           -- At most the cap of its rate limit or circuit ($8, $9; src/worker/flow.rs).
           greatest(0, least(outbox._in_flight_bound(c.options) - coalesce(n.n, 0),
                             coalesce(g.cap, 2147483647)))::int AS room,
           coalesce(timestamptz 'epoch' + f.due_at_us * interval '1 microsecond', '-infinity') AS floor_at,
           coalesce(f.id, 0) AS floor_id
      FROM outbox._channels c
      LEFT JOIN flying_per_channel n ON n.channel_id = c.id
      LEFT JOIN unnest($5::int4[], $6::int8[], $7::int8[]) AS f(channel_id, due_at_us, id)
             ON f.channel_id = c.id
      LEFT JOIN unnest($8::int4[], $9::int4[]) AS g(channel_id, cap) ON g.channel_id = c.id
     -- Only the channels that the walk of the due index kept (crate::worker::due_channels).
     WHERE c.id = ANY($10::int4[]) AND NOT c.paused
), ready AS (
    -- share: the most this claim takes of the channel, its room or its part of the batch;
    -- a channel that got all of it may have more due past what was taken (claim_cursor).
    -- head_tenant: the tenant of a due message, where the walk of its lanes starts.
    SELECT ch.id, ch.floor_at, ch.floor_id, ch.room,
           least(ch.room, ceil($1::numeric / count(*) OVER ())::int) AS share,
           h.tenant AS head_tenant
      FROM ch
       -- One probe of the head of the due index per channel; only a channel with room is
       -- probed (a one-time filter: the planner ran a probe as a join first, on a channel
       -- at its bound, over every entry a drain had left since the last VACUUM).
      CROSS JOIN LATERAL (
           SELECT q.tenant FROM outbox._messages q
            WHERE ch.room > 0
              AND q.channel_id = ch.id AND q.state = 'queued' AND NOT q.held_by_key
              AND q.next_attempt_at <= now()
              AND (q.next_attempt_at, q.id) >= (ch.floor_at, ch.floor_id)
              AND q.id NOT IN (SELECT flying.id FROM flying)
            ORDER BY q.next_attempt_at, q.id
            LIMIT 1) h
     ORDER BY random()
), lanes AS MATERIALIZED (
    -- The tenants with a queued message in each ready channel (its lanes), by a walk of
    -- `_messages_lane_idx` that starts at the head's tenant: one descent per tenant above
    -- it, one per tenant below it. A descent never enters the head tenant's part of the
    -- index, where a drained backlog leaves its entries until VACUUM: a channel of one
    -- tenant costs two descents that find nothing.
    WITH RECURSIVE above(channel_id, tenant) AS (
        SELECT ready.id, ready.head_tenant FROM ready
      UNION ALL
        SELECT a.channel_id,
               (SELECT m.tenant FROM outbox._messages m
                 WHERE m.channel_id = a.channel_id AND m.state = 'queued' AND NOT m.held_by_key
                   AND m.tenant > a.tenant
                 ORDER BY m.tenant LIMIT 1)
          FROM above a
         WHERE a.tenant IS NOT NULL
    ), below(channel_id, tenant, head_tenant) AS (
        SELECT ready.id,
               (SELECT m.tenant FROM outbox._messages m
                 WHERE m.channel_id = ready.id AND m.state = 'queued' AND NOT m.held_by_key
                   AND m.tenant < ready.head_tenant
                 ORDER BY m.tenant LIMIT 1),
               ready.head_tenant
          FROM ready
      UNION ALL
        SELECT b.channel_id,
               (SELECT m.tenant FROM outbox._messages m
                 WHERE m.channel_id = b.channel_id AND m.state = 'queued' AND NOT m.held_by_key
                   AND m.tenant > b.tenant AND m.tenant < b.head_tenant
                 ORDER BY m.tenant LIMIT 1),
               b.head_tenant
          FROM below b
         WHERE b.tenant IS NOT NULL
    )
    SELECT above.channel_id, above.tenant FROM above WHERE above.tenant IS NOT NULL
     UNION ALL
    SELECT below.channel_id, below.tenant FROM below WHERE below.tenant IS NOT NULL
), turns AS (
    -- The order in which the lanes of a channel take turns: from the tenant after the one
    -- this worker served last on the channel ($11, $12), round to it. A lane's cap ($13,
    -- $14, $15) is its circuit's (crate::worker::flow): 0 while it is open for that tenant
    -- alone, 1 for its probe. Each lane is read for at most the channel's share, or for
    -- one message when the channel has as many lanes as its share.
    SELECT lanes.channel_id, lanes.tenant, ready.share, ready.room, ready.floor_at, ready.floor_id,
           count(*) OVER per_channel AS lanes_n,
           row_number() OVER (per_channel ORDER BY (r.after IS NOT NULL AND lanes.tenant <= r.after),
                                                   lanes.tenant) AS lane_order,
           coalesce(k.cap, 2147483647) AS lane_cap
      FROM lanes
      JOIN ready ON ready.id = lanes.channel_id
      LEFT JOIN unnest($11::int4[], $12::text[]) AS r(channel_id, after)
             ON r.channel_id = lanes.channel_id
      LEFT JOIN unnest($13::int4[], $14::text[], $15::int4[]) AS k(channel_id, tenant, cap)
             ON k.channel_id = lanes.channel_id AND k.tenant = lanes.tenant
    WINDOW per_channel AS (PARTITION BY lanes.channel_id)
), due AS MATERIALIZED (
    -- Each lane's oldest due messages, taken in turns: the first of every lane, then the
    -- second of every lane, and so on, up to the channel's share. One tenant's backlog
    -- stands before another tenant's next message for one turn at most.
    SELECT picked.*
      FROM (SELECT d.*, t.share, t.room, t.lanes_n,
                   row_number() OVER (PARTITION BY t.channel_id ORDER BY d.turn, t.lane_order) AS pick
              FROM turns t CROSS JOIN LATERAL (
                   SELECT lane.*, row_number() OVER (ORDER BY lane.next_attempt_at, lane.id) AS turn
                     FROM (
                   SELECT m.id, m.tenant, m.channel_id, m.effect_key, m.payload, m.headers,
                          -- The attempt under way: the one after those the row counts.
                          -- Saturates: a counter at its limit (set by hand) must not fail
                          -- every claim.
                          least(m.attempts, 2147483646) + 1 AS attempt,
                          coalesce(m.budget_started_at, m.created_at) AS budget_started_at,
                          m.first_attempt_at, m.budget_base, m.next_attempt_at, m.created_at
                     FROM outbox._messages m
                    WHERE m.channel_id = t.channel_id
                      AND m.tenant = t.tenant
                      AND m.state = 'queued'
                      -- Held behind its key (crate::worker::key_hold): out of the lanes.
                      AND NOT m.held_by_key
                      AND m.next_attempt_at <= now()
                      AND (m.next_attempt_at, m.id) >= (t.floor_at, t.floor_id)
                      AND m.id NOT IN (SELECT flying.id FROM flying)
                      AND (m.ordering_key IS NULL OR NOT EXISTS (
                             SELECT 1 FROM outbox._messages e
                              WHERE e.tenant = m.tenant AND e.ordering_key = m.ordering_key
                                AND e.id < m.id AND e.state IN ('queued', 'uncertain')))
                    ORDER BY m.next_attempt_at, m.id
                    LIMIT least(t.lane_cap, CASE WHEN t.lanes_n >= t.share THEN 1 ELSE t.share END)
                      FOR UPDATE OF m SKIP LOCKED) lane) d) picked
     WHERE picked.pick <= picked.share
     LIMIT $1
), claimed AS (
    -- An attempt starts when it is claimed, not when the claim's transaction began: the
    -- wait for the claim lock comes first, and an attempt of another worker may be
    -- recorded in between. Its lease starts then too: a lease counted from the start of
    -- a transaction that waited for a lock would be born expired.
    INSERT INTO outbox._claims (channel_id, lease_owner, worker_pid, lease_until, started_at, message_ids)
    SELECT due.channel_id, $3, $4, pg_catalog.clock_timestamp() + $2 * interval '1 millisecond',
           pg_catalog.clock_timestamp(),
           array_agg(due.id ORDER BY due.id)
      FROM due
     GROUP BY due.channel_id
 RETURNING channel_id, started_at
)
SELECT d.id, outbox._epoch_us(c.started_at), d.attempt, d.tenant, d.channel_id,
       d.effect_key, d.payload::text, d.headers::text,
       -- NULL (read as 0) for a time of ±infinity set by hand.
       outbox._epoch_ms(d.budget_started_at), outbox._epoch_ms(coalesce(d.first_attempt_at, c.started_at)),
       l.message_id, l.external_id, d.attempt::int8 - d.budget_base,
       -- NULL for a due time outside the range of positions (one set by hand).
       CASE WHEN d.next_attempt_at BETWEEN timestamptz '1900-01-01' AND timestamptz '2200-01-01'
            THEN outbox._epoch_us(d.next_attempt_at) END,
       d.share, d.room, d.lanes_n::int4, d.pick,
       -- For the latency from enqueue to delivered (crate::metrics::latency).
       outbox._epoch_ms(d.created_at)
  FROM due d
  JOIN claimed c ON c.channel_id = d.channel_id
  -- The barrier: one ledger probe per claimed message (crate::ledger).
  LEFT JOIN LATERAL outbox._ledger_entry(d.tenant, d.effect_key) l ON true
 ORDER BY d.id");

/// When the earliest queued message of an unpaused channel is due (unix ms): a day ahead
/// when none is queued or the earliest waits longer (until 'infinity', say); now when it
/// is already due, also at '-infinity', a time with no number. Then whether it was due at
/// the claim (the transaction's `now()`): a claim that came back empty although something
/// was due could not take it (starved). A time after the claim's is not, even when it has
/// passed by the time the worker sleeps: a channel's next token, set by the claim itself a
/// few milliseconds before, or a retry's backoff ending meanwhile.
/// A channel whose attempts open at once are at its bound counts as due now, without a
/// look at its queue: a claim came back empty, so the worker waits as one that could not
/// take what is due (`idle_wait`), until a record makes room and wakes it. Reading the head
/// of such a channel's due index would step over the entry of every message claimed since
/// the last VACUUM, which a deep backlog drained at the bound leaves by the hundred
/// thousand (2.9 ms and 1,600 buffers a call in a drain of 1,000,000, BENCHMARKS.md).
/// Only the channels with a queued message are read: a walk of the due index, one descent
/// per such channel (`due_channels`), none for a channel with an empty queue.
pub(crate) static NEXT_DUE: Statement = Statement::planned_once(
    "
WITH RECURSIVE queued(channel_id) AS (
    SELECT (-2147483649)::int8 -- below every channel id; no channel has it
  UNION ALL
    SELECT (SELECT m.channel_id FROM outbox._messages m
             WHERE m.state = 'queued' AND m.channel_id > q.channel_id
             ORDER BY m.channel_id LIMIT 1)::int8
      FROM queued q
     WHERE q.channel_id IS NOT NULL
)
SELECT (extract(epoch FROM least(greatest(coalesce(min(n.next_attempt_at), 'infinity'), now()),
                                 now() + interval '1 day')) * 1000)::int8,
       coalesce(min(n.next_attempt_at) <= now(), false)
  FROM queued q
  JOIN outbox._channels c ON c.id = q.channel_id
  LEFT JOIN outbox._channel_flow f ON f.channel_id = c.id
  CROSS JOIN LATERAL (
       SELECT now() AS next_attempt_at
        WHERE outbox._in_flight_bound(c.options)
              <= (SELECT coalesce(sum(pg_catalog.cardinality(w.message_ids)), 0)
                    FROM outbox._claims w WHERE w.channel_id = c.id)
       UNION ALL
       -- Not before the channel's flow control lets it send (src/worker/flow.rs): the end
       -- of a Retry-After hold, of an open circuit, of a probe out, the next token.
       (SELECT greatest(m.next_attempt_at, f.hold_until,
                       -- A circuit that holds back one tenant's lane alone holds no
                       -- channel back: the worker waits as one that could not take what
                       -- is due, until a record or the lane's open_ms (idle_wait).
                       CASE WHEN f.circuit_state = 'open' AND f.circuit_tenant IS NULL
                            THEN f.circuit_since + outbox._option_int(c.options, '{circuit,open_ms}')
                                                   * interval '1 millisecond' END,
                       CASE WHEN f.circuit_state = 'half_open' AND f.circuit_tenant IS NULL
                            THEN f.probe_until END,
                       CASE WHEN f.tokens < 1 AND jsonb_typeof(c.options -> 'rate_limit') = 'object'
                            THEN f.tokens_at + (1 - f.tokens) * 1000.0
                                 / greatest(outbox._option_int(c.options, '{rate_limit,per_second}'), 1)
                                 * interval '1 millisecond' END) AS next_attempt_at
         FROM outbox._messages m
        WHERE m.channel_id = c.id AND m.state = 'queued' AND NOT m.held_by_key
          AND m.id NOT IN (SELECT pg_catalog.unnest(w.message_ids) FROM outbox._claims w)
        ORDER BY m.next_attempt_at LIMIT 1)
        LIMIT 1) n
 WHERE NOT c.paused",
);

/// Who claims, and for how long: the lease its claims hold (ms), the worker's slot and its
/// process, and the fence of the attempts it claims (taken when the claim began).
#[derive(Debug, Clone, Copy)]
pub struct Claimant {
    pub lease_ms: i64,
    pub worker_index: i32,
    pub pid: i32,
    pub fence: Fence,
}

/// What a worker's claims remember from one claim to the next: where each channel's due
/// index is read from (`claim_cursor`), and which tenant of a shared channel goes first
/// (`lane_turns`).
#[derive(Debug, Default)]
pub struct ClaimMemory {
    pub cursors: ClaimCursors,
    pub turns: LaneTurns,
}

/// Claims up to `batch_size` due messages for `claimant`, at most what `gates` lets a
/// channel with flow control give, reading each channel from its cursor when the worker
/// has one; a claim under cursors that comes back short claims the rest from the heads of
/// the due indexes, in the same transaction, of the channels `due` only (`due_channels`).
/// The caller holds the claim lock (`worker_locks::CLAIMS`), or claims without it
/// (`claim_unserialized`).
pub fn claim_due(
    client: &mut SpiClient<'_>,
    claimant: Claimant,
    batch_size: i32,
    memory: &mut ClaimMemory,
    now_ms: i64,
    gates: &Gates,
    due: &[i32],
) -> SpiResult<Vec<Job>> {
    let caps = &gates.caps;
    let floors = memory.cursors.floors(now_ms);
    // Only a claim that starts with no cursor reads every channel from its head: the rest
    // of a short batch is read from the heads of the channels with room left.
    let from_head = floors.is_empty();
    let floor_channels = floors.channel_ids.clone();
    let read = Read {
        turns: memory.turns.args(),
        lane_caps: &gates.lane_caps,
        due,
    };
    let (mut jobs, mut cut, full) = claim_from(client, claimant, batch_size, floors, caps, &read)?;
    if !from_head && (jobs.len() as i32) < batch_size && rest_claim_may_take(&floor_channels, &full)
    {
        let rest = batch_size - jobs.len() as i32;
        let mut left: HashMap<i32, u32> = caps
            .iter()
            .map(|(id, cap)| {
                let taken = jobs.iter().filter(|j| j.channel_id == *id).count() as u32;
                (*id, cap.saturating_sub(taken))
            })
            .collect();
        // A channel that took all its room is not read again.
        left.extend(full.iter().map(|id| (*id, 0)));
        let (more, more_cut, _) =
            claim_from(client, claimant, rest, Floors::default(), &left, &read)?;
        jobs.extend(more);
        cut.extend(more_cut);
    }
    memory.cursors.after_claim(
        now_ms,
        from_head,
        batch_size.max(0) as usize,
        jobs.iter().map(|j| (j.channel_id, j.position)),
        &cut,
    );
    memory.turns.after_claim(jobs.iter().map(|j| Picked {
        channel_id: j.channel_id,
        lanes: j.turn.lanes,
        pick: j.turn.pick,
        tenant: &j.tenant,
    }));
    Ok(jobs)
}

/// What every claim statement of one claim reads alike: the lanes' turns and caps, and the
/// channels with due work.
struct Read<'a> {
    turns: (Vec<i32>, Vec<String>),
    lane_caps: &'a [(i32, String, u32)],
    due: &'a [i32],
}

/// Messages of `$1` in a claim of another process (`$2`: this one), as committed when the
/// statement began.
static CLAIMED_BY_OTHERS: Statement = Statement::planned_once(
    "
SELECT count(*) FROM outbox._claims w
 WHERE w.worker_pid <> $2 AND w.message_ids && $1::int8[]",
);

/// A claim made without the claim lock, whose holder is stopped or stuck inside its own
/// claim (a stalled worker must not stop the others from delivering).
///
/// Claims are serialized so that each claim statement's snapshot holds every claim made
/// before it. Without the lock, a claim that committed between this statement's snapshot
/// and its row locks is not in that snapshot, and the message it took is no longer locked:
/// this claim could take it again. So the claim runs in a subtransaction and, once it holds
/// its rows, looks again with a snapshot of its own: a claim of another worker that holds
/// one of its messages committed before that row was locked here, and is seen. Then the
/// whole claim is rolled back and nothing is taken this time. A message locked by the
/// stalled holder's claim is passed over (SKIP LOCKED) and is never in both.
///
/// What the lock also gives, and this claim does not: the bound of attempts open at once of
/// a channel may be passed by what two claims made at the same moment take.
pub fn claim_unserialized(
    client: &mut SpiClient<'_>,
    pid: i32,
    claim: &mut impl FnMut(&mut SpiClient<'_>) -> SpiResult<Vec<Job>>,
) -> Vec<Job> {
    let claimed = crate::spi::subtransaction(|| -> Result<Vec<Job>, String> {
        let jobs = claim(client).map_err(|e| e.to_string())?;
        let ids: Vec<i64> = jobs.iter().map(|j| j.message_id).collect();
        let taken = spi::run(
            client,
            &CLAIMED_BY_OTHERS,
            Some(1),
            &[ids.into(), pid.into()],
        )
        .and_then(|rows| rows.first().get::<i64>(1))
        .map_err(|e| e.to_string())?
        .unwrap_or(0);
        if taken > 0 {
            return Err(format!(
                "{taken} message(s) of this claim were taken by another worker's claim meanwhile"
            ));
        }
        Ok(jobs)
    });
    match claimed {
        Ok(jobs) => jobs,
        Err((_, why)) => {
            pgrx::log!("outbox_delivery: a claim without the claim lock took nothing: {why}");
            Vec::new()
        }
    }
}

/// One claim statement: the jobs, the channels that got all the claim could take of them
/// (`channels_cut`), and those that took all their room (the same count against the
/// channel's room).
fn claim_from(
    client: &mut SpiClient<'_>,
    claimant: Claimant,
    batch_size: i32,
    floors: Floors,
    caps: &HashMap<i32, u32>,
    read: &Read<'_>,
) -> SpiResult<(Vec<Job>, BTreeSet<i32>, BTreeSet<i32>)> {
    let (cap_ids, cap_values): (Vec<i32>, Vec<i32>) = caps
        .iter()
        .map(|(id, cap)| (*id, (*cap).min(i32::MAX as u32) as i32))
        .unzip();
    let mut lane_cap_ids = Vec::with_capacity(read.lane_caps.len());
    let mut lane_cap_tenants = Vec::with_capacity(read.lane_caps.len());
    let mut lane_cap_values = Vec::with_capacity(read.lane_caps.len());
    for (id, tenant, cap) in read.lane_caps {
        lane_cap_ids.push(*id);
        lane_cap_tenants.push(tenant.clone());
        lane_cap_values.push((*cap).min(i32::MAX as u32) as i32);
    }
    let rows = spi::run(
        client,
        &CLAIM_DUE,
        None,
        &[
            batch_size.into(),
            (claimant.lease_ms as f64).into(),
            claimant.worker_index.into(),
            claimant.pid.into(),
            floors.channel_ids.into(),
            floors.due_at_us.into(),
            floors.ids.into(),
            cap_ids.into(),
            cap_values.into(),
            read.due.to_vec().into(),
            read.turns.0.clone().into(),
            read.turns.1.clone().into(),
            lane_cap_ids.into(),
            lane_cap_tenants.into(),
            lane_cap_values.into(),
        ],
    )?;
    let mut jobs = Vec::with_capacity(rows.len());
    let mut shares = Vec::with_capacity(rows.len());
    let mut rooms = Vec::with_capacity(rows.len());
    for row in rows {
        let (Some(message_id), Some(started_at_us)) = (row.get::<i64>(1)?, row.get::<i64>(2)?)
        else {
            continue;
        };
        let channel_id = row.get::<i32>(5)?.unwrap_or_default();
        shares.push((channel_id, row.get::<i32>(15)?.unwrap_or(i32::MAX)));
        rooms.push((channel_id, row.get::<i32>(16)?.unwrap_or(i32::MAX)));
        let ledger = match row.get::<i64>(11)? {
            Some(recorded_by) => Some((recorded_by, row.get::<String>(12)?)),
            None => None,
        };
        let tenant = row.get::<String>(4)?.unwrap_or_default();
        let turn = Turn {
            lanes: row.get::<i32>(17)?.unwrap_or(1),
            pick: row.get::<i64>(18)?.unwrap_or(1),
        };
        // As outbox._provider_key gives it, without a call of it for every message.
        let effect_key =
            crate::effect_key::into_provider(&tenant, row.get::<String>(6)?.unwrap_or_default());
        jobs.push(Job {
            message_id,
            started_at_us,
            attempt: row.get::<i32>(3)?.unwrap_or(1),
            tenant,
            channel_id,
            effect_key,
            payload: row.get::<String>(7)?.unwrap_or_else(|| "null".into()),
            headers: row.get::<String>(8)?,
            budget_started_at_ms: row.get::<i64>(9)?.unwrap_or_default(),
            first_attempt_at_ms: row.get::<i64>(10)?.unwrap_or_default(),
            enqueued_at_ms: row.get::<i64>(19)?.unwrap_or_default(),
            budget_attempt: row.get::<i64>(13)?.unwrap_or(1),
            ledger,
            // A channel read in several lanes keeps no cursor: a position in one tenant's
            // lane says nothing of where the others stand.
            position: row
                .get::<i64>(14)?
                .filter(|_| turn.lanes <= 1)
                .map(|due_at_us| Position {
                    due_at_us,
                    id: message_id,
                }),
            turn,
            fence: claimant.fence,
        });
    }
    Ok((jobs, channels_cut(shares), channels_cut(rooms)))
}

/// When an idle worker's next message is due, as read after a claim that took nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NextDue {
    /// Unix ms.
    pub at_ms: i64,
    /// It was due at the claim, which could not take it.
    pub starved: bool,
}

pub fn next_due(client: &SpiClient<'_>) -> SpiResult<Option<NextDue>> {
    let row = spi::run(client, &NEXT_DUE, Some(1), &[])?.first();
    let (at_ms, starved) = (row.get::<i64>(1)?, row.get::<bool>(2)?);
    Ok(at_ms.map(|at_ms| NextDue {
        at_ms,
        starved: starved.unwrap_or(false),
    }))
}

/// Due `uncertain` messages on channels that can reconcile: their next read-only lookup.
/// The lookup is leased by pushing `next_attempt_at` past the lease, so that no other worker
/// looks the same message up meanwhile. A message whose settle window was written on the
/// boot clock of this boot (`$3`, the boot id; `$4`, the boot clock now) waits for it too,
/// whatever the wall clock says: a step forward of the wall clock must not look it up
/// before the provider has had the time to finish the request.
static CLAIM_LOOKUPS: Statement = Statement::planned_each_run("
WITH due AS (
    SELECT m.id
      FROM outbox._messages m
      JOIN outbox._channels c ON c.id = m.channel_id
     WHERE m.state = 'uncertain'
       AND outbox._can_look_up(c.options)
       AND NOT c.paused
       AND m.next_attempt_at <= now()
       AND (m.settle_boot_ms IS NULL OR m.settle_boot_id IS DISTINCT FROM $3::uuid
            OR m.settle_boot_ms <= $4)
     ORDER BY m.next_attempt_at
     LIMIT $1
       FOR UPDATE OF m SKIP LOCKED
)
UPDATE outbox._messages m
   SET next_attempt_at = now() + $2 * interval '1 millisecond'
  FROM due
 WHERE m.id = due.id
RETURNING m.id, m.channel_id, outbox._provider_key(m.tenant, m.effect_key), m.external_id, m.payload::text,
          (outbox._epoch_ms(m.created_at) / 1000.0)::int8, m.reconcile_attempts");

/// A message due for a reconcile lookup.
#[derive(Debug, Clone)]
pub struct LookupJob {
    pub message_id: i64,
    pub channel_id: i32,
    pub subject: crate::channels::lookup_url::Subject,
    pub lookups_so_far: i32,
}

pub fn claim_lookups(
    client: &mut SpiClient<'_>,
    limit: i32,
    lease_ms: i64,
) -> SpiResult<Vec<LookupJob>> {
    let rows = spi::run(
        client,
        &CLAIM_LOOKUPS,
        None,
        &[
            limit.into(),
            (lease_ms as f64).into(),
            crate::clock::boot_id().map(str::to_string).into(),
            crate::clock::boot_ms().into(),
        ],
    )?;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let Some(message_id) = row.get::<i64>(1)? else {
            continue;
        };
        out.push(LookupJob {
            message_id,
            channel_id: row.get::<i32>(2)?.unwrap_or_default(),
            subject: crate::channels::lookup_url::Subject {
                effect_key: row.get::<String>(3)?.unwrap_or_default(),
                external_id: row.get::<String>(4)?,
                payload: row.get::<String>(5)?.unwrap_or_else(|| "null".into()),
                created_at_s: row.get::<i64>(6)?.unwrap_or_default(),
            },
            lookups_so_far: row.get::<i32>(7)?.unwrap_or_default(),
        });
    }
    Ok(out)
}
