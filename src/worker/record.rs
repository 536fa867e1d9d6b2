//! Record: one transaction per batch. A confirmed delivery writes the ledger entry, marks
//! the message delivered and closes its attempt, atomically; any other outcome moves the
//! message to its next state and closes the attempt with its classified facts.

use crate::classify::Class;
use crate::outbox::state::State;
use crate::worker::decide::Verdict;
use pgrx::spi::{SpiClient, SpiResult};

/// Confirmed effects. The ledger insert is the barrier for every later attempt; a message
/// already delivered (by another worker or reconcile) keeps its first record.
const RECORD_DELIVERED: &str = "
WITH d AS (
    SELECT * FROM unnest($1::int8[], $2::int8[], $3::text[], $4::int4[], $5::text[])
        AS d(message_id, attempt_id, external_id, http_status, outcome)
), m AS (
    UPDATE outbox._messages m
       SET state = 'delivered',
           delivered_at = now(),
           updated_at = now(),
           external_id = coalesce(d.external_id, m.external_id),
           last_http_status = coalesce(d.http_status, m.last_http_status),
           lease_until = NULL,
           lease_owner = NULL
      FROM d
     WHERE m.id = d.message_id AND m.state <> 'delivered'
 RETURNING m.id, m.tenant, m.effect_key, d.external_id
), l AS (
    INSERT INTO outbox._ledger (tenant, effect_key, message_id, external_id, recorded_by)
    SELECT m.tenant, m.effect_key, m.id, m.external_id, 'worker' FROM m
        ON CONFLICT (tenant, effect_key) DO NOTHING
)
UPDATE outbox._attempts a
   SET finished_at = now(), outcome = d.outcome, http_status = d.http_status, external_id = d.external_id
  FROM d
 WHERE a.id = d.attempt_id";

/// Every other outcome. Applies only while the message is still in the attempt that
/// produced it (`sending`, same attempt number): a late answer never overrides a newer state.
const RECORD_SETTLED: &str = "
WITH o AS (
    SELECT * FROM unnest($1::int8[], $2::int8[], $3::int4[], $4::text[], $5::int8[], $6::text[],
                         $7::text[], $8::int4[], $9::int8[], $10::text[])
        AS o(message_id, attempt_id, attempt, state, next_at_ms, error_class, error, http_status,
             retry_after_ms, outcome)
), m AS (
    UPDATE outbox._messages m
       SET state = o.state::outbox.state,
           next_attempt_at = CASE WHEN o.next_at_ms IS NULL THEN m.next_attempt_at
                                  ELSE to_timestamp(o.next_at_ms / 1000.0) END,
           last_error_class = o.error_class::outbox.error_class,
           last_error = o.error,
           last_http_status = o.http_status,
           lease_until = NULL,
           lease_owner = NULL,
           updated_at = now()
      FROM o
     WHERE m.id = o.message_id AND m.state = 'sending' AND m.attempts = o.attempt
 RETURNING m.id
)
UPDATE outbox._attempts a
   SET finished_at = now(),
       outcome = o.outcome,
       error_class = o.error_class::outbox.error_class,
       http_status = o.http_status,
       error = o.error,
       retry_after_ms = o.retry_after_ms
  FROM o
 WHERE a.id = o.attempt_id AND a.finished_at IS NULL";

/// The recovery decision for an attempt interrupted by a stopped worker, as its own row.
const RECORD_RECOVERY_ROWS: &str = "
INSERT INTO outbox._attempts (message_id, attempt, kind, finished_at, outcome, error_class, error,
                              effect_key_sent, worker_pid)
SELECT o.message_id, o.attempt, 'recovery', now(), o.outcome, 'ambiguous', o.error, m.effect_key, $5
  FROM unnest($1::int8[], $2::int4[], $3::text[], $4::text[]) AS o(message_id, attempt, outcome, error)
  JOIN outbox._messages m ON m.id = o.message_id";

/// One confirmed delivery.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub message_id: i64,
    pub attempt_id: i64,
    pub external_id: Option<String>,
    pub http_status: Option<i32>,
    pub outcome: String,
}

/// One outcome other than a delivery.
#[derive(Debug, Clone)]
pub struct Settlement {
    pub message_id: i64,
    pub attempt_id: i64,
    pub attempt: i32,
    pub verdict: Verdict,
}

