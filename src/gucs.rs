//! Every setting of the extension: private statics, one `init()`, typed getters.
//! Getters read Postgres memory and must only be called on the backend's main thread.

use pgrx::prelude::*;
use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};
use std::ffi::{CStr, CString};
use std::time::Duration;

/// Where the worker deliberately dies, as a crash would, for tests of recovery.
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum FaultPoint {
    #[name = c"none"]
    None,
    /// After the claim transaction committed, before anything is sent.
    #[name = c"crash_after_claim"]
    CrashAfterClaim,
    /// After the request went out and the provider answered, before the answer is read.
    #[name = c"crash_after_send"]
    CrashAfterSend,
    /// After the answer was read and classified, before the record transaction starts.
    #[name = c"crash_after_response"]
    CrashAfterResponse,
    /// Inside the record transaction, after its writes, before COMMIT.
    #[name = c"crash_before_commit"]
    CrashBeforeCommit,
    /// The same four points, where the worker stops itself (`SIGSTOP`) as a paused VM, a
    /// frozen cgroup or `kill -STOP` would stop it, until a `SIGCONT`.
    #[name = c"stall_after_claim"]
    StallAfterClaim,
    #[name = c"stall_after_send"]
    StallAfterSend,
    #[name = c"stall_after_response"]
    StallAfterResponse,
    #[name = c"stall_before_commit"]
    StallBeforeCommit,
    /// Inside the claim transaction, after the claim, before COMMIT, holding the claim lock
    /// and the rows it claimed: a stall only (a crash there rolls the claim back).
    #[name = c"stall_in_claim"]
    StallInClaim,
}

impl FaultPoint {
    pub fn as_str(self) -> &'static str {
        match self {
            FaultPoint::None => "none",
            FaultPoint::CrashAfterClaim => "crash_after_claim",
            FaultPoint::CrashAfterSend => "crash_after_send",
            FaultPoint::CrashAfterResponse => "crash_after_response",
            FaultPoint::CrashBeforeCommit => "crash_before_commit",
            FaultPoint::StallAfterClaim => "stall_after_claim",
            FaultPoint::StallAfterSend => "stall_after_send",
            FaultPoint::StallAfterResponse => "stall_after_response",
            FaultPoint::StallBeforeCommit => "stall_before_commit",
            FaultPoint::StallInClaim => "stall_in_claim",
        }
    }

    /// The stall at the same point as this crash.
    pub fn stall(self) -> FaultPoint {
        match self {
            FaultPoint::CrashAfterClaim => FaultPoint::StallAfterClaim,
            FaultPoint::CrashAfterSend => FaultPoint::StallAfterSend,
            FaultPoint::CrashAfterResponse => FaultPoint::StallAfterResponse,
            FaultPoint::CrashBeforeCommit => FaultPoint::StallBeforeCommit,
            other => other,
        }
    }
}

/// Upper bound of `outbox.workers` (workers of each database served).
pub const MAX_WORKERS: usize = 16;
/// Upper bound of `outbox.http_threads` (threads of one worker's runtime).
pub const MAX_HTTP_THREADS: usize = 16;
/// Worker slots in shared memory: every database served times `outbox.workers`, at most.
pub const MAX_SLOTS: usize = 64;

static DATABASE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c"postgres"));
static WORKERS: GucSetting<i32> = GucSetting::<i32>::new(1);
static HTTP_THREADS: GucSetting<i32> = GucSetting::<i32>::new(1);
static BATCH_SIZE: GucSetting<i32> = GucSetting::<i32>::new(200);
static POLL_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(1000);
static LEASE_MS: GucSetting<i32> = GucSetting::<i32>::new(60_000);
static MAX_PAYLOAD_BYTES: GucSetting<i32> = GucSetting::<i32>::new(1024 * 1024);
static RETENTION_S: GucSetting<i32> = GucSetting::<i32>::new(7 * 24 * 3600);
static LEDGER_RETENTION_S: GucSetting<i32> = GucSetting::<i32>::new(30 * 24 * 3600);
static ALERT_QUEUE_AGE_S: GucSetting<i32> = GucSetting::<i32>::new(300);
static ALERT_ERROR_STREAK: GucSetting<i32> = GucSetting::<i32>::new(10);
static ALERT_UNCERTAIN_AGE_S: GucSetting<i32> = GucSetting::<i32>::new(300);
static ALERT_PAUSED_S: GucSetting<i32> = GucSetting::<i32>::new(3600);
static ALERT_AMBIGUOUS_PCT: GucSetting<i32> = GucSetting::<i32>::new(5);
static ALERT_UNOWNED_S: GucSetting<i32> = GucSetting::<i32>::new(86_400);
static METRICS_CHANNEL_SERIES: GucSetting<i32> = GucSetting::<i32>::new(1000);
static FAULT_INJECTION: GucSetting<FaultPoint> = GucSetting::<FaultPoint>::new(FaultPoint::None);
static WORKER_ROLE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c"outbox_worker"));
static TENANT: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
static ALLOWED_HOSTS: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c"*"));
static METRICS_ADDRESS: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
static METRICS_TOKEN_FILE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

