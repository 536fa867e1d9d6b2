-- outbox_delivery: what operators and applications read.

-- A channel is shown to the roles that may use it: admins see every channel, writers and
-- operators those whose option tenants lists one of their tenants (or '*'). Secrets are
-- masked for everyone (src/channels/secrets.rs); admins read outbox._channels for them.
-- The view runs with its owner's rights, so it is a security barrier: a condition of the
-- reader's own is evaluated only on the rows its filter lets through, never first (the
-- filter, a function, costs more than any cheap condition the planner would put before it).
-- Which channels a role may see is outbox._channel_visible (sql/tenancy.sql).
CREATE VIEW outbox.channels WITH (security_barrier) AS
SELECT c.id,
       c.name,
       outbox._masked_url(c.endpoint) AS endpoint,
       -- Options that cannot be read as JSON are masked whole, a string: shown as they are.
       (SELECT CASE WHEN pg_catalog.jsonb_typeof(s.masked) = 'object' AND s.masked ? 'tenants'
                    THEN pg_catalog.jsonb_set(s.masked, '{tenants}',
                                              outbox._shown_tenants(s.masked -> 'tenants'))
                    ELSE s.masked END
          FROM (SELECT outbox._masked_options(c.options)) AS s(masked)) AS options,
       c.paused,
       c.paused_reason,
       c.paused_at,
       c.created_at,
       c.updated_at,
       outbox._in_flight_bound(c.options) AS in_flight_bound,
       outbox._in_flight_reason(c.options) AS in_flight_reason,
       CASE WHEN jsonb_typeof(c.options -> 'circuit') = 'object'
            THEN coalesce(f.circuit_state, 'closed') END AS circuit_state,
       f.circuit_since
  FROM outbox._channels c
  LEFT JOIN outbox._channel_flow f ON f.channel_id = c.id
 WHERE outbox._channel_visible(c.options -> 'tenants');
COMMENT ON VIEW outbox.channels IS
    'Delivery channels with their effective options, as far as the reader may use them; static header values and URL userinfo, query values and fragments are masked.';

-- Each message in flight (sql/schema.sql, outbox._claims) with its claim, as far as the
-- reader may see its message: the views below read a message's attempt under way here. A
-- security barrier, as outbox.channels is: it runs with its owner's rights.
CREATE VIEW outbox._under_way WITH (security_barrier) AS
SELECT u.message_id, c.channel_id, c.lease_owner, c.worker_pid, c.lease_until, c.started_at,
       c.id AS claim_id
  FROM outbox._claims c
 CROSS JOIN LATERAL pg_catalog.unnest(c.message_ids) AS u(message_id)
 WHERE (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname = current_user)
    OR EXISTS (SELECT 1 FROM outbox._messages m
                WHERE m.id = u.message_id AND m.tenant = ANY (outbox._visible_tenants()));
COMMENT ON VIEW outbox._under_way IS 'Messages in flight, one row each, with their claim (private).';

CREATE VIEW outbox.messages AS
SELECT m.id,
       m.tenant,
       c.name AS channel,
       -- A message in flight is `sending`, in the attempt after those its row counts.
       CASE WHEN w.message_id IS NOT NULL THEN 'sending'::outbox.state ELSE m.state END AS state,
       m.effect_key,
       m.ordering_key,
       -- Saturates, as the claim counts (src/worker/claim.rs): a counter at its limit, set
       -- by hand, must not fail the view.
       CASE WHEN w.message_id IS NOT NULL THEN least(m.attempts, 2147483646) + 1 ELSE m.attempts END AS attempts,
       outbox._option_int(c.options, '{retry,max_attempts}') AS max_attempts,
       -- queued: the next send; uncertain on a channel that can reconcile: the next lookup.
       CASE WHEN (m.state = 'queued' AND w.message_id IS NULL)
              OR (m.state = 'uncertain' AND outbox._can_look_up(c.options))
            THEN m.next_attempt_at END AS next_attempt_at,
       -- A delivered message has no error left: its earlier failures stay in
       -- outbox.attempts, one row each.
       CASE WHEN m.state <> 'delivered' THEN m.last_error_class END AS last_error_class,
       CASE WHEN m.state <> 'delivered' THEN m.last_error END AS last_error,
       m.last_http_status,
       m.external_id,
       m.owner,
       m.created_at,
       greatest(m.updated_at, w.started_at) AS updated_at,
       m.delivered_at,
       m.not_before,
       coalesce(w.lease_until, m.lease_until) AS lease_until,
       m.payload,
       m.headers
  FROM outbox._messages m
  LEFT JOIN outbox._under_way w ON w.message_id = m.id
  LEFT JOIN outbox.channels c ON c.id = m.channel_id
UNION ALL
-- Delivered messages: moved into their ledger entries by the record that confirmed them.
SELECT l.message_id,
       l.tenant,
       c.name,
       'delivered'::outbox.state,
       l.effect_key,
       l.ordering_key,
       l.attempts,
       outbox._option_int(c.options, '{retry,max_attempts}'),
       NULL::timestamptz,
       NULL::outbox.error_class,
       NULL::text,
       l.last_http_status,
       l.external_id,
       l.owner,
       l.created_at,
       l.recorded_at,
       l.recorded_at,
       l.not_before,
       NULL::timestamptz,
       l.payload,
       l.headers
  FROM outbox._ledger l
  LEFT JOIN outbox.channels c ON c.id = l.channel_id
 WHERE l.channel_id IS NOT NULL;
