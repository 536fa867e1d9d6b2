//! Who is calling: the session's role, which decides the tenants a call may act for.
//!
//! Inside a `SECURITY DEFINER` function `current_user` is the function's owner, so the
//! tenant functions of sql/tenancy.sql ask for the *outer* user instead: `session_user`, or
//! the role named by `SET ROLE`. Row-level security and the definer functions therefore
//! agree on one identity.

use pgrx::pg_sys;
use pgrx::prelude::*;
use std::ffi::CStr;

/// The oid of the session's role (`session_user`, or the role of `SET ROLE`).
#[pg_extern(stable, parallel_safe)]
fn _caller_oid() -> pg_sys::Oid {
    unsafe { pg_sys::GetOuterUserId() }
}

/// The name of the session's role, for messages.
#[pg_extern(stable, parallel_safe)]
fn _caller_name() -> String {
    unsafe {
        let name = pg_sys::GetUserNameFromId(pg_sys::GetOuterUserId(), true);
        if name.is_null() {
            return String::new();
        }
        CStr::from_ptr(name).to_string_lossy().into_owned()
    }
}

/// Is the session's role a superuser? (A superuser acts for any tenant.)
#[pg_extern(stable, parallel_safe)]
fn _caller_is_superuser() -> bool {
    unsafe { pg_sys::superuser_arg(pg_sys::GetOuterUserId()) }
}
