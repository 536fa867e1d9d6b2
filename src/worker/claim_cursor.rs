//! Claim cursors: where a worker's next claim of a channel resumes reading the due index.
//!
//! A claim takes the oldest due messages from the head of `_messages_due_idx`, and the
//! index keeps the entry of every message it took until VACUUM removes it. While a deep
//! backlog drains, VACUUM of a table of a million rows falls behind, and a claim that
//! starts at the head steps over hundreds of thousands of dead entries (about 2,000 index
//! pages, 10–15 ms a claim) before it reaches the first queued message.
//!
//! So while a worker claims full batches, its next claim of a channel starts at the first
//! message it took there the last time. A cursor may pass over a due message: one locked
//! by another worker's claim that then rolled back, one held back by its ordering key, one
//! whose transaction committed after later ones with an earlier due time. Those are found
//! by a claim that reads from the head, and one does:
//! - whenever the claim under cursors returns less than a full batch (the rest of the batch
//!   is claimed from the head in the same transaction), so a worker never goes idle without
//!   having read every channel from its head;
//! - at least every [`FULL_SCAN_EVERY_MS`] while full batches go on.
//!
//! Pure bookkeeping; the claim statement applies the floors (`claim::CLAIM_DUE`).

use std::collections::BTreeMap;

/// Longest time between two claims that read every due index from its head.
pub const FULL_SCAN_EVERY_MS: i64 = 1_000;

/// A message's place in the due index of its channel: (due time in µs since the epoch, id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    pub due_at_us: i64,
    pub id: i64,
}

/// Per channel, the position a claim starts from (the statement's `$5`, `$6`, `$7`).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Floors {
    pub channel_ids: Vec<i32>,
    pub due_at_us: Vec<i64>,
    pub ids: Vec<i64>,
}

impl Floors {
    /// No floor: every channel is read from the head of its due index.
    pub fn is_empty(&self) -> bool {
        self.channel_ids.is_empty()
    }
}

/// One worker's cursors. Times are milliseconds of a monotonic clock.
#[derive(Debug, Default)]
pub struct ClaimCursors {
    by_channel: BTreeMap<i32, Position>,
    last_full_scan_ms: Option<i64>,
}

impl ClaimCursors {
    /// Where the next claim starts; empty when it must read from the head.
    pub fn floors(&self, now_ms: i64) -> Floors {
        let mut floors = Floors::default();
        let recent = self
            .last_full_scan_ms
            .is_some_and(|at| now_ms.saturating_sub(at) < FULL_SCAN_EVERY_MS);
        if !recent {
            return floors;
        }
        for (&channel_id, p) in &self.by_channel {
            floors.channel_ids.push(channel_id);
            floors.due_at_us.push(p.due_at_us);
            floors.ids.push(p.id);
        }
        floors
    }

