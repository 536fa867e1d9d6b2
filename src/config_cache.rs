//! What `enqueue` reads in every call but changes rarely — the channels (name → id, paused)
//! and the tenant bindings of the session's role — is cached for the session.
//!
//! A cache is valid while the generation it was filled in is current. The generation moves
//! on every relation-cache invalidation this backend processes (and on any change of a
//! role or a role membership, which decides the bindings through `pg_has_role`). The
//! tables themselves send one: a statement trigger on `outbox._channels` and
//! `outbox._tenant_bindings` invalidates the table's relation cache entry whenever a
//! statement changes it, so every session sees the change at its next transaction (and
//! the changing session at its next statement). Unrelated DDL also moves the generation;
//! that only costs one lookup more.
//!
//! A cached value can be stale only within a transaction that began before a change
//! committed: for the channels that is a wake-up missed or sent in vain, never a message
//! lost (the worker's poll finds it), and channels are never deleted, so an id stays right.

use pgrx::pg_sys;
use pgrx::prelude::*;
use std::borrow::Borrow;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::hash::Hash;

thread_local! {
    static GENERATION: Cell<u64> = const { Cell::new(1) };
    static REGISTERED: Cell<bool> = const { Cell::new(false) };
    /// Moves only on an invalidation of `outbox._channels` (or of every relation): the
    /// worker's channels are read again after a change of that table alone, not after every
    /// ANALYZE of another table ([`channels_generation`]).
    static CHANNELS_GENERATION: Cell<u64> = const { Cell::new(1) };
    /// The table `outbox._channels`, once [`watch_channels`] named it; until then every
    /// relation's invalidation counts as one of it.
    static CHANNELS_OID: Cell<pg_sys::Oid> = const { Cell::new(pg_sys::InvalidOid) };
}

/// The current generation; a cache filled in an older one must be filled again.
pub fn generation() -> u64 {
    if !REGISTERED.replace(true) {
        unsafe {
            pg_sys::CacheRegisterRelcacheCallback(
                Some(on_relcache_invalidation),
                pg_sys::Datum::from(0),
            );
            for cache in [
                pg_sys::SysCacheIdentifier::AUTHOID,
                pg_sys::SysCacheIdentifier::AUTHMEMROLEMEM,
            ] {
                pg_sys::CacheRegisterSyscacheCallback(
                    cache as i32,
                    Some(on_syscache_invalidation),
                    pg_sys::Datum::from(0),
                );
            }
        }
        // Anything cached before the callbacks existed is forgotten.
        advance();
        advance_channels();
    }
    GENERATION.get()
}

/// The generation of what was read from `outbox._channels`: moves when a statement changed
/// that table (its trigger invalidates it) or the whole relation cache was reset.
pub fn channels_generation() -> u64 {
    generation();
    CHANNELS_GENERATION.get()
}

/// Whether [`watch_channels`] has named the table yet.
pub fn channels_watched() -> bool {
    CHANNELS_OID.get() != pg_sys::InvalidOid
}

/// Names the table whose invalidations move [`channels_generation`].
pub fn watch_channels(oid: pg_sys::Oid) {
    if CHANNELS_OID.replace(oid) != oid {
        advance_channels();
    }
}

/// Values read from the cached tables, by key, valid for one generation. Keep one in a
/// `thread_local!` (a backend has one thread).
pub struct SessionCache<K, V> {
    entries: RefCell<(u64, HashMap<K, V>)>,
}

impl<K: Eq + Hash, V: Clone> SessionCache<K, V> {
    pub fn new() -> Self {
        SessionCache {
            entries: RefCell::new((0, HashMap::new())),
        }
    }

    /// The value for `key`: cached if read in the current generation, else `fill()`'s,
    /// which is cached unless it is `None` (a name not found yet may be created).
    pub fn get_or_fill<Q>(&self, key: &Q, fill: impl FnOnce() -> Option<V>) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Eq + Hash + ToOwned<Owned = K> + ?Sized,
    {
        let generation = generation();
        {
            let (g, entries) = &*self.entries.borrow();
            if *g == generation {
                if let Some(value) = entries.get(key) {
                    return Some(value.clone());
                }
            }
        }
        let value = fill()?;
        let (g, entries) = &mut *self.entries.borrow_mut();
        if *g != generation {
            entries.clear();
            *g = generation;
        }
        entries.insert(key.to_owned(), value.clone());
        Some(value)
    }
}

impl<K: Eq + Hash, V: Clone> Default for SessionCache<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

fn advance() {
    GENERATION.set(GENERATION.get().wrapping_add(1));
}

fn advance_channels() {
    CHANNELS_GENERATION.set(CHANNELS_GENERATION.get().wrapping_add(1));
}

#[pg_guard]
unsafe extern "C-unwind" fn on_relcache_invalidation(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    advance();
    let watched = CHANNELS_OID.get();
    if relid == pg_sys::InvalidOid || watched == pg_sys::InvalidOid || relid == watched {
        advance_channels();
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_syscache_invalidation(_arg: pg_sys::Datum, _cache: i32, _hash: u32) {
    advance();
}

#[no_mangle]
#[doc(hidden)]
pub extern "C" fn pg_finfo_outbox_config_changed() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

/// The statement trigger `outbox._config_changed()` on the cached tables (`sql/schema.sql`,
/// `sql/tenancy.sql`): invalidates the table's relation cache entry, which every session
/// processes before it next reads the table.
///
/// # Safety
/// Called by the trigger manager.
#[no_mangle]
#[pg_guard]
pub unsafe extern "C-unwind" fn outbox_config_changed(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    let context = (*fcinfo).context;
    if context.is_null() || (*context).type_ != pg_sys::NodeTag::T_TriggerData {
        pgrx::error!("outbox._config_changed() runs only as a trigger");
    }
    let trigger = context as *mut pg_sys::TriggerData;
    pg_sys::CacheInvalidateRelcache((*trigger).tg_relation);
    pg_sys::Datum::from(0)
}
