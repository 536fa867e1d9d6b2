//! Reconcile: an ambiguous outcome is settled by asking the provider, read-only, whether it
//! has the message — never by sending it again. Found → `delivered` with the provider's
//! external id and a ledger entry `recorded_by = reconcile`; not found → requeued with the
//! same effect key (or `exhausted` when its budget is spent); no usable answer → stays
//! `uncertain` and is looked up again later with backoff.
//!
//! The worker reconciles due `uncertain` messages on its own; `outbox.reconcile(id)` and
//! `outbox.reconcile()` do the same on demand.

use crate::channels::http::Transport;
use crate::channels::lookup::{Lookup, Subject};
use crate::channels::options::ChannelOptions;
use crate::channels::remote;
use crate::clock::now_ms;
use crate::error::{spi_failure, OrRaise, OutboxError};
use crate::gucs;
use crate::ledger;
use crate::outbox::state::State;
use crate::retry_policy::DEFAULT_MAX_ATTEMPTS;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};

/// Applies a lookup that concluded nothing final — not found, or no usable answer — to one
/// message, and records it as an attempt of kind `reconcile`. A message that is `sending`
/// or already `delivered` is left alone. Returns the message's state afterwards (no row if
/// it was left alone). `$2` is the answer (`not_found` or `unavailable`); `$7` is the
/// default `retry.max_attempts`, for options changed by hand into no number. A not-found
/// answer requeues the message only once its settle window has passed on the wall clock
/// and, when it was written on the boot clock of this boot (`$9`, the boot id; `$10`, the
/// boot clock now), on that clock too: a step forward of the wall clock must not turn an
/// answer that came too early into a resend.
const RECORD_LOOKUP: &str = "
WITH cur AS (
    SELECT m.id, m.state,
           (m.attempts::int8 - m.budget_base) >= coalesce(outbox._option_int(c.options, '{retry,max_attempts}'), $7) AS spent,
           last_send.at + $6::int8 * interval '1 millisecond' AS settled_at,
           (m.settle_boot_ms IS NULL OR m.settle_boot_id IS DISTINCT FROM $9::uuid
            OR m.settle_boot_ms <= $10) AS settled_on_boot_clock
      FROM outbox._messages m
      LEFT JOIN outbox._channels c ON c.id = m.channel_id
      LEFT JOIN LATERAL (SELECT max(a.started_at) AS at FROM outbox._attempts a
                          WHERE a.message_id = m.id AND a.kind = 'send') last_send ON true
     WHERE m.id = $1
), verdict AS (
    -- A not-found answer is believed only once the last attempt has settled at the provider.
    SELECT cur.*, $2 = 'not_found' AND cur.state = 'uncertain'
                  AND (cur.settled_at IS NULL OR cur.settled_at <= now())
                  AND cur.settled_on_boot_clock AS requeue
      FROM cur
), m AS (
    UPDATE outbox._messages m
       SET state = CASE WHEN v.requeue AND v.spent THEN 'exhausted'::outbox.state
                        WHEN v.requeue THEN 'queued'::outbox.state
                        ELSE m.state END,
           next_attempt_at = CASE WHEN v.requeue THEN now()
                                  WHEN $2 = 'not_found' THEN greatest(v.settled_at, now() + interval '100 milliseconds')
                                  WHEN $4::int8 IS NOT NULL THEN to_timestamp($4::int8 / 1000.0)
                                  ELSE m.next_attempt_at END,
           last_error = $3,
           reconcile_attempts = least(m.reconcile_attempts, 2147483646) + 1,
           updated_at = now()
      FROM verdict v
     WHERE m.id = v.id AND m.state <> 'delivered'
       AND m.id NOT IN (SELECT pg_catalog.unnest(w.message_ids) FROM outbox._claims w)
 RETURNING m.id, m.tenant, m.effect_key, m.attempts, m.state
), attempt AS (
    INSERT INTO outbox._attempts (message_id, tenant, attempt, kind, finished_at, outcome, http_status, error,
                                  effect_key_sent, worker_pid)
    SELECT m.id, m.tenant, m.attempts, 'reconcile', now(), $2, $8, $3,
           outbox._provider_key(m.tenant, m.effect_key), $5 FROM m
)
SELECT m.state::text FROM m";

