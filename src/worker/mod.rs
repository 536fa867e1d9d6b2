//! The delivery workers: `outbox.workers` background workers in each database named by
//! `outbox.database`, each of which claims due messages, sends them with no transaction
//! open, and records the outcome and the ledger entry in one local transaction. On a hot
//! standby they deliver nothing until the server is promoted (`standby`); a database or an
//! extension that comes or goes is waited for or left (`served_database`).

pub mod claim;
pub mod claim_cursor;
pub mod claim_release;
pub mod claimed;
pub mod claims_upkeep;
pub mod cycle;
pub mod decide;
pub mod descriptors;
pub mod due_channels;
pub mod flight;
pub mod flow;
pub mod key_hold;
pub mod lane_turns;
pub mod lease;
pub mod liveness;
pub mod record;
pub mod recovery;
pub mod retention;
pub mod schema_version;
pub mod send;
pub mod standby;
pub mod sweep;

use crate::clock::now_ms;
use crate::gucs;
use crate::worker_slots as slots;
use crate::{identity, runtime, served_database};
use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, SignalWakeFlags,
};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::ffi::CStr;
use std::time::{Duration, Instant};

/// How long the postmaster waits before restarting a worker that exited with an error.
const RESTART_AFTER: Duration = Duration::from_secs(1);
/// How often a worker that waits for its database or the extension looks again.
const WAIT_FOR_SETUP: Duration = Duration::from_secs(2);
/// How often retention runs.
const RETENTION_EVERY: Duration = Duration::from_secs(10);
/// Longest sleep of a connected worker: it looks at least this often whether its database
/// is being dropped (DROP DATABASE waits five seconds for the sessions to leave).
const LOOK_AROUND_EVERY: Duration = Duration::from_secs(1);

/// Registers the workers, `outbox.workers` for each database of `outbox.database`; only
/// when loaded through shared_preload_libraries. They start once a standby is consistent.
pub fn register() {
    if !unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        return;
    }
    slots::init_shmem();
    liveness::init_shmem();
    let databases = gucs::databases();
    let workers = gucs::workers();
    let in_use = gucs::slots_in_use(databases.len(), workers);
    if in_use < databases.len() * workers {
        warning!(
            "outbox_delivery: {} databases times outbox.workers = {workers} is more than {} workers; only the first {in_use} are started",
            databases.len(),
            gucs::MAX_SLOTS
        );
    }
    for slot in 0..in_use {
        let database = &databases[gucs::database_index_of_slot(slot, workers)];
        BackgroundWorkerBuilder::new(&format!("outbox_delivery worker {slot} ({database})"))
            .set_type("outbox_delivery worker")
            .set_library("outbox_delivery")
            .set_function("outbox_delivery_worker_main")
            .set_argument(Some(pg_sys::Datum::from(slot as i64)))
            .enable_spi_access()
            .set_start_time(BgWorkerStartTime::ConsistentState)
            .set_restart_time(Some(RESTART_AFTER))
            .load();
    }
}

/// The database worker slot `index` serves.
fn database_of(index: usize) -> String {
    let databases = gucs::databases();
    let at = gucs::database_index_of_slot(index, gucs::workers());
    databases.get(at).cloned().unwrap_or_default()
}

#[pg_guard]
unsafe extern "C-unwind" fn clear_slot(_code: i32, arg: pg_sys::Datum) {
    let index = arg.value();
    slots::update(index, |s| {
        s.pid = 0;
        s.phase = slots::Phase::Stopped;
        s.in_flight = 0;
    });
}

fn log_settings(index: usize, database: &str) {
    log!(
        "outbox_delivery worker {index} settings: database={database} workers={} batch_size={} poll_interval_ms={} lease_ms={} retention={}s ledger_retention={}s fault_injection={} synchronous_commit={}",
        gucs::workers(),
        gucs::batch_size(),
        gucs::poll_interval().as_millis(),
        gucs::lease_ms(),
        gucs::retention_s(),
        gucs::ledger_retention_s(),
        gucs::fault_injection().as_str(),
        current_setting(c"synchronous_commit")
    );
}

/// A setting's value in this session, as `SHOW` gives it.
fn current_setting(name: &CStr) -> String {
    unsafe {
        let value = pg_sys::GetConfigOption(name.as_ptr(), true, false);
        if value.is_null() {
            String::new()
        } else {
            CStr::from_ptr(value).to_string_lossy().into_owned()
        }
    }
}

