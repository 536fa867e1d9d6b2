//! Claim cursors: where a worker's next claim of a channel resumes reading the due index.
//!
//! A claim takes the oldest due messages from the head of `_messages_due_idx`, and the
//! index keeps the entry of every message it took until VACUUM removes it. While a deep
//! backlog drains, VACUUM of a table of a million rows falls behind, and a claim that
//! starts at the head steps over hundreds of thousands of dead entries (about 2,000 index
//! pages, 10–15 ms a claim) before it reaches the first queued message.
//!
//! So while a worker claims full batches, or all a channel lets it take, its next claim of
//! that channel starts at the first message it took there the last time. A deep backlog
//! drained at the channel's bound of attempts open at once (`max_in_flight`) gives short
//! batches, each as large as the room the channel has left: they keep their cursor too,
//! since the backlog goes on past what they took; a head read at each would step over the
//! dead entries again (2,900 buffers a claim in a drain of 1,000,000, BENCHMARKS.md).
//! A cursor may pass over a due message: one locked by another worker's claim that then
//! rolled back, one held back by its ordering key, one whose transaction committed after
//! later ones with an earlier due time. Those are found by a claim that reads from the
//! head, and one does:
//! - whenever the claim under cursors returns less than a full batch (the rest of the batch
//!   is claimed from the head in the same transaction), so a worker never goes idle without
//!   having read every channel with room from its head;
//! - after a claim in which a channel took less than it could: it has nothing due past its
//!   cursor, and its next claim reads it from the head;
//! - at least every [`FULL_SCAN_EVERY_MS`], whatever the batches: only a claim that starts
//!   with no cursor at all counts as such a read, since the rest of a short batch is taken
//!   from the heads of the channels with room only, and a channel at its bound has none.
//!
//! Pure bookkeeping; the claim statement applies the floors (`claim::CLAIM_DUE`).

use std::collections::{BTreeMap, BTreeSet};

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

    /// Takes note of a claim: whether it started from the head of every channel (no
    /// cursor: `floors` was empty), how many messages were asked for, the channel and
    /// position of each message claimed (none for a due time out of the range of positions:
    /// its channel gets no cursor), and the channels that got all the claim could take of
    /// them (`channels_cut`).
    /// - A full batch: each channel in it resumes at its first message; the others lose
    ///   their cursor.
    /// - A short batch: a channel cut at its share resumes at its first message; one that
    ///   took less lost its cursor; one absent keeps its cursor (it had no room, or nothing
    ///   due even from its head).
    /// - An empty claim changes no cursor.
    pub fn after_claim(
        &mut self,
        now_ms: i64,
        from_head: bool,
        batch_size: usize,
        claimed: impl IntoIterator<Item = (i32, Option<Position>)>,
        cut: &BTreeSet<i32>,
    ) {
        if from_head {
            self.last_full_scan_ms = Some(now_ms);
        }
        let mut count = 0usize;
        let mut first: BTreeMap<i32, Option<Position>> = BTreeMap::new();
        for (channel_id, p) in claimed {
            count += 1;
            first
                .entry(channel_id)
                .and_modify(|q| *q = q.zip(p).map(|(a, b)| a.min(b)))
                .or_insert(p);
        }
        if count >= batch_size && batch_size > 0 {
            self.by_channel = first
                .into_iter()
                .filter_map(|(channel_id, p)| Some((channel_id, p?)))
                .collect();
            return;
        }
        for (channel_id, p) in first {
            match p.filter(|_| cut.contains(&channel_id)) {
                Some(p) => self.by_channel.insert(channel_id, p),
                None => self.by_channel.remove(&channel_id),
            };
        }
    }
}

/// The channels that got all one claim statement could take of them: (channel, share) for
/// each message it claimed, where share is the most it could take of that channel (its
/// room, or its part of the batch).
pub fn channels_cut(claimed: impl IntoIterator<Item = (i32, i32)>) -> BTreeSet<i32> {
    let mut taken: BTreeMap<i32, (i64, i32)> = BTreeMap::new();
    for (channel_id, share) in claimed {
        let e = taken.entry(channel_id).or_insert((0, share));
        e.0 += 1;
        e.1 = e.1.min(share);
    }
    taken
        .into_iter()
        .filter(|(_, (count, share))| *count >= i64::from(*share))
        .map(|(channel_id, _)| channel_id)
        .collect()
}

