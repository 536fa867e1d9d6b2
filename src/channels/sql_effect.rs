//! The `sql` channel: an effect inside this database. The worker calls the channel's
//! function `(payload jsonb, effect_key text) → text` inside the same local transaction that
//! writes the ledger entry and marks the message delivered — both commit or neither, so the
//! effect happens exactly once by construction.
//!
//! Each call runs in a subtransaction as the channel's `run_as` role (never a superuser), in
//! a security-restricted operation (see worker/identity.rs), bounded by the channel's
//! `timeout_ms` and by the worker's stop (`effect_bound`): a failing, timed-out or cancelled
//! effect is rolled back, classified and recorded without touching the rest of the batch.
//! Nothing of the call outlives it in the worker: neither its settings nor its
//! session-level advisory locks (released after it).

use super::effect_bound;
use crate::classify::EffectOutcome;
use crate::error::sqlstate_and_message;
use crate::gucs::set_in_nest;
use crate::spi::{self, Statement};
use crate::tenancy::{within_effect, EffectScope};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};
use std::cell::RefCell;
use std::ffi::CString;
use std::panic::AssertUnwindSafe;
use std::time::Instant;

/// The function a channel names, resolved by its exact signature under the search path in
/// force (the caller's at `create_channel`, the database's at each call); its qualified
/// name and whether it returns text. No row: it does not exist. Every other name is
/// qualified, operators included: a worker keeps the statement and runs it under the
/// database's search path and plan cache mode (`spi::run_under_caller_settings`, which
/// applies no plan mode of the statement's own; `create_channel` runs its text).
pub static FIND_FUNCTION: Statement = Statement::planned_each_run(
    "
SELECT pg_catalog.quote_ident(n.nspname) OPERATOR(pg_catalog.||) '.'
           OPERATOR(pg_catalog.||) pg_catalog.quote_ident(p.proname),
       p.prorettype OPERATOR(pg_catalog.=) 'pg_catalog.text'::pg_catalog.regtype
  FROM pg_catalog.pg_proc p
  JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) p.pronamespace
 WHERE p.oid OPERATOR(pg_catalog.=) pg_catalog.to_regprocedure($1 OPERATOR(pg_catalog.||) '(jsonb, text)')",
);

/// A role an effect may run as: it must exist and must not be a superuser; and may the
/// calling role (the session's role, see tenancy.rs) act as it?
pub const FIND_ROLE: &str = "
SELECT r.rolsuper,
       outbox._caller_is_superuser() OR pg_catalog.pg_has_role(outbox._caller_oid(), r.oid, 'MEMBER')
  FROM pg_catalog.pg_roles r WHERE r.rolname = $1";

/// May the calling role point a channel at a function? Superusers and members of
/// outbox_admin.
pub const MAY_ADMINISTER: &str = "
SELECT outbox._caller_is_superuser()
    OR (pg_catalog.to_regrole('outbox_admin') IS NOT NULL
        AND pg_catalog.pg_has_role(outbox._caller_oid(), 'outbox_admin', 'MEMBER'))";

/// The oid of a role an effect may run as: it exists and is not a superuser. Run before
/// every call, kept (`spi::run`).
static RUN_AS_ROLE: Statement = Statement::planned_once(
    "SELECT oid FROM pg_catalog.pg_roles WHERE rolname = $1 AND NOT rolsuper",
);

thread_local! {
    /// The search path effects run under: the database's own (its default, or what
    /// `ALTER DATABASE … SET search_path` made it), taken before the worker pinned its own.
    static EFFECT_SEARCH_PATH: RefCell<CString> = RefCell::new(CString::from(c"\"$user\", public"));
    /// The same for `plan_cache_mode`.
    static EFFECT_PLAN_CACHE_MODE: RefCell<CString> = RefCell::new(CString::from(c"auto"));
}

/// Remembers a setting effects run under (see [`EFFECT_SEARCH_PATH`]): `search_path` or
/// `plan_cache_mode`; any other name is ignored.
pub fn set_effect_setting(name: &std::ffi::CStr, value: &std::ffi::CStr) {
    let setting = match name.to_bytes() {
        b"search_path" => &EFFECT_SEARCH_PATH,
        b"plan_cache_mode" => &EFFECT_PLAN_CACHE_MODE,
        _ => return,
    };
    setting.with(|s| *s.borrow_mut() = value.to_owned());
}

