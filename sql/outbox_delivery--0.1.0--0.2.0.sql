-- outbox_delivery 0.1.0 -> 0.2.0 (ALTER EXTENSION outbox_delivery UPDATE)
--
-- Turns the schema of 0.1.0 into the schema a fresh install of 0.2.0 creates; the upgrade
-- test compares the two (RELEASES.md, "Changing the SQL surface").

-- pg_dump keeps the per-minute delivery figures too, like every other table of the
-- extension (a restored database shows the same 5-minute metrics).
SELECT pg_catalog.pg_extension_config_dump('outbox._channel_minutes', '');

-- The bound on attempts open at once on a channel that can neither dedupe nor be asked
-- (max_unverifiable_in_flight), read by the worker's claim and by outbox.channels.
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

-- The ledger's one way of recording a confirmed effect, and its check (sql/ledger.sql).
CREATE FUNCTION outbox._ledger_entry(tenant text, effect_key text)
RETURNS TABLE (message_id bigint, external_id text)
LANGUAGE sql STABLE PARALLEL SAFE
-- No SET clause and no SECURITY DEFINER: the claim inlines it as one index probe per
-- claimed message. OFFSET 0 keeps the probe a subquery of its own, so that the planner
-- never hashes the whole ledger, which grows with every delivery.
AS $fn$
    SELECT l.message_id, l.external_id
      FROM outbox._ledger l
     WHERE l.tenant OPERATOR(pg_catalog.=) $1 AND l.effect_key OPERATOR(pg_catalog.=) $2
    OFFSET 0
$fn$;
COMMENT ON FUNCTION outbox._ledger_entry(text, text) IS
    'The ledger entry of one effect (tenant, effect key), if it was recorded: the message that recorded it and its external id.';

CREATE FUNCTION outbox._record_delivered(
    message_ids bigint[], external_ids text[], http_statuses integer[], recorder text,
    leave_sending boolean)
RETURNS SETOF bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF recorder IS NULL OR recorder NOT IN ('worker', 'reconcile', 'operator') THEN
        RAISE EXCEPTION 'recorder must be worker, reconcile or operator, not %', coalesce(quote_literal(recorder), 'NULL')
            USING ERRCODE = '22023';
    END IF;
    RETURN QUERY
    WITH d AS (
        SELECT * FROM unnest(message_ids, external_ids, http_statuses) AS d(id, external_id, http_status)
    ), moved AS (
        -- The usual case: the message leaves the queue for its ledger entry. The ledger is
        -- probed through outbox._ledger_entry: one index probe per message, never a hash of
        -- the whole ledger, which grows with every delivery.
        DELETE FROM outbox._messages m
         USING d
         WHERE m.id = d.id AND m.id = ANY (message_ids) AND m.state <> 'delivered'
           AND NOT (leave_sending AND m.id IN (SELECT pg_catalog.unnest(w.message_ids) FROM outbox._claims w))
           AND NOT EXISTS (SELECT 1 FROM outbox._ledger_entry(m.tenant, m.effect_key))
     RETURNING m.*, d.external_id AS confirmed_external_id, d.http_status AS confirmed_http_status
    ), kept AS (
        -- An effect recorded already (by an earlier message of the key) keeps its first
        -- entry; the message stays, delivered, until retention removes it. Only the
        -- messages the deletion did not take are looked up again.
        UPDATE outbox._messages m
           SET state = 'delivered',
               delivered_at = now(),
               updated_at = now(),
               external_id = coalesce(d.external_id, m.external_id),
               last_http_status = coalesce(d.http_status, m.last_http_status),
               lease_until = NULL,
               lease_owner = NULL
          FROM d
         WHERE m.id = d.id AND m.id = ANY (message_ids) AND m.state <> 'delivered'
           AND NOT (leave_sending AND m.id IN (SELECT pg_catalog.unnest(w.message_ids) FROM outbox._claims w))
           AND NOT EXISTS (SELECT 1 FROM moved WHERE moved.id = d.id)
           AND EXISTS (SELECT 1 FROM outbox._ledger_entry(m.tenant, m.effect_key))
     RETURNING m.id
    ), l AS (
        INSERT INTO outbox._ledger (tenant, effect_key, message_id, external_id, recorded_by,
                                    channel_id, ordering_key, payload, headers, not_before,
                                    attempts, last_error_class, last_error, last_http_status,
                                    owner, created_at, attempt_started_at, attempt_pid, generation)
        SELECT m.tenant, m.effect_key, m.id, coalesce(m.confirmed_external_id, m.external_id), recorder,
               m.channel_id, m.ordering_key, m.payload, m.headers, m.not_before,
               m.attempts, m.last_error_class, m.last_error,
               coalesce(m.confirmed_http_status, m.last_http_status),
               m.owner, m.created_at, m.attempt_started_at, m.attempt_pid,
               -- The current generation, read once for the whole statement.
               (SELECT coalesce((SELECT g.generation FROM outbox._ledger_generations g
                                  WHERE g.closed_at IS NULL), 0::smallint))
          FROM moved m
    )
    SELECT moved.id FROM moved
    UNION ALL
    SELECT kept.id FROM kept;
END
$fn$;
COMMENT ON FUNCTION outbox._record_delivered(bigint[], text[], integer[], text, boolean) IS
    'Confirms effects: moves each message (unless it is delivered already, or is being sent and leave_sending is set) out of the queue into its ledger entry; a message whose effect is in the ledger already stays, marked delivered, and the entry keeps its first message. Returns the messages it confirmed.';

-- resolve(…, 'delivered', …) records through the ledger's function.
CREATE OR REPLACE FUNCTION outbox.resolve(id bigint, outcome text, reason text DEFAULT NULL, external_id text DEFAULT NULL)
RETURNS outbox.state
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_msg   outbox._messages;
    v_after outbox.state;
BEGIN
    IF outcome IS NULL OR outcome NOT IN ('delivered', 'failed', 'cancelled') THEN
        RAISE EXCEPTION 'outcome must be delivered, failed or cancelled, not %', coalesce(pg_catalog.quote_literal(outcome), 'NULL')
            USING ERRCODE = '22023';
    END IF;
    PERFORM outbox._require_reason(resolve.reason);
    v_msg := outbox._lock_message(resolve.id);
    IF v_msg.state = 'sending' THEN
        RAISE EXCEPTION 'message % is being sent right now; resolve refused', v_msg.id
            USING ERRCODE = '55000', HINT = 'Wait for the attempt''s outcome, then look again.';
    END IF;
    IF v_msg.state = 'delivered' AND outcome <> 'delivered' THEN
        RAISE EXCEPTION 'message % was delivered (confirmed); it cannot be resolved as %', v_msg.id, outcome
            USING ERRCODE = '55000';
    END IF;
    v_after := outcome::outbox.state;
    IF v_msg.state = 'delivered' THEN
        RAISE NOTICE 'message % is already delivered', v_msg.id;
    ELSIF v_after = 'delivered' THEN
        PERFORM outbox._record_delivered(ARRAY[v_msg.id], ARRAY[resolve.external_id], ARRAY[NULL::integer],
                                         'operator', false);
    ELSE
        UPDATE outbox._messages m
           SET state = v_after, external_id = coalesce(resolve.external_id, m.external_id),
               lease_until = NULL, lease_owner = NULL, updated_at = pg_catalog.now()
         WHERE m.id = v_msg.id;
    END IF;
    INSERT INTO outbox._operator_log (action, message_id, tenant, reason, state_before, state_after, detail)
    VALUES ('resolve', v_msg.id, v_msg.tenant, resolve.reason, v_msg.state, v_after,
            jsonb_build_object('outcome', outcome, 'external_id', resolve.external_id));
    RETURN v_after;
END
$fn$;

-- What is left of a claim once its recorded messages are taken out: the worker's record
-- calls it on each of its claims (src/worker/claim_release.rs).
CREATE FUNCTION outbox._claim_ids_left(ids bigint[], released bigint[]) RETURNS bigint[]
IMMUTABLE STRICT PARALLEL SAFE COST 1000
LANGUAGE c
AS 'MODULE_PATHNAME', '_claim_ids_left_wrapper';

-- The effect key as providers see it and a time since the Unix epoch, which every claimed
-- message needs: functions of the library now, no longer SQL (a
-- regular expression and a numeric each; src/effect_key.rs, src/clock.rs). Replaced in
-- place: the views that call outbox._provider_key, its comment and its grants stay.
CREATE OR REPLACE FUNCTION outbox._provider_key(tenant text, effect_key text) RETURNS text
IMMUTABLE STRICT PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', '_provider_key_wrapper';
CREATE OR REPLACE FUNCTION outbox._epoch_ms(t timestamptz) RETURNS int8
IMMUTABLE STRICT PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', '_epoch_ms_wrapper';
CREATE FUNCTION outbox._epoch_us(t timestamptz) RETURNS int8
IMMUTABLE STRICT PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', '_epoch_us_wrapper';
COMMENT ON FUNCTION outbox._epoch_ms(timestamptz) IS
    'A time as milliseconds since the Unix epoch, rounded half away from zero; NULL for -infinity and infinity.';
COMMENT ON FUNCTION outbox._epoch_us(timestamptz) IS
    'A time as microseconds since the Unix epoch; NULL for -infinity and infinity, and for a time whose count does not fit in bigint.';

-- Nothing of the extension is PUBLIC's (sql/privileges.sql): the new functions neither.
REVOKE ALL ON FUNCTION
    outbox._claim_ids_left(bigint[], bigint[]),
    outbox._epoch_us(timestamptz),
    outbox._can_verify(jsonb),
    outbox._can_look_up(jsonb),
    outbox._in_flight_bound(jsonb),
    outbox._in_flight_reason(jsonb),
    outbox._ledger_entry(text, text),
    outbox._record_delivered(bigint[], text[], integer[], text, boolean)
    FROM PUBLIC;
-- outbox.alerts asks whether a channel can look an uncertain message up (pg_monitor reads
-- it); granted first, as a fresh install does.
GRANT EXECUTE ON FUNCTION outbox._can_look_up(jsonb) TO pg_monitor;
GRANT EXECUTE ON FUNCTION outbox._claim_ids_left(bigint[], bigint[]) TO outbox_worker;
GRANT EXECUTE ON FUNCTION outbox._epoch_us(timestamptz) TO outbox_worker;
GRANT EXECUTE ON FUNCTION outbox._option_int(jsonb, text[]) TO outbox_admin;
GRANT EXECUTE ON FUNCTION
    outbox._can_verify(jsonb),
    outbox._can_look_up(jsonb),
    outbox._in_flight_bound(jsonb),
    outbox._in_flight_reason(jsonb)
    TO outbox_worker, outbox_writer, outbox_operator, outbox_admin;
GRANT EXECUTE ON FUNCTION
    outbox._ledger_entry(text, text),
    outbox._record_delivered(bigint[], text[], integer[], text, boolean)
    TO outbox_worker;

-- Tenants, effect keys and ordering keys compare byte by byte (COLLATE "C", sql/schema.sql):
-- their B-tree indexes no longer go through the database's collation at every comparison.
-- A column's collation cannot change under the views and policies that read it: they are
-- dropped first and made again, the views in their final form below.
DROP VIEW outbox.work_queue, outbox.ledger, outbox.attempts, outbox.messages;
DROP POLICY tenant_rows ON outbox._messages;
ALTER TABLE outbox._messages
    ALTER COLUMN tenant TYPE text COLLATE "C",
    ALTER COLUMN effect_key TYPE text COLLATE "C",
    ALTER COLUMN ordering_key TYPE text COLLATE "C";
CREATE POLICY tenant_rows ON outbox._messages FOR SELECT
    USING (tenant = ANY ((SELECT outbox._visible_tenants())::text[]));

