//! Messages: their states and what wakes the worker when one is committed.
//! `enqueue`, `status` and the channel pause switch are SQL functions in `sql/api.sql`.

pub mod state;
pub mod wake;
