//! Lane turns: the tenants of a shared channel take turns in its claims.
//!
//! Several tenants may send over one channel (a channel's `tenants`). Each tenant's queued
//! messages on it form a lane (`_messages_lane_idx`). A claim reads every lane's oldest due
//! messages and takes them in turns, the first of each lane, then the second of each, up to
//! the channel's share of the claim (`claim::CLAIM_DUE`). When the share is smaller than
//! the number of lanes (a rate limit that grants one token, a channel near its bound of
//! attempts in flight), the lanes that go first take it: so each worker remembers, per
//! channel, the tenant it served last, and its next claim of the channel starts with the
//! tenant after it and wraps round. One tenant's backlog then stands before another
//! tenant's next message for one turn of the lanes at most.
//!
//! Pure bookkeeping: the claim statement orders the lanes from what [`LaneTurns::args`]
//! gives it.

use std::collections::BTreeMap;

/// One message a claim took: its channel, how many lanes the channel had in the claim,
/// the message's place in the channel's order of turns (1, 2, …), and its tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Picked<'a> {
    pub channel_id: i32,
    pub lanes: i32,
    pub pick: i64,
    pub tenant: &'a str,
}

/// A worker's turns: per channel with more than one lane, the tenant served last.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct LaneTurns {
    served_last: BTreeMap<i32, String>,
}

impl LaneTurns {
    /// The claim statement's `$11`, `$12`: (channel, tenant served last) pairs.
    pub fn args(&self) -> (Vec<i32>, Vec<String>) {
        self.served_last
            .iter()
            .map(|(id, t)| (*id, t.clone()))
            .unzip()
    }

    /// After a claim: a channel with several lanes is served next from the tenant after
    /// the one that took its last turn; a channel with one lane forgets its turn. Channels
    /// the claim took nothing from keep theirs.
    pub fn after_claim<'a>(&mut self, picked: impl IntoIterator<Item = Picked<'a>>) {
        let mut last: BTreeMap<i32, (i32, i64, &str)> = BTreeMap::new();
        for p in picked {
            let e = last
                .entry(p.channel_id)
                .or_insert((p.lanes, p.pick, p.tenant));
            if p.pick > e.1 {
                *e = (p.lanes, p.pick, p.tenant);
            }
        }
        for (channel_id, (lanes, _, tenant)) in last {
            if lanes > 1 {
                self.served_last.insert(channel_id, tenant.to_string());
            } else {
                self.served_last.remove(&channel_id);
            }
        }
    }

    /// Keeps the turns of the channels that still exist.
    pub fn retain(&mut self, exists: impl Fn(i32) -> bool) {
        self.served_last.retain(|id, _| exists(*id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn picked(channel_id: i32, lanes: i32, pick: i64, tenant: &str) -> Picked<'_> {
        Picked {
            channel_id,
            lanes,
            pick,
            tenant,
        }
    }

    /// The lanes in the order the claim statement gives them turns: those after the tenant
    /// served last first, then round to it (its `ORDER BY (tenant <= after), tenant`).
    fn order<'a>(lanes: &[&'a str], after: Option<&str>) -> Vec<&'a str> {
        let mut v = lanes.to_vec();
        v.sort_by_key(|t| (after.is_some_and(|a| *t <= a), *t));
        v
    }

    /// Claims of `share` messages each from lanes that always have something due: the
    /// tenants served, claim after claim.
    fn serve(lanes: &[&str], share: usize, claims: usize) -> Vec<String> {
        let mut turns = LaneTurns::default();
        let mut served = Vec::new();
        for _ in 0..claims {
            let (_, after) = turns.args();
            let ordered = order(lanes, after.first().map(String::as_str));
            let took: Vec<&str> = ordered.iter().cycle().take(share).copied().collect();
            served.extend(took.iter().map(|t| t.to_string()));
            turns.after_claim(
                took.iter()
                    .enumerate()
                    .map(|(i, t)| picked(7, lanes.len() as i32, i as i64 + 1, t)),
            );
        }
        served
    }

    #[test]
    fn claims_of_one_message_serve_every_lane_in_turn() {
        assert_eq!(
            serve(&["a", "b", "c"], 1, 7),
            ["a", "b", "c", "a", "b", "c", "a"]
        );
    }

    #[test]
    fn a_share_smaller_than_the_lanes_goes_on_where_the_last_stopped() {
        assert_eq!(
            serve(&["a", "b", "c"], 2, 3),
            ["a", "b", "c", "a", "b", "c"]
        );
    }

    #[test]
    fn a_share_larger_than_the_lanes_takes_whole_turns_and_goes_on() {
        assert_eq!(serve(&["a", "b"], 3, 2), ["a", "b", "a", "b", "a", "b"]);
    }

    #[test]
    fn no_lane_waits_more_than_one_turn_whatever_the_share() {
        for lanes in 1..6usize {
            let names: Vec<String> = (0..lanes).map(|i| format!("t{i}")).collect();
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            for share in 1..8 {
                let served = serve(&refs, share, 3 * lanes);
                for name in &names {
                    let at: Vec<usize> = served
                        .iter()
                        .enumerate()
                        .filter(|(_, t)| *t == name)
                        .map(|(i, _)| i)
                        .collect();
                    assert!(at[0] < lanes, "{name} first served at {}", at[0]);
                    for w in at.windows(2) {
                        assert!(
                            w[1] - w[0] <= lanes,
                            "{name}: {at:?} ({lanes} lanes, share {share})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_channel_of_one_lane_keeps_no_turn_and_others_keep_theirs() {
        let mut turns = LaneTurns::default();
        turns.after_claim([
            picked(1, 2, 1, "a"),
            picked(1, 2, 2, "b"),
            picked(2, 3, 1, "x"),
        ]);
        assert_eq!(turns.args(), (vec![1, 2], vec!["b".into(), "x".into()]));
        turns.after_claim([picked(1, 1, 1, "b")]);
        assert_eq!(
            turns.args(),
            (vec![2], vec!["x".into()]),
            "channel 2 untouched"
        );
        turns.after_claim([picked(2, 3, 2, "z"), picked(2, 3, 1, "y")]);
        assert_eq!(
            turns.args(),
            (vec![2], vec!["z".into()]),
            "the last pick, in any order"
        );
        turns.retain(|id| id != 2);
        assert_eq!(turns, LaneTurns::default());
    }
}
