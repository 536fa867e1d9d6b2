//! What is left of a claim once some of its messages are recorded: the record takes the
//! recorded messages out of the worker's claims (`record::RELEASE_CLAIMED`), deleting a
//! claim left empty. `outbox._claim_ids_left(ids, released)` computes one claim's ids
//! without the released ones, in one pass over each array. Array operators compared every
//! id of a claim with every released one (`<@`, `&&`, `<> ALL`): in a drain the release took
//! 0.33–0.37 ms a record that way, against 0.06–0.08 ms now (BENCHMARKS.md).

use pgrx::prelude::*;
use std::borrow::Cow;

/// `released` in ascending order: as given when it is already (the worker passes its ids
/// sorted), else a sorted copy.
pub fn sorted(released: &[i64]) -> Cow<'_, [i64]> {
    if released.is_sorted() {
        Cow::Borrowed(released)
    } else {
        let mut copy = released.to_vec();
        copy.sort_unstable();
        Cow::Owned(copy)
    }
}

/// The ids of a claim that are not in `released_sorted` (ascending), in their order; `None`
/// when none of them is released, and the claim stays as it is. A NULL id (none is ever
/// written) is never released and stays.
pub fn left(
    ids: impl IntoIterator<Item = Option<i64>>,
    released_sorted: &[i64],
) -> Option<Vec<Option<i64>>> {
    let mut released_any = false;
    let left = ids
        .into_iter()
        .filter(|id| {
            let stays = id.is_none_or(|id| released_sorted.binary_search(&id).is_err());
            released_any |= !stays;
            stays
        })
        .collect();
    released_any.then_some(left)
}

/// `outbox._claim_ids_left(ids, released)`: the ids of `ids` that are not in `released`, in
/// their order, or NULL when none of them is ([`left`]). NULL elements of `released` release
/// nothing. Its cost (1,000) makes the planner test a claim's worker before calling it.
#[pg_extern(immutable, strict, parallel_safe, cost = 1000)]
fn _claim_ids_left(ids: Array<'_, i64>, released: Array<'_, i64>) -> Option<Vec<Option<i64>>> {
    let without_nulls: Vec<i64>;
    let released = match released.as_slice() {
        Ok(slice) => slice,
        Err(_) => {
            without_nulls = released.iter().flatten().collect();
            &without_nulls
        }
    };
    let released = sorted(released);
    match ids.as_slice() {
        Ok(slice) => left(slice.iter().map(|id| Some(*id)), &released),
        Err(_) => left(ids.iter(), &released),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ids left as the array operators computed them: every id compared with every
    /// released one.
    fn by_comparison(ids: &[Option<i64>], released: &[i64]) -> Option<Vec<Option<i64>>> {
        let left: Vec<Option<i64>> = ids
            .iter()
            .copied()
            .filter(|id| id.is_none_or(|id| !released.contains(&id)))
            .collect();
        (left.len() < ids.len()).then_some(left)
    }

    #[test]
    fn a_claim_keeps_what_was_not_released_in_its_order() {
        let ids = [Some(5), Some(1), Some(9), Some(3)];
        assert_eq!(left(ids, &sorted(&[9, 1])), Some(vec![Some(5), Some(3)]));
        assert_eq!(left(ids, &sorted(&[3, 9, 5, 1, 7])), Some(vec![]));
    }

    #[test]
    fn a_claim_none_of_whose_ids_is_released_stays_as_it_is() {
        let ids = [Some(5), Some(1), Some(9), Some(3)];
        assert_eq!(left(ids, &sorted(&[])), None);
        assert_eq!(left(ids, &sorted(&[2, 4, 6])), None);
        assert_eq!(left([], &sorted(&[1, 2])), None);
        assert_eq!(left([None], &sorted(&[1, 2])), None);
    }

    #[test]
    fn a_null_id_stays_and_duplicates_go_together() {
        assert_eq!(
            left([None, Some(2), Some(2), Some(4)], &sorted(&[2])),
            Some(vec![None, Some(4)])
        );
    }

    #[test]
    fn released_ids_in_any_order_release_the_same() {
        assert!(matches!(sorted(&[1, 2, 2, 8]), Cow::Borrowed(_)));
        assert_eq!(&*sorted(&[8, 2, 1, 2]), &[1, 2, 2, 8]);
    }

    /// Every claim of up to 5 ids from 0..6 (with repeats and a NULL) against every set of
    /// released ids from 0..6, in both orders: the same as comparing each with each.
    #[test]
    fn the_same_as_comparing_every_id_with_every_released_one() {
        let values: Vec<Option<i64>> = (0..6).map(Some).chain([None]).collect();
        let mut claims: Vec<Vec<Option<i64>>> = vec![vec![]];
        for _ in 0..5 {
            let longer: Vec<Vec<Option<i64>>> = claims
                .iter()
                .filter(|c| c.len() == claims.last().map_or(0, Vec::len))
                .flat_map(|c| {
                    values.iter().map(move |v| {
                        let mut c = c.clone();
                        c.push(*v);
                        c
                    })
                })
                .collect();
            claims.extend(longer);
        }
        for mask in 0u32..64 {
            let released: Vec<i64> = (0..6).filter(|i| mask & (1 << i) != 0).collect();
            let reversed: Vec<i64> = released.iter().rev().copied().collect();
            for claim in &claims {
                let expected = by_comparison(claim, &released);
                assert_eq!(left(claim.iter().copied(), &sorted(&released)), expected);
                assert_eq!(left(claim.iter().copied(), &sorted(&reversed)), expected);
            }
        }
    }
}
