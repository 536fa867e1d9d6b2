//! Which tenant a call acts for, and what a tenant name may be: the pure rules behind
//! `enqueue`, the tenant bindings and row-level security. Who the caller is (its role, its
//! bindings, the effect running now) is read by the enclosing module; these rules only
//! decide.

use pgrx::PgSqlErrorCode;

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
        Some(n) if n.chars().any(is_control) => Err(bad(Some(n.len()))),
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
}

/// A control character as the database's `[[:cntrl:]]` class knows it in a UTF-8 locale:
/// C0, DEL, C1, and the line and paragraph separators.
pub(crate) fn is_control(c: char) -> bool {
    c.is_control() || c == '\u{2028}' || c == '\u{2029}'
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