/// Whether the rest of a short claim read under cursors, from the heads of the due
/// indexes, may take anything: not when every channel read from a cursor (`floor_channels`)
/// took all its room (`full`). Such a channel has nothing more to give this claim, wherever
/// its due messages are; a channel without a cursor was read from its head already.
pub fn rest_claim_may_take(floor_channels: &[i32], full: &BTreeSet<i32>) -> bool {
    floor_channels.iter().any(|id| !full.contains(id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rest_of_a_claim_is_read_while_a_channel_with_a_cursor_has_room() {
        let full: BTreeSet<i32> = [1, 2].into();
        assert!(
            !rest_claim_may_take(&[1], &full),
            "its only channel is at its bound"
        );
        assert!(!rest_claim_may_take(&[1, 2], &full));
        assert!(
            rest_claim_may_take(&[1, 3], &full),
            "channel 3 may have room"
        );
        assert!(rest_claim_may_take(&[3], &BTreeSet::new()));
        assert!(
            !rest_claim_may_take(&[], &full),
            "no cursor: read from the heads already"
        );
    }

    fn p(due_at_us: i64, id: i64) -> Position {
        Position { due_at_us, id }
    }

    fn none() -> BTreeSet<i32> {
        BTreeSet::new()
    }

    fn cut(channels: &[i32]) -> BTreeSet<i32> {
        channels.iter().copied().collect()
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
            &none(),
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
    fn a_short_batch_of_a_channel_that_took_less_than_it_could_sends_it_to_the_head() {
        let mut c = ClaimCursors::default();
        full(&mut c, 0, &[(1, p(10, 1)), (1, p(10, 2))]);
        assert!(!c.floors(1).is_empty());
        c.after_claim(
            2,
            false,
            3,
            [(1, Some(p(10, 5))), (1, Some(p(10, 6)))],
            &none(),
        );
        assert!(c.floors(3).is_empty());
        c.after_claim(4, true, 3, [], &none());
        assert!(c.floors(5).is_empty());
    }

    #[test]
    fn a_short_batch_cut_at_the_channels_room_keeps_its_cursor() {
        // A backlog drained at the channel's bound: each claim takes the room left.
        let mut c = ClaimCursors::default();
        full(&mut c, 0, &[(1, p(10, 1)), (1, p(10, 2)), (1, p(10, 3))]);
        c.after_claim(1, false, 3, [(1, Some(p(10, 9)))], &cut(&[1]));
        assert_eq!(c.floors(2), floors_of(&[(1, 10, 9)]));
        c.after_claim(
            3,
            false,
            3,
            [(1, Some(p(11, 12))), (1, Some(p(11, 10)))],
            &cut(&[1]),
        );
        assert_eq!(c.floors(4), floors_of(&[(1, 11, 10)]));
    }

    #[test]
    fn an_empty_claim_changes_no_cursor() {
        // A channel at its bound has no room: the claim reads nothing of it.
        let mut c = ClaimCursors::default();
        full(&mut c, 0, &[(1, p(10, 1)), (2, p(10, 2))]);
        c.after_claim(1, false, 2, [], &none());
        assert_eq!(c.floors(2), floors_of(&[(1, 10, 1), (2, 10, 2)]));
    }

    #[test]
    fn in_a_short_batch_an_absent_channel_keeps_its_cursor_and_a_present_one_not_cut_loses_it() {
        let mut c = ClaimCursors::default();
        full(&mut c, 0, &[(1, p(10, 1)), (2, p(10, 2)), (3, p(10, 3))]);
        c.after_claim(
            1,
            false,
            3,
            [(2, Some(p(20, 5))), (3, Some(p(20, 6)))],
            &cut(&[3]),
        );
        assert_eq!(c.floors(2), floors_of(&[(1, 10, 1), (3, 20, 6)]));
    }

    #[test]
    fn an_empty_batch_size_keeps_no_cursor() {
        let mut c = ClaimCursors::default();
        c.after_claim(0, true, 0, [], &none());
        assert!(c.floors(1).is_empty());
    }

    #[test]
    fn the_head_is_read_again_once_a_second_has_passed_since_the_last_time() {
        let mut c = ClaimCursors::default();
        full(&mut c, 1_000, &[(1, p(10, 1))]);
        // Full batches, and short ones cut at the channel's room, under cursors do not
        // renew the head read.
        for now in [1_100, 1_500, 1_999] {
            assert!(!c.floors(now).is_empty(), "at {now}");
            c.after_claim(now, false, 1, [(1, Some(p(now, now)))], &none());
            c.after_claim(now, false, 2, [(1, Some(p(now, now)))], &cut(&[1]));
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
        c.after_claim(
            2,
            false,
            2,
            [(2, Some(p(20, 7))), (2, Some(p(20, 8)))],
            &none(),
        );
        assert_eq!(c.floors(3), floors_of(&[(2, 20, 7)]));
    }

    #[test]
    fn a_channel_with_a_message_of_unknown_position_is_read_from_the_head() {
        let claimed = [
            (1, Some(p(10, 1))),
            (1, None),
            (1, Some(p(5, 2))),
            (2, Some(p(7, 3))),
        ];
        let mut c = ClaimCursors::default();
        c.after_claim(0, true, 4, claimed, &none());
        assert_eq!(c.floors(1), floors_of(&[(2, 7, 3)]));
        // The same in a short batch that got all of both channels.
        let mut c = ClaimCursors::default();
        full(&mut c, 0, &[(1, p(1, 1)), (2, p(1, 1))]);
        c.after_claim(1, false, 9, claimed, &cut(&[1, 2]));
        assert_eq!(c.floors(2), floors_of(&[(2, 7, 3)]));
    }

    /// Every short or full batch of two channels, each with or without a cursor before,
    /// taking 0 to 3 messages, cut or not: the cursor after is the rule's.
    #[test]
    fn every_batch_of_two_channels_leaves_the_cursors_the_rule_says() {
        for batch_size in 1..=6usize {
            for before in 0..4u8 {
                for taken in [
                    (0, 0),
                    (0, 1),
                    (1, 0),
                    (1, 1),
                    (2, 1),
                    (0, 3),
                    (3, 3),
                    (2, 2),
                ] {
                    for cut_mask in 0..4u8 {
                        let mut c = ClaimCursors::default();
                        let prior: Vec<(i32, Position)> = (1..=2)
                            .filter(|ch| before & (1 << (ch - 1)) != 0)
                            .map(|ch| (ch, p(1, i64::from(ch))))
                            .collect();
                        c.after_claim(
                            0,
                            true,
                            prior.len(),
                            prior.iter().map(|&(ch, q)| (ch, Some(q))),
                            &none(),
                        );
                        let claimed: Vec<(i32, Option<Position>)> = (0..taken.0)
                            .map(|i| (1, Some(p(5, 10 + i))))
                            .chain((0..taken.1).map(|i| (2, Some(p(5, 20 + i)))))
                            .collect();
                        let cuts: BTreeSet<i32> = (1..=2)
                            .filter(|ch| cut_mask & (1 << (ch - 1)) != 0)
                            .collect();
                        c.after_claim(1, false, batch_size, claimed.iter().copied(), &cuts);
                        let floors = c.floors(2);
                        let count = (taken.0 + taken.1) as usize;
                        for (ch, n, first) in [(1, taken.0, 10), (2, taken.1, 20)] {
                            let had = before & (1 << (ch - 1)) != 0;
                            let expected = if count >= batch_size {
                                (n > 0).then_some(first)
                            } else if n == 0 {
                                had.then_some(i64::from(ch))
                            } else {
                                cuts.contains(&ch).then_some(first)
                            };
                            let got = floors
                                .channel_ids
                                .iter()
                                .position(|&x| x == ch)
                                .map(|k| floors.ids[k]);
                            assert_eq!(
                                got, expected,
                                "batch {batch_size}, before {before:b}, taken {taken:?}, cut {cut_mask:b}, channel {ch}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_channel_is_cut_when_a_statement_took_all_its_share() {
        assert_eq!(channels_cut([]), none());
        assert_eq!(channels_cut([(1, 2), (1, 2), (2, 3)]), cut(&[1]));
        assert_eq!(channels_cut([(1, 1), (2, 3), (2, 3), (2, 3)]), cut(&[1, 2]));
        // A share of zero or less (no room left) is reached by any message.
        assert_eq!(channels_cut([(4, 0)]), cut(&[4]));
        // Every count against every share, one channel.
        for share in 1..=5 {
            for count in 1..=6 {
                let got = channels_cut(std::iter::repeat_n((7, share), count as usize));
                assert_eq!(got.contains(&7), count >= share, "{count} of {share}");
            }
        }
    }

    #[test]
    fn positions_order_by_due_time_then_id_like_the_index() {
        assert!(p(10, 99) < p(11, 1));
        assert!(p(10, 1) < p(10, 2));
        assert!(p(i64::MIN, 0) < p(0, 0));
    }
}