-- Attempts under way as claims (sql/schema.sql, outbox._claims): a claim writes one row per
-- channel and no message row. A message in flight at the update, `sending` in 0.1.0, stays
-- as it is: the first sweep of a worker adopts it into a claim whose lease has ended and
-- takes it back as an interrupted attempt, closing the row 0.1.0 opened for it.
-- Attempts under way. A claim writes one row for each channel it took messages of: their
-- ids, their lease and the worker that sends them. It locks the messages but does not write
-- them: a message row is written once its outcome is known, so that a delivery writes its
-- queue row twice (the enqueue, the record's deletion) and not a second version besides.
-- A message is `sending` while its id is in a row here, in the attempt after the ones its
-- row counts (attempts + 1). The record of an outcome takes the message's id out of its
-- row (and deletes a row left empty); recovery takes back the ids of a row whose lease ran
-- out. A handful of rows (at most a few batches per worker): every reader scans it whole.
CREATE SEQUENCE outbox._claims_id_seq AS bigint;
CREATE TABLE outbox._claims (
    id          bigint      NOT NULL DEFAULT nextval('outbox._claims_id_seq') PRIMARY KEY,
    channel_id  integer     NOT NULL,
    -- The index of the worker's slot (outbox.worker_status), and its process.
    lease_owner integer     NOT NULL,
    worker_pid  integer     NOT NULL,
    lease_until timestamptz NOT NULL,
    started_at  timestamptz NOT NULL,
    message_ids bigint[]    NOT NULL
-- Full pages: a claim's row is rewritten by each record of its messages, and pages kept
-- half empty for those versions left the table four times as long in a long drain, and
-- every reader scans it whole (BENCHMARKS.md, 2026-12-05).
) WITH (fillfactor = 100, autovacuum_vacuum_threshold = 500, autovacuum_vacuum_scale_factor = 0);
ALTER SEQUENCE outbox._claims_id_seq OWNED BY outbox._claims.id;
COMMENT ON TABLE outbox._claims IS 'Attempts under way, one row per claim and channel (private; read outbox.messages and outbox.attempts).';

SELECT pg_catalog.pg_extension_config_dump('outbox._claims', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._claims_id_seq', '');
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox._claims TO outbox_worker;
GRANT USAGE ON SEQUENCE outbox._claims_id_seq TO outbox_worker;
DROP INDEX outbox._messages_sending_idx;
CREATE INDEX _messages_sending_idx ON outbox._messages (id) WHERE state = 'sending';

CREATE VIEW outbox._under_way AS
SELECT u.message_id, c.channel_id, c.lease_owner, c.worker_pid, c.lease_until, c.started_at,
       c.id AS claim_id
  FROM outbox._claims c
 CROSS JOIN LATERAL pg_catalog.unnest(c.message_ids) AS u(message_id)
 WHERE (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname = current_user)
    OR EXISTS (SELECT 1 FROM outbox._messages m
                WHERE m.id = u.message_id AND m.tenant = ANY (outbox._visible_tenants()));
COMMENT ON VIEW outbox._under_way IS 'Messages in flight, one row each, with their claim (private).';
GRANT SELECT ON outbox._under_way TO outbox_writer, outbox_operator, outbox_admin;

-- The ledger is made anew (sql/schema.sql): delivered messages live in their entries, whose
-- columns it gains, its keys compare byte by byte, and it is kept in three generations that
-- retention empties whole. The entries of 0.1.0 go to generation 0; the table of 0.1.0
-- (with its policies) leaves the extension and is dropped. Messages delivered before the
-- update stay in the queue table, delivered, until retention removes them.
ALTER EXTENSION outbox_delivery DROP TABLE outbox._ledger;
ALTER TABLE outbox._ledger RENAME TO _ledger_of_0_1_0;
ALTER INDEX outbox._ledger_pkey RENAME TO _ledger_of_0_1_0_pkey;
ALTER INDEX outbox._ledger_recorded_at_idx RENAME TO _ledger_of_0_1_0_recorded_at_idx;
ALTER INDEX outbox._ledger_message_idx RENAME TO _ledger_of_0_1_0_message_idx;

-- The ledger's generations: the ledger is kept in three tables (outbox._ledger_0, _1 and
-- _2, the partitions of outbox._ledger), filled one after another, and retention empties
-- a whole table with TRUNCATE instead of deleting its entries one by one (src/ledger/
-- generations.rs). A row per generation that holds entries: when it was opened, and when
-- it stopped taking new entries (NULL: the current one), and since when its emptying,
-- due, has been put off because another session held its table (outbox.alerts raises
-- ledger_retention_deferred after five minutes). No row at all: generation 0 is current
-- (a fresh install).
CREATE TABLE outbox._ledger_generations (
    generation smallint    PRIMARY KEY,
    opened_at  timestamptz NOT NULL,
    closed_at  timestamptz,
    emptying_deferred_since timestamptz,
    CONSTRAINT ledger_generation_known CHECK (generation BETWEEN 0 AND 2)
);
CREATE UNIQUE INDEX _ledger_generations_current_idx ON outbox._ledger_generations ((true))
    WHERE closed_at IS NULL;
COMMENT ON TABLE outbox._ledger_generations IS 'Which table of the ledger takes new entries, and since when each was closed (private).';

-- The generation new entries go to. The worker's record names it in its statement
-- (computed once per statement); this default serves every other insertion.
CREATE FUNCTION outbox._ledger_current_generation() RETURNS smallint
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT coalesce((SELECT g.generation FROM outbox._ledger_generations g WHERE g.closed_at IS NULL), 0::smallint)
$fn$;
COMMENT ON FUNCTION outbox._ledger_current_generation() IS
    'The generation of the ledger that takes new entries.';

-- The ledger: the barrier. An effect recorded here is never sent again.
-- It is also where delivered messages live: the record that confirms an effect moves its
-- message out of outbox._messages (which keeps only what is still to do) into its entry,
-- in the same transaction, so that a delivery writes the entry and deletes the queue row
-- instead of writing a new version of the message and an entry besides. The columns
-- after recorded_by are the moved message's; they are NULL in an entry whose message
-- stayed in outbox._messages (an effect confirmed while an earlier message of its key
-- had recorded it already). outbox.messages and outbox.attempts show the moved messages.
-- Partitioned by generation: every lookup of an effect probes the three tables (one index
-- probe each), and retention truncates the oldest when all of it is older than the ledger
-- keeps entries. An effect is entered once across the generations: it is moved in with
-- the only queue row of its key (unique in outbox._messages), and only when no generation
-- holds it yet.
CREATE TABLE outbox._ledger (
    tenant      text COLLATE "C" NOT NULL,
    effect_key  text COLLATE "C" NOT NULL,
    message_id  bigint      NOT NULL,
    external_id text,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    recorded_by text        NOT NULL,
    channel_id         integer,
    ordering_key       text COLLATE "C",
    payload            jsonb,
    headers            jsonb,
    not_before         timestamptz,
    attempts           integer,
    last_error_class   outbox.error_class,
    last_error         text,
    last_http_status   integer,
    owner              text,
    created_at         timestamptz,
    attempt_started_at timestamptz,
    attempt_pid        integer,
    generation         smallint    NOT NULL DEFAULT outbox._ledger_current_generation(),
    PRIMARY KEY (tenant, effect_key, generation),
    CONSTRAINT ledger_recorded_by_known CHECK (recorded_by IN ('worker', 'reconcile', 'operator'))
) PARTITION BY LIST (generation);
CREATE INDEX _ledger_message_idx ON outbox._ledger (message_id);
COMMENT ON TABLE outbox._ledger IS 'Effects confirmed by a provider, reconcile or an operator (private; read outbox.ledger).';
-- A generation only takes insertions until it is emptied whole: no vacuum is started by
-- its insertions alone (autovacuum_vacuum_insert_threshold = -1). Such a vacuum would only
-- mark its pages all-visible, which no reader of the ledger uses (an effect is looked up by
-- key and its entry read from the table), and it read the generation's new pages while the
-- workers were filling it. Dead rows (an insertion rolled back) and the age of its
-- transaction ids still start one as for any table.
CREATE TABLE outbox._ledger_0 PARTITION OF outbox._ledger FOR VALUES IN (0)
    WITH (autovacuum_analyze_scale_factor = 0.05, autovacuum_vacuum_insert_threshold = -1);
CREATE TABLE outbox._ledger_1 PARTITION OF outbox._ledger FOR VALUES IN (1)
    WITH (autovacuum_analyze_scale_factor = 0.05, autovacuum_vacuum_insert_threshold = -1);
CREATE TABLE outbox._ledger_2 PARTITION OF outbox._ledger FOR VALUES IN (2)
    WITH (autovacuum_analyze_scale_factor = 0.05, autovacuum_vacuum_insert_threshold = -1);
COMMENT ON TABLE outbox._ledger_0 IS 'Generation 0 of the ledger (private; read outbox.ledger).';
COMMENT ON TABLE outbox._ledger_1 IS 'Generation 1 of the ledger (private; read outbox.ledger).';
COMMENT ON TABLE outbox._ledger_2 IS 'Generation 2 of the ledger (private; read outbox.ledger).';
-- An entry's payload and headers are the moved message's, as its queue row stored them:
-- compressed when they compressed, and they are not compressed again (STORAGE EXTERNAL,
-- in every generation). A value the queue row keeps out of line uncompressed is one that
-- did not compress there; the default storage tried again with every entry, which cost a
-- delivery of 4 kB of such a payload a third of its CPU (BENCHMARKS.md, 2026-12-05).
ALTER TABLE outbox._ledger ALTER COLUMN payload SET STORAGE EXTERNAL,
                           ALTER COLUMN headers SET STORAGE EXTERNAL;

INSERT INTO outbox._ledger (tenant, effect_key, message_id, external_id, recorded_at, recorded_by, generation)
SELECT tenant, effect_key, message_id, external_id, recorded_at, recorded_by, 0
  FROM outbox._ledger_of_0_1_0;
DROP TABLE outbox._ledger_of_0_1_0;

SELECT pg_catalog.pg_extension_config_dump('outbox._ledger_0', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._ledger_1', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._ledger_2', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._ledger_generations', '');

ALTER TABLE outbox._ledger ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant_rows ON outbox._ledger FOR SELECT
    USING (tenant = ANY ((SELECT outbox._visible_tenants())::text[]));
CREATE POLICY worker_rows ON outbox._ledger TO outbox_worker USING (true) WITH CHECK (true);

REVOKE ALL ON FUNCTION outbox._ledger_current_generation() FROM PUBLIC;
GRANT SELECT ON outbox._ledger TO outbox_writer;
GRANT SELECT ON outbox._ledger TO outbox_operator;
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox._ledger TO outbox_worker;
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox._ledger_generations TO outbox_worker;
GRANT TRUNCATE ON outbox._ledger_0, outbox._ledger_1, outbox._ledger_2 TO outbox_worker;
GRANT EXECUTE ON FUNCTION outbox._ledger_current_generation() TO outbox_worker;

CREATE VIEW outbox.ledger AS
SELECT l.tenant, l.effect_key, l.message_id, l.external_id, l.recorded_at, l.recorded_by
  FROM outbox._ledger l;
ALTER VIEW outbox.ledger SET (security_invoker = true);
COMMENT ON VIEW outbox.ledger IS
    'Confirmed effects: the barrier the worker checks before every send.';

-- The nats channel kind (NATS JetStream): it dedupes by Nats-Msg-Id inside its stream's
-- duplicate window, and can be looked up where its subject names {effect_key}. Every place
-- that asked whether a channel can reconcile asks outbox._can_look_up.
CREATE OR REPLACE VIEW outbox.messages AS
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
COMMENT ON VIEW outbox.messages IS
    'Every message: state, attempts and budget, next attempt, last classified error, external id, owner; delivered messages are read from their ledger entries.';

CREATE OR REPLACE VIEW outbox.work_queue AS
SELECT m.id,
       c.name AS channel,
       m.state,
       CASE m.state
           WHEN 'uncertain' THEN 'outcome unknown: the provider may or may not have it'
           WHEN 'exhausted' THEN 'retry budget spent on transient errors'
           WHEN 'failed'    THEN 'permanent error'
       END AS reason,
       m.last_error,
       m.attempts,
       m.owner,
       pg_catalog.now() - m.created_at AS age,
       CASE
           WHEN m.state = 'uncertain' AND outbox._can_look_up(c.options)
               THEN pg_catalog.format('reconcile: SELECT outbox.reconcile(%s)', m.id)
           WHEN m.state = 'uncertain'
               THEN pg_catalog.format('ask the provider, then outbox.resolve(%s, ''delivered''|''failed'', reason) or outbox.retry(%s, reason)', m.id, m.id)
           WHEN m.state = 'exhausted'
               THEN pg_catalog.format('check the channel for an outage, then outbox.retry(%s, reason)', m.id)
           ELSE pg_catalog.format('fix the cause (token, recipient, payload), then outbox.retry(%s, reason) or outbox.cancel(%s, reason)', m.id, m.id)
       END AS suggested_action,
       m.last_error_class,
       m.last_http_status,
       m.effect_key,
       m.tenant,
       m.updated_at
  FROM outbox._messages m
  LEFT JOIN outbox.channels c ON c.id = m.channel_id
 WHERE m.state IN ('uncertain', 'exhausted', 'failed');

CREATE OR REPLACE FUNCTION outbox.retry(id bigint, reason text DEFAULT NULL) RETURNS outbox.state
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_msg     outbox._messages;
    v_options jsonb;
    v_after   outbox.state;
    v_lookup  text;
    v_detail  jsonb := '{}';
BEGIN
    PERFORM outbox._require_reason(retry.reason);
    v_msg := outbox._lock_message(retry.id);
    SELECT c.options INTO v_options FROM outbox._channels c WHERE c.id = v_msg.channel_id;

    CASE v_msg.state
    WHEN 'sending' THEN
        RAISE EXCEPTION 'message % is being sent right now; retry refused', v_msg.id
            USING ERRCODE = '55000', HINT = 'Wait for the attempt''s outcome (its lease ends by itself), then look again.';
    WHEN 'delivered', 'cancelled', 'queued' THEN
        RAISE NOTICE 'message % is %: nothing to retry', v_msg.id, v_msg.state;
        v_after := v_msg.state;
        v_detail := jsonb_build_object('result', 'no-op');
    WHEN 'uncertain' THEN
        IF outbox._can_look_up(v_options) THEN
            -- The provider may have it: ask before anything is resent.
            v_lookup := outbox.reconcile(v_msg.id);
            v_detail := jsonb_build_object('reconcile', v_lookup);
            -- Found: the message has moved into its ledger entry, delivered.
            v_after := coalesce((SELECT m.state FROM outbox._messages m WHERE m.id = v_msg.id), 'delivered');
            IF v_lookup = 'unavailable' THEN
                RAISE NOTICE 'message %: the provider could not be asked; nothing was resent', v_msg.id
                    USING HINT = 'Try again later, or settle it with outbox.resolve() after checking by hand.';
            ELSIF v_lookup = 'not_found' AND v_after = 'uncertain' THEN
                RAISE NOTICE 'message %: not found yet, but its last attempt may still be in process at the provider; nothing was resent', v_msg.id
                    USING HINT = 'Retry again once the channel''s reconcile settle time (twice its timeout by default) has passed.';
            ELSIF v_lookup = 'not_supported' OR (v_lookup = 'not_found' AND v_after <> 'queued') THEN
                PERFORM outbox._requeue(v_msg.id);
                v_after := 'queued';
            END IF;
        ELSE
            PERFORM outbox._requeue(v_msg.id);
            v_after := 'queued';
        END IF;
    ELSE -- exhausted, failed: a fresh budget, the same effect key
        PERFORM outbox._requeue(v_msg.id);
        v_after := 'queued';
    END CASE;

    INSERT INTO outbox._operator_log (action, message_id, tenant, reason, state_before, state_after, detail)
    VALUES ('retry', v_msg.id, v_msg.tenant, retry.reason, v_msg.state, v_after,
            v_detail || jsonb_build_object('effect_key', v_msg.effect_key));
    RETURN v_after;
END
$fn$;
COMMENT ON FUNCTION outbox.retry(bigint, text) IS
    'Operator: requeue with the same effect key (fresh budget for exhausted/failed); an uncertain message is reconciled first where the channel can; sending: 55000; delivered/cancelled: no-op.';

-- Flow control of a channel, shared by every worker of the database: the token bucket of
-- its rate_limit, a Retry-After that holds the whole channel back, and its circuit
-- (src/channels/rate_limit.rs, src/channels/circuit.rs, src/worker/flow.rs). A row exists
-- for a channel with rate_limit or circuit once a worker has claimed for it.
CREATE TABLE outbox._channel_flow (
    channel_id     integer          NOT NULL PRIMARY KEY
                                    REFERENCES outbox._channels (id) ON DELETE CASCADE,
    tokens         double precision NOT NULL DEFAULT 0,
    tokens_at      timestamptz      NOT NULL DEFAULT now(),
    hold_until     timestamptz,
    circuit_state  text             NOT NULL DEFAULT 'closed',
    circuit_since  timestamptz,
    circuit_streak integer          NOT NULL DEFAULT 0,
    probe_until    timestamptz,
    CONSTRAINT circuit_state_known CHECK (circuit_state IN ('closed', 'open', 'half_open'))
);
COMMENT ON TABLE outbox._channel_flow IS 'Rate limit tokens, channel-wide Retry-After and circuit state per channel (private; see outbox.channels).';
SELECT pg_catalog.pg_extension_config_dump('outbox._channel_flow', '');
REVOKE ALL ON outbox._channel_flow FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox._channel_flow TO outbox_worker;

-- outbox.channels shows the bound of attempts open at once in force and why, and the circuit.
CREATE OR REPLACE VIEW outbox.channels AS
SELECT c.id,
       c.name,
       outbox._masked_url(c.endpoint) AS endpoint,
       outbox._masked_options(c.options) AS options,
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

-- outbox.alerts raises circuit_open.
CREATE OR REPLACE VIEW outbox.alerts AS
SELECT 'queue_age'::text AS alert,
       m.channel,
       CASE WHEN m.oldest_queued_age_s > 4 * outbox._setting('outbox.alert_queue_age_s', 300)
            THEN 'critical' ELSE 'warning' END AS severity,
       m.oldest_queued_age_s AS value,
       outbox._setting('outbox.alert_queue_age_s', 300)::numeric AS threshold,
       pg_catalog.now() - make_interval(secs => m.oldest_queued_age_s::double precision) AS since
  FROM outbox.metrics m
 WHERE m.scope = 'channel' AND NOT m.paused
   AND m.oldest_queued_age_s > outbox._setting('outbox.alert_queue_age_s', 300)
UNION ALL
SELECT 'error_streak', c.name, 'warning', s.error_streak::numeric,
       outbox._setting('outbox.alert_error_streak', 10)::numeric, s.error_streak_since
  FROM outbox._channel_stats s
  JOIN outbox._channels c ON c.id = s.channel_id
 WHERE s.error_streak >= outbox._setting('outbox.alert_error_streak', 10)
UNION ALL
SELECT 'terminal_failures', c.name, 'critical', count(*)::numeric, 0::numeric, min(m.updated_at)
  FROM outbox._messages m
  JOIN outbox._channels c ON c.id = m.channel_id
 WHERE m.state IN ('failed', 'exhausted') AND m.updated_at > pg_catalog.now() - interval '1 hour'
 GROUP BY c.name
UNION ALL
SELECT 'uncertain', c.name, 'critical', count(*)::numeric,
       outbox._setting('outbox.alert_uncertain_age_s', 300)::numeric, min(u.since)
  FROM outbox._messages m
  JOIN outbox._channels c ON c.id = m.channel_id
  -- Uncertain since the send (or the recovery of a lost lease) that left it so: the
  -- inconclusive lookups that follow change the row, not how long nobody has known.
  CROSS JOIN LATERAL (
      SELECT coalesce((SELECT coalesce(a.finished_at, a.started_at)
                         FROM outbox._attempts a
                        WHERE a.message_id = m.id AND a.kind IN ('send', 'recovery')
                        ORDER BY a.id DESC LIMIT 1),
                      m.updated_at) AS since) u
 WHERE m.state = 'uncertain'
   AND (NOT outbox._can_look_up(c.options)
        OR u.since < pg_catalog.now() - make_interval(secs => outbox._setting('outbox.alert_uncertain_age_s', 300)))
 GROUP BY c.name
UNION ALL
-- A channel whose circuit is open (or half open, probing): value = seconds in that state.
SELECT 'circuit_open', c.name, 'critical',
       round(extract(epoch FROM pg_catalog.now() - f.circuit_since), 3)::numeric, 0::numeric,
       f.circuit_since
  FROM outbox._channel_flow f
  JOIN outbox._channels c ON c.id = f.channel_id
 WHERE f.circuit_state IN ('open', 'half_open')
   AND jsonb_typeof(c.options -> 'circuit') = 'object'
UNION ALL
-- The ledger's retention has put off emptying a due generation for five minutes: a session
-- holds its table (docs/runbook.md). value = seconds since the first time it was put off.
SELECT 'ledger_retention_deferred', NULL, 'warning',
       round(extract(epoch FROM pg_catalog.now() - g.emptying_deferred_since), 3)::numeric,
       300::numeric, g.emptying_deferred_since
  FROM outbox._ledger_generations g
 WHERE g.emptying_deferred_since < pg_catalog.now() - interval '5 minutes';
COMMENT ON VIEW outbox.alerts IS
    'What needs a human, not every transient error: queue age over outbox.alert_queue_age_s, an error streak of outbox.alert_error_streak failed attempts on one channel, terminal failures in the last hour, uncertain messages (at once where the channel cannot reconcile, after outbox.alert_uncertain_age_s since the send that left them uncertain where it can), a channel whose circuit is open, a generation of the ledger whose emptying has been put off for five minutes. since = when it began.';

-- worker_status() answers for the database it is called in (outbox.database lists several).
COMMENT ON FUNCTION outbox.worker_status() IS
    'One row per delivery worker of the current database: pid, database, state, last loop, in-flight requests and totals since the server started.';


-- outbox.prometheus() gains outbox_queued (what /metrics serves, src/metrics_server.rs).
CREATE OR REPLACE FUNCTION outbox.prometheus() RETURNS text
LANGUAGE sql STABLE
AS $fn$
-- A series per channel while there are at most outbox.metrics_channel_series channels;
-- above it, the total of every channel as channel "*".
WITH every AS MATERIALIZED (SELECT * FROM outbox.metrics),
m AS (
    SELECT e.scope, CASE WHEN e.scope = 'total' THEN '*' ELSE e.channel END AS channel, e.queued,
           e.sending, e.uncertain, e.exhausted, e.failed, e.oldest_queued_age_s, e.delivered_total,
           e.attempts_failed_total, e.exhausted_total, e.failed_total, e.error_streak,
           e.success_rate_5m
      FROM every e
     WHERE e.scope = CASE WHEN (SELECT count(*) FROM every c WHERE c.scope = 'channel')
                               <= outbox._setting('outbox.metrics_channel_series', 1000)
                          THEN 'channel' ELSE 'total' END
),
families(ord, name, kind, help) AS (VALUES
    (1, 'outbox_messages', 'gauge', 'Messages by channel and state.'),
    (2, 'outbox_oldest_queued_age_seconds', 'gauge', 'How long the oldest due queued message of a channel has waited.'),
    (3, 'outbox_delivered_total', 'counter', 'Messages confirmed delivered (by a 2xx or by reconcile).'),
    (4, 'outbox_attempts_failed_total', 'counter', 'Attempts that did not deliver.'),
    (5, 'outbox_exhausted_total', 'counter', 'Messages whose retry budget ran out.'),
    (6, 'outbox_failed_total', 'counter', 'Messages that failed permanently.'),
    (7, 'outbox_error_streak', 'gauge', 'Consecutive failed attempts on a channel.'),
    (8, 'outbox_success_rate_5m', 'gauge', 'Share of attempts in the last 5 minutes that delivered.'),
    (9, 'outbox_alert', 'gauge', 'Active alerts (1 per alert).'),
    (10, 'outbox_worker_up', 'gauge', 'Delivery workers running.'),
    (11, 'outbox_queued', 'gauge', 'Queued messages of a channel (outbox_messages with state queued).')
),
samples(ord, line) AS (
    SELECT 1, format('outbox_messages{channel="%s",state="%s"} %s', outbox._prom_label(m.channel), s.state, s.n)
      FROM m CROSS JOIN LATERAL (VALUES ('queued', m.queued), ('sending', m.sending), ('uncertain', m.uncertain),
                                        ('exhausted', m.exhausted), ('failed', m.failed)) AS s(state, n)
    UNION ALL
    SELECT 2, format('outbox_oldest_queued_age_seconds{channel="%s"} %s', outbox._prom_label(m.channel), coalesce(m.oldest_queued_age_s, 0)) FROM m
    UNION ALL
    SELECT 3, format('outbox_delivered_total{channel="%s"} %s', outbox._prom_label(m.channel), m.delivered_total) FROM m
    UNION ALL
    SELECT 4, format('outbox_attempts_failed_total{channel="%s"} %s', outbox._prom_label(m.channel), m.attempts_failed_total) FROM m
    UNION ALL
    SELECT 5, format('outbox_exhausted_total{channel="%s"} %s', outbox._prom_label(m.channel), m.exhausted_total) FROM m
    UNION ALL
    SELECT 6, format('outbox_failed_total{channel="%s"} %s', outbox._prom_label(m.channel), m.failed_total) FROM m
    UNION ALL
    SELECT 7, format('outbox_error_streak{channel="%s"} %s', outbox._prom_label(m.channel), m.error_streak) FROM m
    UNION ALL
    SELECT 8, format('outbox_success_rate_5m{channel="%s"} %s', outbox._prom_label(m.channel), m.success_rate_5m)
      FROM m WHERE m.success_rate_5m IS NOT NULL
    UNION ALL
    SELECT 9, format('outbox_alert{alert="%s",channel="%s",severity="%s"} 1', a.alert, outbox._prom_label(a.channel), a.severity)
      FROM outbox.alerts a
    UNION ALL
    SELECT 10, format('outbox_worker_up %s', count(*)) FROM outbox.worker_status() w WHERE w.pid IS NOT NULL
    UNION ALL
    SELECT 11, format('outbox_queued{channel="%s"} %s', outbox._prom_label(m.channel), m.queued) FROM m
)
SELECT string_agg(x.line, E'\n' ORDER BY x.ord, x.sub, x.line) || E'\n'
  FROM (SELECT f.ord, 0 AS sub, format('# HELP %s %s', f.name, f.help) AS line FROM families f
        UNION ALL
        SELECT f.ord, 1, format('# TYPE %s %s', f.name, f.kind) FROM families f
        UNION ALL
        SELECT s.ord, 2, s.line FROM samples s) x
$fn$;
COMMENT ON FUNCTION outbox.prometheus() IS
    'Prometheus text exposition of outbox.metrics, outbox.alerts and the workers; *_total counters are kept in the database and only grow across restarts.';

-- CREATE OR REPLACE VIEW resets a view's options: the views replaced above read with their
-- caller's rights again (row-level security applies to the reader), as a fresh install's do.
ALTER VIEW outbox.messages SET (security_invoker = true);
ALTER VIEW outbox.work_queue SET (security_invoker = true);

-- A send's attempt row is written once, with its outcome, when the send is recorded or
-- recovered; the attempt in progress lives on the `sending` message (src/worker/claim.rs).
-- A send still open at the update keeps its row (finished_at NULL): outbox.attempts shows
-- it as before, and recovery closes it (src/worker/recovery.rs).
ALTER TABLE outbox._messages ADD COLUMN attempt_started_at timestamptz;
ALTER TABLE outbox._messages ADD COLUMN attempt_pid integer;
CREATE OR REPLACE VIEW outbox.attempts AS
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
-- The views made again above, with the comment and the grants a fresh install gives them
-- (sql/operator.sql, sql/privileges.sql).
COMMENT ON VIEW outbox.work_queue IS
    'Every message that waits for a human (uncertain, exhausted, failed): why, who owns it, how old, and what to do.';
GRANT SELECT ON outbox.messages, outbox.attempts, outbox.ledger TO outbox_writer;
GRANT SELECT ON outbox.messages, outbox.attempts, outbox.ledger, outbox.work_queue TO outbox_operator;
GRANT EXECUTE ON FUNCTION outbox._provider_key(text, text) TO outbox_writer, outbox_operator;

-- enqueue and the operator's actions find a delivered message in its ledger entry.
CREATE OR REPLACE FUNCTION outbox._enqueue_existing(channel_id integer, payload jsonb, effect_key text, tenant text)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    v_existing   record;
BEGIN
    SELECT m.id, m.payload, m.channel_id INTO v_existing
      FROM outbox._messages m
     WHERE m.tenant = _enqueue_existing.tenant AND m.effect_key = _enqueue_existing.effect_key;
    IF NOT FOUND THEN
        -- Delivered: the message moved into its ledger entry. An entry without the message's
        -- columns (its message stayed in the queue table until retention removed it) tells
        -- neither payload nor channel: nothing to compare.
        SELECT l.message_id AS id, coalesce(l.payload, _enqueue_existing.payload) AS payload,
               coalesce(l.channel_id, _enqueue_existing.channel_id) AS channel_id
          INTO v_existing
          FROM outbox._ledger l
         WHERE l.tenant = _enqueue_existing.tenant AND l.effect_key = _enqueue_existing.effect_key;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'message with effect key % was removed while this enqueue ran', _enqueue_existing.effect_key
            USING ERRCODE = '40001', HINT = 'Retry the transaction.';
    END IF;
    IF v_existing.payload IS DISTINCT FROM _enqueue_existing.payload OR v_existing.channel_id <> _enqueue_existing.channel_id THEN
        RAISE WARNING 'effect key % already belongs to message %, whose channel or payload differs; nothing new was enqueued',
                _enqueue_existing.effect_key, v_existing.id
            USING DETAIL = pg_catalog.format(
                      'existing message %s: channel id %s, payload sha256 %s; this call: channel id %s, payload sha256 %s',
                      v_existing.id, v_existing.channel_id,
                      pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(v_existing.payload::text, 'UTF8')), 'hex'),
                      _enqueue_existing.channel_id,
                      pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(_enqueue_existing.payload::text, 'UTF8')), 'hex')),
                  HINT = 'One effect key names one side effect. A new, intentional action needs a new key.';
    END IF;
    RETURN v_existing.id;
