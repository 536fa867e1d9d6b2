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
use crate::pinned_statement::{self, PinnedStatement};
use pgrx::pg_sys;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::{PgLogLevel, PgSqlErrorCode};
use std::cell::RefCell;
use std::ffi::CStr;

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

/// A tenant name is 1 to this many bytes long.
pub const MAX_TENANT_BYTES: usize = 128;

/// Why a call may not act for a tenant, as the caller sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantRefusal {
    /// NULL, empty, too long, or with a control character (22023). `length` is `None` for
    /// NULL.
    BadName {
        argument: String,
        length: Option<usize>,
    },
    /// `'*'` where one tenant is needed (22023).
    StarIsNotATenant { argument: String },
    /// `outbox.tenant` names a tenant the role is not bound to (42501).
    NotBound { tenant: String, bound: Vec<String> },
    /// The role is bound to no tenant (42501).
    Unbound,
    /// Several tenants, or `'*'`, and `outbox.tenant` names none (42501).
    Ambiguous { bound: Vec<String> },
}

/// Checks a tenant name: 1 to 128 bytes, no control characters; `'*'` only where
/// `star_allowed` (a binding, not a tenant).
pub fn check_tenant_name(
    name: Option<&str>,
    argument: &str,
    star_allowed: bool,
) -> Result<(), TenantRefusal> {
    let bad = |length| TenantRefusal::BadName {
        argument: argument.to_string(),
        length,
    };
    match name {
        None => Err(bad(None)),
        Some(n) if n.is_empty() || n.len() > MAX_TENANT_BYTES => Err(bad(Some(n.len()))),
        Some(n) if n.chars().any(crate::outbox::enqueue_check::is_control) => {
            Err(bad(Some(n.len())))
        }
        Some("*") if !star_allowed => Err(TenantRefusal::StarIsNotATenant {
            argument: argument.to_string(),
        }),
        Some(_) => Ok(()),
    }
}

/// The tenant an effect acts for: its message's tenant, whatever it names. Naming another
/// tenant in `outbox.tenant` is refused (42501), as for a role not bound to it.
pub fn acting_tenant_of_effect(
    named: Option<&str>,
    scope_tenant: &str,
) -> Result<String, TenantRefusal> {
    match named {
        None => Ok(scope_tenant.to_string()),
        Some(tenant) if tenant == scope_tenant => Ok(tenant.to_string()),
        Some(tenant) => {
            check_tenant_name(named, "outbox.tenant", false)?;
            Err(TenantRefusal::NotBound {
                tenant: tenant.to_string(),
                bound: vec![scope_tenant.to_string()],
            })
        }
    }
}

/// The tenant a call acts for. `named` is `outbox.tenant` (`None` when unset or empty);
/// `bindings` gives the tenants the role is bound to, directly or through membership
/// (`'*'` included), and is asked only for a role that is not a superuser.
pub fn acting_tenant(
    named: Option<&str>,
    superuser: bool,
    bindings: impl FnOnce() -> Vec<String>,
) -> Result<String, TenantRefusal> {
    if named.is_some() {
        check_tenant_name(named, "outbox.tenant", false)?;
    }
    if superuser {
        return Ok(named.unwrap_or("default").to_string());
    }
    let bound = bindings();
    let star = bound.iter().any(|b| b == "*");
    if let Some(tenant) = named {
        if star || bound.iter().any(|b| b == tenant) {
            return Ok(tenant.to_string());
        }
        return Err(TenantRefusal::NotBound {
            tenant: tenant.to_string(),
            bound,
        });
    }
    let mut tenants = bound.iter().filter(|b| *b != "*");
    match (tenants.next(), tenants.next(), star) {
        (Some(one), None, false) => Ok(one.clone()),
        _ if bound.is_empty() => Err(TenantRefusal::Unbound),
        _ => Err(TenantRefusal::Ambiguous { bound }),
    }
}

impl TenantRefusal {
    pub fn sqlstate(&self) -> PgSqlErrorCode {
        match self {
            TenantRefusal::BadName { .. } | TenantRefusal::StarIsNotATenant { .. } => {
                PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE
            }
            _ => PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
        }
    }

