//! The fence of an attempt: the latest moment, on the boot clock, at which its request may
//! still start.
//!
//! A claim leases its messages to the worker for the lease's length, renewed while the
//! worker beats (`crate::worker::liveness`). A worker stopped for longer than that (a
//! paused VM, a frozen cgroup, `kill -STOP`, a swap storm) loses its claims to recovery,
//! which takes each attempt back as interrupted and settles it another way: a lookup, a
//! resend with the same key, an operator. When the stopped worker runs again, the attempts
//! it had not started must not start: the fence is taken when the claim begins, as the boot
//! time then plus the lease less [`margin_ms`], and every transport looks at it as late as
//! it can, right before the first byte of the request (`wire::transmit`), before the
//! request is handed to reqwest (`http::transmit`, which connects and writes in one call),
//! and before a publish (`nats`). An attempt whose fence has passed ends "not sent: lease
//! ran out", and the record puts its message back in the queue as it was, no attempt
//! counted; if recovery took it back meanwhile, the record leaves it to that.
//!
//! Why the margin: recovery takes a claim back only after its worker has been silent for
//! longer than the lease, measured from its last beat, which is no earlier than the fence's
//! start less one beat interval (100 ms); the margin covers that interval and what a check
//! costs, so that a fence always passes before the claim can be taken back. What it cannot
//! cover is a stop that lands between the check and the write itself: the call that writes
//! on the plain HTTP path and the publish call on NATS (both on a connection made before the
//! check), the connection's set-up too on the reqwest (HTTPS) path. A worker stopped exactly there sends when it resumes; recovery will have taken
//! the attempt back as interrupted, so the provider can see the key twice, and a deduping
//! provider drops the copy. Measured on the plain HTTP path (`wire`'s test
//! `the_window_between_the_fence_check_and_the_written_request_is_microseconds`, 2,000
//! requests on loopback): from the check to the whole request written, p50 15 µs, p99 27 µs,
//! max 229 µs, against a margin of at least 1.25 s; a stop must land inside those
//! microseconds. docs/reliability.md lists this window.

use crate::clock::boot_ms;

/// The most a fence starts before its lease ends, in ms.
pub const MARGIN_MS: i64 = 2_000;

/// The margin of a fence for a lease of `lease_ms`: [`MARGIN_MS`], or a quarter of a
/// shorter lease.
pub fn margin_ms(lease_ms: i64) -> i64 {
    MARGIN_MS.min(lease_ms.max(0) / 4)
}

/// When an attempt may no longer start, on the boot clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence {
    deadline_boot_ms: i64,
}

impl Fence {
    /// The fence of an attempt claimed at `claimed_at_boot_ms` under a lease of `lease_ms`.
    pub fn for_claim(claimed_at_boot_ms: i64, lease_ms: i64) -> Fence {
        Fence {
            deadline_boot_ms: claimed_at_boot_ms
                .saturating_add(lease_ms.max(0))
                .saturating_sub(margin_ms(lease_ms)),
        }
    }

    /// A fence that never passes: a send that no claim leases (a benchmark, a test).
    pub const fn open() -> Fence {
        Fence {
            deadline_boot_ms: i64::MAX,
        }
    }

    /// Whether the fence has passed at `now_boot_ms`.
    pub fn passed_at(&self, now_boot_ms: i64) -> bool {
        now_boot_ms >= self.deadline_boot_ms
    }

    /// Whether the fence has passed now.
    pub fn passed(&self) -> bool {
        self.passed_at(boot_ms())
    }

    /// How far past the fence `now_boot_ms` is, in ms (0 before it).
    pub fn overrun_ms(&self, now_boot_ms: i64) -> i64 {
        now_boot_ms.saturating_sub(self.deadline_boot_ms).max(0)
    }
}

/// The error text of an attempt that did not start because its fence had passed.
pub fn not_sent_text(fence: &Fence) -> String {
    format!(
        "not sent: lease ran out before the request could start ({} ms past its fence; the worker was stopped or held up)",
        fence.overrun_ms(boot_ms())
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fence_passes_a_margin_before_its_lease_ends() {
        let f = Fence::for_claim(1_000_000, 60_000);
        assert!(!f.passed_at(1_000_000));
        assert!(!f.passed_at(1_000_000 + 60_000 - MARGIN_MS - 1));
        assert!(f.passed_at(1_000_000 + 60_000 - MARGIN_MS));
        assert!(f.passed_at(1_000_000 + 60_000));
        assert_eq!(f.overrun_ms(1_000_000), 0);
        assert_eq!(f.overrun_ms(1_000_000 + 60_000), MARGIN_MS);
    }

    #[test]
    fn the_margin_covers_a_beat_and_fits_a_short_lease() {
        let beat = crate::worker::liveness::BEAT_EVERY.as_millis() as i64;
        assert!(MARGIN_MS >= 10 * beat);
        assert_eq!(margin_ms(60_000), MARGIN_MS);
        assert_eq!(margin_ms(5_000), 1_250);
        assert_eq!(margin_ms(0), 0);
        assert_eq!(margin_ms(-5), 0);
        // The least lease a worker gives (lease::MARGIN_MS over a timeout of 0) keeps room
        // for requests to start.
        let least = crate::worker::lease::MARGIN_MS as i64;
        assert!(least - margin_ms(least) >= least / 2);
    }

    #[test]
    fn no_lease_overflows_its_fence() {
        let f = Fence::for_claim(i64::MAX - 5, i64::MAX);
        assert!(!f.passed_at(0));
        let g = Fence::for_claim(1_000, -10);
        assert!(g.passed_at(1_000));
        assert!(!Fence::open().passed_at(i64::MAX - 1));
    }
}
