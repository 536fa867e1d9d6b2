//! Planner settings for the worker's own statements.
//!
//! Every statement the worker runs reaches its rows through an index, a batch at a time.
//! With statistics that lag a fast-growing table, the planner may prefer a sequential scan
//! of the whole attempt table to 200 index probes: a cost that grows with every delivery.
//! Sequential scans are therefore disabled for the rest of the worker's transaction (a
//! table without a usable index is still scanned). `SET LOCAL` ends with the transaction,
//! and the worker issues it after any `sql` effect has run, so the functions of those
//! effects plan with the server's settings.

use pgrx::spi::{SpiClient, SpiResult};

const PREFER_INDEXES: &str = "SET LOCAL enable_seqscan = off";

/// For the rest of the current transaction.
pub fn prefer_indexes(client: &mut SpiClient<'_>) -> SpiResult<()> {
    client.update(PREFER_INDEXES, None, &[])?;
    Ok(())
}