-- The caller's rights and row-level security apply; channels are read through the masked view.
ALTER VIEW outbox.messages SET (security_invoker = true);
COMMENT ON VIEW outbox.messages IS
    'Every message: state, attempts and budget, next attempt, last classified error, external id, owner; delivered messages are read from their ledger entries.';

-- A send is written to outbox._attempts once, with its outcome; while it is in progress
-- its claim is its row (finished_at NULL), unless the message still has a row of its own
-- for that attempt (a send open at the update from 0.1.0). A send that
-- delivered is not written at all: the delivered message holds everything its row would.
CREATE VIEW outbox.attempts AS
SELECT a.message_id,
       a.attempt,
       a.kind,
       a.started_at,
       a.finished_at,
       a.outcome,
       a.error_class,
       a.http_status,
       a.error,
       a.retry_after_ms,
       a.external_id,
       a.effect_key_sent,
       a.worker_pid,
       a.id AS attempt_id,
       a.tenant
  FROM outbox._attempts a
UNION ALL
SELECT m.id,
       least(m.attempts, 2147483646) + 1,
       'send'::text,
       w.started_at,
       NULL::timestamptz,
       NULL::text,
       NULL::outbox.error_class,
       NULL::integer,
       NULL::text,
       NULL::bigint,
       NULL::text,
       outbox._provider_key(m.tenant, m.effect_key),
       w.worker_pid,
       NULL::bigint,
       m.tenant
  FROM outbox._under_way w
  JOIN outbox._messages m ON m.id = w.message_id
 WHERE NOT EXISTS (SELECT 1 FROM outbox._attempts o
                    WHERE o.message_id = m.id AND o.attempt = least(m.attempts, 2147483646) + 1
                      AND o.kind = 'send')
UNION ALL
-- A send that delivered its message in the attempt the message still counts, and whose
-- row the record did not write: the delivered message is that row (src/ledger.rs,
-- RECORD_SENT). Any row of that attempt (a recovery's, a late answer's) is the row instead.
SELECT m.id,
       m.attempts,
       'send'::text,
       m.attempt_started_at,
       m.delivered_at,
       'delivered'::text,
       NULL::outbox.error_class,
       m.last_http_status,
       NULL::text,
       NULL::bigint,
       m.external_id,
       outbox._provider_key(m.tenant, m.effect_key),
       m.attempt_pid,
       NULL::bigint,
       m.tenant
  FROM outbox._messages m
 WHERE m.state = 'delivered' AND m.attempts > 0 AND m.attempt_started_at IS NOT NULL
   AND NOT EXISTS (SELECT 1 FROM outbox._attempts o
                    WHERE o.message_id = m.id AND o.attempt = m.attempts)
UNION ALL
-- The same, for a delivered message moved into its ledger entry.
SELECT l.message_id,
       l.attempts,
       'send'::text,
       l.attempt_started_at,
       l.recorded_at,
       'delivered'::text,
       NULL::outbox.error_class,
       l.last_http_status,
       NULL::text,
       NULL::bigint,
       l.external_id,
       outbox._provider_key(l.tenant, l.effect_key),
       l.attempt_pid,
       NULL::bigint,
       l.tenant
  FROM outbox._ledger l
 WHERE l.channel_id IS NOT NULL AND l.attempts > 0 AND l.attempt_started_at IS NOT NULL
   AND NOT EXISTS (SELECT 1 FROM outbox._attempts o
                    WHERE o.message_id = l.message_id AND o.attempt = l.attempts);
ALTER VIEW outbox.attempts SET (security_invoker = true);
COMMENT ON VIEW outbox.attempts IS
    'Attempt history: one row per send, reconcile lookup or recovery decision, with its classified outcome; a send in progress has no outcome and no finished_at yet; a send that delivered is shown from its delivered message.';

CREATE VIEW outbox.ledger AS
SELECT l.tenant, l.effect_key, l.message_id, l.external_id, l.recorded_at, l.recorded_by
  FROM outbox._ledger l;
ALTER VIEW outbox.ledger SET (security_invoker = true);
COMMENT ON VIEW outbox.ledger IS
    'Confirmed effects: the barrier the worker checks before every send.';

CREATE VIEW outbox.operator_log AS
SELECT o.at, o.actor, o.action, o.message_id, o.reason, o.state_before, o.state_after,
       CASE WHEN o.detail #> '{options,tenants}' IS NOT NULL
            THEN pg_catalog.jsonb_set(o.detail, '{options,tenants}',
                                      outbox._shown_tenants(o.detail #> '{options,tenants}'))
            ELSE o.detail END AS detail,
       o.channel, o.id, o.tenant
  FROM outbox._operator_log o;
ALTER VIEW outbox.operator_log SET (security_invoker = true);
COMMENT ON VIEW outbox.operator_log IS
    'Audit log: every operator action and channel change, who made it, why, and the state before and after.';
