//! Holding messages behind their ordering key. A message with an ordering key waits while
//! an earlier message of its key is pending (queued or uncertain); the claim checks that
//! for every due message it reads, and passes over the ones that wait. A long queue behind
//! one key (its first message scheduled far ahead, uncertain, or failing slowly) was read
//! entry by entry at every claim of its channel, under the claim lock that every worker
//! takes in turn: 20,000 such messages made another channel's 5,000 take 21.9 s instead of
//! 0.7 s (BENCHMARKS.md).
//!
//! So a worker marks such messages held (`outbox._messages.held_by_key`): they sort apart
//! in the due index, and the claim reads only the part that is not held. The message before
//! a held one releases it when it stops being pending, in whatever statement does that
//! (`outbox._release_key`, a trigger). Holding is only ever a hint: the claim checks the
//! order itself, so a message wrongly left free is still not sent out of order; one wrongly
//! left held would wait, and [`RELEASE_STRANDED`] frees it.
//!
//! - Which messages wait is read from the index of the pending messages of a key not held
//!   (queued or uncertain), by (tenant, key, id): each entry after the first of its key is
//!   behind the one before it. No lookup per message: a queue of many keys with a message
//!   or two each costs an index entry a message, read once a cycle. An `uncertain` message
//!   is never held, but the queued one after it is, as after a queued one: many keys each
//!   stopped at an uncertain message (a provider that drops every connection) cost the
//!   claims nothing either.
//! - A worker goes through that index [`HOLD_SCAN`] entries at a time, from where it
//!   stopped ([`HoldClock`]), around and around: once a second, and at once again while it
//!   holds some. While each step holds at least half of a whole scan (a burst), it goes
//!   on step after step for up to [`HOLD_BURST_MS`] before it claims again: a claim
//!   between two steps passes over every message of the burst not held yet (100,000
//!   behind one key slowed another channel's drain for 14 s; BENCHMARKS.md).
//! - A message is held once it has waited [`HOLD_AFTER_MS`]: one behind a message in
//!   flight for a moment is not written twice (held, released) for a wait of a few claims.
//! - Holding takes a share lock on the message before, and skips one that is locked: that
//!   message cannot stop being pending, and so release nothing, before the hold commits.
//!   Nothing it does waits for a lock.

use crate::spi::{self, Statement};
use pgrx::spi::{SpiClient, SpiResult};

/// How long a message waits behind its key before it is held.
pub const HOLD_AFTER_MS: i64 = 1_000;
/// How often a worker holds what waits (and at once again while it holds some).
pub const HOLD_EVERY_MS: i64 = 1_000;
/// How often a worker frees held messages that nothing pending is before any more.
pub const RELEASE_STRANDED_EVERY_MS: i64 = 10_000;
/// Index entries read per statement at most.
pub const HOLD_SCAN: i32 = 10_000;
/// How long a worker goes on holding, step after step, while each step holds at least
/// half a scan's worth (a burst), before it claims again. Meanwhile it neither claims nor
/// records, nor looks whether its database is being dropped.
pub const HOLD_BURST_MS: i64 = 1_000;
/// Keys with held messages read per release of the stranded at most: how many a tenant
/// made is theirs to choose, and the release goes on from where it stopped.
pub const RELEASE_KEYS: i32 = 2_000;

