//! Who is calling: the session's role, which decides the tenants a call may act for.
//!
//! Inside a `SECURITY DEFINER` function `current_user` is the function's owner, so the
//! tenant functions of sql/tenancy.sql ask for the *outer* user instead: `session_user`, or
//! the role named by `SET ROLE`. Row-level security and the definer functions therefore
//! agree on one identity.
//!
//! Inside a `sql` effect the worker is the session, and its outer user is the bootstrap
//! superuser it connected as. While an effect runs, the caller is therefore the effect's
//! [`EffectScope`] instead: its `run_as` role, acting for its message's tenant alone. Row-level
//! security, `enqueue` and every function that asks who is calling see that role and that
//! tenant, never the worker's or a superuser's.

use crate::config_cache::SessionCache;
use crate::spi::pinned::{self, PinnedStatement};
use pgrx::pg_sys;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::PgLogLevel;
use std::cell::RefCell;
use std::ffi::CStr;

pub mod acting;
pub use acting::{
    acting_tenant, acting_tenant_of_effect, check_tenant_name, TenantRefusal, MAX_TENANT_BYTES,
};

/// Who a `sql` effect acts as while it runs: its channel's `run_as` role, for its message's
/// tenant alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EffectScope {
    pub role: pg_sys::Oid,
    pub tenant: String,
}

thread_local! {
    /// The effect running now in this process, if any (only the worker runs effects).
    static EFFECT: RefCell<Option<EffectScope>> = const { RefCell::new(None) };
}

/// Clears the effect scope when dropped: after the effect returns, and also when its error
/// unwinds through the caller.
struct ScopeGuard(Option<EffectScope>);

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        let previous = self.0.take();
        EFFECT.with(|e| *e.borrow_mut() = previous);
    }
}

/// Runs `body` (an effect's call) as `scope`: every check of the caller inside it sees the
/// scope's role and tenant.
pub fn within_effect<R>(scope: EffectScope, body: impl FnOnce() -> R) -> R {
    let previous = EFFECT.with(|e| e.borrow_mut().replace(scope));
    let _guard = ScopeGuard(previous);
    body()
}

/// The effect running now, if any.
pub fn current_effect() -> Option<EffectScope> {
    EFFECT.with(|e| e.borrow().clone())
}

/// The calling role: the running effect's role, else the session's (`session_user`, or the
/// role of `SET ROLE`).
fn caller() -> pg_sys::Oid {
    match current_effect() {
        Some(scope) => scope.role,
        None => unsafe { pg_sys::GetOuterUserId() },
    }
}

/// The oid of the calling role (see [`caller`]).
#[pg_extern(stable, parallel_safe)]
fn _caller_oid() -> pg_sys::Oid {
    caller()
}

/// The name of the calling role, for messages.
#[pg_extern(stable, parallel_safe)]
fn _caller_name() -> String {
    unsafe {
        let name = pg_sys::GetUserNameFromId(caller(), true);
        if name.is_null() {
            return String::new();
        }
        CStr::from_ptr(name).to_string_lossy().into_owned()
    }
}

/// Is the calling role a superuser? (A superuser acts for any tenant.) An effect never is:
/// its `run_as` role is refused when it is one.
#[pg_extern(stable, parallel_safe)]
fn _caller_is_superuser() -> bool {
    current_effect().is_none() && unsafe { pg_sys::superuser_arg(pg_sys::GetOuterUserId()) }
}

/// The tenant of the effect running now; NULL outside an effect. Row-level security shows
/// an effect this tenant's rows alone (`outbox._visible_tenants`).
#[pg_extern(stable, parallel_safe)]
fn _effect_tenant() -> Option<String> {
    current_effect().map(|scope| scope.tenant)
}

impl TenantRefusal {
    pub fn raise(self) -> ! {
        let role = quoted_caller_name();
        let (message, detail, hint) = self.text(&role);
        let mut report =
            ErrorReport::new(self.sqlstate(), message, "outbox_delivery").set_hint(hint);
        if let Some(detail) = detail {
            report = report.set_detail(detail);
        }
        report.report(PgLogLevel::ERROR);
        unreachable!("an ERROR report does not return")
    }
}

/// The calling role's name, quoted as an identifier where it needs to be.
fn quoted_caller_name() -> String {
    let name = std::ffi::CString::new(_caller_name()).unwrap_or_default();
    unsafe {
        CStr::from_ptr(pg_sys::quote_identifier(name.as_ptr()))
            .to_string_lossy()
            .into_owned()
    }
}

/// Refuses a tenant name (22023): the rule of `check_tenant_name`, for the SQL functions
/// that take one (`bind_tenant`, `unbind_tenant`).
#[pg_extern(immutable, parallel_safe)]
fn _check_tenant_name(tenant: Option<&str>, argument: &str, star_allowed: bool) {
    if let Err(refusal) = check_tenant_name(tenant, argument, star_allowed) {
        refusal.raise();
    }
}

thread_local! {
    /// The tenants the session's role is bound to, directly or through membership, sorted
    /// (the function row-level security uses too, in sql/tenancy.sql).
    static BINDINGS: PinnedStatement = const { PinnedStatement::new(
        c"SELECT outbox._caller_bindings()",
        &[],
    ) };
}

thread_local! {
    /// The bindings of a role.
    static CACHED_BINDINGS: SessionCache<pg_sys::Oid, Vec<String>> = SessionCache::new();
}

/// The tenants `role` (the session's role) is bound to, directly or through membership,
/// sorted; cached for the session until the bindings, a role or a membership change
/// (`config_cache`).
fn bindings_of(role: pg_sys::Oid) -> Vec<String> {
    let read = || unsafe {
        pinned::connected(|| {
            BINDINGS.with(|s| s.execute(&[]));
            Some(match pinned::column(0, 1) {
                Some(array) => Vec::<String>::from_datum(array, false).unwrap_or_default(),
                None => Vec::new(),
            })
        })
    };
    CACHED_BINDINGS
        .with(|cache| cache.get_or_fill(&role, read))
        .unwrap_or_default()
}

/// The tenant the calling role writes for: `outbox.tenant` if it may act for it, else
/// its one binding; a superuser acts for `outbox.tenant` or `default`; an effect for its
/// message's tenant alone. Raises 42501 (or 22023 for a bad `outbox.tenant`) when it cannot
/// say.
pub fn acting_tenant_of_caller() -> String {
    let named = crate::gucs::tenant();
    if let Some(scope) = current_effect() {
        return match acting_tenant_of_effect(named.as_deref(), &scope.tenant) {
            Ok(tenant) => tenant,
            Err(refusal) => refusal.raise(),
        };
    }
    let role = unsafe { pg_sys::GetOuterUserId() };
    let superuser = unsafe { pg_sys::superuser_arg(role) };
    match acting_tenant(named.as_deref(), superuser, || bindings_of(role)) {
        Ok(tenant) => tenant,
        Err(refusal) => refusal.raise(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_effect_scope_ends_with_its_call_even_when_it_unwinds() {
        let scope = EffectScope {
            role: pg_sys::Oid::from(42u32),
            tenant: "a".into(),
        };
        assert_eq!(current_effect(), None);
        within_effect(scope.clone(), || {
            assert_eq!(current_effect(), Some(scope.clone()))
        });
        assert_eq!(current_effect(), None);
        let unwound = std::panic::catch_unwind(|| {
            within_effect(scope.clone(), || panic!("the effect raised"))
        });
        assert!(unwound.is_err());
        assert_eq!(current_effect(), None);
    }
}
