//! The wall clock, read in one place. Pure logic takes the time as an argument; the worker
//! and the SQL functions read it here. Also a `timestamptz` as a count since the Unix epoch,
//! the way the worker's statements return times (`outbox._epoch_ms`, `outbox._epoch_us`),
//! and back (`outbox.worker_status()`'s last loop).

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

/// Milliseconds on the machine's boot clock (`CLOCK_BOOTTIME`): it never steps when the
/// wall clock is set, keeps counting while a process is stopped (`SIGSTOP`, a frozen
/// cgroup) and while the machine is suspended, and is the same for every process of the
/// machine. Every time that decides whether an attempt may still start, or whether a
/// worker is alive, is read on it (`crate::worker::liveness`, `crate::channels::fence`).
pub fn boot_ms() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: one live timespec; CLOCK_BOOTTIME exists on every Linux PostgreSQL runs on.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } == 0;
    if !ok {
        return 0;
    }
    ts.tv_sec.saturating_mul(1000) + ts.tv_nsec / 1_000_000
}

/// The machine's boot id (`/proc/sys/kernel/random/boot_id`), read once: a reading of the
/// boot clock means something only on the boot it was taken in. `None` where it cannot be
/// read; the wall clock alone then decides.
pub fn boot_id() -> Option<&'static str> {
    static BOOT_ID: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    BOOT_ID
        .get_or_init(|| {
            std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| uuid_shaped(s))
        })
        .as_deref()
}

/// Whether `s` is a UUID in its hyphenated form (as `uuid` reads it).
fn uuid_shaped(s: &str) -> bool {
    s.len() == 36
        && s.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01 00:00 UTC), from which a
/// `timestamptz` counts its microseconds.
const POSTGRES_EPOCH_UNIX_US: i64 = 946_684_800_000_000;

/// A `timestamptz` (microseconds since 2000-01-01) as microseconds since the Unix epoch;
/// `None` for -infinity and infinity, and for the few times near the end of the range
/// whose count does not fit in `i64`.
pub fn unix_us(timestamptz: i64) -> Option<i64> {
    if timestamptz == i64::MIN || timestamptz == i64::MAX {
        return None;
    }
    timestamptz.checked_add(POSTGRES_EPOCH_UNIX_US)
}

/// Milliseconds since the Unix epoch as a `timestamptz`'s count (microseconds since
/// 2000-01-01): the inverse of [`unix_ms`] for a whole millisecond.
pub fn timestamptz_of_unix_ms(ms: i64) -> i64 {
    (ms - POSTGRES_EPOCH_UNIX_US / 1000) * 1000
}

/// A `timestamptz` as milliseconds since the Unix epoch, rounded half away from zero, as
/// `(extract(epoch FROM t) * 1000)::int8` rounds; `None` for -infinity and infinity.
pub fn unix_ms(timestamptz: i64) -> Option<i64> {
    if timestamptz == i64::MIN || timestamptz == i64::MAX {
        return None;
    }
    // On the count since the Unix epoch, which may not fit in i64 near the end of the range
    // (its milliseconds do): halves round away from that epoch, not from PostgreSQL's.
    let us = i128::from(timestamptz) + i128::from(POSTGRES_EPOCH_UNIX_US);
    let (ms, rest) = (us / 1000, us % 1000);
    let rounded = match rest {
        500.. => ms + 1,
        ..=-500 => ms - 1,
        _ => ms,
    };
    i64::try_from(rounded).ok()
}

/// `outbox._epoch_ms(t)`: a time as milliseconds since the Unix epoch, as the worker reads
/// times ([`unix_ms`]); NULL for -infinity and infinity, which have no number (a row may
/// hold them when written by hand).
#[pgrx::pg_extern(immutable, strict, parallel_safe)]
fn _epoch_ms(t: pgrx::datum::TimestampWithTimeZone) -> Option<i64> {
    unix_ms(t.into_inner())
}

/// `outbox._epoch_us(t)`: a time as microseconds since the Unix epoch ([`unix_us`]); NULL
/// for -infinity, infinity and a time past the year 294,000 or so. The claim reads each
/// message's times so: `extract(epoch FROM t)`, a numeric, cost it about 0.3 µs a time
/// (BENCHMARKS.md).
#[pgrx::pg_extern(immutable, strict, parallel_safe)]
fn _epoch_us(t: pgrx::datum::TimestampWithTimeZone) -> Option<i64> {
    unix_us(t.into_inner())
}

