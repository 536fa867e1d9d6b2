//! A subtransaction of the current transaction, for a step the transaction may go on
//! without: the step's error rolls the subtransaction back and is returned instead of
//! aborting the whole transaction (the ledger's retention uses it for a lock it may not
//! get in time).

use crate::error::sqlstate_and_message;
use pgrx::pg_sys;
use pgrx::PgTryBuilder;
use std::panic::AssertUnwindSafe;

/// Runs `step` in a subtransaction: its result once the subtransaction is released, or,
/// when it raised an error, that error's SQLSTATE and message once the subtransaction is
/// rolled back (with its locks, settings and writes).
pub fn subtransaction<R>(step: impl FnOnce() -> R) -> Result<R, (String, String)> {
    // SAFETY: the subtransaction begun here is ended here, on either path, and the memory
    // context and resource owner of the caller are restored after it, as PL/pgSQL does
    // around an exception block.
    unsafe {
        let outer_context = pg_sys::CurrentMemoryContext;
        let outer_owner = pg_sys::CurrentResourceOwner;
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(outer_context);
        let result = PgTryBuilder::new(AssertUnwindSafe(|| Ok(step())))
            .catch_others(|caught| Err(sqlstate_and_message(&caught)))
            .execute();
        match result {
            Ok(_) => {
                pg_sys::ReleaseCurrentSubTransaction();
            }
            Err(_) => {
                pg_sys::MemoryContextSwitchTo(outer_context);
                pg_sys::RollbackAndReleaseCurrentSubTransaction();
            }
        }
        pg_sys::MemoryContextSwitchTo(outer_context);
        pg_sys::CurrentResourceOwner = outer_owner;
        result
    }
}
