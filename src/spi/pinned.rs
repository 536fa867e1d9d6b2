//! Statements that the extension's C-language functions run through SPI: prepared once per
//! session and kept, and always planned and executed under a search path of `pg_catalog`
//! alone.
//!
//! `enqueue` runs as the extension's owner (`SECURITY DEFINER`) without a `SET search_path`
//! clause, which would cost a configuration save and restore in every call. The statements
//! below are what keeps that safe: every name in them is schema-qualified, operators
//! included (`OPERATOR(pg_catalog.=)`), and the search path they are analysed and planned
//! under is pushed by this module, not taken from the caller. The plan cache compares the
//! search path at every execution, so a pinned path also means the plan is never made again
//! because a caller's path differs.

use pgrx::pg_sys;
use std::cell::Cell;
use std::ffi::{c_char, CStr};

/// One statement, prepared at its first execution in a session.
pub struct PinnedStatement {
    sql: &'static CStr,
    argtypes: &'static [pg_sys::Oid],
    plan: Cell<pg_sys::SPIPlanPtr>,
}

impl PinnedStatement {
    pub const fn new(sql: &'static CStr, argtypes: &'static [pg_sys::Oid]) -> Self {
        PinnedStatement {
            sql,
            argtypes,
            plan: Cell::new(std::ptr::null_mut()),
        }
    }

    /// Executes the statement with `args` (`None` is SQL NULL) and returns SPI's result code;
    /// the rows are in `SPI_tuptable`.
    ///
    /// # Safety
    /// Between `SPI_connect` and `SPI_finish`, on the backend's main thread; `args` holds one
    /// datum of the declared type per parameter.
    pub unsafe fn execute(&self, args: &[Option<pg_sys::Datum>]) -> i32 {
        assert_eq!(
            args.len(),
            self.argtypes.len(),
            "one argument per parameter"
        );
        let mut values: Vec<pg_sys::Datum> = args
            .iter()
            .map(|a| a.unwrap_or(pg_sys::Datum::from(0)))
            .collect();
        let nulls: Vec<c_char> = args
            .iter()
            .map(|a| if a.is_some() { b' ' } else { b'n' } as c_char)
            .collect();
        with_pinned_search_path(|| {
            let plan = self.prepared();
            pg_sys::SPI_execute_plan(plan, values.as_mut_ptr(), nulls.as_ptr(), false, 0)
        })
    }

    unsafe fn prepared(&self) -> pg_sys::SPIPlanPtr {
        if self.plan.get().is_null() {
            let plan = pg_sys::SPI_prepare(
                self.sql.as_ptr(),
                self.argtypes.len() as i32,
                self.argtypes.as_ptr() as *mut pg_sys::Oid,
            );
            if plan.is_null() || pg_sys::SPI_keepplan(plan) != 0 {
                panic!("could not prepare {:?}", self.sql);
            }
            self.plan.set(plan);
        }
        self.plan.get()
    }
}

/// Runs `f` with the search path `pg_catalog` alone. On an error the transaction's (or
/// subtransaction's) abort removes the pushed path.
unsafe fn with_pinned_search_path<T>(f: impl FnOnce() -> T) -> T {
    let path = pg_sys::palloc0(std::mem::size_of::<pg_sys::OverrideSearchPath>())
        as *mut pg_sys::OverrideSearchPath;
    (*path).schemas = std::ptr::null_mut();
    (*path).addCatalog = true;
    (*path).addTemp = false;
    pg_sys::PushOverrideSearchPath(path);
    let result = f();
    pg_sys::PopOverrideSearchPath();
    result
}

/// Column `n` (from 1) of row `row` of the last statement's result; `None` for NULL.
///
/// # Safety
/// After a successful `execute` that returned at least `row + 1` rows, before `SPI_finish`.
pub unsafe fn column(row: usize, n: i32) -> Option<pg_sys::Datum> {
    let table = pg_sys::SPI_tuptable;
    let tuple = *(*table).vals.add(row);
    let mut isnull = false;
    let datum = pg_sys::SPI_getbinval(tuple, (*table).tupdesc, n, &mut isnull);
    (!isnull).then_some(datum)
}

/// How many rows the last statement returned.
///
/// # Safety
/// Before `SPI_finish`.
pub unsafe fn rows() -> u64 {
    pg_sys::SPI_processed
}

/// Runs `f` inside `SPI_connect` … `SPI_finish`. Datums `f` returns must be passed by value
/// or copied out of SPI's memory first.
///
/// # Safety
/// On the backend's main thread, inside a transaction.
pub unsafe fn connected<T>(f: impl FnOnce() -> T) -> T {
    if pg_sys::SPI_connect() != pg_sys::SPI_OK_CONNECT as i32 {
        panic!("SPI_connect failed");
    }
    let result = f();
    pg_sys::SPI_finish();
    result
}