pgrx::extension_sql!(
    r#"COMMENT ON FUNCTION outbox._epoch_ms(timestamptz) IS
    'A time as milliseconds since the Unix epoch, rounded half away from zero; NULL for -infinity and infinity.';
COMMENT ON FUNCTION outbox._epoch_us(timestamptz) IS
    'A time as microseconds since the Unix epoch; NULL for -infinity and infinity, and for a time whose count does not fit in bigint.';"#,
    name = "epoch_comments",
    requires = [_epoch_ms, _epoch_us]
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_boot_id_is_read_as_a_uuid() {
        assert!(uuid_shaped("0f4ad1e2-6a6d-4a58-9d1f-3c2b1a0e9f88"));
        assert!(!uuid_shaped("0f4ad1e2-6a6d-4a58-9d1f-3c2b1a0e9f8"));
        assert!(!uuid_shaped("0f4ad1e2x6a6d-4a58-9d1f-3c2b1a0e9f88"));
        assert!(!uuid_shaped("0f4ad1e2-6a6d-4a58-9d1f-3c2b1a0e9fzz"));
        if let Some(id) = boot_id() {
            assert!(uuid_shaped(id), "{id}");
        }
    }

    /// Exact arithmetic on i128, as `extract(epoch FROM t)` (a numeric) computes it, rounded
    /// half away from zero as a numeric's cast to bigint rounds.
    fn ms_as_numeric(timestamptz: i64) -> i64 {
        let us = timestamptz as i128 + POSTGRES_EPOCH_UNIX_US as i128;
        let (ms, rest) = (us / 1000, (us % 1000).abs());
        (if rest >= 500 { ms + us.signum() } else { ms }) as i64
    }

    #[test]
    fn milliseconds_round_half_away_from_zero() {
        let edges = [
            0i64,
            1,
            499,
            500,
            501,
            999,
            1000,
            1499,
            1500,
            -1,
            -499,
            -500,
            -501,
            -999,
            -1000,
            -1500,
            -POSTGRES_EPOCH_UNIX_US,
            -POSTGRES_EPOCH_UNIX_US - 500,
            -POSTGRES_EPOCH_UNIX_US + 500,
            -POSTGRES_EPOCH_UNIX_US - 499,
            i64::MIN + 1,
            i64::MAX - 1,
            9_223_371_331_200_000_000,
        ];
        for base in edges {
            for delta in -1001..=1001 {
                let Some(t) = base.checked_add(delta) else {
                    continue;
                };
                if t == i64::MIN || t == i64::MAX {
                    continue;
                }
                assert_eq!(unix_ms(t), Some(ms_as_numeric(t)), "{t}");
            }
        }
    }

    #[test]
    fn a_whole_millisecond_goes_there_and_back() {
        for ms in [
            0,
            1,
            -1,
            946_684_800_000,
            1_733_000_000_123,
            -62_135_596_800_000,
        ] {
            assert_eq!(unix_ms(timestamptz_of_unix_ms(ms)), Some(ms));
        }
        assert_eq!(timestamptz_of_unix_ms(946_684_800_000), 0);
    }

    #[test]
    fn the_boot_clock_moves_forward_only() {
        let a = boot_ms();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let b = boot_ms();
        assert!(a > 0 && b >= a + 5, "{a} then {b}");
    }

    #[test]
    fn infinities_have_no_number() {
        for f in [unix_ms, unix_us] {
            assert_eq!(f(i64::MIN), None);
            assert_eq!(f(i64::MAX), None);
        }
    }

    #[test]
    fn microseconds_count_from_the_unix_epoch() {
        assert_eq!(unix_us(0), Some(946_684_800_000_000));
        assert_eq!(unix_us(-946_684_800_000_000), Some(0));
        assert_eq!(unix_us(-946_684_800_000_001), Some(-1));
        // The end of timestamptz's range (294276 AD) is past what fits.
        assert_eq!(unix_us(9_223_371_331_200_000_000), None);
        assert_eq!(unix_us(i64::MAX - POSTGRES_EPOCH_UNIX_US), Some(i64::MAX));
        assert_eq!(unix_us(i64::MAX - POSTGRES_EPOCH_UNIX_US + 1), None);
    }
}
