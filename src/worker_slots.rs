//! Worker slots in shared memory: each worker's PID (so a committing backend can set its
//! latch) and its live figures for `outbox.worker_status()`.

use crate::gucs::{self, MAX_SLOTS};
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
    /// The server is a hot standby: nothing is delivered until it is promoted.
    Standby,
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
            Phase::Standby => "standby",
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
    /// the connection failed (the database does not exist), or the worker left a database
    /// that is being dropped: the next start waits for the database, bound to none.
    pub connecting: bool,
    /// The database the worker is connected to (0 before it is).
    pub database_oid: u32,
    /// The worker said in the log that its database or its extension is gone; the next
    /// start waits without saying it again.
    pub told_gone: bool,
    /// Idle although messages are due: its last claim could take none of them (another
    /// worker's attempts fill the channel's room, an earlier message with the same
    /// ordering key is pending). Another worker's record can change that, and wakes it.
    pub starved: bool,
}

#[derive(Debug, Clone, Copy)]
pub struct Slots {
    pub slots: [Slot; MAX_SLOTS],
    /// When a worker of this server first saw it promoted from a hot standby (Unix ms; 0:
    /// never). An attempt claimed before it was claimed on the old primary.
    pub promoted_at_ms: i64,
    /// A stall of `outbox.fault_injection` has stopped a worker since the setting was last
    /// changed: it stops one worker once, not every worker that passes the point.
    pub stall_fired: bool,
}