    /// Takes note of a claim: whether it read every channel from the head, how many
    /// messages were asked for, and the channel and position of each message claimed
    /// (none for a due time out of the range of positions: its channel gets no cursor).
    pub fn after_claim(
        &mut self,
        now_ms: i64,
        from_head: bool,
        batch_size: usize,
        claimed: impl IntoIterator<Item = (i32, Option<Position>)>,
    ) {
        if from_head {
            self.last_full_scan_ms = Some(now_ms);
        }
        self.by_channel.clear();
        let mut count = 0usize;
        let mut first: BTreeMap<i32, Option<Position>> = BTreeMap::new();
        for (channel_id, p) in claimed {
            count += 1;
            first
                .entry(channel_id)
                .and_modify(|q| *q = q.zip(p).map(|(a, b)| a.min(b)))
                .or_insert(p);
        }
        // A short batch means no deep backlog (or a full channel): read from the head.
        if count >= batch_size && batch_size > 0 {
            self.by_channel = first
                .into_iter()
                .filter_map(|(channel_id, p)| Some((channel_id, p?)))
                .collect();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(due_at_us: i64, id: i64) -> Position {
        Position { due_at_us, id }
    }

    /// Floors from (channel, due time, id) triples.
    fn floors_of(entries: &[(i32, i64, i64)]) -> Floors {
        Floors {
            channel_ids: entries.iter().map(|e| e.0).collect(),
            due_at_us: entries.iter().map(|e| e.1).collect(),
            ids: entries.iter().map(|e| e.2).collect(),
        }
    }

    fn full(cursors: &mut ClaimCursors, now: i64, claimed: &[(i32, Position)]) {
        cursors.after_claim(
            now,
            true,
            claimed.len(),
            claimed.iter().map(|&(c, p)| (c, Some(p))),
        );
    }

    #[test]
    fn a_new_worker_reads_from_the_head() {
        assert!(ClaimCursors::default().floors(0).is_empty());
        assert!(ClaimCursors::default().floors(i64::MAX).is_empty());
    }

    #[test]
    fn after_a_full_batch_each_channel_resumes_at_its_first_claimed_message() {
        let mut c = ClaimCursors::default();
        full(
            &mut c,
            100,
            &[
                (2, p(50, 9)),
                (1, p(10, 4)),
                (2, p(40, 12)),
                (1, p(10, 3)),
                (2, p(40, 11)),
            ],
        );
        assert_eq!(c.floors(101), floors_of(&[(1, 10, 3), (2, 40, 11)]));
    }

    #[test]
    fn a_short_batch_sends_the_next_claim_to_the_head() {
        let mut c = ClaimCursors::default();
        full(&mut c, 0, &[(1, p(10, 1)), (1, p(10, 2))]);
        assert!(!c.floors(1).is_empty());
        c.after_claim(2, false, 3, [(1, Some(p(10, 5))), (1, Some(p(10, 6)))]);
        assert!(c.floors(3).is_empty());
        c.after_claim(4, true, 3, []);
        assert!(c.floors(5).is_empty());
    }

    #[test]
    fn an_empty_batch_size_keeps_no_cursor() {
        let mut c = ClaimCursors::default();
        c.after_claim(0, true, 0, []);
        assert!(c.floors(1).is_empty());
    }

    #[test]
    fn the_head_is_read_again_once_a_second_has_passed_since_the_last_time() {
        let mut c = ClaimCursors::default();
        full(&mut c, 1_000, &[(1, p(10, 1))]);
        // Full batches under cursors do not renew the head read.
        for now in [1_100, 1_500, 1_999] {
            assert!(!c.floors(now).is_empty(), "at {now}");
            c.after_claim(now, false, 1, [(1, Some(p(now, now)))]);
        }
        assert!(c.floors(2_000).is_empty());
        assert!(c.floors(5_000).is_empty());
        // A claim from the head renews it.
        full(&mut c, 2_000, &[(1, p(10, 1))]);
        assert!(!c.floors(2_999).is_empty());
        assert!(c.floors(3_000).is_empty());
    }

    #[test]
    fn a_clock_that_goes_back_never_skips_the_head_read_for_long() {
        let mut c = ClaimCursors::default();
        full(&mut c, 10_000, &[(1, p(10, 1))]);
        // A monotonic clock does not go back, but an earlier time must not extend the cursor's life.
        assert!(!c.floors(9_000).is_empty());
        assert!(c.floors(11_000).is_empty());
        assert!(c.floors(i64::MAX).is_empty());
        full(&mut c, i64::MIN, &[(1, p(10, 1))]);
        assert!(c.floors(i64::MAX).is_empty());
    }

    #[test]
    fn a_channel_absent_from_a_full_batch_loses_its_cursor() {
        let mut c = ClaimCursors::default();
        full(&mut c, 0, &[(1, p(10, 1)), (2, p(10, 2))]);
        assert_eq!(c.floors(1).channel_ids, vec![1, 2]);
        c.after_claim(2, false, 2, [(2, Some(p(20, 7))), (2, Some(p(20, 8)))]);
        assert_eq!(c.floors(3), floors_of(&[(2, 20, 7)]));
    }

    #[test]
    fn a_channel_with_a_message_of_unknown_position_is_read_from_the_head() {
        let mut c = ClaimCursors::default();
        c.after_claim(
            0,
            true,
            4,
            [
                (1, Some(p(10, 1))),
                (1, None),
                (1, Some(p(5, 2))),
                (2, Some(p(7, 3))),
            ],
        );
        assert_eq!(c.floors(1), floors_of(&[(2, 7, 3)]));
    }

    #[test]
    fn positions_order_by_due_time_then_id_like_the_index() {
        assert!(p(10, 99) < p(11, 1));
        assert!(p(10, 1) < p(10, 2));
        assert!(p(i64::MIN, 0) < p(0, 0));
    }
}