/// $1, $2, $3: where to start (tenant, ordering key, id; the first entry read, which the
/// statement before read last); $4: entries read at most; $5: `HOLD_AFTER_MS`. Reads the
/// index of pending messages of a key that are not held, by key, and holds each message
/// queued for at least `$5` that the entry before it, of the same key, is before (with a
/// share lock on that one, skipped when locked). Returns the last entry read (NULLs when
/// none was), how many it read and how many it held.
pub(crate) static HOLD_BEHIND_KEYS: Statement = Statement::planned_once(
    "
WITH scanned AS MATERIALIZED (
    SELECT u.tenant, u.ordering_key, u.id,
           lag(u.id) OVER w AS before_id,
           coalesce(lag(u.tenant) OVER w = u.tenant AND lag(u.ordering_key) OVER w = u.ordering_key,
                    false) AS behind
      FROM (SELECT k.tenant, k.ordering_key, k.id FROM outbox._messages k
             WHERE k.ordering_key IS NOT NULL AND k.state IN ('queued', 'uncertain')
               AND NOT k.held_by_key
               AND (k.tenant, k.ordering_key, k.id) >= ($1, $2, $3)
             ORDER BY k.tenant, k.ordering_key, k.id
             LIMIT $4) u
    WINDOW w AS (ORDER BY u.tenant, u.ordering_key, u.id)
), held AS (
    UPDATE outbox._messages m SET held_by_key = true
     WHERE m.id = ANY (ARRAY(
           -- One message at a time, in the primary key: the message before it share-locked
           -- (skipped when locked), then the message itself, locked to be written
           -- (skipped when locked). The state is compared as text, which no partial index
           -- of queued rows answers: a plan made once, while the table was small, read one
           -- of them whole.
           SELECT c.id
             FROM scanned s
            CROSS JOIN LATERAL (
                  SELECT c.id FROM outbox._messages c
                   WHERE c.id = s.id AND c.state::text = 'queued' AND NOT c.held_by_key
                     AND c.created_at <= now() - $5 * interval '1 millisecond'
                     FOR UPDATE OF c SKIP LOCKED) c
            WHERE s.behind
              AND EXISTS (SELECT 1 FROM outbox._messages p
                           WHERE p.id = s.before_id AND p.state::text IN ('queued', 'uncertain')
                             FOR SHARE OF p SKIP LOCKED)))
 RETURNING m.id
)
SELECT last.tenant, last.ordering_key, last.id, (SELECT count(*) FROM scanned)::int4,
       (SELECT count(*) FROM held)::int4
  FROM (SELECT 1) one
  LEFT JOIN LATERAL (SELECT s.tenant, s.ordering_key, s.id FROM scanned s
                      ORDER BY s.tenant DESC, s.ordering_key DESC, s.id DESC
                      LIMIT 1) last ON true",
);

/// $1, $2: the key after which to read (tenant, ordering key; empty strings: from the
/// start); $3: keys read at most. The first held message of each key from there on (a
/// skip over the index of held messages, one probe a key) that no pending message of its
/// key is before any more, released: a release missed by a race of two transactions, or a
/// row changed by hand. Returns the last key read (NULLs when none was), how many keys it
/// read and how many messages it released.
pub(crate) static RELEASE_STRANDED: Statement = Statement::planned_once(
    "
WITH RECURSIVE firsts AS (
    (SELECT h.tenant, h.ordering_key, h.id, 1 AS n FROM outbox._messages h
      WHERE h.state = 'queued' AND h.held_by_key AND (h.tenant, h.ordering_key) > ($1, $2)
      ORDER BY h.tenant, h.ordering_key, h.id
      LIMIT 1)
    UNION ALL
    SELECT nx.tenant, nx.ordering_key, nx.id, f.n + 1
      FROM firsts f
     CROSS JOIN LATERAL (
           SELECT h.tenant, h.ordering_key, h.id FROM outbox._messages h
            WHERE h.state = 'queued' AND h.held_by_key
              AND (h.tenant, h.ordering_key) > (f.tenant, f.ordering_key)
            ORDER BY h.tenant, h.ordering_key, h.id
            LIMIT 1) nx
     WHERE f.n < $3
), stranded AS (
    SELECT f.id FROM firsts f
     WHERE NOT EXISTS (SELECT 1 FROM outbox._messages e
                        WHERE e.tenant = f.tenant AND e.ordering_key = f.ordering_key
                          AND e.id < f.id AND e.state IN ('queued', 'uncertain'))
), released AS (
    UPDATE outbox._messages m SET held_by_key = false
     WHERE m.id = ANY (ARRAY(SELECT stranded.id FROM stranded))
       AND m.state::text = 'queued' AND m.held_by_key
 RETURNING m.id
)
SELECT last.tenant, last.ordering_key, (SELECT count(*) FROM firsts)::int4,
       (SELECT count(*) FROM released)::int4
  FROM (SELECT 1) one
  LEFT JOIN LATERAL (SELECT f.tenant, f.ordering_key FROM firsts f ORDER BY f.n DESC LIMIT 1) last ON true",
);

