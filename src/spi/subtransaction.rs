//! A subtransaction of the current transaction, for a step the transaction may go on
//! without: the step's error rolls the subtransaction back and is returned instead of
//! aborting the whole transaction (the ledger's retention uses it for a lock it may not
//! get in time).

use crate::error::sqlstate_and_message;
use pgrx::pg_sys;
use pgrx::PgTryBuilder;
use std::fmt::Display;
use std::panic::AssertUnwindSafe;

/// Runs `step` in a subtransaction. When it returns `Ok`, the subtransaction is released:
/// its writes, locks and settings (`set_config(…, true)`) stay with the transaction. When
/// it returns `Err` or raises an error, the subtransaction is rolled back, with its writes,
/// locks and settings, and the error's SQLSTATE (XX000 for an `Err`) and message returned.
pub fn subtransaction<R, E: Display>(
    step: impl FnOnce() -> Result<R, E>,
) -> Result<R, (String, String)> {
    // SAFETY: the subtransaction begun here is ended here, on either path, and the memory
    // context and resource owner of the caller are restored after it, as PL/pgSQL does
    // around an exception block.
    unsafe {
        let outer_context = pg_sys::CurrentMemoryContext;
        let outer_owner = pg_sys::CurrentResourceOwner;
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(outer_context);
        let result = PgTryBuilder::new(AssertUnwindSafe(|| {
            step().map_err(|e| ("XX000".to_string(), e.to_string()))
        }))
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
