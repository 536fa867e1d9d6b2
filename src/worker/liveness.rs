//! Whether the worker that holds a claim is alive: the lease of its messages.
//!
//! Each worker process beats in shared memory: a thread of its own writes the boot clock
//! (`clock::boot_ms`, `CLOCK_BOOTTIME`) into the worker's slot every [`BEAT_EVERY`]. The
//! thread runs as long as the process runs, whatever its main thread waits for (a long
//! record, a lock an application holds, a slow effect), and stops with it: a process that
//! is stopped (`kill -STOP`, a frozen cgroup, a paused VM) or gone stops beating. So the
//! beat renews the lease of everything the worker holds, continuously and without a write
//! to the database, and recovery (`recovery::FIND_LOST_LEASES`) takes back only what a dead
//! or stalled worker held:
//!
//! | holder of the claim (its slot, its pid)            | state     | taken back            |
//! |-----------------------------------------------------|-----------|-----------------------|
//! | its slot has its pid, in this database, beat fresh  | `live`    | never                 |
//! | its slot has its pid, its last beat older than the lease | `stalled` | at once          |
//! | no slot has it (exited, crashed, another server)    | `gone`    | once `lease_until` passed |
//!
//! The lease a claim was given (`lease_until - started_at`, both written by the claim from
//! one clock reading) is what a stall is measured against, on the boot clock: a step of the
//! wall clock, forward or back, neither expires a live worker's lease nor keeps a stalled
//! one's. A `gone` holder's claim waits for its wall-clock `lease_until`, as before: a
//! claim written by hand for a test, or by an old primary, has no slot here.
//!
//! The other half of the lease is the fence (`crate::channels::fence`): an attempt not
//! started by its claim's boot time plus the lease, less a margin, is never started. A
//! worker that was stalled for longer than the lease finds its unsent attempts past their
//! deadline when it resumes, and those it had sent are taken back as interrupted, never
//! sent a second time blindly.

use crate::clock::boot_ms;
use crate::gucs::MAX_SLOTS;
use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgAtomic};
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

/// How often a worker's beat is written.
pub const BEAT_EVERY: Duration = Duration::from_millis(100);

/// The last beat of each worker slot (boot clock, ms; 0 before its first).
pub struct Beats {
    at_ms: [AtomicI64; MAX_SLOTS],
}

impl Default for Beats {
    fn default() -> Self {
        Beats {
            at_ms: std::array::from_fn(|_| AtomicI64::new(0)),
        }
    }
}

unsafe impl PGRXSharedMemory for Beats {}

static BEATS: PgAtomic<Beats> = unsafe { PgAtomic::new(c"outbox_delivery_worker_beats") };

/// Called from `_PG_init` during shared_preload_libraries processing only.
pub fn init_shmem() {
    pg_shmem_init!(BEATS);
}

/// Writes the beat of slot `index` now.
pub fn beat(index: usize) {
    if index < MAX_SLOTS && crate::worker_slots::preloaded() {
        BEATS.get().at_ms[index].store(boot_ms(), Ordering::Release);
    }
}

fn last_beat_ms(index: usize) -> i64 {
    if index < MAX_SLOTS && crate::worker_slots::preloaded() {
        BEATS.get().at_ms[index].load(Ordering::Acquire)
    } else {
        0
    }
}

/// Starts the thread that beats for slot `index` as long as this process runs. It touches
/// no PostgreSQL API (an atomic store into shared memory mapped before the process
/// started) and blocks every signal, so that the server's signals reach the main thread.
pub fn start_beating(index: usize) -> std::io::Result<()> {
    beat(index);
    let previous = crate::runtime::block_all_signals();
    let started = std::thread::Builder::new()
        .name("outbox beat".into())
        .stack_size(64 * 1024)
        .spawn(move || loop {
            beat(index);
            std::thread::sleep(BEAT_EVERY);
        });
    crate::runtime::restore_signals(&previous);
    started.map(|_| ())
}

/// What is known of a claim's holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// Its process runs and beats: its lease holds.
    Live,
    /// Its process has not beaten for longer than the claim's lease: it is stopped or
    /// stuck, and whatever it had not sent by now it will not send (the fence).
    Stalled,
    /// No worker of this database has that pid in that slot.
    Gone,
}

impl Holder {
    pub fn as_str(self) -> &'static str {
        match self {
            Holder::Live => "live",
            Holder::Stalled => "stalled",
            Holder::Gone => "gone",
        }
    }
}

/// The slot a claim names, as read from shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotSeen {
    pub pid: i32,
    pub database_oid: u32,
    pub last_beat_ms: i64,
}

