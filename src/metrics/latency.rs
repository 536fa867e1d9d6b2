//! Latency histograms, pure: how long a send took (request start to answer or failure) and
//! how long a message waited from enqueue to delivered. The worker counts each batch's
//! observations per channel into buckets of fixed bounds (`Histogram`), and adds them to
//! `outbox._channel_stats` (since the start, for `prometheus()`'s histograms) and
//! `outbox._channel_minutes` (per minute, for the 5-minute p50/p95/p99 of `outbox.metrics`).
//! The SQL side (`outbox._latency_bounds_ms()`, `outbox._quantile_ms()`) holds the same
//! bounds and the same estimate; `src/tests/observability.rs` checks that they agree.

/// Upper bounds of the buckets, in ms, each inclusive (Prometheus' `le`); one more bucket
/// past the last holds everything longer (`+Inf`). From a loopback answer to an hour's
/// retries.
pub const BOUNDS_MS: [i64; 16] = [
    5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 300_000, 900_000,
    3_600_000,
];

/// Buckets of a histogram: one per bound, and `+Inf`.
pub const BUCKETS: usize = BOUNDS_MS.len() + 1;

/// Observations counted per bucket (not cumulative), and their sum in ms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Histogram {
    pub counts: [i64; BUCKETS],
    pub sum_ms: i64,
}

impl Histogram {
    /// Counts one observation of `ms` (a negative one, from a clock step, as 0).
    pub fn observe(&mut self, ms: i64) {
        let ms = ms.max(0);
        self.counts[bucket_of(ms)] += 1;
        self.sum_ms = self.sum_ms.saturating_add(ms);
    }
}

/// The bucket that counts `ms`: the first whose bound is at least `ms`.
pub fn bucket_of(ms: i64) -> usize {
    BOUNDS_MS.partition_point(|&bound| bound < ms)
}

/// The `q` quantile (0 to 1) of per-bucket `counts`, estimated as Prometheus'
/// `histogram_quantile` does: linearly inside the bucket that holds the rank, from 0 below
/// the first bound; the last finite bound when the rank falls in `+Inf`. None when empty.
pub fn quantile_ms(counts: &[i64], q: f64) -> Option<f64> {
    let total: i64 = counts.iter().sum();
    if total <= 0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total as f64;
    let mut below = 0i64;
    for (i, &c) in counts.iter().enumerate() {
        if c > 0 && (below + c) as f64 >= rank {
            let Some(&upper) = BOUNDS_MS.get(i) else {
                return Some(BOUNDS_MS[BOUNDS_MS.len() - 1] as f64);
            };
            let lower = if i == 0 { 0 } else { BOUNDS_MS[i - 1] };
            return Some(lower as f64 + (upper - lower) as f64 * (rank - below as f64) / c as f64);
        }
        below += c;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_value_falls_in_the_first_bucket_whose_bound_holds_it() {
        assert_eq!(bucket_of(-3), 0);
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(5), 0);
        assert_eq!(bucket_of(6), 1);
        for (i, &bound) in BOUNDS_MS.iter().enumerate() {
            assert_eq!(bucket_of(bound), i, "{bound} is inside its own bucket");
            assert_eq!(bucket_of(bound + 1), i + 1, "{bound}+1 is in the next");
        }
        assert_eq!(bucket_of(i64::MAX), BUCKETS - 1);
        assert!(BOUNDS_MS.windows(2).all(|w| w[0] < w[1]), "bounds rise");
    }

    #[test]
    fn observations_are_counted_and_summed() {
        let mut h = Histogram::default();
        for ms in [1, 7, 7, 4_000_000, -5] {
            h.observe(ms);
        }
        assert_eq!(h.counts.iter().sum::<i64>(), 5);
        assert_eq!(h.sum_ms, 1 + 7 + 7 + 4_000_000);
        assert_eq!(h.counts[0], 2);
        assert_eq!(h.counts[1], 2);
        assert_eq!(h.counts[BUCKETS - 1], 1);
        let mut big = Histogram::default();
        big.observe(i64::MAX);
        big.observe(i64::MAX);
        assert_eq!(big.sum_ms, i64::MAX, "the sum saturates");
    }

    #[test]
    fn quantiles_interpolate_inside_the_bucket_that_holds_the_rank() {
        assert_eq!(quantile_ms(&[0; BUCKETS], 0.5), None);
        assert_eq!(quantile_ms(&[], 0.5), None);
        // 10 in (0, 5]: the median is half way.
        let mut c = [0; BUCKETS];
        c[0] = 10;
        assert_eq!(quantile_ms(&c, 0.5), Some(2.5));
        assert_eq!(quantile_ms(&c, 1.0), Some(5.0));
        // 90 fast, 10 in (1000, 2500]: p50 fast, p95 half way into the slow bucket.
        let mut c = [0; BUCKETS];
        c[bucket_of(3)] = 90;
        c[bucket_of(2_000)] = 10;
        assert_eq!(quantile_ms(&c, 0.5), Some(5.0 * 50.0 / 90.0));
        assert_eq!(quantile_ms(&c, 0.95), Some(1_000.0 + 1_500.0 * 0.5));
        // In +Inf: the highest finite bound.
        let mut c = [0; BUCKETS];
        c[BUCKETS - 1] = 3;
        assert_eq!(quantile_ms(&c, 0.99), Some(3_600_000.0));
    }

    #[test]
    fn quantiles_rise_with_q_and_stay_inside_the_observed_buckets() {
        let mut h = Histogram::default();
        let mut x: u64 = 7;
        for _ in 0..2_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            h.observe(((x >> 33) % 120_000) as i64);
        }
        let mut last = 0.0;
        for q in (0..=100).map(|i| i as f64 / 100.0) {
            let v = quantile_ms(&h.counts, q).unwrap();
            assert!(v >= last, "q {q}: {v} < {last}");
            assert!(
                v <= 300_000.0,
                "q {q}: {v} past the bucket of the largest value"
            );
            last = v;
        }
    }
}
