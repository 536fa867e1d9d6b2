//! How the extension runs its own SQL. Every statement is a named `static` with `$n`
//! parameters; it is prepared at its first run in a process and kept for the life of the
//! process (`SPI_keepplan`), and it is analysed, planned and run under a search path the
//! extension pins, never the caller's. PostgreSQL's plan cache revalidates a kept
//! statement when an object it depends on changes.
//!
//! Two doors lead to that one rule:
//! - [`statement`]: through pgrx's SPI client, with each statement's plan mode
//!   (planned once, or for each run's values). The worker's cycle, the ledger and
//!   retention use it, under [`PINNED_SEARCH_PATH`]; a `sql` effect's lookup of its
//!   function, which must resolve the function's name as the effect will, runs kept under
//!   the database's settings instead (`run_under_caller_settings`).
//! - [`pinned`]: straight through SPI's C interface, for the SQL-callable functions on the
//!   application's hot path (`enqueue`, the tenant bindings it reads), where pgrx's
//!   conversions and a configuration save and restore per call would cost more than the
//!   statement itself. Their statements qualify every name, operators included, and run
//!   under `pg_catalog` alone.
//!
//! Statements that run once in a while (channel administration, reconcile on demand) use
//! `SpiClient::select`/`update` with a `const` text: a kept plan would buy nothing there.

use std::ffi::CStr;

pub mod pinned;
pub mod statement;
pub mod subtransaction;

pub use statement::{run, run_under_caller_settings, Plan, Statement};
pub use subtransaction::subtransaction;

/// The search path of the worker's own statements. No schema that anyone but the
/// extension's owner can create in is on it: a function or operator planted under a
/// built-in's name (in `public`, say) is never resolved by the worker's statements, which
/// run as a role that bypasses row-level security.
pub const PINNED_SEARCH_PATH: &CStr = c"pg_catalog, outbox, pg_temp";