/// A lookup that found the message, after the ledger recorded it
/// (`crate::ledger::record_delivered`): counts the lookup and records it as an attempt of
/// kind `reconcile`.
/// The message has usually moved into its ledger entry by then; one that stayed in the queue
/// table (its effect was recorded already) counts the lookup on its row.
const RECORD_FOUND: &str = "
WITH kept AS (
    UPDATE outbox._messages m
       SET reconcile_attempts = least(m.reconcile_attempts, 2147483646) + 1
     WHERE m.id = $1
 RETURNING m.id, m.tenant, m.effect_key, m.attempts
), m AS (
    SELECT * FROM kept
    UNION ALL
    SELECT l.message_id, l.tenant, l.effect_key, l.attempts
      FROM outbox._ledger l
     WHERE l.message_id = $1 AND l.channel_id IS NOT NULL AND NOT EXISTS (SELECT 1 FROM kept)
)
INSERT INTO outbox._attempts (message_id, tenant, attempt, kind, finished_at, outcome, http_status,
                              external_id, effect_key_sent, worker_pid)
SELECT m.id, m.tenant, m.attempts, 'reconcile', now(), 'delivered', $2, $4,
       outbox._provider_key(m.tenant, m.effect_key), $3 FROM m";

/// One message with what a lookup needs, locked for the caller's transaction. Another
/// tenant's message is not found, exactly as an id that does not exist.
const LOCK_SUBJECT: &str = "
SELECT m.state::text, outbox._provider_key(m.tenant, m.effect_key), m.external_id, m.payload::text,
       (outbox._epoch_ms(m.created_at) / 1000.0)::int8, m.reconcile_attempts, c.id, c.options::text,
       c.endpoint
  FROM outbox._messages m
  LEFT JOIN outbox._channels c ON c.id = m.channel_id
 WHERE m.id = $1 AND outbox._tenant_visible(m.tenant)
   FOR UPDATE OF m";

/// Is message `$1` in the ledger (delivered, and moved out of the queue table)? Another
/// tenant's entry is not found.
const IN_LEDGER: &str = "
SELECT 1 FROM outbox._ledger l WHERE l.message_id = $1 AND outbox._tenant_visible(l.tenant) LIMIT 1";

/// Every `uncertain` message of the caller's tenants on a channel that can reconcile.
const RECONCILABLE: &str = "
SELECT m.id
  FROM outbox._messages m
  JOIN outbox._channels c ON c.id = m.channel_id
 WHERE m.state = 'uncertain' AND outbox._can_look_up(c.options)
   AND outbox._tenant_visible(m.tenant)
 ORDER BY m.id";

/// When the next lookup is due after one that concluded nothing: the channel's backoff
/// ceiling for the number of lookups so far (no jitter: lookups are read-only and few).
pub fn next_lookup_at_ms(options: &ChannelOptions, lookups_so_far: i32, now_ms: i64) -> i64 {
    let delay = options
        .retry
        .backoff_ceiling_ms((lookups_so_far.max(0) as u32).saturating_add(1));
    now_ms.saturating_add(delay.min(i64::MAX as u64) as i64)
}

