-- outbox_delivery: a channel's options as SQL reads them (the worker's claim, the views).
-- Options are validated in Rust when a channel is created or altered (src/channels/options.rs);
-- these functions read what is stored and never fail on a row changed by hand.

-- An integer option of a channel (`path` into its options), NULL when it is not a number
-- in the range of integer. Options are validated when a channel is created or altered, but
-- a row changed by hand may hold anything, and a failing cast would stop every statement
-- that reads the channel. IMMUTABLE and not STRICT, so that the planner inlines it.
CREATE FUNCTION outbox._option_int(options jsonb, path text[]) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
BEGIN ATOMIC
    -- Rounded before its range is checked: 2147483647.5 rounds out of it.
    SELECT CASE WHEN jsonb_typeof(options #> path) = 'number'
                THEN CASE WHEN round((options #>> path)::numeric) BETWEEN -2147483648 AND 2147483647
                          THEN round((options #>> path)::numeric)::integer END
           END;
END;

-- Attempts open at once on a channel, all workers together: `max_in_flight` (default 64)
-- where an interrupted attempt can be settled without an operator — the provider dedupes
-- by key (idempotency_header) or answers lookups (reconcile), or the effect is a `sql`
-- function run in the record transaction — and `max_unverifiable_in_flight` (default 8)
-- elsewhere, since a crash there leaves every open attempt `uncertain` for an operator.
-- The defaults are literals (options::DEFAULT_MAX_IN_FLIGHT and
-- DEFAULT_MAX_UNVERIFIABLE_IN_FLIGHT; a test holds them equal): with a parameter, the
-- claim's plan made once claimed a message that committed late behind a backlog only
-- once the backlog was drained. IMMUTABLE and not STRICT, so that the planner inlines it.
CREATE FUNCTION outbox._can_verify(options jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT coalesce(options ->> 'kind', 'http') IN ('sql', 'nats')
        OR jsonb_typeof(options -> 'idempotency_header') = 'string'
        OR jsonb_typeof(options -> 'reconcile') = 'object';
END;

-- Can an uncertain message of the channel be looked up, read-only (options::can_look_up)?
-- An http channel with `reconcile`; a nats channel whose subject names {effect_key}, so
-- that the last message on the subject is the message's.
CREATE FUNCTION outbox._can_look_up(options jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT coalesce(CASE coalesce(options ->> 'kind', 'http')
                      WHEN 'http' THEN jsonb_typeof(options -> 'reconcile') = 'object'
                      WHEN 'nats' THEN strpos(options ->> 'subject', '{effect_key}') > 0
                    END, false);
END;

CREATE FUNCTION outbox._in_flight_bound(options jsonb) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT CASE WHEN outbox._can_verify(options)
                THEN coalesce(outbox._option_int(options, '{max_in_flight}'), 64)
                ELSE coalesce(outbox._option_int(options, '{max_unverifiable_in_flight}'), 8)
           END;
END;

CREATE FUNCTION outbox._in_flight_reason(options jsonb) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT CASE WHEN outbox._can_verify(options) THEN 'max_in_flight'
                ELSE 'max_unverifiable_in_flight: no dedupe, no lookup' END;
END;