use crate::spi::PINNED_SEARCH_PATH;

/// Pins the session's search path to [`PINNED_SEARCH_PATH`] and its `plan_cache_mode` to
/// `force_generic_plan`, the settings the worker's kept statements run under, after handing
/// the database's own (its defaults, or `ALTER DATABASE … SET`) to the `sql` effects, which
/// run under them. A session-level setting outranks the database's and the role's; effects
/// cannot change it for longer than their call (`channels::sql_effect::call_effect`), and a
/// kept statement sets what the session does not hold for its own run
/// (`spi::statement::run`): sequential scans off, and a plan made at every run for the few
/// statements planned so.
fn pin_session_settings() {
    unsafe {
        for (name, pinned) in [
            (c"search_path", PINNED_SEARCH_PATH),
            (c"plan_cache_mode", c"force_generic_plan"),
        ] {
            let current = pg_sys::GetConfigOption(name.as_ptr(), true, false);
            if !current.is_null() {
                crate::channels::sql_effect::set_effect_setting(name, CStr::from_ptr(current));
            }
            pg_sys::SetConfigOption(
                name.as_ptr(),
                pinned.as_ptr(),
                pg_sys::GucContext::PGC_USERSET,
                pg_sys::GucSource::PGC_S_SESSION,
            );
        }
        for (name, pinned) in SESSION_PINS {
            pg_sys::SetConfigOption(
                name.as_ptr(),
                pinned.as_ptr(),
                pg_sys::GucContext::PGC_SUSET,
                pg_sys::GucSource::PGC_S_SESSION,
            );
        }
    }
}

/// Settings that decide whether the worker's own statements succeed, pinned for its
/// session over what `ALTER DATABASE … SET`, `ALTER ROLE … SET` or postgresql.conf say: a
/// `lock_timeout` or `statement_timeout` meant for applications would fail the record of
/// answers the worker holds, a read-only default would fail every claim, a stricter
/// isolation would fail claims and records with serialization errors, and
/// `session_replication_role = replica` would silence the extension's own triggers. The
/// worker bounds its own waits (`worker_locks`, the effects' `timeout_ms`).
/// Taken from the configuration on purpose: `synchronous_commit` (at least `on`,
/// [`durable_commit_level`]), and what changes no outcome (`work_mem`, logging settings).
const SESSION_PINS: [(&CStr, &CStr); 8] = [
    (c"lock_timeout", c"0"),
    (c"statement_timeout", c"0"),
    (c"idle_in_transaction_session_timeout", c"0"),
    (c"default_transaction_read_only", c"off"),
    (c"default_transaction_isolation", c"read committed"),
    (c"default_transaction_deferrable", c"off"),
    (c"session_replication_role", c"origin"),
    (c"row_security", c"on"),
];

/// The `synchronous_commit` a worker commits with, given the one its configuration sets
/// (the server's, its database's or its role's): that one, except `off`. A claim must be on
/// disk before its request leaves: a claim lost in a crash after its send would let the
/// message go out again as if it had never been tried. `local` and the levels that wait for
/// standbys already flush the claim here first.
fn durable_commit_level(configured: &str) -> &str {
    if configured.eq_ignore_ascii_case("off") {
        "on"
    } else {
        configured
    }
}

/// Sets the session's `synchronous_commit` to [`durable_commit_level`] of the configured one
/// (the value `RESET` would restore, which a reload of the configuration updates under the
/// session's setting).
fn pin_durable_commits() {
    unsafe {
        let configured = pg_sys::GetConfigOptionResetString(c"synchronous_commit".as_ptr());
        let configured = if configured.is_null() {
            "on".to_string()
        } else {
            CStr::from_ptr(configured).to_string_lossy().into_owned()
        };
        let level = std::ffi::CString::new(durable_commit_level(&configured)).unwrap_or_default();
        pg_sys::SetConfigOption(
            c"synchronous_commit".as_ptr(),
            level.as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
        );
    }
}

/// Reloads the configuration after SIGHUP; true when it did.
fn reload_config_if_asked(index: usize) -> bool {
    if BackgroundWorker::sighup_received() {
        unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
        pin_durable_commits();
        if gucs::fault_injection() == gucs::FaultPoint::None {
            slots::rearm_stall();
        }
        log_settings(index, &database_of(index));
        return true;
    }
    false
}