/// One worker of a database holds (the first, `Worker::hold_keys`), and only while no
/// other does: after a change of `outbox.workers`, two would read the same entries and
/// each skip the other's. A worker that does not get the lock (`worker_locks::KEY_HOLDS`,
/// which no SQL can take) tries again later.
pub fn try_lock() -> bool {
    crate::worker_locks::KEY_HOLDS.try_take()
}

/// An entry of the index of messages not held: (tenant, ordering key, id). The default,
/// empty strings and id 0, is before every entry: a tenant and a key are never empty, an
/// id never 0.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Entry {
    pub tenant: String,
    pub ordering_key: String,
    pub id: i64,
}

/// What one run of [`hold`] did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Held {
    /// The last entry read, if any was.
    pub last: Option<Entry>,
    pub read: i32,
    pub held: i32,
}

/// Holds the messages that wait behind their key, reading from `from` on (one statement).
pub fn hold(client: &mut SpiClient<'_>, from: &Entry) -> SpiResult<Held> {
    let rows = spi::run(
        client,
        &HOLD_BEHIND_KEYS,
        None,
        &[
            from.tenant.as_str().into(),
            from.ordering_key.as_str().into(),
            from.id.into(),
            HOLD_SCAN.into(),
            (HOLD_AFTER_MS as f64).into(),
        ],
    )?;
    let Some(row) = rows.into_iter().next() else {
        return Ok(Held::default());
    };
    let last = match (
        row.get::<String>(1)?,
        row.get::<String>(2)?,
        row.get::<i64>(3)?,
    ) {
        (Some(tenant), Some(ordering_key), Some(id)) => Some(Entry {
            tenant,
            ordering_key,
            id,
        }),
        _ => None,
    };
    Ok(Held {
        last,
        read: row.get::<i32>(4)?.unwrap_or(0),
        held: row.get::<i32>(5)?.unwrap_or(0),
    })
}

/// An ordering key of a tenant: where a release of the stranded goes on from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Key {
    pub tenant: String,
    pub ordering_key: String,
}

/// What one release of the stranded did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Released {
    /// The last key read, if any was.
    pub last: Option<Key>,
    pub read: i32,
    pub released: i32,
}

/// Releases held messages that nothing pending is before, reading keys after `after`.
pub fn release_stranded(client: &mut SpiClient<'_>, after: &Key) -> SpiResult<Released> {
    let rows = spi::run(
        client,
        &RELEASE_STRANDED,
        None,
        &[
            after.tenant.as_str().into(),
            after.ordering_key.as_str().into(),
            RELEASE_KEYS.into(),
        ],
    )?;
    let Some(row) = rows.into_iter().next() else {
        return Ok(Released::default());
    };
    let last = match (row.get::<String>(1)?, row.get::<String>(2)?) {
        (Some(tenant), Some(ordering_key)) => Some(Key {
            tenant,
            ordering_key,
        }),
        _ => None,
    };
    Ok(Released {
        last,
        read: row.get::<i32>(3)?.unwrap_or(0),
        released: row.get::<i32>(4)?.unwrap_or(0),
    })
}

/// What a worker does about ordering keys at a given moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HoldStep {
    /// Read the index from this entry on.
    pub from: Entry,
    /// Also release the stranded, reading keys after this one.
    pub release_stranded: Option<Key>,
}

