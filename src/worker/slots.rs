//! Worker slots in shared memory: each worker's PID (so a committing backend can set its
//! latch) and its live figures for `outbox.worker_status()`.

use crate::gucs::MAX_WORKERS;
use pgrx::lwlock::PgLwLock;
use pgrx::prelude::*;
use pgrx::{pg_shmem_init, pg_sys, PGRXSharedMemory};
use std::sync::atomic::{AtomicBool, Ordering};

/// What a worker is doing, as shown by `worker_status()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum Phase {
    #[default]
    Stopped = 0,
    Starting,
    WaitingForDatabase,
    WaitingForExtension,
    WaitingForUpdate,
    WaitingForRole,
    Idle,
    Claiming,
    Sending,
    Recording,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Stopped => "stopped",
            Phase::Starting => "starting",
            Phase::WaitingForDatabase => "waiting for database",
            Phase::WaitingForExtension => "waiting for extension",
            Phase::WaitingForUpdate => "waiting for extension update",
            Phase::WaitingForRole => "waiting for outbox.role",
            Phase::Idle => "idle",
            Phase::Claiming => "claiming",
            Phase::Sending => "sending",
            Phase::Recording => "recording",
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Slot {
    pub pid: i32,
    pub phase: Phase,
    pub last_loop_at_ms: i64,
    pub in_flight: i32,
    pub claimed_total: i64,
    pub delivered_total: i64,
    /// Set while the worker connects to its database; still set at the next start means
    /// the connection failed (the database does not exist).
    pub connecting: bool,
}

#[derive(Debug, Clone, Copy)]
pub struct Slots {
    pub slots: [Slot; MAX_WORKERS],
}

impl Default for Slots {
    fn default() -> Self {
        Slots {
            slots: [Slot::default(); MAX_WORKERS],
        }
    }
}

unsafe impl PGRXSharedMemory for Slots {}

static SLOTS: PgLwLock<Slots> = unsafe { PgLwLock::new(c"outbox_delivery_worker_slots") };

/// Set in `_PG_init` when loaded through shared_preload_libraries; inherited by every
/// backend the postmaster forks. Shared memory exists only then.
static PRELOADED: AtomicBool = AtomicBool::new(false);

/// Called from `_PG_init` during shared_preload_libraries processing only.
pub fn init_shmem() {
    pg_shmem_init!(SLOTS);
    PRELOADED.store(true, Ordering::Relaxed);
}

pub fn preloaded() -> bool {
    PRELOADED.load(Ordering::Relaxed)
}

/// Sets the latch of every running worker. Called at COMMIT of an enqueuing transaction.
pub fn wake_workers() {
    if !preloaded() {
        return;
    }
    let pids: Vec<i32> = SLOTS
        .share()
        .slots
        .iter()
        .map(|s| s.pid)
        .filter(|p| *p > 0)
        .collect();
    for pid in pids {
        unsafe {
            let proc_ = pg_sys::BackendPidGetProc(pid);
            if !proc_.is_null() {
                pg_sys::SetLatch(&mut (*proc_).procLatch);
            }
        }
    }
}

/// Updates this worker's slot.
pub fn update(index: usize, f: impl FnOnce(&mut Slot)) {
    if index < MAX_WORKERS {
        f(&mut SLOTS.exclusive().slots[index]);
    }
}

/// A copy of one slot.
pub fn read(index: usize) -> Slot {
    if index < MAX_WORKERS && preloaded() {
        SLOTS.share().slots[index]
    } else {
        Slot::default()
    }
}

pub fn snapshot() -> Vec<Slot> {
    if !preloaded() {
        return Vec::new();
    }
    SLOTS.share().slots.to_vec()
}

/// `outbox.worker_status()`: one row per worker slot in use.
#[pg_extern(volatile)]
#[allow(clippy::type_complexity)]
fn worker_status() -> TableIterator<
    'static,
    (
        name!(worker, i32),
        name!(pid, Option<i32>),
        name!(database, String),
        name!(state, String),
        name!(last_loop_at, Option<pgrx::datum::TimestampWithTimeZone>),
        name!(in_flight, i32),
        name!(claimed_total, i64),
        name!(delivered_total, i64),
    ),
> {
    let database = crate::gucs::database();
    let configured = crate::gucs::workers();
    let rows: Vec<_> = snapshot()
        .into_iter()
        .enumerate()
        .take(configured)
        .map(|(i, s)| {
            let last = (s.last_loop_at_ms > 0)
                .then(|| {
                    pgrx::datum::TimestampWithTimeZone::try_from(unix_ms_to_pg_micros(
                        s.last_loop_at_ms,
                    ))
                    .ok()
                })
                .flatten();
            (
                i as i32,
                (s.pid > 0).then_some(s.pid),
                database.clone(),
                s.phase.as_str().to_string(),
                last,
                s.in_flight,
                s.claimed_total,
                s.delivered_total,
            )
        })
        .collect();
    TableIterator::new(rows)
}

/// Unix milliseconds → Postgres timestamp microseconds (since 2000-01-01).
fn unix_ms_to_pg_micros(ms: i64) -> i64 {
    const PG_EPOCH_OFFSET_MS: i64 = 946_684_800_000;
    (ms - PG_EPOCH_OFFSET_MS) * 1000
}

extension_sql!(
    r#"COMMENT ON FUNCTION outbox.worker_status() IS
    'One row per configured delivery worker: pid, database, state, last loop, in-flight requests and totals since the server started.';"#,
    name = "worker_status_comment",
    requires = [worker_status]
);