pub fn init() {
    // Postmaster settings can only be defined while shared_preload_libraries is processed;
    // a backend that loads the library on demand (no worker) keeps their defaults.
    if unsafe { pgrx::pg_sys::process_shared_preload_libraries_in_progress } {
        define_postmaster_settings();
    }
    define_runtime_settings();
    define_identity_settings();
}

fn define_postmaster_settings() {
    GucRegistry::define_string_guc(
        c"outbox.metrics_address",
        c"Address (host:port) where a worker of its own serves GET /metrics; empty: none.",
        c"The text of outbox.prometheus() of every database served, with a database label (src/metrics/).",
        &METRICS_ADDRESS,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"outbox.metrics_token_file",
        c"File holding the bearer token GET /metrics must carry; empty: no authentication.",
        c"Read at every request, without its trailing line end; a missing, unreadable or empty file answers 503 (src/metrics/request.rs).",
        &METRICS_TOKEN_FILE,
        GucContext::Postmaster,
        GucFlags::SUPERUSER_ONLY,
    );
    GucRegistry::define_string_guc(
        c"outbox.database",
        c"Databases the delivery workers serve: a comma-separated list.",
        c"Each database gets its own outbox.workers workers; one without the extension is waited for.",
        &DATABASE,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.workers",
        c"Number of delivery workers.",
        c"Each worker claims its own batches with FOR UPDATE SKIP LOCKED.",
        &WORKERS,
        0,
        MAX_WORKERS as i32,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.http_threads",
        c"Threads each delivery worker runs its HTTP and NATS sends on.",
        c"One thread carries a worker's batches on its own; more help when the worker's TLS handshakes or signatures take more than a core.",
        &HTTP_THREADS,
        1,
        MAX_HTTP_THREADS as i32,
        GucContext::Postmaster,
        GucFlags::default(),
    );
}

fn define_runtime_settings() {
    GucRegistry::define_int_guc(
        c"outbox.batch_size",
        c"Messages a worker claims and sends per batch.",
        c"",
        &BATCH_SIZE,
        1,
        5000,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.poll_interval_ms",
        c"Fallback poll interval of an idle worker.",
        c"Workers are woken at COMMIT of an enqueue; the poll catches due retries and anything missed.",
        &POLL_INTERVAL_MS,
        10,
        3_600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"outbox.lease_ms",
        c"How long a claimed message stays leased to its worker.",
        c"A sending message whose lease ran out is recovered as an ambiguous attempt.",
        &LEASE_MS,
        1000,
        86_400_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"outbox.max_payload_bytes",
        c"Largest payload outbox.enqueue accepts, in bytes of its JSON text.",
        c"",
        &MAX_PAYLOAD_BYTES,
        1,
        i32::MAX,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.retention",
        c"How long delivered and cancelled messages (and their attempts) are kept.",
        c"",
        &RETENTION_S,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"outbox.ledger_retention",
        c"How long ledger entries are kept; never shorter than the longest retry horizon.",
        c"",
        &LEDGER_RETENTION_S,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    // Read by outbox.prometheus() (sql/observability.sql).
    GucRegistry::define_int_guc(
        c"outbox.metrics_channel_series",
        c"outbox.prometheus() labels its series by channel while there are at most this many channels.",
        c"Above it, each family is one series summed over every channel (channel=\"*\"): per-channel series are what a Prometheus stores and bills.",
        &METRICS_CHANNEL_SERIES,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::default(),
    );
    define_alert_settings();
}

/// The thresholds of `outbox.alerts`.
fn define_alert_settings() {
    GucRegistry::define_int_guc(
        c"outbox.alert_queue_age_s",
        c"Alert when the oldest due queued message of a channel has waited longer than this many seconds.",
        c"",
        &ALERT_QUEUE_AGE_S,
        1,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.alert_uncertain_age_s",
        c"Alert when an uncertain message on a channel that can reconcile is older than this many seconds.",
        c"On channels that cannot reconcile every uncertain message is an alert at once.",
        &ALERT_UNCERTAIN_AGE_S,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.alert_paused_s",
        c"Alert when a channel has been paused longer than this many seconds.",
        c"A paused channel raises no queue_age alert: its messages wait by design, until someone forgets to resume it.",
        &ALERT_PAUSED_S,
        1,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.alert_ambiguous_pct",
        c"Alert when more than this percentage of a channel's sends in the last hour came out ambiguous.",
        c"Counted over at least 20 sends. Frequent ambiguity points to a timeout shorter than the provider's answers, a gateway in between, or a classification to look at: outbox.ambiguity_review() says which.",
        &ALERT_AMBIGUOUS_PCT,
        0,
        100,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.alert_unowned_s",
        c"Alert when a message has waited in the work queue without an owner for longer than this many seconds.",
        c"Measures the daily review of the work queue: every uncertain, exhausted or failed message should have an owner (outbox.assign) within a day.",
        &ALERT_UNOWNED_S,
        1,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.alert_error_streak",
        c"Alert when this many consecutive attempts on one channel failed.",
        c"",
        &ALERT_ERROR_STREAK,
        1,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::default(),
    );
}

/// The settings of who acts and for whom: the worker's role, the session's tenant, the
/// destinations requests may reach; and the test-only fault injection.
fn define_identity_settings() {
    GucRegistry::define_enum_guc(
        c"outbox.fault_injection",
        c"Test only: make the worker die at a chosen point, as a crash would.",
        c"Fires on the first send attempt of each message claimed while it is set.",
        &FAULT_INJECTION,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"outbox.role",
        c"Role the delivery worker acts as; must not be a superuser.",
        c"Every transaction of the worker runs as this role in a security-restricted operation.",
        &WORKER_ROLE,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"outbox.tenant",
        c"Tenant this session acts for, checked against the role's tenant bindings.",
        c"Needed by roles bound to '*' or to several tenants; see outbox.bind_tenant.",
        &TENANT,
        GucContext::Userset,
        GucFlags::default(),
    );
    // SAFETY: the check hook is a #[pg_guard] function that only reads its argument.
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"outbox.allowed_hosts",
            c"Hosts and addresses http channels may send to (comma-separated).",
            c"Entries: *, a host name, *.domain (subdomains only), an IP address or a CIDR. Link-local, cloud metadata and unspecified addresses are refused unless an IP or CIDR entry lists them. Checked at create_channel/alter_channel and again by the worker on every resolved address.",
            &ALLOWED_HOSTS,
            GucContext::Suset,
            GucFlags::default(),
            Some(check_allowed_hosts),
            None,
            None,
        );
    }
}

