//! The database a worker serves, and its extension, coming and going while the server runs.
//!
//! - A database that does not exist yet is waited for by a worker bound to no database
//!   (`mod.rs`, probe mode), which restarts itself to connect once it is there.
//! - `DROP DATABASE` (and `ALTER DATABASE … RENAME` or `SET TABLESPACE`) waits about five
//!   seconds for the other sessions of the database to leave, then fails; `WITH (FORCE)`
//!   terminates them. Both hold an `AccessExclusiveLock` on the database object meanwhile.
//!   A worker looks at least every second whether it could take an `AccessShareLock` on
//!   it; when it cannot, it leaves the database, says so once, and waits bound to none
//!   until a database of that name can be served again (a re-created one is served).
//! - `DROP EXTENSION` leaves the workers nothing to run: a worker that finds the extension
//!   gone says so once and waits, without a restart loop, for `CREATE EXTENSION`.

use crate::worker_slots as slots;
use pgrx::bgworkers::BackgroundWorker;
use pgrx::pg_sys;
use pgrx::prelude::*;

/// Whether delivery workers serve the connected database: the library is preloaded, it
/// runs workers, and the database is in `outbox.database`. Messages of a database that is
/// not served stay queued.
pub fn served_here() -> bool {
    if !slots::preloaded() || crate::gucs::workers() == 0 {
        return false;
    }
    // SAFETY: a backend connected to a database; the name is palloc'd in the current context.
    let name = unsafe {
        let p = pg_sys::get_database_name(pg_sys::MyDatabaseId);
        if p.is_null() {
            return false;
        }
        std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
    };
    crate::gucs::databases().contains(&name)
}

/// `outbox._database_served()`: [`served_here`], for `outbox.alerts`
/// (`database_not_served`).
#[pg_extern(stable, parallel_safe)]
fn _database_served() -> bool {
    served_here()
}

/// Does the extension exist in the connected database?
pub fn extension_exists() -> bool {
    BackgroundWorker::transaction(|| unsafe {
        pg_sys::get_extension_oid(c"outbox_delivery".as_ptr(), true) != pg_sys::InvalidOid
    })
}

/// Whether a session holds, or waits for, a lock on database `oid` that keeps other
/// sessions out of it (DROP DATABASE, ALTER DATABASE RENAME / SET TABLESPACE).
/// Inside a transaction.
unsafe fn excluded_from(oid: pg_sys::Oid) -> bool {
    let tag = pg_sys::LOCKTAG {
        locktag_field1: 0,
        locktag_field2: u32::from(pg_sys::DatabaseRelationId),
        locktag_field3: u32::from(oid),
        locktag_field4: 0,
        locktag_type: pg_sys::LockTagType::LOCKTAG_OBJECT as u8,
        locktag_lockmethodid: pg_sys::DEFAULT_LOCKMETHOD as u8,
    };
    let mode = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
    let got = pg_sys::LockAcquire(&tag, mode, false, true);
    if got == pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL {
        return true;
    }
    pg_sys::LockRelease(&tag, mode, false);
    false
}

/// Whether the database `name` can be served now: it exists and nobody is dropping it.
pub fn can_serve(name: &str) -> bool {
    let Ok(cname) = std::ffi::CString::new(name) else {
        return false;
    };
    BackgroundWorker::transaction(|| unsafe {
        let oid = database_oid(&cname);
        oid != pg_sys::InvalidOid && !excluded_from(oid)
    })
}

/// The OID of database `name`, or `InvalidOid`. Inside a transaction. Unlike
/// `get_database_oid`, it works in a process bound to no database whose shared relation
/// cache is not complete (one started before any session wrote `global/pg_internal.init`
/// after the server start): there it reads `pg_database` without its index, as PostgreSQL's
/// own `GetDatabaseTuple` does, because opening the index would read `pg_class`, which a
/// process bound to no database cannot do (FATAL).
unsafe fn database_oid(name: &std::ffi::CStr) -> pg_sys::Oid {
    let mut key: pg_sys::ScanKeyData = std::mem::zeroed();
    pg_sys::ScanKeyInit(
        &mut key,
        pg_sys::Anum_pg_database_datname as pg_sys::AttrNumber,
        pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
        pg_sys::Oid::from(pg_sys::F_NAMEEQ),
        pg_sys::Datum::from(name.as_ptr()),
    );
    let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
    let catalog = pg_sys::table_open(pg_sys::DatabaseRelationId, lock);
    let scan = pg_sys::systable_beginscan(
        catalog,
        pg_sys::Oid::from(pg_sys::DatabaseNameIndexId),
        pg_sys::criticalSharedRelcachesBuilt,
        std::ptr::null_mut(),
        1,
        &mut key,
    );
    let tuple = pg_sys::systable_getnext(scan);
    let oid = if tuple.is_null() {
        pg_sys::InvalidOid
    } else {
        (*pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_database>(tuple)).oid
    };
    pg_sys::systable_endscan(scan);
    pg_sys::table_close(catalog, lock);
    oid
}

/// What a connected worker finds around it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Surroundings {
    /// The database and the extension are there.
    Served,
    /// The database is being dropped (or renamed, or moved): the worker must leave it.
    DatabaseLeaving,
    /// The extension was dropped from the database.
    ExtensionGone,
}

/// Looks at the connected database and its extension (one short transaction).
pub fn look_around() -> Surroundings {
    BackgroundWorker::transaction(|| unsafe {
        if excluded_from(pg_sys::MyDatabaseId) {
            Surroundings::DatabaseLeaving
        } else if pg_sys::get_extension_oid(c"outbox_delivery".as_ptr(), true) == pg_sys::InvalidOid
        {
            Surroundings::ExtensionGone
        } else {
            Surroundings::Served
        }
    })
}

/// Leaves the worker's database or waits for its extension when either is going away:
/// one log line, then the worker exits and its next start waits, saying nothing more (a
/// database: bound to none, until one of that name can be served; an extension: until
/// `CREATE EXTENSION`). Returns when the database is served.
pub fn leave_if_gone(index: usize, database: &str, seen: Surroundings) {
    match seen {
        Surroundings::Served => {}
        Surroundings::DatabaseLeaving => {
            log!("outbox_delivery worker {index}: database \"{database}\" is being dropped, renamed or moved; the worker leaves it and serves a database of that name again when there is one");
            slots::update(index, |s| {
                s.connecting = true;
                s.told_gone = true;
            });
            unsafe { pg_sys::proc_exit(1) }
        }
        Surroundings::ExtensionGone => {
            log!("outbox_delivery worker {index}: extension outbox_delivery was dropped from database \"{database}\"; delivering nothing there until CREATE EXTENSION outbox_delivery");
            slots::update(index, |s| s.told_gone = true);
            unsafe { pg_sys::proc_exit(1) }
        }
    }
}

/// After a failed step (its error already caught): rolls the failed transaction back and
/// tells whether the step failed because the database or the extension is going away.
pub fn after_failure() -> Surroundings {
    // SAFETY: the error was caught and flushed (pgrx); the abort ends whatever transaction
    // the step had open, and leaves the worker in TopMemoryContext.
    unsafe { pg_sys::AbortCurrentTransaction() };
    look_around()
}
