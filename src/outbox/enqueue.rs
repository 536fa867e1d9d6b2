//! `outbox.enqueue(channel, payload, effect_key, ordering_key, not_before, headers)`: writes
//! a message in the caller's transaction.
//!
//! An application calls it once per business transaction, so its cost is paid on the
//! application's critical path. It is a C-language function: the arguments are checked in
//! Rust (`enqueue_check`), the tenant and the channel come from caches kept for the session
//! (`tenancy`, `config_cache`), and the row is written by one INSERT whose plan is kept for
//! the session (`spi::pinned`). The payload and headers reach that INSERT as the
//! caller's jsonb datums, never converted.
//!
//! It is declared `SECURITY DEFINER` (writers have no INSERT right on the tables) without a
//! `SET search_path` clause: its statements are schema-qualified and run under a pinned
//! search path, which `spi::pinned` explains.
//!
//! The rare path, an effect key that already names a message, is
//! `outbox._enqueue_existing` in `sql/api.sql`.

use super::enqueue_check;
use super::wake;
use crate::config_cache::SessionCache;
use crate::spi::pinned::{self, PinnedStatement};
use crate::tenancy;
use pgrx::datum::TimestampWithTimeZone;
use pgrx::fcinfo::{pg_arg_is_null, pg_getarg, pg_getarg_datum_raw};
use pgrx::pg_sys;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::{PgLogLevel, PgSqlErrorCode};
use std::ffi::CStr;
use std::rc::Rc;

/// The arguments, in the order of the SQL signature.
const CHANNEL_NAME: usize = 0;
const PAYLOAD: usize = 1;
const EFFECT_KEY: usize = 2;
const ORDERING_KEY: usize = 3;
const NOT_BEFORE: usize = 4;
const HEADERS: usize = 5;

thread_local! {
    /// Inserts the message if its (tenant, effect key) is new: neither queued nor in the
    /// ledger, where a delivered message moves; returns its id.
    /// $1 tenant, $2 channel id, $3 effect key, $4 ordering key, $5 payload, $6 headers,
    /// $7 not_before.
    static INSERT_MESSAGE: PinnedStatement = const { PinnedStatement::new(
        c"INSERT INTO outbox._messages AS m
                 (tenant, channel_id, effect_key, ordering_key, payload, headers, not_before, next_attempt_at)
          SELECT $1, $2, $3, $4, $5, $6, $7, GREATEST(pg_catalog.now(), $7)
           WHERE NOT EXISTS (SELECT 1 FROM outbox._ledger l
                              WHERE l.tenant OPERATOR(pg_catalog.=) $1
                                AND l.effect_key OPERATOR(pg_catalog.=) $3)
          ON CONFLICT (tenant, effect_key) DO NOTHING
          RETURNING m.id",
        &[
            pg_sys::TEXTOID,
            pg_sys::INT4OID,
            pg_sys::TEXTOID,
            pg_sys::TEXTOID,
            pg_sys::JSONBOID,
            pg_sys::JSONBOID,
            pg_sys::TIMESTAMPTZOID,
        ],
    ) };

    /// When nothing was inserted: the id of the message the effect key already names, queued
    /// or delivered (with a warning if its channel or payload differs). $1 channel id, $2 payload,
    /// $3 effect key, $4 tenant.
    static EXISTING_MESSAGE: PinnedStatement = const { PinnedStatement::new(
        c"SELECT outbox._enqueue_existing($1, $2, $3, $4)",
        &[pg_sys::INT4OID, pg_sys::JSONBOID, pg_sys::TEXTOID, pg_sys::TEXTOID],
    ) };

    /// A channel by name: its id, whether it is paused, the tenants it serves (`tenants`,
    /// a JSON array) and the headers that carry the effect key on it.
    static CHANNEL: PinnedStatement = const { PinnedStatement::new(
        c"SELECT c.id, c.paused,
                 (c.options OPERATOR(pg_catalog.->) 'tenants')::pg_catalog.text,
                 c.options OPERATOR(pg_catalog.->>) 'idempotency_header',
                 c.options OPERATOR(pg_catalog.->>) 'reference_header'
            FROM outbox._channels c WHERE c.name OPERATOR(pg_catalog.=) $1",
        &[pg_sys::TEXTOID],
    ) };

    /// Channels by name.
    static CHANNELS: SessionCache<String, Rc<Channel>> = SessionCache::new();
}

/// What enqueue needs of a channel.
#[derive(Clone)]
struct Channel {
    id: i32,
    /// A paused channel sends nothing: no worker needs to wake for it (resume_channel wakes
    /// them).
    paused: bool,
    /// The tenants that may enqueue on it; `None`: every tenant (`["*"]`, the default).
    tenants: Option<Vec<String>>,
    /// Its idempotency and reference headers, which a message may not set.
    key_headers: Vec<String>,
}

impl Channel {
    fn serves(&self, tenant: &str) -> bool {
        self.tenants
            .as_ref()
            .is_none_or(|tenants| tenants.iter().any(|t| t == tenant))
    }
}

/// The `tenants` option as stored (validated by `create_channel`); `None` for every tenant.
/// A value that is not an array of strings (a row changed by hand) serves no tenant.
fn served_tenants(text: Option<String>) -> Option<Vec<String>> {
    let text = text?;
    let tenants: Vec<String> = serde_json::from_str(&text).unwrap_or_default();
    (!tenants.iter().any(|t| t == "*")).then_some(tenants)
}

/// A text column of the last statement's row 0, copied out of SPI's memory.
unsafe fn text_column(n: i32) -> Option<String> {
    pinned::column(0, n).and_then(|d| String::from_datum(d, false))
}

