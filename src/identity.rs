//! The role the worker acts as (`outbox.role`, default `outbox_worker`).
//!
//! A background worker cannot connect as a `NOLOGIN` role before PostgreSQL 17, so the
//! worker connects as the bootstrap superuser and runs every transaction as the configured
//! role inside a *security-restricted operation* — the mechanism PostgreSQL uses when a
//! maintenance command runs another user's code. Code reached from the worker's statements
//! (a trigger planted on an outbox table, a `sql` channel's function) runs without
//! superuser rights and cannot leave that role: `SET ROLE` and `SET SESSION AUTHORIZATION`
//! are refused, and an aborted transaction restores the previous user by itself.

use pgrx::bgworkers::BackgroundWorker;
use pgrx::pg_sys;
use std::ffi::CString;
use std::panic::AssertUnwindSafe;

/// The flags of a switch to a role whose code must not escape it.
const RESTRICTED: i32 =
    (pg_sys::SECURITY_RESTRICTED_OPERATION | pg_sys::SECURITY_LOCAL_USERID_CHANGE) as i32;

/// Why the worker cannot act: the configured role is missing or a superuser.
pub fn check(name: &str) -> Result<pg_sys::Oid, String> {
    let Ok(cname) = CString::new(name) else {
        return Err(format!("outbox.role \"{name}\" is not a valid role name"));
    };
    BackgroundWorker::transaction(|| unsafe {
        let oid = pg_sys::get_role_oid(cname.as_ptr(), true);
        if oid == pg_sys::InvalidOid {
            Err(format!("role \"{name}\" (outbox.role) does not exist"))
        } else if pg_sys::superuser_arg(oid) {
            Err(format!(
                "role \"{name}\" (outbox.role) is a superuser; the worker acts only as a non-superuser role"
            ))
        } else {
            Ok(oid)
        }
    })
}

/// Runs `body` in a transaction, as `role`, in a security-restricted operation, then
/// reports the transaction's table statistics.
pub fn transaction<R>(role: pg_sys::Oid, body: impl FnOnce() -> R) -> R {
    let result = BackgroundWorker::transaction(AssertUnwindSafe(|| {
        // The role may have been made a superuser since the worker checked it.
        if unsafe { pg_sys::superuser_arg(role) } {
            pgrx::error!(
                "outbox.role names a superuser now; the worker stops acting until it is fixed"
            );
        }
        as_role(role, body)
    }));
    report_statistics(false);
    result
}

/// Hands the rows this process inserted, updated and deleted to the statistics that
/// autovacuum reads. A client backend does this whenever it goes idle; a background worker
/// must do it itself, or autovacuum never learns of the dead rows it leaves (the attempt
/// and ledger tables, written only by the worker, would then grow without bound).
/// Unforced, it flushes at most once a second; `force` before the worker sleeps.
pub fn report_statistics(force: bool) {
    unsafe {
        pg_sys::pgstat_report_stat(force);
    }
}

/// Runs `body` as `role` in a security-restricted operation inside the current
/// transaction (an error in `body` rolls back to the enclosing (sub)transaction, which
/// restores the user by itself).
pub fn as_role<R>(role: pg_sys::Oid, body: impl FnOnce() -> R) -> R {
    let (saved_user, saved_context) = current();
    unsafe { pg_sys::SetUserIdAndSecContext(role, saved_context | RESTRICTED) };
    let result = body();
    unsafe { pg_sys::SetUserIdAndSecContext(saved_user, saved_context) };
    result
}

fn current() -> (pg_sys::Oid, i32) {
    let mut user = pg_sys::InvalidOid;
    let mut context = 0;
    unsafe { pg_sys::GetUserIdAndSecContext(&mut user, &mut context) };
    (user, context)
}