#[derive(Debug, Default)]
pub struct Outcomes {
    pub delivered: Vec<Delivery>,
    pub settled: Vec<Settlement>,
}

impl Outcomes {
    pub fn push(&mut self, message_id: i64, attempt_id: i64, attempt: i32, verdict: Verdict) {
        if verdict.state == State::Delivered {
            self.delivered.push(Delivery {
                message_id,
                attempt_id,
                external_id: verdict.external_id,
                http_status: verdict.http_status.map(i32::from),
                outcome: verdict.outcome,
            });
        } else {
            self.settled.push(Settlement {
                message_id,
                attempt_id,
                attempt,
                verdict,
            });
        }
    }

    pub fn is_empty(&self) -> bool {
        self.delivered.is_empty() && self.settled.is_empty()
    }
}

pub fn record(client: &mut SpiClient<'_>, outcomes: &Outcomes) -> SpiResult<()> {
    if !outcomes.delivered.is_empty() {
        let d = &outcomes.delivered;
        client.update(
            RECORD_DELIVERED,
            None,
            &[
                d.iter().map(|x| x.message_id).collect::<Vec<_>>().into(),
                d.iter().map(|x| x.attempt_id).collect::<Vec<_>>().into(),
                d.iter()
                    .map(|x| x.external_id.clone())
                    .collect::<Vec<_>>()
                    .into(),
                d.iter().map(|x| x.http_status).collect::<Vec<_>>().into(),
                d.iter()
                    .map(|x| x.outcome.clone())
                    .collect::<Vec<_>>()
                    .into(),
            ],
        )?;
    }
    if !outcomes.settled.is_empty() {
        let s = &outcomes.settled;
        client.update(
            RECORD_SETTLED,
            None,
            &[
                s.iter().map(|x| x.message_id).collect::<Vec<_>>().into(),
                s.iter().map(|x| x.attempt_id).collect::<Vec<_>>().into(),
                s.iter().map(|x| x.attempt).collect::<Vec<_>>().into(),
                s.iter()
                    .map(|x| x.verdict.state.as_str().to_string())
                    .collect::<Vec<_>>()
                    .into(),
                s.iter()
                    .map(|x| x.verdict.next_at_ms)
                    .collect::<Vec<_>>()
                    .into(),
                s.iter()
                    .map(|x| {
                        x.verdict
                            .class
                            .map(|c: Class| c.as_str().to_string())
                            .filter(|c| c != "delivered")
                    })
                    .collect::<Vec<_>>()
                    .into(),
                s.iter()
                    .map(|x| x.verdict.error.clone())
                    .collect::<Vec<_>>()
                    .into(),
                s.iter()
                    .map(|x| x.verdict.http_status.map(i32::from))
                    .collect::<Vec<_>>()
                    .into(),
                s.iter()
                    .map(|x| {
                        x.verdict
                            .retry_after_ms
                            .map(|v| v.min(i64::MAX as u64) as i64)
                    })
                    .collect::<Vec<_>>()
                    .into(),
                s.iter()
                    .map(|x| x.verdict.outcome.clone())
                    .collect::<Vec<_>>()
                    .into(),
            ],
        )?;
    }
    Ok(())
}

/// Adds a `recovery` attempt row for each recovered message.
pub fn record_recovery_rows(
    client: &mut SpiClient<'_>,
    recovered: &[Settlement],
    pid: i32,
) -> SpiResult<()> {
    if recovered.is_empty() {
        return Ok(());
    }
    client.update(
        RECORD_RECOVERY_ROWS,
        None,
        &[
            recovered
                .iter()
                .map(|x| x.message_id)
                .collect::<Vec<_>>()
                .into(),
            recovered
                .iter()
                .map(|x| x.attempt)
                .collect::<Vec<_>>()
                .into(),
            recovered
                .iter()
                .map(|x| x.verdict.outcome.clone())
                .collect::<Vec<_>>()
                .into(),
            recovered
                .iter()
                .map(|x| x.verdict.error.clone())
                .collect::<Vec<_>>()
                .into(),
            pid.into(),
        ],
    )?;
    Ok(())
}