/// The holder of a claim made by `claim_pid` in a slot now seen as `slot` (None: no such
/// slot), from a database `database_oid`, given the claim's `lease_ms`, at `now_ms` on the
/// boot clock.
pub fn holder(
    slot: Option<SlotSeen>,
    claim_pid: i32,
    database_oid: u32,
    lease_ms: f64,
    now_ms: i64,
) -> Holder {
    let Some(slot) = slot else {
        return Holder::Gone;
    };
    if claim_pid <= 0 || slot.pid != claim_pid || slot.database_oid != database_oid {
        return Holder::Gone;
    }
    // A lease of no length (or none that is a number) holds nothing.
    let silent_ms = now_ms.saturating_sub(slot.last_beat_ms) as f64;
    if slot.last_beat_ms > 0 && lease_ms > 0.0 && silent_ms <= lease_ms {
        Holder::Live
    } else {
        Holder::Stalled
    }
}

/// `outbox._claim_holder(owner, pid, lease_ms)`: whether the worker that made a claim
/// (`lease_owner`, `worker_pid`) is `live`, `stalled` or `gone`, for a claim whose lease
/// was `lease_ms` ([`holder`]); NULL for a NULL argument (a lease with no finite end).
/// Read by recovery in the worker; it reads shared memory.
#[pg_extern(volatile, strict, parallel_unsafe)]
fn _claim_holder(owner: i32, pid: i32, lease_ms: f64) -> &'static str {
    let database = u32::from(unsafe { pgrx::pg_sys::MyDatabaseId });
    let seen = usize::try_from(owner)
        .ok()
        .filter(|i| *i < MAX_SLOTS && crate::worker_slots::preloaded())
        .map(|i| {
            let slot = crate::worker_slots::read(i);
            SlotSeen {
                pid: slot.pid,
                database_oid: slot.database_oid,
                last_beat_ms: last_beat_ms(i),
            }
        });
    holder(seen, pid, database, lease_ms, boot_ms()).as_str()
}

#[cfg(test)]
mod tests {
    use super::*;

    const DB: u32 = 16384;

    fn slot(pid: i32, db: u32, beat: i64) -> Option<SlotSeen> {
        Some(SlotSeen {
            pid,
            database_oid: db,
            last_beat_ms: beat,
        })
    }

    #[test]
    fn a_holder_that_beats_within_its_lease_is_live_however_long_it_holds() {
        let now = 10_000_000;
        for silent in [0, 1, 999, 59_999, 60_000] {
            assert_eq!(
                holder(slot(42, DB, now - silent), 42, DB, 60_000.0, now),
                Holder::Live,
                "silent for {silent} ms"
            );
        }
    }

    #[test]
    fn a_holder_silent_for_longer_than_its_lease_is_stalled() {
        let now = 10_000_000;
        for (silent, lease) in [(60_001, 60_000.0), (1_001, 1_000.0), (5_000_000, 60_000.0)] {
            assert_eq!(
                holder(slot(42, DB, now - silent), 42, DB, lease, now),
                Holder::Stalled
            );
        }
        assert_eq!(
            holder(slot(42, DB, 0), 42, DB, 60_000.0, now),
            Holder::Stalled,
            "never beat"
        );
    }

    #[test]
    fn a_slot_of_another_process_or_database_or_none_is_gone() {
        let now = 10_000_000;
        assert_eq!(holder(None, 42, DB, 60_000.0, now), Holder::Gone);
        assert_eq!(
            holder(slot(43, DB, now), 42, DB, 60_000.0, now),
            Holder::Gone
        );
        assert_eq!(
            holder(slot(42, DB + 1, now), 42, DB, 60_000.0, now),
            Holder::Gone
        );
        assert_eq!(holder(slot(0, DB, now), 0, DB, 60_000.0, now), Holder::Gone);
        assert_eq!(
            holder(slot(-1, DB, now), -1, DB, 60_000.0, now),
            Holder::Gone
        );
    }

    #[test]
    fn a_lease_of_no_length_holds_nothing() {
        let now = 10_000_000;
        for lease in [0.0, -1.0, f64::NEG_INFINITY, f64::NAN] {
            assert_eq!(
                holder(slot(42, DB, now), 42, DB, lease, now),
                Holder::Stalled,
                "{lease}"
            );
        }
        assert_eq!(
            holder(slot(42, DB, now - 1_000_000), 42, DB, f64::INFINITY, now),
            Holder::Live
        );
    }

    #[test]
    fn the_words_are_those_recovery_compares() {
        let words: Vec<&str> = [Holder::Live, Holder::Stalled, Holder::Gone]
            .iter()
            .map(|h| h.as_str())
            .collect();
        assert_eq!(words, ["live", "stalled", "gone"]);
    }
}