/// Records a lookup's result; returns the message's state afterwards (None when the
/// message was left alone: it is `sending`, or already `delivered`).
pub fn record_lookup(
    client: &mut SpiClient<'_>,
    message_id: i64,
    result: &Lookup,
    options: &ChannelOptions,
    lookups_so_far: i32,
    pid: i32,
) -> SpiResult<Option<String>> {
    let http_status = result.http_status().map(i32::from);
    let (error, next_at) = match result {
        Lookup::Found { external_id, .. } => {
            let confirmed = ledger::Confirmed {
                message_id,
                external_id: external_id.clone(),
                http_status,
            };
            if ledger::record_delivered(client, &[confirmed], ledger::Recorder::Reconcile)?
                .is_empty()
            {
                return Ok(None);
            }
            client.update(
                RECORD_FOUND,
                None,
                &[
                    message_id.into(),
                    http_status.into(),
                    pid.into(),
                    external_id.clone().into(),
                ],
            )?;
            return Ok(Some(State::Delivered.as_str().to_string()));
        }
        Lookup::NotFound { http_status } => (
            format!(
                "reconcile: the provider does not have it ({}); requeued with the same effect key once the last attempt has settled",
                http_status.map_or("no message with its key on the subject".to_string(), |s| format!("HTTP {s}"))
            ),
            None,
        ),
        Lookup::Unavailable { error, .. } => (
            format!("reconcile: {error}; still uncertain, looked up again later"),
            Some(next_lookup_at_ms(options, lookups_so_far, now_ms())),
        ),
    };
    let rows = client.update(
        RECORD_LOOKUP,
        None,
        &[
            message_id.into(),
            result.as_str().into(),
            error.into(),
            next_at.into(),
            pid.into(),
            (options.reconcile_settle_ms().min(i64::MAX as u64) as i64).into(),
            (DEFAULT_MAX_ATTEMPTS as i32).into(),
            http_status.into(),
            crate::clock::boot_id().map(str::to_string).into(),
            crate::clock::boot_ms().into(),
        ],
    )?;
    if rows.is_empty() {
        return Ok(None);
    }
    rows.first().get_one::<String>()
}

/// Runs a lookup from a backend ([`crate::runtime::wait_in_backend`]: a cancel, a
/// terminate or `statement_timeout` ends the call at once, and nothing of the lookup is
/// recorded). The lookup is bounded by the channel's timeout and held to this session's
/// `outbox.allowed_hosts`.
fn lookup_from_backend(
    channel_id: i32,
    endpoint: &str,
    options: &ChannelOptions,
    subject: &Subject,
) -> Lookup {
    let unavailable = |error: String| Lookup::Unavailable {
        error,
        http_status: None,
    };
    let mut transport = Transport::default();
    if let Some(Err(e)) = transport.set_allowed_hosts(&gucs::allowed_hosts()) {
        return unavailable(format!(
            "lookup not sent: outbox.allowed_hosts is invalid: {e}"
        ));
    }
    let mut origins = crate::channels::wire::Origins::default();
    let channel = match remote::open(
        &mut transport,
        &mut origins,
        channel_id,
        "",
        endpoint,
        options,
        1,
    ) {
        Ok(c) => c,
        Err(e) => return unavailable(e),
    };
    crate::runtime::wait_in_backend(channel.lookup(subject, transport.allowed()))
        .unwrap_or_else(|e| unavailable(format!("the lookup ended without an answer: {e}")))
}

fn unknown_message(id: i64) -> ! {
    pgrx::pg_sys::panic::ErrorReport::new(
        PgSqlErrorCode::ERRCODE_NO_DATA,
        format!("message {id} does not exist"),
        "outbox_delivery",
    )
    .set_hint("Find messages in outbox.messages or outbox.work_queue; delivered messages older than outbox.retention are removed.")
    .report(PgLogLevel::ERROR);
    unreachable!()
}

/// What `outbox.reconcile(id)` answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// The message is delivered: already, or the provider has it.
    Delivered,
    /// The provider does not have it.
    NotFound,
    /// No usable answer; nothing is concluded.
    Unavailable,
    /// The channel has no lookup (or cannot build one for this message).
    NotSupported,
}

impl Answer {
    fn as_str(self) -> &'static str {
        match self {
            Answer::Delivered => "delivered",
            Answer::NotFound => "not_found",
            Answer::Unavailable => "unavailable",
            Answer::NotSupported => "not_supported",
        }
    }

    fn of(lookup: &Lookup) -> Answer {
        match lookup {
            Lookup::Found { .. } => Answer::Delivered,
            Lookup::NotFound { .. } => Answer::NotFound,
            Lookup::Unavailable { .. } => Answer::Unavailable,
        }
    }
}

