//! The ledger's generations: retention without DELETE.
//!
//! The ledger is three tables (`outbox._ledger_0`, `_1`, `_2`, the partitions of
//! `outbox._ledger`). New entries go to the *current* generation. Every
//! `(keep + CLOSE_MARGIN_S) / 2` the current one is closed and the next one opened,
//! provided it is empty; a closed generation
//! is emptied whole (`TRUNCATE`) once its close lies `keep` (and [`CLOSE_MARGIN_S`]) in the
//! past, since every entry in it was recorded before it closed. An entry therefore lives
//! at least `keep` and at most about `1.5 × (keep + CLOSE_MARGIN_S)`; no entry is ever
//! deleted one by one, and the tables never hold dead rows for VACUUM to clean.
//!
//! `outbox._ledger_generations` has a row for each generation that holds entries: when it
//! was opened and, once it stopped taking entries, when it closed. With no row for it, a
//! generation is empty; with no current row at all, generation 0 takes new entries (a
//! fresh install: `outbox._ledger_current_generation()`).
//!
//! This module decides; `crate::ledger::retain` reads the rows and carries the decisions
//! out.

/// How many tables the ledger is kept in.
pub const GENERATIONS: i16 = 3;

/// Added to the age of a closed generation before it is emptied. Its close is stamped
/// before the closing transaction commits, and a record that read it as current until
/// then may add an entry a moment after the stamp (by the commit's latency, which a
/// synchronous standby lengthens).
pub const CLOSE_MARGIN_S: f64 = 60.0;

/// A generation that holds entries. Times are seconds since the epoch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Generation {
    pub number: i16,
    pub opened_at: f64,
    pub closed_at: Option<f64>,
}

/// What to do after the closed generations that were due have been emptied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rotation {
    /// The current generation goes on taking entries.
    Stay,
    /// The current generation has no row (a fresh install, or its row was lost): it gets
    /// one, opened now, so that its age counts from here.
    Open(i16),
    /// The current generation closes and the next one, empty, opens.
    Advance { close: i16, open: i16 },
}

/// The generation new entries go to, as `outbox._ledger_current_generation()` says: the
/// one not closed, or 0 when no row says so.
pub fn current(rows: &[Generation]) -> i16 {
    rows.iter()
        .find(|g| g.closed_at.is_none())
        .map_or(0, |g| g.number)
}

/// How long a generation takes entries before the next one opens: half of how long a
/// closed generation waits to be emptied (`keep_s` and [`CLOSE_MARGIN_S`]), so that the
/// next one is empty, in time, whenever the current one's period ends. The three tables
/// hold, between them, the entries of the last `keep` and of one such period before it.
pub fn period_s(keep_s: f64) -> f64 {
    (keep_s.max(0.0) + CLOSE_MARGIN_S) / f64::from(GENERATIONS - 1)
}