pub fn database() -> String {
    DATABASE
        .get()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "postgres".to_string())
}

/// `outbox.metrics_address`; empty when unset.
pub fn metrics_address() -> String {
    METRICS_ADDRESS
        .get()
        .map(|s| s.to_string_lossy().trim().to_string())
        .unwrap_or_default()
}

/// `outbox.metrics_token_file`; empty when unset. A relative path is read from the data
/// directory.
pub fn metrics_token_file() -> String {
    METRICS_TOKEN_FILE
        .get()
        .map(|s| s.to_string_lossy().trim().to_string())
        .unwrap_or_default()
}

pub fn workers() -> usize {
    (WORKERS.get().max(0) as usize).min(MAX_WORKERS)
}

/// The databases of `outbox.database`, in their order, each once.
pub fn databases() -> Vec<String> {
    parse_database_list(&database())
}

/// A comma-separated list of database names: whitespace around a name is ignored, empty
/// entries and repeats are dropped (a database is served by one set of workers).
pub fn parse_database_list(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if !out.iter().any(|n| n == name) {
            out.push(name.to_string());
        }
    }
    out
}

/// The worker slot `slot` of a server with `workers` workers per database: the index of
/// the database it serves, in the order of [`databases`].
pub fn database_index_of_slot(slot: usize, workers: usize) -> usize {
    slot.checked_div(workers).unwrap_or(0)
}

/// The slots to run: `workers` for each of `databases` databases, no more than
/// [`MAX_SLOTS`].
pub fn slots_in_use(databases: usize, workers: usize) -> usize {
    databases.saturating_mul(workers).min(MAX_SLOTS)
}

/// Largest payload `enqueue` accepts (bytes of its JSON text).
/// `outbox.tenant`; `None` when unset or empty.
pub fn tenant() -> Option<String> {
    TENANT
        .get()
        .map(|t| t.to_string_lossy().into_owned())
        .filter(|t| !t.is_empty())
}

pub fn max_payload_bytes() -> i32 {
    MAX_PAYLOAD_BYTES.get()
}

/// Threads of a worker's runtime for its sends (`outbox.http_threads`, 1 by default, never
/// 0). One thread carries a worker's batches: its sends wait on the network, not on a core,
/// and a second thread cost the worker 6–8 % more CPU a delivery in hand-overs and wake-ups
/// between the two (BENCHMARKS.md). One thread runs tokio's current-thread scheduler
/// (`runtime::IoRuntime`), which costs a send less CPU than the multi-thread one.
pub fn http_threads() -> usize {
    (HTTP_THREADS.get().max(1) as usize).min(MAX_HTTP_THREADS)
}