/// One worker's bookkeeping of holds, on its monotonic clock (ms). Pure.
#[derive(Debug, Default)]
pub struct HoldClock {
    last_hold_ms: Option<i64>,
    last_release_ms: Option<i64>,
    /// Where the next step reads from; `None`: from the start.
    from: Option<Entry>,
    /// The key after which the next release of the stranded reads; `None`: from the start.
    release_after: Option<Key>,
    more: bool,
    /// The last step held at least half a scan: a burst ([`HoldClock::in_burst`]).
    burst: bool,
}

impl HoldClock {
    /// The step due at `now_ms`, if any.
    pub fn due(&self, now_ms: i64) -> Option<HoldStep> {
        let elapsed = |at: Option<i64>, every: i64| at.is_none_or(|at| now_ms - at >= every);
        if !self.more && !elapsed(self.last_hold_ms, HOLD_EVERY_MS) {
            return None;
        }
        Some(HoldStep {
            from: self.from.clone().unwrap_or_default(),
            release_stranded: elapsed(self.last_release_ms, RELEASE_STRANDED_EVERY_MS)
                .then(|| self.release_after.clone().unwrap_or_default()),
        })
    }

    /// Notes that `step` ran at `now_ms` and did `held` (and `released`, when it released
    /// the stranded). A step that read the index to its end sends the next one to the
    /// start; one that stopped short, to the entry it read last, which the next one reads
    /// again as the entry before its first. The same for the keys of the release.
    pub fn ran(&mut self, now_ms: i64, step: &HoldStep, held: Held, released: Released) {
        if step.release_stranded.is_some() {
            self.last_release_ms = Some(now_ms);
            self.release_after = if released.read >= RELEASE_KEYS {
                released.last
            } else {
                None
            };
        }
        self.last_hold_ms = Some(now_ms);
        let full = held.read >= HOLD_SCAN;
        self.from = if full { held.last } else { None };
        self.more = full && held.held > 0;
        self.burst = full && held.held >= HOLD_SCAN / 2;
    }

    /// Whether to run the next step at once, before claiming, `elapsed_ms` after the first
    /// step of this turn: the last one read a whole scan and held at least half of it, and
    /// the turn has not lasted [`HOLD_BURST_MS`].
    pub fn in_burst(&self, elapsed_ms: i64) -> bool {
        self.burst && elapsed_ms < HOLD_BURST_MS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str, id: i64) -> Entry {
        Entry {
            tenant: "default".into(),
            ordering_key: key.into(),
            id,
        }
    }

    fn read(last: Entry, read: i32, held: i32) -> Held {
        Held {
            last: Some(last),
            read,
            held,
        }
    }

    #[test]
    fn the_start_is_before_every_entry() {
        let start = Entry::default();
        let first = Entry {
            tenant: "\u{1}".into(),
            ordering_key: "\u{1}".into(),
            id: 1,
        };
        assert!(
            (&start.tenant, &start.ordering_key, start.id)
                < (&first.tenant, &first.ordering_key, first.id)
        );
    }

    #[test]
    fn the_first_step_reads_from_the_start_and_releases() {
        assert_eq!(
            HoldClock::default().due(5),
            Some(HoldStep {
                from: Entry::default(),
                release_stranded: Some(Key::default())
            })
        );
    }

    #[test]
    fn a_step_that_reads_to_the_end_sends_the_next_to_the_start_a_second_later() {
        let mut c = HoldClock::default();
        let step = c.due(0).unwrap();
        c.ran(0, &step, read(entry("k", 40), 7, 3), Released::default());
        assert_eq!(c.due(HOLD_EVERY_MS - 1), None);
        assert_eq!(
            c.due(HOLD_EVERY_MS),
            Some(HoldStep {
                from: Entry::default(),
                release_stranded: None
            })
        );
    }

    #[test]
    fn a_full_step_that_held_is_followed_at_once_from_its_last_entry() {
        let mut c = HoldClock::default();
        let step = c.due(0).unwrap();
        c.ran(
            0,
            &step,
            read(entry("k", 9_000), HOLD_SCAN, 5_000),
            Released::default(),
        );
        assert_eq!(c.due(1).map(|s| s.from), Some(entry("k", 9_000)));
    }