/// The closed generations whose every entry is older than `keep_s` at `now` (their close
/// older than `keep_s` and [`CLOSE_MARGIN_S`]), oldest first. Never the generation that
/// takes new entries.
pub fn due_for_emptying(rows: &[Generation], now: f64, keep_s: f64) -> Vec<i16> {
    let current = current(rows);
    let mut due: Vec<&Generation> = rows
        .iter()
        .filter(|g| g.number != current)
        .filter(|g| {
            matches!(g.closed_at, Some(closed) if closed + keep_s.max(0.0) + CLOSE_MARGIN_S <= now)
        })
        .collect();
    due.sort_by(|a, b| {
        a.closed_at
            .partial_cmp(&b.closed_at)
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    due.into_iter().map(|g| g.number).collect()
}

/// Whether the current generation closes now (`rows` as they are once the due generations
/// were emptied). It closes when it has been open for a period and the next generation is
/// empty; when the next one still holds entries younger than `keep`, the current one goes
/// on taking entries and grows, and nothing is ever emptied early.
pub fn rotation(rows: &[Generation], now: f64, keep_s: f64) -> Rotation {
    let number = current(rows);
    let Some(current) = rows
        .iter()
        .find(|g| g.number == number && g.closed_at.is_none())
    else {
        return Rotation::Open(number);
    };
    let next = (number + 1).rem_euclid(GENERATIONS);
    let next_is_empty = rows.iter().all(|g| g.number != next);
    if next_is_empty && current.opened_at + period_s(keep_s) <= now {
        Rotation::Advance {
            close: number,
            open: next,
        }
    } else {
        Rotation::Stay
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: f64 = 3600.0;

    fn open(number: i16, opened_at: f64) -> Generation {
        Generation {
            number,
            opened_at,
            closed_at: None,
        }
    }

    /// The ring as a keep of an hour leaves it: generation 0 closed at 1800 s, 1 at 3600 s,
    /// 2 current since then.
    fn ring() -> [Generation; 3] {
        [
            closed(0, 0.0, 1800.0),
            closed(1, 1800.0, 3600.0),
            open(2, 3600.0),
        ]
    }

    fn closed(number: i16, opened_at: f64, closed_at: f64) -> Generation {
        Generation {
            number,
            opened_at,
            closed_at: Some(closed_at),
        }
    }

    /// Runs retention every `step` seconds from 0 to `until`, as the worker does (one
    /// generation emptied a round), recording an entry in the current generation at every
    /// step; returns the oldest age any entry reached while
    /// still kept, the youngest age at which one was emptied, and the most generations
    /// that held entries at once.
    fn simulate(keep: f64, step: f64, until: f64) -> (f64, f64, usize) {
        let mut rows: Vec<Generation> = Vec::new();
        let mut entries: Vec<(i16, f64)> = Vec::new();
        let (mut oldest_kept, mut youngest_emptied, mut most_held) = (0.0f64, f64::MAX, 0usize);
        let mut now = 0.0;
        while now <= until {
            entries.push((current(&rows), now));
            // A round empties the oldest due generation (crate::ledger::retain).
            for g in due_for_emptying(&rows, now, keep).into_iter().take(1) {
                for (_, at) in entries.iter().filter(|(n, _)| *n == g) {
                    youngest_emptied = youngest_emptied.min(now - at);
                }
                entries.retain(|(n, _)| *n != g);
                rows.retain(|r| r.number != g);
            }
            match rotation(&rows, now, keep) {
                Rotation::Stay => {}
                Rotation::Open(n) => rows.push(open(n, now)),
                Rotation::Advance { close, open: next } => {
                    rows.iter_mut()
                        .filter(|r| r.number == close)
                        .for_each(|r| r.closed_at = Some(now));
                    rows.push(open(next, now));
                }
            }
            for (_, at) in &entries {
                oldest_kept = oldest_kept.max(now - at);
            }
            let held: std::collections::BTreeSet<i16> = entries.iter().map(|(n, _)| *n).collect();
            most_held = most_held.max(held.len());
            now += step;
        }
        (oldest_kept, youngest_emptied, most_held)
    }

    #[test]
    fn with_no_row_generation_zero_takes_entries_and_gets_its_row() {
        assert_eq!(current(&[]), 0);
        assert_eq!(rotation(&[], 100.0, HOUR), Rotation::Open(0));
        assert!(due_for_emptying(&[], 100.0, HOUR).is_empty());
    }

    #[test]
    fn the_current_generation_closes_after_its_period_when_the_next_is_empty() {
        let rows = [open(0, 0.0)];
        let period = (HOUR + CLOSE_MARGIN_S) / 2.0;
        assert_eq!(period_s(HOUR), period);
        assert_eq!(rotation(&rows, period - 1.0, HOUR), Rotation::Stay);
        assert_eq!(
            rotation(&rows, period, HOUR),
            Rotation::Advance { close: 0, open: 1 }
        );
        let rows = ring();
        assert_eq!(
            rotation(&[rows[1], rows[2]], 6000.0, HOUR),
            Rotation::Advance { close: 2, open: 0 },
            "the ring wraps round"
        );
        assert_eq!(
            rotation(&rows, 6000.0, HOUR),
            Rotation::Stay,
            "the next generation still holds entries"
        );
    }

    #[test]
    fn a_closed_generation_is_emptied_once_its_close_is_keep_and_the_margin_old() {
        let rows = ring();
        let due = |closed_at: f64| closed_at + HOUR + CLOSE_MARGIN_S;
        assert!(due_for_emptying(&rows, due(1800.0) - 0.001, HOUR).is_empty());
        assert_eq!(due_for_emptying(&rows, due(1800.0), HOUR), vec![0]);
        assert_eq!(
            due_for_emptying(&rows, due(3600.0), HOUR),
            vec![0, 1],
            "oldest first"
        );
        assert!(
            due_for_emptying(&[open(1, 0.0)], 1e12, HOUR).is_empty(),
            "never the current generation"
        );
    }

    #[test]
    fn when_no_row_is_current_generation_zero_is_never_emptied() {
        // Inserts go to generation 0 while no row is current: its closed row must not let
        // it be emptied, and it opens again.
        let rows = [closed(0, 0.0, 10.0), closed(1, 10.0, 20.0)];
        assert_eq!(due_for_emptying(&rows, 1e9, HOUR), vec![1]);
        assert_eq!(rotation(&rows, 1e9, HOUR), Rotation::Open(0));
    }

    #[test]
    fn a_keep_raised_later_holds_entries_longer_and_never_empties_early() {
        let rows = ring();
        assert!(due_for_emptying(&rows, 1800.0 + HOUR + CLOSE_MARGIN_S, 10.0 * HOUR).is_empty());
        assert_eq!(rotation(&rows, 1e6, 10.0 * HOUR), Rotation::Stay);
    }

    #[test]
    fn keep_of_zero_or_less_rotates_and_empties_after_the_margin() {
        assert_eq!(period_s(-5.0), CLOSE_MARGIN_S / 2.0);
        assert_eq!(
            rotation(&[open(0, 100.0)], 100.0 + CLOSE_MARGIN_S / 2.0, 0.0),
            Rotation::Advance { close: 0, open: 1 }
        );
        assert_eq!(
            due_for_emptying(
                &[closed(0, 0.0, 100.0), open(1, 100.0)],
                100.0 + CLOSE_MARGIN_S,
                -1.0
            ),
            vec![0]
        );
    }

    #[test]
    fn a_century_of_keep_never_rotates() {
        let century = 100.0 * 365.25 * 86_400.0;
        assert_eq!(rotation(&[open(0, 0.0)], 1e9, century), Rotation::Stay);
    }

    #[test]
    fn every_entry_lives_at_least_keep_and_at_most_one_and_a_half_keep_and_margin() {
        for (keep, step) in [
            (HOUR, 10.0),
            (HOUR, 7.0),
            (60.0, 1.0),
            (15.0, 10.0),
            (0.0, 10.0),
        ] {
            let (oldest_kept, youngest_emptied, most_held) =
                simulate(keep, step, 20.0 * keep.max(100.0));
            assert!(
                youngest_emptied >= keep + CLOSE_MARGIN_S,
                "keep {keep}, rounds every {step}: an entry emptied at {youngest_emptied} s"
            );
            assert!(
                oldest_kept <= 1.5 * (keep + CLOSE_MARGIN_S) + 2.0 * step,
                "keep {keep}, rounds every {step}: an entry kept {oldest_kept} s"
            );
            assert!(most_held <= GENERATIONS as usize);
        }
    }

    #[test]
    fn rounds_that_stop_for_a_while_keep_entries_longer_never_shorter() {
        // Retention runs again after a pause of ten keeps: both closed generations are due,
        // oldest first (a round empties one), and once they are, the next one opens.
        let rows = ring();
        let now = 3600.0 + 10.0 * HOUR;
        assert_eq!(due_for_emptying(&rows, now, HOUR), vec![0, 1]);
        assert_eq!(
            rotation(&[rows[2]], now, HOUR),
            Rotation::Advance { close: 2, open: 0 }
        );
    }
}