    /// Message, detail and hint; `role` is the calling role, quoted as an identifier.
    pub fn text(&self, role: &str) -> (String, Option<String>, &'static str) {
        let bound_to = |bound: &[String]| match bound.is_empty() {
            true => "The role is bound to no tenant.".to_string(),
            false => format!("The role is bound to {}.", bound.join(", ")),
        };
        match self {
            TenantRefusal::BadName { argument, length } => (
                format!("{argument} must be a tenant name of 1 to {MAX_TENANT_BYTES} bytes without control characters"),
                Some(match length {
                    None => format!("{argument} is NULL."),
                    Some(n) => format!("{argument} is {n} bytes long."),
                }),
                "Tenants are short names such as 'acme' or a UUID; a single-tenant install uses 'default'.",
            ),
            TenantRefusal::StarIsNotATenant { argument } => (
                format!("{argument} must name one tenant; '*' is a binding, not a tenant"),
                None,
                "SET outbox.tenant to the tenant this connection works for.",
            ),
            TenantRefusal::NotBound { tenant, bound } => (
                format!("role {role} may not act for tenant \"{tenant}\""),
                Some(bound_to(bound)),
                "An outbox_admin binds roles to tenants with outbox.bind_tenant(role, tenant).",
            ),
            TenantRefusal::Unbound => (
                format!("role {role} is bound to no tenant"),
                None,
                "An outbox_admin binds it: SELECT outbox.bind_tenant(role, 'default') for a single-tenant install.",
            ),
            TenantRefusal::Ambiguous { bound } => (
                format!("role {role} acts for several tenants; name one with SET outbox.tenant"),
                Some(bound_to(bound)),
                "SET outbox.tenant = 'name' (or SET LOCAL in the transaction) before enqueueing.",
            ),
        }
    }

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
        pinned_statement::connected(|| {
            BINDINGS.with(|s| s.execute(&[]));
            Some(match pinned_statement::column(0, 1) {
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

    fn bound(tenants: &[&str]) -> Vec<String> {
        tenants.iter().map(|t| t.to_string()).collect()
    }

    fn acting(
        named: Option<&str>,
        superuser: bool,
        tenants: &[&str],
    ) -> Result<String, TenantRefusal> {
        acting_tenant(named, superuser, || bound(tenants))
    }

    #[test]
    fn tenant_names() {
        assert!(check_tenant_name(Some("acme"), "tenant", false).is_ok());
        assert!(check_tenant_name(Some(&"t".repeat(128)), "tenant", false).is_ok());
        assert!(check_tenant_name(Some("*"), "tenant", true).is_ok());
        let bad = |length| {
            Err(TenantRefusal::BadName {
                argument: "tenant".into(),
                length,
            })
        };
        assert_eq!(check_tenant_name(None, "tenant", true), bad(None));
        assert_eq!(check_tenant_name(Some(""), "tenant", true), bad(Some(0)));
        assert_eq!(
            check_tenant_name(Some(&"t".repeat(129)), "tenant", true),
            bad(Some(129))
        );
        assert_eq!(
            check_tenant_name(Some(&"é".repeat(65)), "tenant", true),
            bad(Some(130)),
            "bytes, not characters"
        );
        for control in ["a\nb", "\t", "x\u{7f}", "\u{85}", "a\u{2028}"] {
            assert_eq!(
                check_tenant_name(Some(control), "tenant", true),
                bad(Some(control.len())),
                "{control:?}"
            );
        }
        assert_eq!(
            check_tenant_name(Some("*"), "outbox.tenant", false),
            Err(TenantRefusal::StarIsNotATenant {
                argument: "outbox.tenant".into()
            })
        );
    }

    #[test]
    fn an_effect_acts_for_its_message_tenant_alone() {
        assert_eq!(acting_tenant_of_effect(None, "a"), Ok("a".into()));
        assert_eq!(acting_tenant_of_effect(Some("a"), "a"), Ok("a".into()));
        assert_eq!(
            acting_tenant_of_effect(Some("b"), "a"),
            Err(TenantRefusal::NotBound {
                tenant: "b".into(),
                bound: bound(&["a"])
            })
        );
        assert!(matches!(
            acting_tenant_of_effect(Some("*"), "a"),
            Err(TenantRefusal::StarIsNotATenant { .. })
        ));
        assert!(matches!(
            acting_tenant_of_effect(Some("a\nb"), "a"),
            Err(TenantRefusal::BadName { .. })
        ));
    }

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

    #[test]
    fn a_superuser_acts_for_the_named_tenant_or_default_and_never_reads_bindings() {
        let never = || -> Vec<String> { panic!("a superuser's bindings are not read") };
        assert_eq!(acting_tenant(None, true, never), Ok("default".into()));
        assert_eq!(acting_tenant(Some("acme"), true, never), Ok("acme".into()));
        assert!(matches!(
            acting_tenant(Some("*"), true, never),
            Err(TenantRefusal::StarIsNotATenant { .. })
        ));
        assert!(matches!(
            acting_tenant(Some("a\nb"), true, never),
            Err(TenantRefusal::BadName { .. })
        ));
    }

    #[test]
    fn a_role_acts_for_its_one_binding_unless_it_names_another() {
        assert_eq!(acting(None, false, &["a"]), Ok("a".into()));
        assert_eq!(acting(Some("a"), false, &["a"]), Ok("a".into()));
        assert_eq!(
            acting(Some("b"), false, &["a"]),
            Err(TenantRefusal::NotBound {
                tenant: "b".into(),
                bound: bound(&["a"])
            })
        );
        assert_eq!(acting(None, false, &[]), Err(TenantRefusal::Unbound));
        assert_eq!(
            acting(Some("a"), false, &[]),
            Err(TenantRefusal::NotBound {
                tenant: "a".into(),
                bound: vec![]
            })
        );
    }

    #[test]
    fn several_tenants_or_a_star_need_outbox_tenant() {
        assert_eq!(
            acting(None, false, &["a", "b"]),
            Err(TenantRefusal::Ambiguous {
                bound: bound(&["a", "b"])
            })
        );
        assert_eq!(acting(Some("b"), false, &["a", "b"]), Ok("b".into()));
        assert_eq!(
            acting(None, false, &["*"]),
            Err(TenantRefusal::Ambiguous {
                bound: bound(&["*"])
            })
        );
        assert_eq!(
            acting(None, false, &["*", "a"]),
            Err(TenantRefusal::Ambiguous {
                bound: bound(&["*", "a"])
            }),
            "'*' with one tenant is still ambiguous"
        );
        assert_eq!(acting(Some("z"), false, &["*"]), Ok("z".into()));
        assert!(matches!(
            acting(Some("*"), false, &["*"]),
            Err(TenantRefusal::StarIsNotATenant { .. })
        ));
    }

    #[test]
    fn refusals_name_the_role_and_its_bindings() {
        let (message, detail, _) = TenantRefusal::NotBound {
            tenant: "b".into(),
            bound: bound(&["a", "c"]),
        }
        .text("app");
        assert_eq!(message, "role app may not act for tenant \"b\"");
        assert_eq!(detail.as_deref(), Some("The role is bound to a, c."));
        let (_, detail, _) = TenantRefusal::NotBound {
            tenant: "b".into(),
            bound: vec![],
        }
        .text("app");
        assert_eq!(detail.as_deref(), Some("The role is bound to no tenant."));
        let (message, detail, hint) = TenantRefusal::Unbound.text("\"App\"");
        assert_eq!(message, "role \"App\" is bound to no tenant");
        assert_eq!(detail, None);
        assert!(hint.contains("bind_tenant"));
        let (message, _, _) = TenantRefusal::BadName {
            argument: "tenant".into(),
            length: None,
        }
        .text("app");
        assert_eq!(
            message,
            "tenant must be a tenant name of 1 to 128 bytes without control characters"
        );
        for refusal in [
            TenantRefusal::Unbound,
            TenantRefusal::Ambiguous { bound: vec![] },
            TenantRefusal::NotBound {
                tenant: "x".into(),
                bound: vec![],
            },
        ] {
            assert_eq!(
                refusal.sqlstate(),
                PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE
            );
        }
        assert_eq!(
            TenantRefusal::StarIsNotATenant {
                argument: "t".into()
            }
            .sqlstate(),
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE
        );
    }
}