END
$fn$;

CREATE OR REPLACE FUNCTION outbox._lock_message(id bigint) RETURNS outbox._messages
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    v outbox._messages;
BEGIN
    IF id IS NULL THEN
        RAISE EXCEPTION 'id must not be NULL' USING ERRCODE = '22023',
            HINT = 'Pass the id of a message, as outbox.messages and outbox.work_queue show it.';
    END IF;
    SELECT * INTO v FROM outbox._messages m
     WHERE m.id = _lock_message.id AND outbox._tenant_visible(m.tenant)
       FOR UPDATE;
    -- A message in a claim is being sent, in the attempt after those its row counts. The
    -- lock above waited for a claim that held it; this statement sees that claim, when its
    -- snapshot is taken now (READ COMMITTED). A transaction that keeps an older snapshot
    -- may not see a claim made since, so it may not act on a queued message.
    IF FOUND AND v.id IN (SELECT pg_catalog.unnest(w.message_ids) FROM outbox._claims w) THEN
        v.state := 'sending';
        v.attempts := least(v.attempts, 2147483646) + 1;
    ELSIF FOUND AND v.state = 'queued'
          AND pg_catalog.current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'message % is queued: an operator action on it needs a READ COMMITTED transaction, not %',
                        v.id, pg_catalog.current_setting('transaction_isolation')
            USING ERRCODE = '0A000',
                  HINT = 'A worker may have claimed it after this transaction''s snapshot was taken; run the action in a READ COMMITTED transaction (the default).';
    END IF;
    IF NOT FOUND THEN
        SELECT l.message_id, l.tenant, l.channel_id, 'delivered', l.effect_key, l.ordering_key,
               l.payload, l.headers, l.not_before, l.recorded_at, l.attempts, 0, NULL, 0, NULL,
               NULL, NULL, l.last_error_class, l.last_error, l.last_http_status, l.external_id,
               l.owner, l.created_at, l.recorded_at, l.recorded_at, l.attempt_started_at,
               l.attempt_pid
          INTO v
          FROM outbox._ledger l
         WHERE l.message_id = _lock_message.id AND l.channel_id IS NOT NULL
           AND outbox._tenant_visible(l.tenant)
           FOR UPDATE;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'message % does not exist', _lock_message.id
            USING ERRCODE = '02000',
                  HINT = 'Find messages in outbox.messages or outbox.work_queue; delivered messages older than outbox.retention are removed.';
    END IF;
    RETURN v;