/// The sleep of a connected worker that waits: at most [`LOOK_AROUND_EVERY`], then it
/// leaves a database that is being dropped. False when the worker must stop.
fn pause_connected(index: usize, timeout: Duration) -> bool {
    if !sleep(timeout.min(LOOK_AROUND_EVERY)) {
        return false;
    }
    if let served_database::Surroundings::DatabaseLeaving = served_database::look_around() {
        served_database::leave_if_gone(
            index,
            &database_of(index),
            served_database::Surroundings::DatabaseLeaving,
        );
    }
    true
}

/// The role of `outbox.role`; while it is missing or a superuser the worker does nothing
/// but say so (once for each problem) and wait for the setting or the role to be fixed.
fn wait_for_role(index: usize) -> pg_sys::Oid {
    let mut told: Option<String> = None;
    loop {
        let name = gucs::worker_role();
        match identity::check(&name) {
            Ok(oid) => {
                if told.is_some() {
                    log!("outbox_delivery worker {index}: acting as role \"{name}\" now");
                }
                return oid;
            }
            Err(why) => {
                if told.as_deref() != Some(why.as_str()) {
                    log!("outbox_delivery worker {index}: {why}; delivering nothing until outbox.role names a non-superuser role");
                    slots::update(index, |s| s.phase = slots::Phase::WaitingForRole);
                    told = Some(why);
                }
            }
        }
        if !pause_connected(index, WAIT_FOR_SETUP) {
            stop(index);
        }
        reload_config_if_asked(index);
    }
}

/// Waits on the latch, and on `bell` when given, at most `timeout`: true when the latch
/// was set (a wake-up at commit, a signal), false when the bell rang or the time ran out.
pub(super) fn latch_set_within(bell: Option<&flight::Bell>, timeout: Duration) -> bool {
    let wake = (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32;
    let timeout = timeout.as_millis().max(1) as std::ffi::c_long;
    let set = unsafe {
        // Without a bell, the latch's own wait set; with one, a set made for this wait.
        let events = match bell {
            None => pg_sys::WaitLatch(pg_sys::MyLatch, wake, timeout, pg_sys::PG_WAIT_EXTENSION),
            Some(bell) => pg_sys::WaitLatchOrSocket(
                pg_sys::MyLatch,
                wake | pg_sys::WL_SOCKET_READABLE as i32,
                bell.fd(),
                timeout,
                pg_sys::PG_WAIT_EXTENSION,
            ),
        };
        pg_sys::ResetLatch(pg_sys::MyLatch);
        events & pg_sys::WL_LATCH_SET as i32 != 0
    };
    pg_sys::check_for_interrupts!();
    set
}

/// An idle worker's sleep: until `timeout` has passed or the worker is woken, with no
/// cycle in between; every [`LOOK_AROUND_EVERY`] it looks whether its database is being
/// dropped. False when the worker must stop.
fn idle(index: usize, database: &str, timeout: Duration) -> bool {
    let until = Instant::now() + timeout;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || latch_set_within(None, left.min(LOOK_AROUND_EVERY)) || stop_requested()
        {
            return !stop_requested();
        }
        served_database::leave_if_gone(index, database, served_database::look_around());
    }
}

/// Sleeps on the latch; false when the worker must stop.
fn sleep(timeout: Duration) -> bool {
    let _ = BackgroundWorker::wait_latch(Some(timeout.max(Duration::from_millis(1))));
    !stop_requested()
}