/// Reconciles one message in the current transaction (the message row stays locked until it
/// ends, so that two operators cannot act on it at once).
fn reconcile_locked(client: &mut SpiClient<'_>, id: i64) -> SpiResult<Answer> {
    let rows = client.update(LOCK_SUBJECT, Some(1), &[id.into()])?;
    if rows.is_empty() {
        if client.select(IN_LEDGER, Some(1), &[id.into()])?.is_empty() {
            unknown_message(id);
        }
        return Ok(Answer::Delivered);
    }
    let row = rows.first();
    let state: String = row.get(1)?.unwrap_or_default();
    let subject = Subject {
        effect_key: row.get(2)?.unwrap_or_default(),
        external_id: row.get(3)?,
        payload: row.get(4)?.unwrap_or_else(|| "null".into()),
        created_at_s: row.get(5)?.unwrap_or_default(),
    };
    let lookups_so_far: i32 = row.get(6)?.unwrap_or_default();
    let channel_options: Option<String> = row.get(8)?;
    if state == State::Delivered.as_str() {
        return Ok(Answer::Delivered);
    }
    let Some(options) = channel_options
        .and_then(|raw| serde_json::from_str(&raw).ok())
        .and_then(|v: serde_json::Value| ChannelOptions::from_json(&v).ok())
    else {
        return Ok(Answer::NotSupported);
    };
    if !options.can_look_up() {
        return Ok(Answer::NotSupported);
    }
    let channel_id: i32 = row.get(7)?.unwrap_or_default();
    let endpoint: String = row.get(9)?.unwrap_or_default();
    let result = lookup_from_backend(channel_id, &endpoint, &options, &subject);
    let pid = unsafe { pgrx::pg_sys::MyProcPid };
    record_lookup(client, id, &result, &options, lookups_so_far, pid)?;
    Ok(Answer::of(&result))
}

/// `outbox.reconcile(id)`: a read-only lookup at the provider; never sends the message.
#[pg_extern(name = "reconcile", volatile, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn reconcile_one(id: Option<i64>) -> &'static str {
    let id = id
        .ok_or_else(|| {
            OutboxError::invalid_argument(
                "id",
                "must not be NULL",
                "Pass a message id from outbox.work_queue.",
            )
        })
        .or_raise();
    Spi::connect_mut(|client| reconcile_locked(client, id))
        .unwrap_or_else(|e| spi_failure(e))
        .as_str()
}

/// `outbox.reconcile()`: every `uncertain` message on a channel that can reconcile.
#[pg_extern(name = "reconcile", volatile, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn reconcile_all() -> TableIterator<
    'static,
    (
        name!(checked, i32),
        name!(delivered, i32),
        name!(not_found, i32),
        name!(unavailable, i32),
    ),
> {
    let counts = Spi::connect_mut(|client| -> SpiResult<(i32, i32, i32, i32)> {
        let ids: Vec<i64> = client
            .select(RECONCILABLE, None, &[])?
            .filter_map(|row| row.get::<i64>(1).ok().flatten())
            .collect();
        let mut counts = (0, 0, 0, 0);
        for id in ids {
            counts.0 += 1;
            match reconcile_locked(client, id)? {
                Answer::Delivered => counts.1 += 1,
                Answer::NotFound => counts.2 += 1,
                Answer::Unavailable | Answer::NotSupported => counts.3 += 1,
            }
        }
        Ok(counts)
    })
    .unwrap_or_else(|e| spi_failure(e));
    TableIterator::once(counts)
}

extension_sql!(
    r#"
COMMENT ON FUNCTION outbox.reconcile(bigint) IS
    'Read-only lookup at the provider for one message; never sends it. Returns delivered, not_found, unavailable or not_supported. Unknown id: error 02000.';
COMMENT ON FUNCTION outbox.reconcile() IS
    'Reconciles every uncertain message on channels that can look messages up; returns the counts.';
"#,
    name = "reconcile_comments",
    requires = [reconcile_one, reconcile_all]
);