/// The channel named `name`; 42704 if there is none.
fn channel(name: Option<&str>) -> Rc<Channel> {
    let read = |name: &str| unsafe {
        pinned::connected(|| {
            CHANNEL.with(|s| s.execute(&[Some(text_datum(name))]));
            (pinned::rows() == 1).then(|| {
                Rc::new(Channel {
                    id: pinned::column(0, 1).expect("id is NOT NULL").value() as i32,
                    paused: pinned::column(0, 2).is_some_and(|d| d.value() != 0),
                    tenants: served_tenants(text_column(3)),
                    key_headers: [text_column(4), text_column(5)]
                        .into_iter()
                        .flatten()
                        .collect(),
                })
            })
        })
    };
    let found = name.and_then(|name| CHANNELS.with(|cache| cache.get_or_fill(name, || read(name))));
    let Some(channel) = found else {
        ErrorReport::new(
            PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT,
            format!("channel \"{}\" does not exist", name.unwrap_or("<NULL>")),
            "outbox_delivery",
        )
        .set_hint("Create it with outbox.create_channel(name, endpoint, options); list them in outbox.channels.")
        .report(PgLogLevel::ERROR);
        unreachable!("an ERROR report does not return")
    };
    channel
}

/// Refuses an enqueue on a channel that does not serve the tenant (42501). The message
/// names neither the tenants the channel serves nor any other option.
fn not_served(channel: &str, tenant: &str) -> ! {
    ErrorReport::new(
        PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
        format!("tenant \"{tenant}\" may not enqueue on channel \"{channel}\""),
        "outbox_delivery",
    )
    .set_detail("The channel's option tenants does not list this tenant.")
    .set_hint(
        "An outbox_admin adds the tenant with outbox.alter_channel(name, '{\"tenants\": [...]}').",
    )
    .report(PgLogLevel::ERROR);
    unreachable!("an ERROR report does not return")
}

#[no_mangle]
#[doc(hidden)]
pub extern "C" fn pg_finfo_outbox_enqueue() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

/// The C entry point of `outbox.enqueue` (declared in `sql/api.sql`).
///
/// # Safety
/// Called by the function manager with the six arguments of the SQL signature.
#[no_mangle]
#[pg_guard]
pub unsafe extern "C-unwind" fn outbox_enqueue(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    let datum = |n: usize| (!pg_arg_is_null(fcinfo, n)).then(|| pg_getarg_datum_raw(fcinfo, n));
    let effect_key: Option<&str> = pg_getarg(fcinfo, EFFECT_KEY);
    let ordering_key: Option<&str> = pg_getarg(fcinfo, ORDERING_KEY);
    let not_before: Option<TimestampWithTimeZone> = pg_getarg(fcinfo, NOT_BEFORE);
    let payload = datum(PAYLOAD);
    let headers = datum(HEADERS);

    let payload_bytes = payload.map(|p| json_text(p).to_bytes().len() as i32);
    let headers_text = headers.map(|h| json_text(h).to_string_lossy());
    if let Err(refusal) = enqueue_check::check(
        effect_key,
        ordering_key,
        not_before.is_some_and(|t| t.is_infinity() || t.is_neg_infinity()),
        payload_bytes,
        crate::gucs::max_payload_bytes(),
        headers_text.as_deref(),
    ) {
        refusal.raise();
    }
    let acting = tenancy::acting_tenant_of_caller();
    let channel_name: Option<&str> = pg_getarg(fcinfo, CHANNEL_NAME);
    if let Err(refusal) = enqueue_check::check_channel(channel_name) {
        refusal.raise();
    }
    let channel = channel(channel_name);
    if !channel.serves(&acting) {
        not_served(channel_name.unwrap_or_default(), &acting);
    }
    if let (Some(text), false) = (&headers_text, channel.key_headers.is_empty()) {
        let keys: Vec<&str> = channel.key_headers.iter().map(String::as_str).collect();
        if let Err(refusal) = enqueue_check::check_reserved_headers(text, &keys) {
            refusal.raise();
        }
    }
    let tenant = text_datum(&acting);
    let channel_id = Some(pg_sys::Datum::from(channel.id));

    let inserted = pinned::connected(|| {
        INSERT_MESSAGE.with(|s| {
            s.execute(&[
                Some(tenant),
                channel_id,
                datum(EFFECT_KEY),
                datum(ORDERING_KEY),
                payload,
                headers,
                datum(NOT_BEFORE),
            ])
        });
        (pinned::rows() == 1).then(|| pinned::column(0, 1).expect("id is NOT NULL"))
    });
    let id = match inserted {
        Some(id) => {
            if !channel.paused {
                wake::_wake_at_commit();
            }
            id
        }
        None => pinned::connected(|| {
            EXISTING_MESSAGE
                .with(|s| s.execute(&[channel_id, payload, datum(EFFECT_KEY), Some(tenant)]));
            pinned::column(0, 1).expect("_enqueue_existing returns an id or raises")
        }),
    };
    (*fcinfo).isnull = false;
    id
}

/// The JSON text of a jsonb datum (palloc'd in the current memory context).
unsafe fn json_text<'a>(jsonb: pg_sys::Datum) -> &'a CStr {
    CStr::from_ptr(pg_sys::OidOutputFunctionCall(
        pg_sys::Oid::from(pg_sys::F_JSONB_OUT),
        jsonb,
    ))
}

/// A text datum in the current memory context.
unsafe fn text_datum(s: &str) -> pg_sys::Datum {
    pg_sys::Datum::from(pg_sys::cstring_to_text_with_len(
        s.as_ptr() as *const _,
        s.len() as i32,
    ))
}