/// Calls `function(payload, effect_key)` as `run_as`, for `tenant` alone, in a
/// subtransaction of the current transaction. On error the subtransaction is rolled back
/// and the error returned.
///
/// The call has a GUC nest level of its own, closed as an abort closes it: no setting the
/// effect changes outlives the call, not even one changed with `set_config(…, false)` or a
/// plain `SET`. The effect runs under the database's search path and plan cache mode (the
/// worker's own are pinned), and the tenancy checks it reaches see `run_as` and `tenant`
/// (`tenancy::within_effect`).
///
/// The call is bounded (`effect_bound`): it is cancelled (57014) `timeout_ms` after it
/// began, or as soon as the worker is asked to stop; a worker asked to stop calls no more
/// effects. Session-level advisory locks taken during the call are released after it,
/// whatever its outcome: the worker holds none of its own.
pub fn call_effect(
    client: &mut SpiClient<'_>,
    function: &str,
    run_as: &str,
    tenant: &str,
    timeout_ms: u64,
    payload: &str,
    effect_key: &str,
) -> SpiResult<EffectOutcome> {
    if effect_bound::stop_requested() {
        return Ok(EffectOutcome::Raised {
            sqlstate: "57014".into(),
            message: "the worker is stopping (fast shutdown or pg_terminate_backend): the effect was not called".into(),
        });
    }
    // No row: the role is gone or has become a superuser (reading a value of an empty
    // result would be an error, and the record's transaction would end with it).
    let found = spi::run(client, &RUN_AS_ROLE, Some(1), &[run_as.into()])?;
    let role = if found.is_empty() {
        None
    } else {
        found.first().get_one::<pg_sys::Oid>()?
    };
    let Some(role) = role else {
        return Ok(EffectOutcome::Unavailable(format!(
            "role \"{run_as}\" (run_as) no longer exists or has become a superuser"
        )));
    };
    let timeout = CString::new(timeout_ms.to_string()).unwrap_or_default();
    let spi_error = |e: pgrx::spi::Error| ("XX000".to_string(), e.to_string());
    let scope = EffectScope {
        role,
        tenant: tenant.to_string(),
    };

    let began = Instant::now();
    let result = unsafe {
        let outer_context = pg_sys::CurrentMemoryContext;
        let outer_owner = pg_sys::CurrentResourceOwner;
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(outer_context);
        let nest = pg_sys::NewGUCNestLevel();

        // Everything runs as run_as, restricted (it cannot SET ROLE its way out): even the
        // lookup of the function, which needs run_as's USAGE on its schema.
        let result = PgTryBuilder::new(AssertUnwindSafe(
            || -> Result<EffectOutcome, (String, String)> {
                set_in_nest(c"statement_timeout", &timeout);
                EFFECT_SEARCH_PATH.with(|p| set_in_nest(c"search_path", &p.borrow()));
                EFFECT_PLAN_CACHE_MODE.with(|m| set_in_nest(c"plan_cache_mode", &m.borrow()));
                effect_bound::arm(timeout_ms);
                let outcome = within_effect(scope, || {
                    crate::identity::as_role(role, || {
                        find_and_call(client, function, payload, effect_key)
                    })
                })
                .map_err(spi_error)?;
                // A cancel that came as the call ended is the call's: it raises here, inside
                // the subtransaction, rather than in the worker's next statement.
                effect_bound::disarm(false);
                pg_sys::check_for_interrupts!();
                // Every setting of the call, SET and set_config(…, false) included, goes
                // back to what it was: the worker's session keeps none of them.
                pg_sys::AtEOXact_GUC(false, nest);
                Ok(outcome)
            },
        ))
        .catch_others(|caught| Err(sqlstate_and_message(&caught)))
        .execute();

        match result {
            Ok(outcome) => {
                pg_sys::ReleaseCurrentSubTransaction();
                pg_sys::MemoryContextSwitchTo(outer_context);
                pg_sys::CurrentResourceOwner = outer_owner;
                Ok(outcome)
            }
            Err((sqlstate, message)) => {
                effect_bound::disarm(true);
                pg_sys::MemoryContextSwitchTo(outer_context);
                pg_sys::RollbackAndReleaseCurrentSubTransaction();
                pg_sys::MemoryContextSwitchTo(outer_context);
                pg_sys::CurrentResourceOwner = outer_owner;
                let message = explain_cancel(
                    &sqlstate,
                    message,
                    began.elapsed().as_millis() as u64,
                    timeout_ms,
                    effect_bound::stop_requested(),
                );
                Ok(EffectOutcome::Raised { sqlstate, message })
            }
        }
    };
    // A session-level advisory lock survives the subtransaction, committed or rolled back:
    // it would stay with the worker's process, held for the tenant for good. The worker
    // takes none of its own, so all of them are the effects'.
    unsafe { pg_sys::LockReleaseSession(pg_sys::USER_LOCKMETHOD as pg_sys::LOCKMETHODID) };
    result
}