END
$fn$;


CREATE OR REPLACE FUNCTION outbox.assign(id bigint, owner text) RETURNS void
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_msg outbox._messages;
BEGIN
    IF pg_catalog.char_length(assign.owner) > 1000 THEN
        RAISE EXCEPTION 'owner is % characters long; at most 1000 are allowed', pg_catalog.char_length(assign.owner)
            USING ERRCODE = '22023', HINT = 'Name a person or a team.';
    END IF;
    v_msg := outbox._lock_message(assign.id);
    UPDATE outbox._messages m SET owner = NULLIF(pg_catalog.btrim(assign.owner), ''), updated_at = pg_catalog.now()
     WHERE m.id = v_msg.id;
    IF NOT FOUND THEN
        -- A delivered message, in its ledger entry.
        UPDATE outbox._ledger l SET owner = NULLIF(pg_catalog.btrim(assign.owner), '')
         WHERE l.message_id = v_msg.id AND l.channel_id IS NOT NULL;
    END IF;
    INSERT INTO outbox._operator_log (action, message_id, tenant, state_before, state_after, detail)
    VALUES ('assign', v_msg.id, v_msg.tenant, v_msg.state, v_msg.state,
            jsonb_build_object('owner_before', v_msg.owner, 'owner', NULLIF(pg_catalog.btrim(assign.owner), '')));
END
$fn$;
COMMENT ON FUNCTION outbox.assign(bigint, text) IS
    'Names the owner of a job in the work queue (NULL or empty clears it).';








CREATE OR REPLACE FUNCTION outbox.status(id bigint) RETURNS outbox.state
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT coalesce(
        (SELECT CASE WHEN m.id IN (SELECT pg_catalog.unnest(w.message_ids) FROM outbox._claims w)
                     THEN 'sending'::outbox.state ELSE m.state END
           FROM outbox._messages m
          WHERE m.id = status.id AND outbox._tenant_visible(m.tenant)),
        (SELECT 'delivered'::outbox.state FROM outbox._ledger l
          WHERE l.message_id = status.id AND outbox._tenant_visible(l.tenant) LIMIT 1))
$fn$;
COMMENT ON FUNCTION outbox.status(bigint) IS
    'State of a message; delivered for a message already removed by retention whose effect is in the ledger; NULL for an id that never existed or belongs to another tenant.';

