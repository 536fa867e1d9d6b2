//! Which channels a claim reads: those with a due message and room for it, found by a walk
//! of the due index rather than a read of every channel.
//!
//! A webhook sender keeps a channel per customer endpoint, and most of them have nothing
//! due at any moment. A claim that probed every channel cost ~50 ms with 10,000 channels,
//! however little was due (BENCHMARKS.md). So a claim first walks `_messages_due_idx`
//! from channel to channel: one descent of the index per channel that has a queued message
//! (due, waiting for a retry, or in flight), none for a channel with an empty queue. A
//! channel kept by the walk is unpaused, below its bound of attempts open at once, and has
//! a due message that is not in flight: one probe of the head of its part of the index, or
//! of the part past its claim cursor (`claim_cursor`). The walk stops once it has found
//! `limit` such channels (a batch's worth, at most one message each), so a claim reads
//! at most `limit` channels that can give it something, however many have work due.
//!
//! The walk steps over the channels that have a cursor rather than into them: the head of a
//! deep backlog being drained holds the entries of the messages claimed since the last
//! VACUUM, which a descent into it would step over. Such a channel is a point of the walk
//! by itself, and its probe starts at its cursor.
//!
//! Fair turns: each worker walks from where its last claim stopped ([`Rotation`]) and wraps
//! round, so that every channel with due work is read within ⌈due channels / limit⌉
//! claims, and a channel with a backlog of a million takes only its share of each claim
//! (`claim::CLAIM_DUE`).
//!
//! Costs: O(limit + channels with a queued message between the start and the limit-th
//! channel kept) index descents, and one read of the claims in flight. Rate limits and
//! circuits are read for the channels kept only (`flow::gate`).

use super::claim_cursor::Floors;
use crate::spi::{self, Statement};
use pgrx::spi::{SpiClient, SpiResult};

/// The channels with due work and room, from the channel after `$1` up to `$2`, in the
/// order of their ids, `$6` of them at most. `$3`, `$4`, `$5`: the claim cursors (channel,
/// due time in µs since the epoch, id).
pub(crate) static DUE_CHANNELS: Statement = Statement::planned_once(
    "
WITH RECURSIVE cursors AS (
    -- The cursors and the counts of attempts in flight, by channel, as arrays in the order
    -- of the channels: a binary search (width_bucket) finds a channel's, however many
    -- channels have one; a join against a set of them read the set once a channel. The
    -- ids are int8, the type of the walk's: an int4[] was cast whole to int8[] at every
    -- search, a cost of every channel in flight at every step of the walk (BENCHMARKS.md).
    SELECT coalesce(array_agg(f.channel_id::int8 ORDER BY f.channel_id), '{}') AS channel_ids,
           coalesce(array_agg(f.due_at_us ORDER BY f.channel_id), '{}') AS due_at_us,
           coalesce(array_agg(f.id ORDER BY f.channel_id), '{}') AS ids
      FROM unnest($3::int4[], $4::int8[], $5::int8[]) AS f(channel_id, due_at_us, id)
), flying AS MATERIALIZED (
    SELECT w.channel_id, pg_catalog.unnest(w.message_ids) AS id FROM outbox._claims w
), in_flight AS (
    SELECT coalesce(array_agg(n.channel_id::int8 ORDER BY n.channel_id), '{}') AS channel_ids,
           coalesce(array_agg(n.n ORDER BY n.channel_id), '{}') AS counts
      FROM (SELECT flying.channel_id, count(*) AS n FROM flying GROUP BY flying.channel_id) n
), walk(channel_id) AS (
    SELECT $1::int8
  UNION ALL
    -- The next channel with a queued message, or the next channel with a cursor, whichever
    -- comes first: a descent never enters a channel with a cursor.
    SELECT least(
             (SELECT m.channel_id FROM outbox._messages m
               WHERE m.state = 'queued' AND m.channel_id > w.channel_id AND m.channel_id <= $2
                 AND m.channel_id < coalesce(k.next_cursor, $2 + 1)
               ORDER BY m.channel_id LIMIT 1),
             CASE WHEN k.next_cursor <= $2 THEN k.next_cursor END)::int8
      FROM walk w
      CROSS JOIN LATERAL (
           SELECT c.channel_ids[pg_catalog.width_bucket(w.channel_id, c.channel_ids) + 1] AS next_cursor
             FROM cursors c) k
     WHERE w.channel_id IS NOT NULL
)
SELECT kept.id
  FROM walk w
  CROSS JOIN cursors k
  CROSS JOIN in_flight i
  CROSS JOIN LATERAL (SELECT pg_catalog.width_bucket(w.channel_id, k.channel_ids) AS at,
                             pg_catalog.width_bucket(w.channel_id, i.channel_ids) AS at_count) b
  CROSS JOIN LATERAL (
       SELECT CASE WHEN k.channel_ids[b.at] = w.channel_id
                   THEN timestamptz 'epoch' + k.due_at_us[b.at] * interval '1 microsecond'
                   ELSE '-infinity' END AS floor_at,
              CASE WHEN k.channel_ids[b.at] = w.channel_id THEN k.ids[b.at] ELSE 0 END AS floor_id,
              CASE WHEN i.channel_ids[b.at_count] = w.channel_id THEN i.counts[b.at_count] ELSE 0 END
                AS in_flight) f
  CROSS JOIN LATERAL (
       SELECT c.id
         FROM outbox._channels c
        WHERE c.id = w.channel_id AND NOT c.paused
          AND outbox._in_flight_bound(c.options) > f.in_flight
          AND EXISTS (SELECT 1 FROM outbox._messages q
                       WHERE q.channel_id = c.id AND q.state = 'queued' AND NOT q.held_by_key
                         AND q.next_attempt_at <= now()
                         AND (q.next_attempt_at, q.id) >= (f.floor_at, f.floor_id)
                         AND q.id NOT IN (SELECT flying.id FROM flying))
       -- Keeps the walk a loop that the LIMIT ends: no join reads every channel.
       OFFSET 0) kept
 WHERE w.channel_id > $1
 LIMIT $6",
);