    #[test]
    fn a_burst_is_held_step_after_step_for_one_turn_at_most() {
        let mut c = HoldClock::default();
        let step = c.due(0).unwrap();
        c.ran(
            0,
            &step,
            read(entry("k", 9_000), HOLD_SCAN, 5_000),
            Released::default(),
        );
        assert!(c.in_burst(0) && c.in_burst(HOLD_BURST_MS - 1));
        assert!(!c.in_burst(HOLD_BURST_MS));
        // A whole scan of which fewer than half were held goes on at once, as before, but
        // after a claim: no burst.
        let step = c.due(1).unwrap();
        c.ran(
            1,
            &step,
            read(entry("k", 9_900), HOLD_SCAN, HOLD_SCAN / 2 - 1),
            Released::default(),
        );
        assert!(c.due(2).is_some() && !c.in_burst(0));
        // A step that read less than a whole scan ends the burst, as one that held nothing.
        let step = c.due(1).unwrap();
        c.ran(
            1,
            &step,
            read(entry("k", 9_500), 500, 500),
            Released::default(),
        );
        assert!(!c.in_burst(1));
        let step = c.due(HOLD_EVERY_MS + 1).unwrap();
        c.ran(
            HOLD_EVERY_MS + 1,
            &step,
            read(entry("m", 12), HOLD_SCAN, 0),
            Released::default(),
        );
        assert!(!c.in_burst(0));
    }

    #[test]
    fn a_full_step_that_held_nothing_goes_on_a_second_later() {
        let mut c = HoldClock::default();
        let step = c.due(0).unwrap();
        c.ran(
            0,
            &step,
            read(entry("m", 12), HOLD_SCAN, 0),
            Released::default(),
        );
        assert_eq!(c.due(1), None);
        assert_eq!(c.due(HOLD_EVERY_MS).map(|s| s.from), Some(entry("m", 12)));
    }

    #[test]
    fn an_empty_index_is_read_from_the_start_each_time() {
        let mut c = HoldClock::default();
        let step = c.due(0).unwrap();
        c.ran(0, &step, Held::default(), Released::default());
        assert_eq!(c.due(HOLD_EVERY_MS).map(|s| s.from), Some(Entry::default()));
    }

    #[test]
    fn stranded_messages_are_released_every_ten_seconds() {
        let mut c = HoldClock::default();
        let step = c.due(0).unwrap();
        c.ran(0, &step, Held::default(), Released::default());
        let mut releases = 0;
        let mut t = 0;
        while t < 60_000 {
            t += HOLD_EVERY_MS;
            if let Some(step) = c.due(t) {
                releases += step.release_stranded.is_some() as i32;
                c.ran(t, &step, Held::default(), Released::default());
            }
        }
        assert_eq!(releases, (60_000 / RELEASE_STRANDED_EVERY_MS) as i32);
    }

    #[test]
    fn a_release_that_read_all_its_keys_goes_on_after_the_last_ten_seconds_later() {
        let mut c = HoldClock::default();
        let step = c.due(0).unwrap();
        let key = Key {
            tenant: "default".into(),
            ordering_key: "k-77".into(),
        };
        let full = Released {
            last: Some(key.clone()),
            read: RELEASE_KEYS,
            released: 0,
        };
        c.ran(0, &step, Held::default(), full);
        assert_eq!(c.due(HOLD_EVERY_MS).map(|s| s.release_stranded), Some(None));
        assert_eq!(
            c.due(RELEASE_STRANDED_EVERY_MS).map(|s| s.release_stranded),
            Some(Some(key))
        );
        let step = c.due(RELEASE_STRANDED_EVERY_MS).unwrap();
        let short = Released {
            last: None,
            read: 3,
            released: 1,
        };
        c.ran(RELEASE_STRANDED_EVERY_MS, &step, Held::default(), short);
        assert_eq!(
            c.due(2 * RELEASE_STRANDED_EVERY_MS)
                .map(|s| s.release_stranded),
            Some(Some(Key::default()))
        );
    }
}
