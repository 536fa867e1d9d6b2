//! Messages: their states and what wakes the worker when one is committed.
//! `enqueue` is written in Rust (`enqueue`), what it refuses is checked in
//! `enqueue_check`; `status` and the channel pause switch are SQL functions in
//! `sql/api.sql`.

pub mod enqueue;
pub mod enqueue_check;
pub mod state;
pub mod wake;