/// Whether the worker was asked to stop (SIGTERM: a fast or smart shutdown,
/// `pg_terminate_backend`). Reads the flag the signal handler sets and nothing clears:
/// `BackgroundWorker::sigterm_received()` clears its own flag when read, and
/// `wait_latch` reads it too, so a SIGTERM that arrived during a busy cycle was consumed
/// by the next latch check and the worker kept delivering through the shutdown.
pub(super) fn stop_requested() -> bool {
    unsafe { (&raw const pg_sys::ShutdownRequestPending).read_volatile() != 0 }
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn outbox_delivery_worker_main(arg: pg_sys::Datum) {
    let index = arg.value();
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let pid = unsafe { pg_sys::MyProcPid };
    slots::update(index, |s| {
        *s = slots::Slot {
            pid,
            phase: slots::Phase::Starting,
            connecting: s.connecting,
            told_gone: s.told_gone,
            ..Default::default()
        }
    });
    unsafe { pg_sys::on_shmem_exit(Some(clear_slot), pg_sys::Datum::from(index)) };
    // The lease of everything this process claims is its beat (`liveness`).
    if let Err(e) = liveness::start_beating(index) {
        log!("outbox_delivery worker {index}: could not start the thread that beats for its leases: {e}");
        unsafe { pg_sys::proc_exit(1) };
    }

    let database = database_of(index);
    connect(index, &database);
    let (runtime, bell) = prepare_session(index, &database);
    if !standby::wait_for_promotion(index, &database, sleep) {
        stop(index);
    }
    wait_for_schema(index, &database);
    let role = wait_for_role(index);
    slots::update(index, |s| s.told_gone = false);
    deliver(cycle::Worker::new(index, pid, runtime, bell, role));
}

/// Connects to `database`. A worker that died while connecting (the database does not
/// exist) or that left its database (it was being dropped) comes back in probe mode: bound
/// to no database, it watches pg_database and restarts itself once the database can be
/// served, instead of failing at every restart.
fn connect(index: usize, database: &str) {
    if slots::read(index).connecting {
        BackgroundWorker::connect_worker_to_spi(None, None);
        slots::update(index, |s| s.phase = slots::Phase::WaitingForDatabase);
        if !slots::read(index).told_gone {
            log!("outbox_delivery worker {index}: database \"{database}\" does not exist yet; waiting (see outbox.database)");
        }
        while !served_database::can_serve(database) {
            if !sleep(WAIT_FOR_SETUP) {
                stop(index);
            }
        }
        log!("outbox_delivery worker {index}: database \"{database}\" exists now; restarting to connect");
        slots::update(index, |s| {
            s.connecting = false;
            s.told_gone = false;
        });
        unsafe { pg_sys::proc_exit(1) };
    }
    slots::update(index, |s| s.connecting = true);
    BackgroundWorker::connect_worker_to_spi(Some(database), None);
    let oid = u32::from(unsafe { pg_sys::MyDatabaseId });
    slots::update(index, |s| {
        s.connecting = false;
        s.database_oid = oid;
    });
}

/// The session's settings, its descriptors and its HTTP runtime.
fn prepare_session(
    index: usize,
    database: &str,
) -> (runtime::IoRuntime, std::sync::Arc<flight::Bell>) {
    // Many short statements: a JIT compilation (triggered by a misestimate on a large
    // table) would cost more than any query it speeds up.
    unsafe {
        pg_sys::SetConfigOption(
            c"jit".as_ptr(),
            c"off".as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_OVERRIDE,
        );

        // Every statement of the worker runs as the non-superuser outbox.role (see
        // identity.rs); is_superuser says so to the code it reaches, as after SET ROLE.
        pg_sys::SetConfigOption(
            c"is_superuser".as_ptr(),
            c"off".as_ptr(),
            pg_sys::GucContext::PGC_INTERNAL,
            pg_sys::GucSource::PGC_S_OVERRIDE,
        );
    }
    pin_session_settings();
    pin_durable_commits();

    // Sockets to providers must not take the descriptors PostgreSQL counts on: the sends
    // under way, lingering ones included, and as many idle connections as one batch uses
    // kept for the next one.
    descriptors::make_room_for_sockets(
        index,
        (flight::most_sends(gucs::batch_size()) + gucs::batch_size()) as u64,
    );
    let runtime = match runtime::IoRuntime::build(gucs::http_threads()) {
        Ok(r) => r,
        Err(e) => {
            log!("outbox_delivery worker {index}: could not start its HTTP runtime: {e}");
            unsafe { pg_sys::proc_exit(1) }
        }
    };
    // The operating system's CA store is read now, once for the process, rather than
    // when the worker builds its first HTTP client, in front of that channel's first
    // request (about 11 ms for Debian's store).
    crate::channels::tls::system_roots();
    let bell = match flight::Bell::new() {
        Ok(b) => b,
        Err(e) => {
            log!("outbox_delivery worker {index}: could not open the eventfd its sends ring: {e}");
            unsafe { pg_sys::proc_exit(1) }
        }
    };
    log_settings(index, database);
    (runtime, bell)
}

/// The delivery loop: a cycle, retention now and then, and a sleep when nothing was due.
fn deliver(mut worker: cycle::Worker) -> ! {
    let index = worker.index();
    let database = database_of(index);
    let mut last_retention = Instant::now() - RETENTION_EVERY;
    let mut upkeep = claims_upkeep::Upkeep::default();
    let upkeep_memory = claims_upkeep::Workspace::create();
    // The worker looks around after a cycle, at most once a second: the look is a
    // transaction of its own, which before a cycle would sit between a commit that woke the
    // worker and the request. A step that fails because the extension was dropped looks at
    // once (`guarded`); an idle worker looks every second of its sleep (`idle`).
    let mut last_look = Instant::now();
    loop {
        if reload_config_if_asked(index) {
            // The batches under way are recorded as the role they were claimed as.
            guarded(index, &database, "delivery cycle", || worker.land_all());
            worker.role = wait_for_role(index);
        }
        if stop_requested() {
            break;
        }
        let report = guarded(index, &database, "delivery cycle", || worker.run_once());
        if last_look.elapsed() >= LOOK_AROUND_EVERY {
            served_database::leave_if_gone(index, &database, served_database::look_around());
            last_look = Instant::now();
        }
        guarded(index, &database, "holding behind ordering keys", || {
            worker.hold_keys()
        });
        if last_retention.elapsed() >= RETENTION_EVERY {
            guarded(index, &database, "retention", || worker.retention());
            last_retention = Instant::now();
        }
        if upkeep.due(Instant::now(), worker.claims_made()) {
            guarded(index, &database, "vacuum of the claims", || {
                claims_upkeep::vacuum_claims(&upkeep_memory)
            });
            upkeep.done(Instant::now(), worker.claims_made());
        }
        if report.busy {
            // Batches are under way, or more may be due: the next cycle waits for them,
            // claims again or learns when the next message is due.
            pg_sys::check_for_interrupts!();
            if stop_requested() {
                break;
            }
            continue;
        }
        let (timeout, starved) = idle_wait(report.next_due, now_ms(), gucs::poll_interval());
        slots::update(index, |s| {
            s.phase = slots::Phase::Idle;
            s.starved = starved;
        });
        identity::report_statistics(true);
        if !idle(index, &database, timeout) {
            break;
        }
    }
    // What was sent is recorded before the worker stops: a fast shutdown waits for it.
    guarded(index, &database, "delivery cycle", || worker.land_all());
    stop(index);
}

/// How long an idle worker sleeps, and whether it is starved: messages were due at its claim,
/// which came back empty, and it could not take them. Then it sleeps until another worker's
/// record or a commit wakes it, and at most [`sweep::SWEEP_EVERY_MS`]: claiming again a
/// millisecond later would take nothing either, a thousand times a second for as long as
/// an ordering key waits behind an uncertain message. Otherwise until the next message is
/// due, within the poll interval, and at least a millisecond: a time that was ahead at the
/// claim and has passed since (a rate-limited channel's next token, a few milliseconds
/// away) is claimed at once, not after a starved worker's wait.
pub(super) fn idle_wait(
    next_due: Option<claim::NextDue>,
    now_ms: i64,
    poll: Duration,
) -> (Duration, bool) {
    let poll_ms = poll.as_millis().max(1) as i64;
    match next_due {
        Some(due) if due.starved => (
            Duration::from_millis(sweep::SWEEP_EVERY_MS.min(poll_ms) as u64),
            true,
        ),
        Some(due) => (
            Duration::from_millis((due.at_ms - now_ms).clamp(1, poll_ms) as u64),
            false,
        ),
        None => (poll, false),
    }
}

/// Waits until the extension exists in `database` and its schema is the version this
/// library expects (`ALTER EXTENSION … UPDATE` has run); stops the worker when asked to.
/// A worker that said its extension was dropped waits without saying it again.
fn wait_for_schema(index: usize, database: &str) {
    let mut waited_for_extension = false;
    while !served_database::extension_exists() {
        if !waited_for_extension {
            if !slots::read(index).told_gone {
                log!("outbox_delivery worker {index}: extension outbox_delivery is not created in \"{database}\" yet; waiting");
            }
            slots::update(index, |s| s.phase = slots::Phase::WaitingForExtension);
            waited_for_extension = true;
        }
        if !pause_connected(index, WAIT_FOR_SETUP) {
            stop(index);
        }
        let _ = reload_config_if_asked(index);
    }
    if waited_for_extension && slots::read(index).told_gone {
        log!("outbox_delivery worker {index}: extension outbox_delivery was created in \"{database}\"; delivering");
    }
    let waited = schema_version::wait_until_current(index, || {
        let go_on = pause_connected(index, WAIT_FOR_SETUP);
        let _ = reload_config_if_asked(index);
        go_on
    });
    if !waited {
        stop(index);
    }
}

/// Runs one step of the worker; an error in it (which rolls its transaction back) is
/// written to the server log with its SQLSTATE, and the worker exits to be restarted. A
/// step that failed because its database or its extension is going away says that instead,
/// once (`served_database`).
fn guarded<R>(index: usize, database: &str, what: &str, f: impl FnOnce() -> R) -> R {
    PgTryBuilder::new(std::panic::AssertUnwindSafe(f))
        .catch_others(|caught| {
            let (code, message) = crate::error::sqlstate_and_message(&caught);
            served_database::leave_if_gone(index, database, served_database::after_failure());
            let hint = if code == "42703" || code == "42P01" || code == "42883" {
                " (the extension's SQL objects do not match the installed library: update or recreate the extension)"
            } else {
                ""
            };
            log!("outbox_delivery worker {index}: {what} failed: SQLSTATE {code}: {message}{hint}; restarting");
            unsafe { pg_sys::proc_exit(1) }
        })
        .execute()
}

/// Stops the worker. The exit code is 1 so that the postmaster restarts a worker that was
/// terminated on its own (pg_terminate_backend); at server shutdown nothing is restarted.
/// A worker terminated by `DROP DATABASE … WITH (FORCE)` leaves its database as for a
/// plain `DROP DATABASE`.
fn stop(index: usize) -> ! {
    if slots::read(index).database_oid != 0 && !standby::in_recovery() {
        if let served_database::Surroundings::DatabaseLeaving = served_database::look_around() {
            served_database::leave_if_gone(
                index,
                &database_of(index),
                served_database::Surroundings::DatabaseLeaving,
            );
        }
    }
    log!("outbox_delivery worker {index}: stopping");
    unsafe { pg_sys::proc_exit(1) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLL: Duration = Duration::from_millis(1000);

    fn ahead(at_ms: i64) -> Option<claim::NextDue> {
        Some(claim::NextDue {
            at_ms,
            starved: false,
        })
    }

    fn starved(at_ms: i64) -> Option<claim::NextDue> {
        Some(claim::NextDue {
            at_ms,
            starved: true,
        })
    }

    #[test]
    fn an_idle_worker_sleeps_until_the_next_due_time_within_the_poll() {
        assert_eq!(idle_wait(None, 5_000, POLL), (POLL, false));
        assert_eq!(
            idle_wait(ahead(5_040), 5_000, POLL),
            (Duration::from_millis(40), false)
        );
        assert_eq!(idle_wait(ahead(9_000), 5_000, POLL), (POLL, false));
        assert_eq!(
            idle_wait(ahead(5_001), 5_000, POLL),
            (Duration::from_millis(1), false)
        );
    }

    #[test]
    fn a_due_time_ahead_at_the_claim_and_passed_since_is_claimed_at_once() {
        // A rate-limited channel's next token, 8 ms after its claim's gate, when the claim's
        // commit took longer.
        assert_eq!(
            idle_wait(ahead(5_000), 5_000, POLL),
            (Duration::from_millis(1), false)
        );
        assert_eq!(
            idle_wait(ahead(4_990), 5_000, POLL),
            (Duration::from_millis(1), false)
        );
        assert_eq!(
            idle_wait(ahead(-1), 5_000, POLL),
            (Duration::from_millis(1), false)
        );
    }

    #[test]
    fn a_worker_commits_durably_at_the_level_configured_unless_it_is_off() {
        assert_eq!(durable_commit_level("off"), "on");
        assert_eq!(durable_commit_level("OFF"), "on");
        for kept in ["on", "local", "remote_write", "remote_apply"] {
            assert_eq!(durable_commit_level(kept), kept);
        }
    }

    #[test]
    fn a_worker_whose_claim_could_take_nothing_due_waits_to_be_woken() {
        let wait = Duration::from_millis(sweep::SWEEP_EVERY_MS as u64);
        assert_eq!(idle_wait(starved(5_000), 5_000, POLL), (wait, true));
        assert_eq!(idle_wait(starved(-1), 5_000, POLL), (wait, true));
        assert_eq!(
            idle_wait(starved(4_000), 5_000, Duration::from_millis(10)),
            (Duration::from_millis(10), true),
            "never longer than the poll interval"
        );
    }
}