/// Finds `function(jsonb, text)` as the effect's role sees it (its USAGE on the schema
/// decides), checks that it still returns text, and calls it with the message's payload
/// and effect key: what it returned, or why it could not be called.
fn find_and_call(
    client: &mut SpiClient<'_>,
    function: &str,
    payload: &str,
    effect_key: &str,
) -> SpiResult<EffectOutcome> {
    let found =
        spi::run_under_caller_settings(client, &FIND_FUNCTION, Some(1), &[function.into()])?;
    if found.is_empty() {
        return Ok(EffectOutcome::Unavailable(format!(
            "function {function}(jsonb, text) does not exist (dropped or renamed since the channel was created?)"
        )));
    }
    let row = found.first();
    let qualified: String = row.get(1)?.unwrap_or_default();
    if row.get::<bool>(2)? != Some(true) {
        return Ok(EffectOutcome::Unavailable(format!(
            "function {function}(jsonb, text) no longer returns text"
        )));
    }
    // The name comes from the catalog, quoted by quote_ident: no input
    // reaches the SQL text.
    let call = format!("SELECT {qualified}($1::jsonb, $2::text)");
    // A function declared `RETURNS SETOF text` may return no row: it ran,
    // and returned no external id, as one that returns NULL.
    let returned = client
        .update(call.as_str(), Some(1), &[payload.into(), effect_key.into()])
        .and_then(|rows| {
            if rows.is_empty() {
                Ok(None)
            } else {
                rows.first().get_one::<String>()
            }
        })?;
    Ok(EffectOutcome::Returned(returned))
}

/// The message of an effect's error: a cancel (57014) says what cancelled it, the worker's
/// stop or the channel's `timeout_ms`.
fn explain_cancel(
    sqlstate: &str,
    message: String,
    elapsed_ms: u64,
    timeout_ms: u64,
    stopping: bool,
) -> String {
    if sqlstate != "57014" {
        message
    } else if stopping {
        format!("{message}: the worker was asked to stop (fast shutdown or pg_terminate_backend) during the effect, which was rolled back")
    } else if elapsed_ms >= timeout_ms {
        format!("{message}: the effect ran past the channel's timeout_ms ({timeout_ms} ms) and was rolled back")
    } else {
        message
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cancel_says_what_cancelled_the_effect() {
        let timeout = "canceling statement due to statement timeout".to_string();
        let said = explain_cancel("57014", timeout.clone(), 2_003, 2_000, false);
        assert!(said.starts_with(&timeout), "{said}");
        assert!(said.contains("timeout_ms (2000 ms)"), "{said}");
        let user = "canceling statement due to user request".to_string();
        let said = explain_cancel("57014", user.clone(), 300, 2_000, true);
        assert!(said.contains("asked to stop"), "{said}");
        // pg_cancel_backend by an operator, before the deadline: said as PostgreSQL says it.
        assert_eq!(
            explain_cancel("57014", user.clone(), 300, 2_000, false),
            user
        );
        assert_eq!(
            explain_cancel("23505", "duplicate key".into(), 9_000, 2_000, true),
            "duplicate key"
        );
    }
}