/// Where a worker's next walk starts: after the last channel its previous claim read,
/// when that claim stopped at its limit; from the first channel when it read them all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rotation {
    /// The walk reads the channels after this id (exclusive), then wraps round to it.
    after: i64,
}

/// Below every channel id.
const BEFORE_ALL: i64 = i32::MIN as i64 - 1;
const LAST: i64 = i32::MAX as i64;

impl Default for Rotation {
    fn default() -> Self {
        Rotation { after: BEFORE_ALL }
    }
}

impl Rotation {
    /// The stretches of ids to walk, in order, each (after, up to and with): after the
    /// start to the last id, then from the first id round to the start.
    pub fn stretches(&self) -> Vec<(i64, i64)> {
        if self.after == BEFORE_ALL {
            vec![(BEFORE_ALL, LAST)]
        } else {
            vec![(self.after, LAST), (BEFORE_ALL, self.after)]
        }
    }

    /// After a walk that kept `kept` (in the order found) with a limit of `limit`: the next
    /// walk starts after the last one kept when the limit cut the walk short.
    pub fn after_walk(&mut self, kept: &[i32], limit: usize) {
        self.after = match kept.last() {
            Some(&last) if kept.len() >= limit => i64::from(last),
            _ => BEFORE_ALL,
        };
    }
}

/// The channels the next claim reads (see the module), at most `limit`, and the rotation
/// moved on past them.
pub fn due_channels(
    client: &SpiClient<'_>,
    rotation: &mut Rotation,
    floors: &Floors,
    limit: usize,
) -> SpiResult<Vec<i32>> {
    let mut kept: Vec<i32> = Vec::new();
    for (after, upto) in rotation.stretches() {
        let left = limit.saturating_sub(kept.len());
        if left == 0 {
            break;
        }
        for row in spi::run(
            client,
            &DUE_CHANNELS,
            None,
            &[
                after.into(),
                upto.into(),
                floors.channel_ids.clone().into(),
                floors.due_at_us.clone().into(),
                floors.ids.clone().into(),
                (left as i64).into(),
            ],
        )? {
            if let Some(id) = row.get::<i32>(1)? {
                kept.push(id);
            }
        }
    }
    rotation.after_walk(&kept, limit);
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn covered(r: Rotation) -> i128 {
        r.stretches().iter().map(|(a, b)| i128::from(b - a)).sum()
    }

    #[test]
    fn a_walk_from_the_start_reads_every_id_once() {
        let r = Rotation::default();
        assert_eq!(r.stretches(), vec![(BEFORE_ALL, LAST)]);
        assert_eq!(covered(r), 1i128 << 32);
    }

    #[test]
    fn a_walk_from_the_middle_wraps_round_to_its_start() {
        let mut r = Rotation::default();
        r.after_walk(&[3, 7, 9], 3);
        assert_eq!(r.stretches(), vec![(9, LAST), (BEFORE_ALL, 9)]);
    }

    #[test]
    fn a_walk_cut_by_its_limit_goes_on_next_time_and_a_whole_walk_starts_over() {
        let mut r = Rotation::default();
        r.after_walk(&[1, 2], 2);
        assert_eq!(r, Rotation { after: 2 });
        r.after_walk(&[5], 2);
        assert_eq!(r, Rotation::default(), "the walk read everything");
        r.after_walk(&[], 2);
        assert_eq!(r, Rotation::default());
        r.after_walk(&[4, 8, 6], 2);
        assert_eq!(r, Rotation { after: 6 }, "the last found, wrapped or not");
        r.after_walk(&[i32::MIN, i32::MAX], 1);
        assert_eq!(r, Rotation { after: LAST });
    }

    #[test]
    fn the_stretches_of_any_rotation_cover_every_id_once() {
        for after in [i32::MIN, -1, 0, 1, 500, i32::MAX - 1, i32::MAX] {
            let r = Rotation {
                after: i64::from(after),
            };
            let s = r.stretches();
            assert_eq!(s.len(), 2);
            assert_eq!(s[0], (i64::from(after), LAST), "first to the end");
            assert_eq!(
                s[1],
                (BEFORE_ALL, i64::from(after)),
                "then round to the start"
            );
            assert_eq!(covered(r), 1i128 << 32, "after {after}");
        }
    }
}
