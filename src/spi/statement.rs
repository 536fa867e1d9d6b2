//! Statements run through pgrx's SPI client (the worker's cycle, the ledger): parsed and
//! analysed once per process, and planned once where one plan serves every run.
//!
//! Parsing and analysing the claim statement took about 0.6 ms and planning it 1.1 ms, of
//! an idle worker's claim transaction of about 2.5 ms, and its text never changes. Each
//! statement of the worker's cycle is therefore prepared at its first run and kept for the
//! life of the process (`SPI_keepplan`). PostgreSQL's plan cache revalidates a kept
//! statement when something it depends on changes (an extension update, an index added or
//! dropped, new statistics from ANALYZE), so a kept statement never runs against stale
//! objects, and a plan made once is made again when the tables' statistics change.
//!
//! Each statement says how it is planned ([`Plan`]). A statement that reaches its rows
//! through the primary key, a TID or an index in its own order has one good plan whatever
//! the values; one whose plan depends on how many rows its values select is planned for
//! them at every run. A plan made once cannot know a batch's size, so such a statement must
//! not join its batch to the message table: the planner may expect thousands of rows and
//! read the whole table to meet them (the claim did, until it took its batch as an array
//! of addresses). The `#[pg_test]` in `src/tests/plans.rs` plans the statements planned
//! once as the worker does, at a backlog, and fails on a scan of the message table that no
//! condition bounds.
//!
//! Every kept statement is planned with sequential scans disabled: each reaches its rows
//! through an index, a batch at a time, and with statistics that lag a fast-growing table
//! the planner may prefer a sequential scan of the whole attempt table to 200 index probes,
//! a cost that grows with every delivery (a table without a usable index is still
//! scanned). Each also runs under the worker's pinned search path (`PINNED_SEARCH_PATH`), so
//! that a plan made again after an invalidation resolves the same functions and operators.
//! Sequential scans are disabled for the run of the statement only. The worker's session
//! holds the search path and the plan cache mode of most statements itself
//! (`worker::pin_session_settings`), and a statement sets only what the session does not
//! hold; the functions of `sql` effects run under the database's settings.

use crate::gucs::set_in_nest;
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::{self, PgOid};
use pgrx::spi::{OwnedPreparedStatement, SpiClient, SpiResult, SpiTupleTable};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::CStr;

/// How a kept statement is planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Once, for any values (a generic plan), and again when the plan cache invalidates it.
    Once,
    /// At every run, for its values (a custom plan).
    EachRun,
}

impl Plan {
    /// The `plan_cache_mode` a statement of this plan runs under.
    pub(crate) fn plan_cache_mode(self) -> &'static CStr {
        match self {
            Plan::Once => c"force_generic_plan",
            Plan::EachRun => c"force_custom_plan",
        }
    }

    /// The same as the value of the GUC's variable (`pg_sys::plan_cache_mode`).
    pub(crate) fn plan_cache_mode_value(self) -> i32 {
        (match self {
            Plan::Once => pg_sys::PlanCacheMode::PLAN_CACHE_MODE_FORCE_GENERIC_PLAN,
            Plan::EachRun => pg_sys::PlanCacheMode::PLAN_CACHE_MODE_FORCE_CUSTOM_PLAN,
        }) as i32
    }
}

/// One statement of the worker.
#[derive(Debug)]
pub struct Statement {
    pub sql: &'static str,
    pub plan: Plan,
}

impl Statement {
    pub const fn planned_once(sql: &'static str) -> Statement {
        Statement {
            sql,
            plan: Plan::Once,
        }
    }

    pub const fn planned_each_run(sql: &'static str) -> Statement {
        Statement {
            sql,
            plan: Plan::EachRun,
        }
    }
}

thread_local! {
    /// Kept statements by the address of their text (each statement is a `static`). A kept
    /// statement lives as long as the worker process.
    static KEPT: RefCell<HashMap<usize, &'static OwnedPreparedStatement>> =
        RefCell::new(HashMap::new());
}

/// Runs `statement` with `args`, preparing it at its first run in this process. The
/// parameter types are those of the arguments of that first run; every call site of a
/// statement passes arguments of the same types.
pub fn run<'conn>(
    client: &SpiClient<'conn>,
    statement: &'static Statement,
    limit: Option<i64>,
    args: &[DatumWithOid<'_>],
) -> SpiResult<SpiTupleTable<'conn>> {
    let kept = kept(client, statement, args)?;
    // SAFETY: the GUC nest level opened here is closed here; an error in between aborts
    // the transaction, and the abort closes every nest level the transaction opened. The
    // globals read are the GUCs' own variables, read on the process's only thread.
    unsafe {
        // Only the settings the session does not hold already are set, each in a nest level
        // of the statement's own: the worker's session holds the search path and the plan
        // cache mode of most statements (`worker::pin_session_settings`); each setting set
        // and restored was a part of the 16–31 µs a statement of an idle claim spent before
        // it started (BENCHMARKS.md).
        let set_mode = pg_sys::plan_cache_mode != statement.plan.plan_cache_mode_value();
        let set_seqscan = pg_sys::enable_seqscan;
        // Analysed again (after an invalidation) under this path alone, whatever the
        // session's path has become.
        let set_path = pg_sys::namespace_search_path.is_null()
            || CStr::from_ptr(pg_sys::namespace_search_path) != super::PINNED_SEARCH_PATH;
        let nest = (set_mode || set_seqscan || set_path).then(|| pg_sys::NewGUCNestLevel());
        if set_mode {
            set_in_nest(c"plan_cache_mode", statement.plan.plan_cache_mode());
        }
        if set_seqscan {
            set_in_nest(c"enable_seqscan", c"off");
        }
        if set_path {
            set_in_nest(c"search_path", super::PINNED_SEARCH_PATH);
        }
        // Kept statements are prepared as mutating: each runs with a fresh snapshot that
        // sees the transaction's earlier writes, whether it reads or writes.
        let rows = client.select(kept, limit, args);
        if let Some(nest) = nest {
            pg_sys::AtEOXact_GUC(true, nest);
        }
        rows
    }
}

/// Runs `statement` as [`run`] does, kept from its first run in this process, but under the
/// settings in force: no search path, plan cache mode or `enable_seqscan` of its own. For a
/// statement that must resolve a name as its caller would: a `sql` effect's lookup of its
/// channel's function, which runs under the database's search path as the effect does
/// (`channels::sql_effect`). Such a statement qualifies every other name, operators
/// included; PostgreSQL's plan cache analyses it again when the search path it was
/// analysed under changes.
pub fn run_under_caller_settings<'conn>(
    client: &SpiClient<'conn>,
    statement: &'static Statement,
    limit: Option<i64>,
    args: &[DatumWithOid<'_>],
) -> SpiResult<SpiTupleTable<'conn>> {
    let kept = kept(client, statement, args)?;
    client.select(kept, limit, args)
}

fn kept(
    client: &SpiClient<'_>,
    statement: &'static Statement,
    args: &[DatumWithOid<'_>],
) -> SpiResult<&'static OwnedPreparedStatement> {
    let key = statement as *const Statement as usize;
    if let Some(kept) = KEPT.with(|k| k.borrow().get(&key).copied()) {
        return Ok(kept);
    }
    let types: Vec<PgOid> = args.iter().map(|a| PgOid::from(a.oid())).collect();
    let kept: &'static OwnedPreparedStatement =
        Box::leak(Box::new(client.prepare_mut(statement.sql, &types)?.keep()));
    KEPT.with(|k| k.borrow_mut().insert(key, kept));
    Ok(kept)
}
