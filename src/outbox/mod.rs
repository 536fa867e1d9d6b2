//! Messages: their states and what wakes the worker when one is committed.
//! `enqueue`, `status` and the channel pause switch are SQL functions in `sql/api.sql`;
//! what `enqueue` refuses is checked in `enqueue_check`.

pub mod enqueue_check;
pub mod state;
pub mod wake;
