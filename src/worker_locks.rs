//! Locks the delivery workers of a database take among themselves: the claim (one claim at
//! a time), holding messages behind their ordering key (one worker at a time) and a round
//! of the ledger's retention (one round at a time).
//!
//! They are advisory locks in a space of their own. PostgreSQL's SQL functions of advisory
//! locks name a lock by one int8 key or by two int4 keys, and write 1 or 2 into the last
//! field of its tag; these locks carry
//! [`SPACE`] there instead, so no SQL, of any role, can take, wait for or release one of
//! them: a login role with no grant at all cannot stop or steer a worker through them.
//! `pg_locks` shows them as `advisory` locks of the database, `classid` = [`KEY`],
//! `objid` = the lock's number and `objsubid` = [`SPACE`]; the holder's `pid` is there.
//!
//! A wait for one is bounded ([`WorkerLock::take_within`]): a worker that holds it and is
//! stopped (a paused VM, a frozen cgroup, `kill -STOP`) holds it until it runs again, and
//! the others go on with what needs no lock (recording the answers they hold, taking back
//! lost attempts) instead of waiting behind it.

use crate::spi::{self, Statement};
use pgrx::pg_sys;
use pgrx::spi::{SpiClient, SpiResult};
use std::time::Duration;

/// The last field of the tag of every lock here: neither 1 nor 2, which SQL can name.
pub const SPACE: u16 = 0x6f62; // "ob"
/// The first key of every lock here.
pub const KEY: u32 = 0x6f62_6f78; // "obox"

/// One lock of the workers of a database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerLock {
    number: u32,
    pub name: &'static str,
}

/// Serializes the claims: a claim counts each channel's attempts under way to leave room for
/// `max_in_flight`, and passes over messages already in a claim. Behind this lock its
/// statement's snapshot holds every claim committed before it (`crate::worker::claim`).
pub const CLAIMS: WorkerLock = WorkerLock {
    number: 1,
    name: "the claim lock",
};
/// One worker holds messages behind their ordering key at a time (`crate::worker::key_hold`).
pub const KEY_HOLDS: WorkerLock = WorkerLock {
    number: 2,
    name: "the lock of holding behind ordering keys",
};
/// One round of the ledger's retention at a time (`crate::ledger`).
pub const LEDGER_ROUNDS: WorkerLock = WorkerLock {
    number: 3,
    name: "the lock of the ledger's retention",
};

/// The process that holds a lock of this space (`$1`: its number), as `pg_locks` shows it.
static HOLDER: Statement = Statement::planned_once(
    "
SELECT l.pid FROM pg_catalog.pg_locks l
 WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory'
   AND l.database OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database d
                                           WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
   AND l.classid OPERATOR(pg_catalog.=) $1::int8::oid AND l.objid OPERATOR(pg_catalog.=) $2::int8::oid
   AND l.objsubid OPERATOR(pg_catalog.=) $3::int2 AND l.granted
 LIMIT 1",
);

impl WorkerLock {
    fn tag(&self) -> pg_sys::LOCKTAG {
        // SET_LOCKTAG_ADVISORY: the database, three keys, the advisory type of the user
        // lock method, as the SQL functions build it, with SPACE where they put 1 or 2.
        pg_sys::LOCKTAG {
            locktag_field1: unsafe { pg_sys::MyDatabaseId }.into(),
            locktag_field2: KEY,
            locktag_field3: self.number,
            locktag_field4: SPACE,
            locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
            locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
        }
    }

    /// Takes the lock for the rest of the transaction when no other process holds it;
    /// false when one does. Never waits.
    pub fn try_take(&self) -> bool {
        let tag = self.tag();
        // SAFETY: a transaction-scoped lock on a tag built above; with dontWait the call
        // returns at once and raises nothing for a lock held elsewhere.
        let got = unsafe { pg_sys::LockAcquire(&tag, pg_sys::ExclusiveLock as i32, false, true) };
        got != pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
    }

    /// Takes the lock for the rest of the transaction, waiting at most `wait` in the lock's
    /// queue (first come, first served, as any lock wait); false when the wait ran out or
    /// was cancelled. The wait runs in a subtransaction under a `lock_timeout` of its own,
    /// so that its end rolls back nothing but the wait.
    pub fn take_within(&self, wait: Duration) -> bool {
        if self.try_take() {
            return true;
        }
        let tag = self.tag();
        let timeout_ms = wait.as_millis().clamp(1, i32::MAX as u128) as i32;
        let waited = crate::spi::subtransaction(|| -> Result<(), String> {
            // SAFETY: lock_timeout is read by the lock wait below (ProcSleep arms and
            // disarms its timer); the session's own value (0, pinned by the worker) is
            // put back on both paths below, before anything else waits for a lock.
            unsafe {
                pg_sys::LockTimeout = timeout_ms;
                pg_sys::LockAcquire(&tag, pg_sys::ExclusiveLock as i32, false, false);
            }
            Ok(())
        });
        // SAFETY: the worker's session value of lock_timeout (spi::pin: 0).
        unsafe { pg_sys::LockTimeout = 0 };
        // A lock taken in the subtransaction passes to the transaction when it is released.
        waited.is_ok()
    }

    /// The process that holds the lock now, if any.
    pub fn holder(&self, client: &SpiClient<'_>) -> SpiResult<Option<i32>> {
        let rows = spi::run(
            client,
            &HOLDER,
            Some(1),
            &[
                i64::from(KEY).into(),
                i64::from(self.number).into(),
                (SPACE as i16).into(),
            ],
        )?;
        if rows.is_empty() {
            return Ok(None);
        }
        rows.first().get::<i32>(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_sql_advisory_function_names_this_space() {
        // The SQL functions write 1 for an int8 key and 2 for two int4 keys.
        assert_ne!(SPACE, 1);
        assert_ne!(SPACE, 2);
    }

    #[test]
    fn every_lock_has_a_number_of_its_own() {
        let all = [CLAIMS, KEY_HOLDS, LEDGER_ROUNDS];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a.number, b.number, "{} and {}", a.name, b.name);
            }
        }
    }
}