impl Default for Slots {
    fn default() -> Self {
        Slots {
            slots: [Slot::default(); MAX_SLOTS],
            promoted_at_ms: 0,
            stall_fired: false,
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

/// Copies of the slots of the running workers of this backend's database, but the slot
/// `except`; with `unbound`, also those of workers not connected to a database yet.
fn workers_here(except: Option<usize>, unbound: bool) -> Vec<Slot> {
    let database = u32::from(unsafe { pg_sys::MyDatabaseId });
    SLOTS
        .share()
        .slots
        .iter()
        .enumerate()
        .filter(|(i, s)| {
            Some(*i) != except
                && s.pid > 0
                && (s.database_oid == database || (unbound && s.database_oid == 0))
        })
        .map(|(_, s)| *s)
        .collect()
}

/// Wakes the workers of this database that a COMMIT of an enqueuing transaction wakes
/// ([`to_wake`]).
pub fn wake_workers() {
    if !preloaded() {
        return;
    }
    let phases: Vec<(i32, Phase)> = workers_here(None, true)
        .iter()
        .map(|s| (s.pid, s.phase))
        .collect();
    set_latches(&to_wake(&phases, unsafe { pg_sys::MyProcPid }));
}

/// Wakes one idle worker of this worker's database besides itself, if there is one: called
/// by a worker whose claim came back full, so that a backlog made due at once (one large
/// commit, `resume_channel`, retries due together) is taken by every worker, not by the one
/// a commit woke while the others sleep out their poll interval.
pub fn wake_idle_peer(index: usize) {
    if !preloaded() {
        return;
    }
    let idle: Vec<i32> = workers_here(Some(index), false)
        .iter()
        .filter(|s| s.phase == Phase::Idle)
        .map(|s| s.pid)
        .collect();
    set_latches(pick_one(&idle, unsafe { pg_sys::MyProcPid }).as_slice());
}

/// Wakes the idle workers of this worker's database that wait for messages they could not
/// claim ([`Slot::starved`]): called after a batch is recorded, which may have made room in
/// a channel or settled the message an ordering key waited for. A worker claiming right now
/// is woken too: its claim may be coming back empty for want of that room, and it would go
/// to sleep starved after this wake-up.
pub fn wake_starved_peers(index: usize) {
    if !preloaded() {
        return;
    }
    let pids: Vec<i32> = workers_here(Some(index), false)
        .iter()
        .filter(|s| (s.phase == Phase::Idle && s.starved) || s.phase == Phase::Claiming)
        .map(|s| s.pid)
        .collect();
    set_latches(&pids);
}

/// One of `pids`, which one turning with `turn` (a pid), so that the wake-ups of many
/// backends spread over the workers.
fn pick_one(pids: &[i32], turn: i32) -> Option<i32> {
    (!pids.is_empty()).then(|| pids[turn.unsigned_abs() as usize % pids.len()])
}

fn set_latches(pids: &[i32]) {
    for &pid in pids {
        unsafe {
            let proc_ = pg_sys::BackendPidGetProc(pid);
            if !proc_.is_null() {
                pg_sys::SetLatch(&mut (*proc_).procLatch);
            }
        }
    }
}

/// The workers a commit wakes, of `workers` (pid, phase) of its database: one idle worker
/// (which one turns with the committing backend's pid, so that the wake-ups of many
/// sessions spread), since one claim takes every message due; when none is idle, every
/// worker, so that one that is claiming right now and finds nothing does not go to sleep
/// past this commit. Waking every idle worker for one message made them queue for the
/// claim lock and claim nothing but one.
pub fn to_wake(workers: &[(i32, Phase)], committer: i32) -> Vec<i32> {
    let idle: Vec<i32> = workers
        .iter()
        .filter(|(_, phase)| *phase == Phase::Idle)
        .map(|(pid, _)| *pid)
        .collect();
    match pick_one(&idle, committer) {
        Some(pid) => vec![pid],
        None => workers.iter().map(|(pid, _)| *pid).collect(),
    }
}

/// Updates this worker's slot.
pub fn update(index: usize, f: impl FnOnce(&mut Slot)) {
    if index < MAX_SLOTS {
        f(&mut SLOTS.exclusive().slots[index]);
    }
}

/// A copy of one slot.
pub fn read(index: usize) -> Slot {
    if index < MAX_SLOTS && preloaded() {
        SLOTS.share().slots[index]
    } else {
        Slot::default()
    }
}

/// The time this server was first seen promoted (Unix ms), recorded by the first worker
/// that saw it; every worker gets the same answer.
pub fn promoted_at_ms(seen_now_ms: i64) -> i64 {
    let mut slots = SLOTS.exclusive();
    if slots.promoted_at_ms == 0 {
        slots.promoted_at_ms = seen_now_ms;
    }
    slots.promoted_at_ms
}

/// Whether this worker is the one an armed stall stops: the first to pass its point.
pub fn take_stall() -> bool {
    preloaded() && !std::mem::replace(&mut SLOTS.exclusive().stall_fired, true)
}

/// Arms the stall of `outbox.fault_injection` again, for its next setting.
pub fn rearm_stall() {
    if preloaded() && SLOTS.share().stall_fired {
        SLOTS.exclusive().stall_fired = false;
    }
}

/// The time this server was promoted, when a worker saw it; 0 when it never was.
pub fn promoted_at_ms_if_any() -> i64 {
    if preloaded() {
        SLOTS.share().promoted_at_ms
    } else {
        0
    }
}

pub fn snapshot() -> Vec<Slot> {
    if !preloaded() {
        return Vec::new();
    }
    SLOTS.share().slots.to_vec()
}

/// The name of the database this backend is connected to.
fn current_database() -> String {
    unsafe {
        let name = pg_sys::get_database_name(pg_sys::MyDatabaseId);
        if name.is_null() {
            return String::new();
        }
        std::ffi::CStr::from_ptr(name)
            .to_string_lossy()
            .into_owned()
    }
}

/// `outbox.worker_status()`: one row per worker of the database it is called in.
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
    let database = current_database();
    let databases = gucs::databases();
    let workers = gucs::workers();
    let in_use = gucs::slots_in_use(databases.len(), workers);
    let rows: Vec<_> = snapshot()
        .into_iter()
        .enumerate()
        .take(in_use)
        .filter(|(i, _)| {
            databases.get(gucs::database_index_of_slot(*i, workers)) == Some(&database)
        })
        .map(|(i, s)| {
            let last = (s.last_loop_at_ms > 0)
                .then(|| {
                    pgrx::datum::TimestampWithTimeZone::try_from(
                        crate::clock::timestamptz_of_unix_ms(s.last_loop_at_ms),
                    )
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

extension_sql!(
    r#"COMMENT ON FUNCTION outbox.worker_status() IS
    'One row per delivery worker of the current database: pid, database, state, last loop, in-flight requests and totals since the server started.';"#,
    name = "worker_status_comment",
    requires = [worker_status]
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_commit_wakes_one_idle_worker_turning_with_the_committer() {
        let workers = [
            (11, Phase::Sending),
            (12, Phase::Idle),
            (13, Phase::Idle),
            (14, Phase::Claiming),
        ];
        assert_eq!(to_wake(&workers, 100), vec![12]);
        assert_eq!(to_wake(&workers, 101), vec![13]);
        assert_eq!(to_wake(&workers, -3), vec![13], "any pid picks one");
        let one_idle = [(11, Phase::Recording), (12, Phase::Idle)];
        for committer in 0..5 {
            assert_eq!(to_wake(&one_idle, committer), vec![12]);
        }
    }

    #[test]
    fn one_of_several_turns_with_the_pid_and_none_of_none() {
        assert_eq!(pick_one(&[], 5), None);
        assert_eq!(pick_one(&[7], 123), Some(7));
        let picked: Vec<Option<i32>> = (0..4).map(|turn| pick_one(&[7, 8, 9], turn)).collect();
        assert_eq!(picked, vec![Some(7), Some(8), Some(9), Some(7)]);
        assert_eq!(pick_one(&[7, 8], i32::MIN), Some(7), "no overflow");
    }

    #[test]
    fn with_no_idle_worker_a_commit_wakes_every_worker() {
        let busy = [
            (11, Phase::Claiming),
            (12, Phase::Sending),
            (13, Phase::Recording),
            (14, Phase::Starting),
        ];
        assert_eq!(to_wake(&busy, 7), vec![11, 12, 13, 14]);
        assert!(to_wake(&[], 7).is_empty());
    }
}