-- Message counts by channel, for every channel with any, each read once from its partial
-- index (the queued messages from the due index, those waiting for an operator from the
-- work queue's) and from the claims: one read for all channels, where a read per channel
-- cost about 80 µs each, most of a second with 10,000 channels. Then the age of the oldest
-- due queued message of each channel with a queued message not in flight: the head of each
-- part of its due index (the messages free to be claimed, and those held behind their
-- ordering key, which wait too). The planner would pick a sequential scan when its
-- statistics see few channels; the counts must not depend on that. Without JIT: a probe per
-- channel looks costly to the planner, whose JIT then took 400 ms of a read of 10,000.
CREATE FUNCTION outbox._state_counts()
RETURNS TABLE (channel_id integer, queued bigint, sending bigint, uncertain bigint,
               exhausted bigint, failed bigint, oldest_queued_age_s numeric)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $fn$
    WITH flying AS MATERIALIZED (
        SELECT pg_catalog.unnest(w.message_ids) AS id FROM outbox._claims w
    )
    SELECT k.channel_id, k.queued, k.sending, k.uncertain, k.exhausted, k.failed,
           CASE WHEN k.queued > 0 THEN
           (SELECT greatest(0, extract(epoch FROM pg_catalog.now() - min(h.next_attempt_at)))
              FROM (VALUES (false), (true)) AS part(held)
             CROSS JOIN LATERAL (
                   SELECT m.next_attempt_at FROM outbox._messages m
                    WHERE m.channel_id = k.channel_id AND m.state = 'queued'
                      AND m.held_by_key = part.held
                      AND m.id NOT IN (SELECT flying.id FROM flying)
                    ORDER BY m.next_attempt_at LIMIT 1) h
            -- NULL, not 0, for a channel with nothing queued.
            HAVING count(*) > 0) END
      FROM (
    SELECT s.channel_id, sum(s.queued) - sum(s.sending) AS queued, sum(s.sending) AS sending,
           sum(s.uncertain) AS uncertain, sum(s.exhausted) AS exhausted, sum(s.failed) AS failed
      FROM (
            -- A message in flight is a queued row in a claim (sql/schema.sql, outbox._claims).
            SELECT w.channel_id, 0::bigint AS queued,
                   pg_catalog.cardinality(w.message_ids)::bigint AS sending,
                   0::bigint AS uncertain, 0::bigint AS exhausted, 0::bigint AS failed
              FROM outbox._claims w
            UNION ALL
            SELECT m.channel_id, 1, 0, 0, 0, 0 FROM outbox._messages m WHERE m.state = 'queued'
            UNION ALL
            SELECT m.channel_id, 0, 0, (m.state = 'uncertain')::int, (m.state = 'exhausted')::int,
                   (m.state = 'failed')::int
              FROM outbox._messages m WHERE m.state IN ('uncertain', 'exhausted', 'failed')
           ) s
     GROUP BY s.channel_id) k
$fn$;
REVOKE ALL ON FUNCTION outbox._state_counts() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox._state_counts() TO outbox_admin, pg_monitor;

-- Ordering keys: a message that waits behind an earlier one of its key is held out of the
-- claim's part of the due index.
-- Held behind its ordering key: an earlier message of the same key was pending when a
-- worker looked (src/worker/key_hold.rs), so no claim could take this one. A held
-- message leaves the due part of its channel's due index, which the claim would
-- otherwise step over entry by entry at each claim; the message before it releases it
-- when it stops being pending (outbox._release_key). Only ever a hint for the claim,
-- which checks the order itself.
ALTER TABLE outbox._messages ADD COLUMN held_by_key boolean NOT NULL DEFAULT false;
ALTER TABLE outbox._messages
    ADD CONSTRAINT message_held_has_key CHECK (NOT held_by_key OR ordering_key IS NOT NULL);
DROP INDEX outbox._messages_due_idx;
-- Messages held behind their ordering key sort apart (held_by_key), so that the claim,
-- which reads `NOT held_by_key`, never steps over them; a count of a channel's queue
-- still reads one index.
CREATE INDEX _messages_due_idx ON outbox._messages (channel_id, held_by_key, next_attempt_at, id)
    WHERE state = 'queued';
-- Holding behind ordering keys (src/worker/key_hold.rs): the pending messages of a key
-- not held (queued or uncertain), by key, in which every one but the first of its key waits
-- (a worker holds it if it is queued); and the held ones, by key, whose first is released
-- if nothing pending is left before it.
CREATE INDEX _messages_key_unheld_idx ON outbox._messages (tenant, ordering_key, id)
    WHERE ordering_key IS NOT NULL AND state IN ('queued', 'uncertain') AND NOT held_by_key;
CREATE INDEX _messages_key_held_idx ON outbox._messages (tenant, ordering_key, id)
    WHERE state = 'queued' AND held_by_key;
-- Releasing a key's next message: when a pending message of a key (queued or uncertain)
-- stops being pending, in any way (its record, a reconcile, an operator's action, its
-- deletion), the key's first pending message is released if it is held, and the workers
-- are woken at commit. It runs after the statement, so that the first pending message is
-- the one the statement left. SECURITY DEFINER: it fires for the worker's role and for
-- operator functions alike, and reads and writes only the key's own rows.
CREATE FUNCTION outbox._release_key() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_first bigint;
    v_held boolean;
BEGIN
    SELECT m.id, m.held_by_key INTO v_first, v_held
      FROM outbox._messages m
     WHERE m.tenant = OLD.tenant AND m.ordering_key = OLD.ordering_key
       AND m.state IN ('queued', 'uncertain')
     ORDER BY m.id
     LIMIT 1;
    IF v_held THEN
        UPDATE outbox._messages m SET held_by_key = false WHERE m.id = v_first AND m.held_by_key;
        PERFORM outbox._wake_at_commit();
    END IF;
    RETURN NULL;
END
$fn$;
COMMENT ON FUNCTION outbox._release_key() IS
    'Releases the first pending message of an ordering key when the one before it stops being pending (a trigger of outbox._messages).';
REVOKE ALL ON FUNCTION outbox._release_key() FROM PUBLIC;
CREATE TRIGGER _messages_release_key_after_update
    AFTER UPDATE OF state ON outbox._messages
    FOR EACH ROW
    WHEN (OLD.ordering_key IS NOT NULL AND OLD.state IN ('queued', 'uncertain')
          AND NEW.state NOT IN ('queued', 'uncertain'))
    EXECUTE FUNCTION outbox._release_key();
CREATE TRIGGER _messages_release_key_after_delete
    AFTER DELETE ON outbox._messages
    FOR EACH ROW
    WHEN (OLD.ordering_key IS NOT NULL AND OLD.state IN ('queued', 'uncertain'))
    EXECUTE FUNCTION outbox._release_key();

CREATE OR REPLACE FUNCTION outbox._requeue(id bigint) RETURNS void
LANGUAGE sql VOLATILE
AS $fn$
    UPDATE outbox._messages m
       SET state = 'queued', next_attempt_at = pg_catalog.now(), budget_base = m.attempts,
           budget_started_at = pg_catalog.now(), lease_until = NULL, lease_owner = NULL,
           held_by_key = false, updated_at = pg_catalog.now()
     WHERE m.id = _requeue.id;
    SELECT outbox._wake_at_commit();
$fn$;


-- Latency histograms (src/metrics/latency.rs): how long each send took and how long each
-- delivered message waited from enqueue, per channel since the start and per minute.
ALTER TABLE outbox._channel_stats
    ADD COLUMN send_ms_counts bigint[] NOT NULL DEFAULT '{}',
    ADD COLUMN send_ms_sum bigint NOT NULL DEFAULT 0,
    ADD COLUMN delivery_ms_counts bigint[] NOT NULL DEFAULT '{}',
    ADD COLUMN delivery_ms_sum bigint NOT NULL DEFAULT 0;
ALTER TABLE outbox._channel_minutes
    -- Of the failed attempts, those whose outcome was ambiguous (outbox.alerts' ambiguity_high).
    ADD COLUMN ambiguous bigint NOT NULL DEFAULT 0,
    ADD COLUMN send_ms_counts bigint[] NOT NULL DEFAULT '{}',
    ADD COLUMN delivery_ms_counts bigint[] NOT NULL DEFAULT '{}';
-- Two histograms' counts added bucket by bucket (the shorter one padded with zeros): how
-- the worker adds a batch's counts to a channel's row, and outbox._counts_sum's step.
CREATE FUNCTION outbox._add_counts(a bigint[], b bigint[]) RETURNS bigint[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT ARRAY(SELECT pg_catalog.int8pl(coalesce(u.x, 0), coalesce(u.y, 0))
                   FROM ROWS FROM (pg_catalog.unnest(a), pg_catalog.unnest(b)) WITH ORDINALITY AS u(x, y, i)
                  ORDER BY u.i)
$fn$;
-- The histograms of several rows added up.
CREATE AGGREGATE outbox._counts_sum(bigint[]) (
    SFUNC = outbox._add_counts,
    STYPE = bigint[],
    INITCOND = '{}'
);
-- The bounds of the latency histograms' buckets in ms, each inclusive (Prometheus' le),
-- with one more bucket past the last for +Inf (src/metrics/latency.rs, BOUNDS_MS; a test
-- holds the two equal).
CREATE FUNCTION outbox._latency_bounds_ms() RETURNS bigint[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT '{5,10,25,50,100,250,500,1000,2500,5000,10000,30000,60000,300000,900000,3600000}'::bigint[]
$fn$;
-- The q quantile (0 to 1) of a histogram's per-bucket counts, in ms, estimated as
-- Prometheus' histogram_quantile does: linearly inside the bucket that holds the rank, from
-- 0 below the first bound; the highest finite bound when the rank falls in +Inf. NULL for
-- an empty histogram (latency::quantile_ms; a test holds the two equal).
CREATE FUNCTION outbox._quantile_ms(counts bigint[], q double precision) RETURNS numeric
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
    WITH k AS (SELECT outbox._latency_bounds_ms() AS bs, greatest(0, least(1, q)) AS q),
    b AS (
        SELECT u.i::int AS i, u.c, sum(u.c) OVER (ORDER BY u.i) AS upto, sum(u.c) OVER () AS total
          FROM unnest(counts) WITH ORDINALITY AS u(c, i)
    )
    SELECT (CASE WHEN b.i > cardinality(k.bs) THEN k.bs[cardinality(k.bs)]
                 ELSE coalesce(k.bs[b.i - 1], 0)
                      + (k.bs[b.i] - coalesce(k.bs[b.i - 1], 0))
                        * (k.q * b.total::float8 - (b.upto - b.c)::float8) / b.c::float8 END)::numeric
      FROM b, k
     WHERE b.c > 0 AND b.upto::float8 >= k.q * b.total::float8
     ORDER BY b.i LIMIT 1
$fn$;
REVOKE ALL ON FUNCTION outbox._add_counts(bigint[], bigint[]), outbox._counts_sum(bigint[]),
    outbox._latency_bounds_ms(), outbox._quantile_ms(bigint[], double precision) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox._add_counts(bigint[], bigint[]), outbox._counts_sum(bigint[]),
    outbox._latency_bounds_ms(), outbox._quantile_ms(bigint[], double precision)
    TO outbox_admin, pg_monitor;
GRANT EXECUTE ON FUNCTION outbox._add_counts(bigint[], bigint[]) TO outbox_worker;
CREATE OR REPLACE VIEW outbox.metrics AS
WITH counts AS MATERIALIZED (
    SELECT * FROM outbox._state_counts()
), minutes AS MATERIALIZED (
    SELECT b.channel_id, sum(b.delivered) AS delivered, sum(b.failed) AS failed,
           outbox._counts_sum(b.send_ms_counts) AS send_ms_counts,
           outbox._counts_sum(b.delivery_ms_counts) AS delivery_ms_counts
      FROM outbox._channel_minutes b
     WHERE b.minute >= date_trunc('minute', pg_catalog.now()) - interval '4 minutes'
     GROUP BY b.channel_id
), per_channel AS (
    SELECT c.id,
           c.name AS channel,
           coalesce(n.queued, 0) AS queued, coalesce(n.sending, 0) AS sending,
           coalesce(n.uncertain, 0) AS uncertain, coalesce(n.exhausted, 0) AS exhausted,
           coalesce(n.failed, 0) AS failed,
           n.oldest_queued_age_s::numeric(12, 3) AS oldest_queued_age_s,
           coalesce(b.delivered, 0)::bigint AS delivered_5m,
           coalesce(b.failed, 0)::bigint AS failed_5m,
           coalesce(s.error_streak, 0) AS error_streak,
           s.error_streak_since,
           coalesce(s.exhausted_total, 0) AS exhausted_total,
           coalesce(s.delivered_total, 0) AS delivered_total,
           coalesce(s.attempts_failed_total, 0) AS attempts_failed_total,
           coalesce(s.failed_total, 0) AS failed_total,
           c.paused, b.send_ms_counts, b.delivery_ms_counts
      FROM outbox._channels c
      LEFT JOIN counts n ON n.channel_id = c.id
      LEFT JOIN minutes b ON b.channel_id = c.id
      LEFT JOIN outbox._channel_stats s ON s.channel_id = c.id
), rows AS (
    SELECT 'channel'::text AS scope, channel, queued, sending, uncertain, exhausted, failed,
           oldest_queued_age_s, delivered_5m, failed_5m, error_streak, error_streak_since,
           exhausted_total, delivered_total, attempts_failed_total, failed_total, paused,
           send_ms_counts, delivery_ms_counts
      FROM per_channel
    UNION ALL
    SELECT 'total', NULL, coalesce(sum(queued), 0)::bigint, coalesce(sum(sending), 0)::bigint,
           coalesce(sum(uncertain), 0)::bigint, coalesce(sum(exhausted), 0)::bigint,
           coalesce(sum(failed), 0)::bigint, max(oldest_queued_age_s),
           coalesce(sum(delivered_5m), 0)::bigint, coalesce(sum(failed_5m), 0)::bigint,
           coalesce(max(error_streak), 0), min(error_streak_since),
           coalesce(sum(exhausted_total), 0)::bigint, coalesce(sum(delivered_total), 0)::bigint,
           coalesce(sum(attempts_failed_total), 0)::bigint, coalesce(sum(failed_total), 0)::bigint,
           NULL, outbox._counts_sum(send_ms_counts), outbox._counts_sum(delivery_ms_counts)
      FROM per_channel
)
SELECT scope, channel, queued, sending, uncertain, exhausted, failed, oldest_queued_age_s,
       delivered_5m, failed_5m,
       CASE WHEN delivered_5m + failed_5m > 0
            THEN round(delivered_5m::numeric / (delivered_5m + failed_5m), 4) END AS success_rate_5m,
       error_streak, exhausted_total, delivered_total, attempts_failed_total, failed_total,
       error_streak_since, paused,
       outbox._quantile_ms(send_ms_counts, 0.5)::numeric(12, 1) AS send_p50_ms,
       outbox._quantile_ms(send_ms_counts, 0.95)::numeric(12, 1) AS send_p95_ms,
       outbox._quantile_ms(send_ms_counts, 0.99)::numeric(12, 1) AS send_p99_ms,
       outbox._quantile_ms(delivery_ms_counts, 0.5)::numeric(12, 1) AS delivery_p50_ms,
       outbox._quantile_ms(delivery_ms_counts, 0.95)::numeric(12, 1) AS delivery_p95_ms,
       outbox._quantile_ms(delivery_ms_counts, 0.99)::numeric(12, 1) AS delivery_p99_ms
  FROM rows;
COMMENT ON VIEW outbox.metrics IS
    'One row per channel and one total: messages by state, oldest due queued age, deliveries and failed attempts in the last 5 minutes, success rate, error streak, totals, and the p50/p95/p99 of send duration and of enqueue-to-delivered latency over the last 5 minutes.';
-- Counted for one channel at a time before outbox._state_counts() above.
DROP FUNCTION outbox._state_counts(integer);

-- An integer option read from a row changed by hand: its range is checked after rounding,
-- so that 2147483647.5 reads as no number instead of failing every claim (22003).
CREATE OR REPLACE FUNCTION outbox._option_int(options jsonb, path text[]) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
BEGIN ATOMIC
    -- Rounded before its range is checked: 2147483647.5 rounds out of it.
    SELECT CASE WHEN jsonb_typeof(options #> path) = 'number'
                THEN CASE WHEN round((options #>> path)::numeric) BETWEEN -2147483648 AND 2147483647
                          THEN round((options #>> path)::numeric)::integer END
           END;
END;

-- A NULL or empty role to bind is refused with a hint.
CREATE OR REPLACE FUNCTION outbox._check_binding(role name, tenant text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $fn$
BEGIN
    IF role IS NULL OR role = '' THEN
        RAISE EXCEPTION 'role must not be NULL or empty' USING ERRCODE = '22023',
            HINT = 'Name the role whose sessions act for the tenant, for example bind_tenant(''app_writer'', ''acme'').';
    END IF;
    PERFORM outbox._check_tenant_name(tenant, 'tenant', true);
END
$fn$;

-- The channels whose rows of the operator log (its creation, a change of its options, a
-- pause, its circuit: rows without a tenant) the calling role may read: for an operator or
-- an admin, those outbox.channels shows it, as their option tenants stands now; for any
-- other role, none. The log's row-level security reads it once per query (a hashed
-- subquery), so it is granted to PUBLIC as outbox._visible_tenants is, and it answers
-- about the caller alone. A row about a channel deleted by hand is a superuser's to read.
CREATE FUNCTION outbox._visible_channels() RETURNS SETOF text
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT c.name FROM outbox._channels c
     WHERE (pg_catalog.pg_has_role(outbox._caller_oid(), 'outbox_operator', 'USAGE')
            OR pg_catalog.pg_has_role(outbox._caller_oid(), 'outbox_admin', 'USAGE'))
       AND outbox._channel_visible(c.options -> 'tenants')
$fn$;
COMMENT ON FUNCTION outbox._visible_channels() IS
    'The channels whose rows of the operator log the calling role may read: those outbox.channels shows an operator or an admin.';
REVOKE ALL ON FUNCTION outbox._visible_channels() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox._visible_channels() TO PUBLIC;
ALTER POLICY tenant_rows ON outbox._operator_log
    USING (tenant = ANY ((SELECT outbox._visible_tenants())::text[])
           OR (tenant IS NULL AND channel IN (SELECT outbox._visible_channels())));

-- The views that run with their owner's rights are security barriers: a condition of the
-- reader's own is evaluated only on the rows their filter lets through.
ALTER VIEW outbox.channels SET (security_barrier = true);
ALTER VIEW outbox._under_way SET (security_barrier = true);

-- Whether the worker that made a claim is alive, stalled or gone, from its beat in shared
-- memory (src/worker/liveness.rs): recovery takes back only what a dead or stalled worker
-- held, never the attempts of one that is alive, however long they take.
CREATE FUNCTION outbox._claim_holder(owner integer, pid integer, lease_ms double precision) RETURNS text
VOLATILE STRICT PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', '_claim_holder_wrapper';
REVOKE ALL ON FUNCTION outbox._claim_holder(integer, integer, double precision) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox._claim_holder(integer, integer, double precision) TO outbox_worker;
-- Every function of the extension written in SQL or PL/pgSQL with a body parsed when it
-- runs pins its search path: a name or an operator in its body is never looked up under
-- the caller's search path, where a role that may create in a schema of it could plant its
-- own (outbox.prometheus() is read by pg_monitor and by superusers).
ALTER FUNCTION outbox._setting(text, integer) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._prom_label(text) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.prometheus() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._require_reason(text) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._lock_message(bigint) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._requeue(bigint) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._caller_bindings() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._tenant_visible(text) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._check_binding(name, text) SET search_path = pg_catalog, pg_temp;

-- A channel's option tenants as the calling role is shown them (outbox.channels and the
-- operator log's rows about channels): an admin sees the whole list; anyone else the
-- tenants of the list it may see itself, so that a tenant served by a shared channel does
-- not learn which other tenants it serves. ["*"] (every tenant) names no one and is shown.
CREATE FUNCTION outbox._shown_tenants(tenants jsonb) RETURNS jsonb
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT CASE WHEN outbox._caller_is_superuser()
                  OR pg_catalog.pg_has_role(outbox._caller_oid(), 'outbox_admin', 'USAGE')
                  OR pg_catalog.jsonb_typeof(tenants) IS DISTINCT FROM 'array'
                  OR tenants = '["*"]'::jsonb
                THEN tenants
                ELSE coalesce((SELECT pg_catalog.jsonb_agg(t.tenant ORDER BY t.n)
                                 FROM pg_catalog.jsonb_array_elements_text(tenants) WITH ORDINALITY AS t(tenant, n)
                                WHERE t.tenant = ANY (outbox._visible_tenants())),
                              '[]'::jsonb)
           END
$fn$;
COMMENT ON FUNCTION outbox._shown_tenants(jsonb) IS
    'A channel''s option tenants as the calling role is shown them: all of them to an admin, its own to anyone else.';
REVOKE ALL ON FUNCTION outbox._shown_tenants(jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox._shown_tenants(jsonb) TO outbox_writer, outbox_operator, outbox_admin;
-- outbox.channels and outbox.operator_log show each reader who is not an admin its own
-- tenants of a channel's option tenants, not the whole list.
CREATE OR REPLACE VIEW outbox.channels AS
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
ALTER VIEW outbox.channels SET (security_barrier = true);
CREATE OR REPLACE VIEW outbox.operator_log AS
SELECT o.at, o.actor, o.action, o.message_id, o.reason, o.state_before, o.state_after,
       CASE WHEN o.detail #> '{options,tenants}' IS NOT NULL
            THEN pg_catalog.jsonb_set(o.detail, '{options,tenants}',
                                      outbox._shown_tenants(o.detail #> '{options,tenants}'))
            ELSE o.detail END AS detail,
       o.channel, o.id, o.tenant
  FROM outbox._operator_log o;
ALTER VIEW outbox.operator_log SET (security_invoker = true);

-- outbox.drop_channel (sql/api.sql).
CREATE FUNCTION outbox.drop_channel(name text, reason text DEFAULT NULL) RETURNS void
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    dropped integer;
    pending bigint;
    removed bigint;
BEGIN
    IF reason IS NULL OR pg_catalog.btrim(reason) = '' THEN
        RAISE EXCEPTION 'a reason is required'
            USING ERRCODE = '22023', DETAIL = 'The reason was missing, NULL or blank.',
                  HINT = 'Say why the channel is dropped, as the second argument; it is written to outbox.operator_log.';
    END IF;
    -- No enqueue on the channel may commit between the count below and the drop: an
    -- enqueue that did would leave a message no worker can send. Enqueues (and records)
    -- wait for this transaction, which is short.
    LOCK TABLE outbox._messages IN SHARE ROW EXCLUSIVE MODE;
    SELECT c.id INTO dropped FROM outbox._channels c WHERE c.name = drop_channel.name FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'channel "%" does not exist', drop_channel.name
            USING ERRCODE = '42704', HINT = 'List channels in outbox.channels.';
    END IF;
    SELECT count(*) INTO pending FROM outbox._messages m
     WHERE m.channel_id = dropped AND m.state IN ('queued', 'sending', 'uncertain');
    IF pending > 0 THEN
        RAISE EXCEPTION 'channel "%" still has % message(s) queued, sending or uncertain', drop_channel.name, pending
            USING ERRCODE = '55006',
                  HINT = 'Pause it (outbox.pause_channel), then let them settle or settle them by hand (outbox.cancel, outbox.resolve) before dropping it.';
    END IF;
    DELETE FROM outbox._attempts a USING outbox._messages m
     WHERE a.message_id = m.id AND m.channel_id = dropped;
    DELETE FROM outbox._messages m WHERE m.channel_id = dropped;
    GET DIAGNOSTICS removed = ROW_COUNT;
    DELETE FROM outbox._channel_stats s WHERE s.channel_id = dropped;
    DELETE FROM outbox._channel_minutes b WHERE b.channel_id = dropped;
    DELETE FROM outbox._channels c WHERE c.id = dropped;
    INSERT INTO outbox._operator_log (action, channel, reason, detail)
    VALUES ('drop_channel', drop_channel.name, drop_channel.reason,
            pg_catalog.jsonb_build_object('messages_removed', removed));
END
$fn$;
COMMENT ON FUNCTION outbox.drop_channel(text, text) IS
    'Removes a channel with nothing queued, sending or uncertain on it, and its finished messages; its ledger entries stay. Logged.';
REVOKE ALL ON FUNCTION outbox.drop_channel(text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.drop_channel(text, text) TO outbox_admin;

-- Lanes of shared channels: a claim takes a channel's tenants in turn.
CREATE INDEX _messages_lane_idx ON outbox._messages (channel_id, tenant, next_attempt_at, id)
    WHERE state = 'queued' AND NOT held_by_key;
-- A circuit that one tenant's failures opened holds back that tenant's lane alone.
ALTER TABLE outbox._channel_flow ADD COLUMN circuit_tenant text;
-- The settle window of an uncertain message on the boot clock: a step of the wall clock
-- never brings its first lookup forward.
ALTER TABLE outbox._messages ADD COLUMN settle_boot_id uuid, ADD COLUMN settle_boot_ms bigint;
-- outbox.alerts raises database_not_served where no delivery worker serves the database,
-- and channel_paused for a channel paused longer than outbox.alert_paused_s; /metrics shows
-- outbox_channel_paused.
CREATE FUNCTION outbox._database_served() RETURNS bool
STABLE STRICT PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', '_database_served_wrapper';
REVOKE ALL ON FUNCTION outbox._database_served() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox._database_served() TO outbox_admin, pg_monitor;
-- outbox.alerts raises both: its definition is at the end of this script.

-- The latency histograms of every channel since the start, for prometheus() (read by its
-- caller, pg_monitor or outbox_admin, who may not read the tables).
CREATE VIEW outbox._latency AS
SELECT c.name AS channel, s.send_ms_counts, s.send_ms_sum, s.delivery_ms_counts, s.delivery_ms_sum
  FROM outbox._channels c
  JOIN outbox._channel_stats s ON s.channel_id = c.id;

-- One histogram of one channel in the text exposition: its cumulative buckets with le in
-- seconds, its sum in seconds and its count.
CREATE FUNCTION outbox._prom_histogram(name text, channel text, counts bigint[], sum_ms bigint)
RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    WITH k AS (SELECT outbox._latency_bounds_ms() AS bs),
    b AS (
        SELECT g.i,
               CASE WHEN g.i <= cardinality(k.bs) THEN trim_scale(k.bs[g.i] / 1000.0)::text
                    ELSE '+Inf' END AS le,
               sum(coalesce(counts[g.i], 0)) OVER (ORDER BY g.i) AS upto
          FROM k, generate_series(1, cardinality(k.bs) + 1) AS g(i)
    )
    SELECT string_agg(format('%s_bucket{channel="%s",le="%s"} %s', name, outbox._prom_label(channel),
                             b.le, b.upto), E'\n' ORDER BY b.i)
           || format(E'\n%s_sum{channel="%s"} %s', name, outbox._prom_label(channel),
                     trim_scale(coalesce(sum_ms, 0) / 1000.0))
           || format(E'\n%s_count{channel="%s"} %s', name, outbox._prom_label(channel), max(b.upto))
      FROM b
$fn$;
REVOKE ALL ON outbox._latency FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._prom_histogram(text, text, bigint[], bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox._prom_histogram(text, text, bigint[], bigint) TO outbox_admin, pg_monitor;
GRANT SELECT ON outbox._latency TO outbox_admin, pg_monitor;

CREATE OR REPLACE FUNCTION outbox.prometheus() RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
-- A series per channel while there are at most outbox.metrics_channel_series channels;
-- above it, the total of every channel as channel "*".
WITH every AS MATERIALIZED (SELECT * FROM outbox.metrics),
m AS (
    SELECT e.scope, CASE WHEN e.scope = 'total' THEN '*' ELSE e.channel END AS channel, e.queued,
           e.sending, e.uncertain, e.exhausted, e.failed, e.oldest_queued_age_s, e.delivered_total,
           e.attempts_failed_total, e.exhausted_total, e.failed_total, e.error_streak,
           e.success_rate_5m,
           CASE WHEN e.scope = 'total'
                THEN (SELECT count(*) FROM every p WHERE p.scope = 'channel' AND p.paused)
                ELSE e.paused::int END AS paused
      FROM every e
     WHERE e.scope = CASE WHEN (SELECT count(*) FROM every c WHERE c.scope = 'channel')
                               <= outbox._setting('outbox.metrics_channel_series', 1000)
                          THEN 'channel' ELSE 'total' END
),
latency AS (
    SELECT m.channel, l.send_ms_counts, l.send_ms_sum, l.delivery_ms_counts, l.delivery_ms_sum
      FROM m JOIN outbox._latency l ON l.channel = m.channel
     WHERE m.scope = 'channel'
    UNION ALL
    SELECT '*', outbox._counts_sum(l.send_ms_counts), sum(l.send_ms_sum)::bigint,
           outbox._counts_sum(l.delivery_ms_counts), sum(l.delivery_ms_sum)::bigint
      FROM outbox._latency l
     WHERE EXISTS (SELECT 1 FROM m WHERE m.scope = 'total')
    HAVING count(*) > 0
),
families(ord, name, kind, help) AS (VALUES
    (1, 'outbox_messages', 'gauge', 'Messages by channel and state.'),
    (2, 'outbox_oldest_queued_age_seconds', 'gauge', 'How long the oldest due queued message of a channel has waited.'),
    (3, 'outbox_delivered_total', 'counter', 'Messages confirmed delivered (by a 2xx or by reconcile).'),
    (4, 'outbox_attempts_failed_total', 'counter', 'Attempts that did not deliver.'),
    (5, 'outbox_exhausted_total', 'counter', 'Messages whose retry budget ran out.'),
    (6, 'outbox_failed_total', 'counter', 'Messages that failed permanently.'),
    (7, 'outbox_error_streak', 'gauge', 'Consecutive failed attempts on a channel.'),
    (8, 'outbox_success_rate_5m', 'gauge', 'Share of attempts in the last 5 minutes that delivered.'),
    (9, 'outbox_alert', 'gauge', 'Active alerts (1 per alert).'),
    (10, 'outbox_worker_up', 'gauge', 'Delivery workers running.'),
    (11, 'outbox_queued', 'gauge', 'Queued messages of a channel (outbox_messages with state queued).'),
    (12, 'outbox_channel_paused', 'gauge', 'Whether a channel is paused (1) or not (0); for channel "*", how many are.'),
    (13, 'outbox_send_duration_seconds', 'histogram', 'How long each send took, from its start to its answer or failure.'),
    (14, 'outbox_delivery_latency_seconds', 'histogram', 'How long each delivered message waited from enqueue to delivered.')
),
samples(ord, line) AS (
    SELECT 1, format('outbox_messages{channel="%s",state="%s"} %s', outbox._prom_label(m.channel), s.state, s.n)
      FROM m CROSS JOIN LATERAL (VALUES ('queued', m.queued), ('sending', m.sending), ('uncertain', m.uncertain),
                                        ('exhausted', m.exhausted), ('failed', m.failed)) AS s(state, n)
    UNION ALL
    SELECT 2, format('outbox_oldest_queued_age_seconds{channel="%s"} %s', outbox._prom_label(m.channel), coalesce(m.oldest_queued_age_s, 0)) FROM m
    UNION ALL
    SELECT 3, format('outbox_delivered_total{channel="%s"} %s', outbox._prom_label(m.channel), m.delivered_total) FROM m
    UNION ALL
    SELECT 4, format('outbox_attempts_failed_total{channel="%s"} %s', outbox._prom_label(m.channel), m.attempts_failed_total) FROM m
    UNION ALL
    SELECT 5, format('outbox_exhausted_total{channel="%s"} %s', outbox._prom_label(m.channel), m.exhausted_total) FROM m
    UNION ALL
    SELECT 6, format('outbox_failed_total{channel="%s"} %s', outbox._prom_label(m.channel), m.failed_total) FROM m
    UNION ALL
    SELECT 7, format('outbox_error_streak{channel="%s"} %s', outbox._prom_label(m.channel), m.error_streak) FROM m
    UNION ALL
    SELECT 8, format('outbox_success_rate_5m{channel="%s"} %s', outbox._prom_label(m.channel), m.success_rate_5m)
      FROM m WHERE m.success_rate_5m IS NOT NULL
    UNION ALL
    SELECT 9, format('outbox_alert{alert="%s",channel="%s",severity="%s"} 1', a.alert, outbox._prom_label(a.channel), a.severity)
      FROM outbox.alerts a
    UNION ALL
    SELECT 10, format('outbox_worker_up %s', count(*)) FROM outbox.worker_status() w WHERE w.pid IS NOT NULL
    UNION ALL
    SELECT 11, format('outbox_queued{channel="%s"} %s', outbox._prom_label(m.channel), m.queued) FROM m
    UNION ALL
    SELECT 12, format('outbox_channel_paused{channel="%s"} %s', outbox._prom_label(m.channel), m.paused) FROM m
    UNION ALL
    SELECT 13, outbox._prom_histogram('outbox_send_duration_seconds', l.channel, l.send_ms_counts, l.send_ms_sum)
      FROM latency l
    UNION ALL
    SELECT 14, outbox._prom_histogram('outbox_delivery_latency_seconds', l.channel, l.delivery_ms_counts,
                                      l.delivery_ms_sum)
      FROM latency l
)
SELECT string_agg(x.line, E'\n' ORDER BY x.ord, x.sub, x.line) || E'\n'
  FROM (SELECT f.ord, 0 AS sub, format('# HELP %s %s', f.name, f.help) AS line FROM families f
        UNION ALL
        SELECT f.ord, 1, format('# TYPE %s %s', f.name, f.kind) FROM families f
        UNION ALL
        SELECT s.ord, 2, s.line FROM samples s) x
$fn$;

-- Operator calls without a reason: the reason takes a default, so a call that leaves it out
-- reaches the check and hears "a reason is required" rather than "function does not exist".
CREATE OR REPLACE FUNCTION outbox._require_reason(reason text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF reason IS NULL OR pg_catalog.btrim(reason) = '' THEN
        RAISE EXCEPTION 'a reason is required'
            USING ERRCODE = '22023',
                  DETAIL = 'The reason was missing, NULL or blank.',
                  HINT = 'Say why, as the reason argument (for example outbox.retry(42, ''provider fixed, INC-1234'')): it is kept in outbox.operator_log with your name.';
    END IF;
    IF pg_catalog.char_length(reason) > 1000 THEN
        RAISE EXCEPTION 'reason is % characters long; at most 1000 are allowed', pg_catalog.char_length(reason)
            USING ERRCODE = '22023', HINT = 'Keep the reason short; put long notes in your ticket and link it.';
    END IF;
END
$fn$;

CREATE OR REPLACE FUNCTION outbox.cancel(id bigint, reason text DEFAULT NULL) RETURNS outbox.state
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_msg outbox._messages;
BEGIN
    PERFORM outbox._require_reason(cancel.reason);
    v_msg := outbox._lock_message(cancel.id);
    IF v_msg.state = 'delivered' THEN
        RAISE EXCEPTION 'message % was delivered; it cannot be cancelled', v_msg.id USING ERRCODE = '55000';
    END IF;
    IF v_msg.state = 'sending' THEN
        RAISE EXCEPTION 'message % is being sent right now; cancel refused', v_msg.id
            USING ERRCODE = '55000', HINT = 'Wait for the attempt''s outcome, then cancel if it did not go through.';
    END IF;
    IF v_msg.state = 'cancelled' THEN
        RAISE NOTICE 'message % is already cancelled', v_msg.id;
    ELSE
        UPDATE outbox._messages m SET state = 'cancelled', updated_at = pg_catalog.now() WHERE m.id = v_msg.id;
    END IF;
    INSERT INTO outbox._operator_log (action, message_id, tenant, reason, state_before, state_after)
    VALUES ('cancel', v_msg.id, v_msg.tenant, cancel.reason, v_msg.state, 'cancelled');
    RETURN 'cancelled'::outbox.state;
END
$fn$;

CREATE OR REPLACE FUNCTION outbox.pause_channel(name text, reason text DEFAULT NULL) RETURNS void
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF reason IS NULL OR pg_catalog.btrim(reason) = '' THEN
        RAISE EXCEPTION 'a reason is required'
            USING ERRCODE = '22023', DETAIL = 'The reason was missing, NULL or blank.',
                  HINT = 'Say why the channel is paused, as the second argument; it is written to outbox.operator_log.';
    END IF;
    UPDATE outbox._channels c
       SET paused = true, paused_reason = pause_channel.reason, paused_at = pg_catalog.now(), updated_at = pg_catalog.now()
     WHERE c.name = pause_channel.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'channel "%" does not exist', pause_channel.name
            USING ERRCODE = '42704', HINT = 'List channels in outbox.channels.';
    END IF;
    INSERT INTO outbox._operator_log (action, channel, reason)
    VALUES ('pause_channel', pause_channel.name, pause_channel.reason);
END
$fn$;

-- The review of ambiguous outcomes (outbox.ambiguity_review), and the alerts of too much
-- ambiguity on a channel and of work nobody has taken (outbox._channel_minutes.ambiguous,
-- added with the latency histograms above).
CREATE FUNCTION outbox.ambiguity_review(since interval DEFAULT '7 days')
RETURNS TABLE (channel text, sends bigint, ambiguous bigint, ambiguous_pct numeric,
               timed_out bigint, lost_after_write bigint, worker_interrupted bigint,
               gateway bigint, lookups_found bigint, lookups_not_found bigint,
               delivered_without_external_id bigint, permanent_then_delivered bigint,
               answer_p99_ms numeric, timeout_ms integer, suggestion text)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
WITH a AS (
    -- The attempts of the window with their channel: from the queue, or from the ledger
    -- entry of a delivered message.
    SELECT a.message_id, a.kind, a.outcome, a.error_class, a.http_status, a.error,
           a.started_at, a.finished_at,
           coalesce((SELECT m.channel_id FROM outbox._messages m WHERE m.id = a.message_id),
                    (SELECT l.channel_id FROM outbox._ledger l WHERE l.message_id = a.message_id LIMIT 1))
             AS channel_id
      FROM outbox._attempts a
     WHERE a.started_at >= pg_catalog.now() - ambiguity_review.since
), per_channel AS (
    SELECT a.channel_id,
           count(*) FILTER (WHERE a.kind = 'send' AND a.outcome IS DISTINCT FROM 'not sent') AS sends,
           count(*) FILTER (WHERE a.kind IN ('send', 'recovery') AND a.error_class = 'ambiguous') AS ambiguous,
           count(*) FILTER (WHERE a.kind = 'send' AND a.error_class = 'ambiguous'
                              AND a.http_status IS NULL AND a.error LIKE '%timed out%') AS timed_out,
           count(*) FILTER (WHERE a.kind = 'send' AND a.error_class = 'ambiguous'
                              AND a.http_status IS NULL AND a.error NOT LIKE '%timed out%') AS lost_after_write,
           count(*) FILTER (WHERE a.kind = 'recovery') AS worker_interrupted,
           count(*) FILTER (WHERE a.kind = 'send' AND a.error_class = 'ambiguous'
                              AND a.http_status IN (502, 504)) AS gateway,
           count(*) FILTER (WHERE a.kind = 'reconcile' AND a.outcome = 'delivered') AS lookups_found,
           count(*) FILTER (WHERE a.kind = 'reconcile' AND a.outcome = 'not_found') AS lookups_not_found,
           (percentile_cont(0.99) WITHIN GROUP (
                ORDER BY extract(epoch FROM a.finished_at - a.started_at) * 1000)
              FILTER (WHERE a.kind = 'send' AND a.http_status IS NOT NULL))::numeric(12, 1) AS answer_p99_ms
      FROM a
     WHERE a.channel_id IS NOT NULL
     GROUP BY a.channel_id
), entries AS (
    SELECT l.channel_id, count(*) AS without_external_id
      FROM outbox._ledger l
     WHERE l.recorded_at >= pg_catalog.now() - ambiguity_review.since
       AND l.recorded_by = 'worker' AND l.external_id IS NULL
     GROUP BY l.channel_id
), rescued AS (
    -- Failed as permanent, then delivered after an operator's retry: a status the channel
    -- classifies as permanent that was not.
    SELECT l.channel_id, count(DISTINCT l.message_id) AS permanent_then_delivered
      FROM outbox._ledger l
     WHERE l.recorded_at >= pg_catalog.now() - ambiguity_review.since
       AND EXISTS (SELECT 1 FROM outbox._attempts p
                    WHERE p.message_id = l.message_id AND p.kind = 'send' AND p.error_class = 'permanent')
       AND EXISTS (SELECT 1 FROM outbox._operator_log o
                    WHERE o.message_id = l.message_id AND o.action = 'retry')
     GROUP BY l.channel_id
)
SELECT c.name,
       p.sends,
       p.ambiguous,
       round(100.0 * p.ambiguous / nullif(p.sends, 0), 2),
       p.timed_out, p.lost_after_write, p.worker_interrupted, p.gateway,
       p.lookups_found, p.lookups_not_found,
       coalesce(e.without_external_id, 0),
       coalesce(r.permanent_then_delivered, 0),
       p.answer_p99_ms,
       t.timeout_ms,
       CASE
           WHEN p.timed_out > 0 AND p.timed_out * 100 >= p.sends
               THEN pg_catalog.format('%s of %s sends timed out: raise timeout_ms above the provider''s slowest answers (now %s ms; try %s), or ask the provider why it is slow',
                                      p.timed_out, p.sends, t.timeout_ms, t.timeout_ms * 2)
           WHEN p.answer_p99_ms >= 0.8 * t.timeout_ms
               THEN pg_catalog.format('answers take up to %s ms (p99), close to timeout_ms %s: raise it to about %s',
                                      p.answer_p99_ms, t.timeout_ms, ceil(p.answer_p99_ms * 2))
           WHEN p.gateway > 0
               THEN pg_catalog.format('%s answers of 502/504 from a gateway: set idempotency_header where the provider dedupes by a key, so that they are resent safely', p.gateway)
           WHEN p.lookups_not_found > 0 AND outbox._can_look_up(c.options)
               THEN pg_catalog.format('%s lookups found nothing: check the reconcile lookup and where the provider''s answers keep their id (external_id)', p.lookups_not_found)
           WHEN coalesce(r.permanent_then_delivered, 0) > 0
               THEN pg_catalog.format('%s messages failed as permanent and were delivered by a retry: classify that status as transient (the classify option)', r.permanent_then_delivered)
           WHEN p.worker_interrupted > 0
               THEN pg_catalog.format('%s attempts were interrupted by a worker crash or stall: see the server log', p.worker_interrupted)
           WHEN coalesce(e.without_external_id, 0) > 0 AND outbox._can_look_up(c.options)
               THEN pg_catalog.format('%s deliveries kept no external id: a lookup by id cannot find them; check the channel''s external id setting', e.without_external_id)
           ELSE 'nothing to change'
       END
  FROM per_channel p
  JOIN outbox.channels c ON c.id = p.channel_id
  LEFT JOIN entries e ON e.channel_id = p.channel_id
  LEFT JOIN rescued r ON r.channel_id = p.channel_id
 CROSS JOIN LATERAL (SELECT coalesce(outbox._option_int(c.options, '{timeout_ms}'), 10000) AS timeout_ms) t
 ORDER BY p.ambiguous DESC, c.name
$fn$;
COMMENT ON FUNCTION outbox.ambiguity_review(interval) IS
    'The review of ambiguous outcomes per channel since an interval ago: their causes (timeout, connection lost after writing, worker crash or stall, gateway 502/504), lookups found and not found, deliveries without an external id, permanent errors a retry delivered, the answer time p99 beside timeout_ms, and a suggested change.';
REVOKE ALL ON FUNCTION outbox.ambiguity_review(interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.ambiguity_review(interval) TO outbox_operator;

CREATE OR REPLACE VIEW outbox.alerts AS
SELECT 'queue_age'::text AS alert,
       m.channel,
       CASE WHEN m.oldest_queued_age_s > 4 * outbox._setting('outbox.alert_queue_age_s', 300)
            THEN 'critical' ELSE 'warning' END AS severity,
       m.oldest_queued_age_s AS value,
       outbox._setting('outbox.alert_queue_age_s', 300)::numeric AS threshold,
       pg_catalog.now() - make_interval(secs => m.oldest_queued_age_s::double precision) AS since
  FROM outbox.metrics m
 WHERE m.scope = 'channel' AND NOT m.paused
   AND m.oldest_queued_age_s > outbox._setting('outbox.alert_queue_age_s', 300)
UNION ALL
SELECT 'error_streak', c.name, 'warning', s.error_streak::numeric,
       outbox._setting('outbox.alert_error_streak', 10)::numeric, s.error_streak_since
  FROM outbox._channel_stats s
  JOIN outbox._channels c ON c.id = s.channel_id
 WHERE s.error_streak >= outbox._setting('outbox.alert_error_streak', 10)
UNION ALL
SELECT 'terminal_failures', c.name, 'critical', count(*)::numeric, 0::numeric, min(m.updated_at)
  FROM outbox._messages m
  JOIN outbox._channels c ON c.id = m.channel_id
 WHERE m.state IN ('failed', 'exhausted') AND m.updated_at > pg_catalog.now() - interval '1 hour'
 GROUP BY c.name
UNION ALL
SELECT 'uncertain', c.name, 'critical', count(*)::numeric,
       outbox._setting('outbox.alert_uncertain_age_s', 300)::numeric, min(u.since)
  FROM outbox._messages m
  JOIN outbox._channels c ON c.id = m.channel_id
  -- Uncertain since the send (or the recovery of a lost lease) that left it so: the
  -- inconclusive lookups that follow change the row, not how long nobody has known.
  CROSS JOIN LATERAL (
      SELECT coalesce((SELECT coalesce(a.finished_at, a.started_at)
                         FROM outbox._attempts a
                        WHERE a.message_id = m.id AND a.kind IN ('send', 'recovery')
                        ORDER BY a.id DESC LIMIT 1),
                      m.updated_at) AS since) u
 WHERE m.state = 'uncertain'
   AND (NOT outbox._can_look_up(c.options)
        OR u.since < pg_catalog.now() - make_interval(secs => outbox._setting('outbox.alert_uncertain_age_s', 300)))
 GROUP BY c.name
UNION ALL
-- A channel whose circuit is open (or half open, probing): value = seconds in that state.
SELECT 'circuit_open', c.name, 'critical',
       round(extract(epoch FROM pg_catalog.now() - f.circuit_since), 3)::numeric, 0::numeric,
       f.circuit_since
  FROM outbox._channel_flow f
  JOIN outbox._channels c ON c.id = f.channel_id
 WHERE f.circuit_state IN ('open', 'half_open')
   AND jsonb_typeof(c.options -> 'circuit') = 'object'
UNION ALL
-- A channel paused for longer than outbox.alert_paused_s: its queue raises no queue_age alert
-- while it is paused. value = seconds since it was paused.
SELECT 'channel_paused', c.name, 'warning',
       round(extract(epoch FROM pg_catalog.now() - c.paused_at), 3)::numeric,
       outbox._setting('outbox.alert_paused_s', 3600)::numeric, c.paused_at
  FROM outbox._channels c
 WHERE c.paused
   AND c.paused_at < pg_catalog.now() - make_interval(secs => outbox._setting('outbox.alert_paused_s', 3600))
UNION ALL
-- No delivery worker serves this database (it is not in outbox.database, or the library is
-- not preloaded): whatever is enqueued here stays queued. value = 0.
SELECT 'database_not_served', NULL, 'critical', 0::numeric, 0::numeric, NULL::timestamptz
 WHERE NOT outbox._database_served()
UNION ALL
-- The ledger's retention has put off emptying a due generation for five minutes: a session
-- holds its table (docs/runbook.md). value = seconds since the first time it was put off.
SELECT 'ledger_retention_deferred', NULL, 'warning',
       round(extract(epoch FROM pg_catalog.now() - g.emptying_deferred_since), 3)::numeric,
       300::numeric, g.emptying_deferred_since
  FROM outbox._ledger_generations g
 WHERE g.emptying_deferred_since < pg_catalog.now() - interval '5 minutes'
UNION ALL
-- A channel whose sends of the last hour came out ambiguous more often than
-- outbox.alert_ambiguous_pct percent, with at least 20 sends: a timeout shorter than the
-- provider's answers, a gateway that gives up first, or a classification to look at
-- (outbox.ambiguity_review). value = the percentage.
SELECT 'ambiguity_high', c.name, 'warning', round(100.0 * b.ambiguous / b.sends, 2),
       outbox._setting('outbox.alert_ambiguous_pct', 5)::numeric, b.since
  FROM (SELECT b.channel_id, sum(b.ambiguous) AS ambiguous, sum(b.delivered + b.failed) AS sends,
               min(b.minute) FILTER (WHERE b.ambiguous > 0) AS since
          FROM outbox._channel_minutes b
         WHERE b.minute >= date_trunc('minute', pg_catalog.now()) - interval '59 minutes'
         GROUP BY b.channel_id) b
  JOIN outbox._channels c ON c.id = b.channel_id
 WHERE b.sends >= 20
   AND 100 * b.ambiguous > outbox._setting('outbox.alert_ambiguous_pct', 5) * b.sends
UNION ALL
-- Messages waiting for an operator that nobody has taken for outbox.alert_unowned_s (a
-- day): the daily review of the work queue is not happening. value = how many.
SELECT 'work_queue_unowned', c.name, 'warning', count(*)::numeric,
       outbox._setting('outbox.alert_unowned_s', 86400)::numeric, min(m.updated_at)
  FROM outbox._messages m
  JOIN outbox._channels c ON c.id = m.channel_id
 WHERE m.state IN ('uncertain', 'exhausted', 'failed') AND m.owner IS NULL
   AND m.updated_at < pg_catalog.now() - make_interval(secs => outbox._setting('outbox.alert_unowned_s', 86400))
 GROUP BY c.name;
COMMENT ON VIEW outbox.alerts IS
    'What needs a human, not every transient error: queue age over outbox.alert_queue_age_s, an error streak of outbox.alert_error_streak failed attempts on one channel, terminal failures in the last hour, uncertain messages (at once where the channel cannot reconcile, after outbox.alert_uncertain_age_s since the send that left them uncertain where it can), a channel whose circuit is open, a channel paused longer than outbox.alert_paused_s, a database no delivery worker serves, a generation of the ledger whose emptying has been put off for five minutes, a channel whose sends of the last hour came out ambiguous more often than outbox.alert_ambiguous_pct percent, messages in the work queue without an owner for outbox.alert_unowned_s. since = when it began.';