pub fn batch_size() -> usize {
    BATCH_SIZE.get().max(1) as usize
}

pub fn poll_interval() -> Duration {
    Duration::from_millis(POLL_INTERVAL_MS.get().max(10) as u64)
}

pub fn lease_ms() -> i64 {
    LEASE_MS.get().max(1000) as i64
}

pub fn retention_s() -> i64 {
    RETENTION_S.get().max(0) as i64
}

pub fn ledger_retention_s() -> i64 {
    LEDGER_RETENTION_S.get().max(0) as i64
}

pub fn fault_injection() -> FaultPoint {
    FAULT_INJECTION.get()
}

pub fn worker_role() -> String {
    WORKER_ROLE
        .get()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "outbox_worker".to_string())
}

/// Refuses a value of `outbox.allowed_hosts` with an invalid entry (22023, the entry named
/// in the detail); the previous value stays in effect.
#[pg_guard]
extern "C-unwind" fn check_allowed_hosts(
    newval: *mut *mut std::ffi::c_char,
    _extra: *mut *mut std::ffi::c_void,
    _source: pgrx::pg_sys::GucSource::Type,
) -> bool {
    // SAFETY: Postgres passes a valid pointer to the proposed value (a C string or NULL).
    let text = unsafe {
        match newval.as_ref() {
            Some(p) if !p.is_null() => std::ffi::CStr::from_ptr(*p).to_string_lossy(),
            _ => std::borrow::Cow::Borrowed(""),
        }
    };
    match crate::allow_list::AllowList::parse(&text) {
        Ok(_) => true,
        Err(e) => {
            let detail = CString::new(format!("outbox.allowed_hosts: {e}.")).unwrap_or_default();
            let hint = CString::new(crate::allow_list::LIST_FORMS).unwrap_or_default();
            // SAFETY: the strings are copied into the current memory context, as the GUC
            // machinery expects of a check hook.
            unsafe {
                pgrx::pg_sys::GUC_check_errcode(
                    PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE as std::ffi::c_int,
                );
                pgrx::pg_sys::GUC_check_errdetail_string = pgrx::pg_sys::pstrdup(detail.as_ptr());
                pgrx::pg_sys::GUC_check_errhint_string = pgrx::pg_sys::pstrdup(hint.as_ptr());
            }
            false
        }
    }
}

/// The text of `outbox.allowed_hosts` (parse it with `allow_list::AllowList::parse`).
pub fn allowed_hosts() -> String {
    ALLOWED_HOSTS
        .get()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Sets any setting (ours or PostgreSQL's) until the current GUC nest level is closed: the
/// worker's kept statements run under planner settings of their own, and a `sql` effect
/// under its timeout and search path, each in a nest level that `AtEOXact_GUC` closes.
///
/// # Safety
/// Inside a transaction, after `pg_sys::NewGUCNestLevel`.
pub unsafe fn set_in_nest(name: &CStr, value: &CStr) {
    pg_sys::set_config_option(
        name.as_ptr(),
        value.as_ptr(),
        pg_sys::GucContext::PGC_USERSET,
        pg_sys::GucSource::PGC_S_SESSION,
        pg_sys::GucAction::GUC_ACTION_SAVE,
        true,
        0,
        false,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_list_ignores_whitespace_empty_entries_and_repeats() {
        assert_eq!(parse_database_list("app"), vec!["app"]);
        assert_eq!(
            parse_database_list(" app , billing,\tsearch "),
            vec!["app", "billing", "search"]
        );
        assert_eq!(parse_database_list("a,,b, ,a"), vec!["a", "b"]);
        assert!(parse_database_list(" , ").is_empty());
        assert!(parse_database_list("").is_empty());
    }

    #[test]
    fn slots_go_to_databases_in_blocks_of_workers() {
        assert_eq!(database_index_of_slot(0, 2), 0);
        assert_eq!(database_index_of_slot(1, 2), 0);
        assert_eq!(database_index_of_slot(2, 2), 1);
        assert_eq!(database_index_of_slot(5, 2), 2);
        assert_eq!(database_index_of_slot(3, 0), 0);
    }

    #[test]
    fn slots_in_use_never_exceed_shared_memory() {
        assert_eq!(slots_in_use(3, 2), 6);
        assert_eq!(slots_in_use(1, 16), 16);
        assert_eq!(slots_in_use(10, 16), MAX_SLOTS);
        assert_eq!(slots_in_use(0, 4), 0);
    }
}
