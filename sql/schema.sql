-- outbox_delivery: durable state.
--
-- Tables are private (`_` prefix); operators and applications read the views defined in
-- views.sql. Every table that holds durable state is registered with
-- pg_extension_config_dump so that pg_dump of the database keeps channels, messages,
-- attempts, the ledger and the operator log.

CREATE TYPE outbox.state AS ENUM (
    'queued', 'sending', 'delivered', 'uncertain', 'exhausted', 'failed', 'cancelled'
);
COMMENT ON TYPE outbox.state IS
    'Life cycle of an outbox message: queued -> sending -> delivered, or uncertain / exhausted / failed for an operator, or cancelled.';

CREATE TYPE outbox.error_class AS ENUM ('transient', 'permanent', 'ambiguous');
COMMENT ON TYPE outbox.error_class IS
    'Class of a failed attempt: transient (retry with backoff), permanent (no retry), ambiguous (the provider may have acted; never blindly resent).';

-- Channels: where messages go and how. `options` holds the complete, validated and
-- normalized option object (every default filled in), so SQL can read it directly.
CREATE SEQUENCE outbox._channels_id_seq AS integer;
CREATE TABLE outbox._channels (
    id            integer     NOT NULL DEFAULT nextval('outbox._channels_id_seq') PRIMARY KEY,
    name          text        NOT NULL UNIQUE,
    endpoint      text        NOT NULL,
    options       jsonb       NOT NULL,
    paused        boolean     NOT NULL DEFAULT false,
    paused_reason text,
    paused_at     timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT channel_name_not_empty CHECK (name <> '')
);
ALTER SEQUENCE outbox._channels_id_seq OWNED BY outbox._channels.id;
COMMENT ON TABLE outbox._channels IS 'Delivery channels (private; use outbox.create_channel / alter_channel).';

-- enqueue caches the channels (name -> id, paused) and the tenant bindings for the
-- session (src/config_cache.rs). Every statement that changes either table invalidates
-- the table's relation cache entry, which tells every session to read it again.
CREATE FUNCTION outbox._config_changed() RETURNS trigger
LANGUAGE c AS 'MODULE_PATHNAME', 'outbox_config_changed';
CREATE TRIGGER _channels_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON outbox._channels
    FOR EACH STATEMENT EXECUTE FUNCTION outbox._config_changed();

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
    -- The tenant whose lane alone the circuit holds back (or whose failures alone make its
    -- streak); NULL: the whole channel (src/channels/circuit.rs).
    circuit_tenant text,
    CONSTRAINT circuit_state_known CHECK (circuit_state IN ('closed', 'open', 'half_open'))
);
COMMENT ON TABLE outbox._channel_flow IS 'Rate limit tokens, channel-wide Retry-After and circuit state per channel (private; see outbox.channels).';

-- Messages: one row per side effect. (tenant, effect_key) is unique: the same effect
-- enqueued twice yields the same message.
CREATE SEQUENCE outbox._messages_id_seq AS bigint;
CREATE TABLE outbox._messages (
    id               bigint             NOT NULL DEFAULT nextval('outbox._messages_id_seq') PRIMARY KEY,
    -- Keys compare byte by byte (COLLATE "C"): their B-tree indexes, which every enqueue,
    -- claim and record descends, never go through the database's collation (the ledger's
    -- keys too). Equality is the same; only their sort order is bytewise.
    tenant           text COLLATE "C"   NOT NULL DEFAULT 'default',
    channel_id       integer            NOT NULL,
    state            outbox.state       NOT NULL DEFAULT 'queued',
    effect_key       text COLLATE "C"   NOT NULL,
    ordering_key     text COLLATE "C",
    payload          jsonb              NOT NULL,
    headers          jsonb,
    not_before       timestamptz,
    next_attempt_at  timestamptz        NOT NULL DEFAULT now(),
    attempts         integer            NOT NULL DEFAULT 0,
    -- The retry budget counts attempts after budget_base, and age since budget_started_at
    -- (NULL: since created_at); an operator's retry of an exhausted or failed message
    -- starts a fresh budget, keeping the effect key.
    budget_base      integer            NOT NULL DEFAULT 0,
    budget_started_at timestamptz,
    reconcile_attempts integer          NOT NULL DEFAULT 0,
    lease_until      timestamptz,
    lease_owner      integer,
    first_attempt_at timestamptz,
    last_error_class outbox.error_class,
    last_error       text,
    last_http_status integer,
    external_id      text,
    owner            text,
    created_at       timestamptz        NOT NULL DEFAULT now(),
    updated_at       timestamptz        NOT NULL DEFAULT now(),
    delivered_at     timestamptz,
    -- The attempt in progress (state `sending`): when it was claimed and the pid of the
    -- worker that sends it. Its row of outbox._attempts is written once, with its outcome,
    -- when it is recorded or recovered; until then outbox.attempts shows it from here, and
    -- so it does for good when that attempt delivered the message (no row is written).
    -- Kept out of every index: they add no index entries of their own. (The claim's and the
    -- record's updates are not HOT anyway: they change `state`, which the partial indexes read.)
    attempt_started_at timestamptz,
    attempt_pid      integer,
    -- Held behind its ordering key: an earlier message of the same key was pending when a
    -- worker looked (src/worker/key_hold.rs), so no claim could take this one. A held
    -- message leaves the due part of its channel's due index, which the claim would
    -- otherwise step over entry by entry at each claim; the message before it releases it
    -- when it stops being pending (outbox._release_key). Only ever a hint for the claim,
    -- which checks the order itself.
    held_by_key      boolean            NOT NULL DEFAULT false,
    -- The end of the settle window of an `uncertain` message (the wait before its first
    -- lookup) on the boot clock (CLOCK_BOOTTIME, ms) of the machine's boot
    -- `settle_boot_id`: no lookup runs, and no not-found answer requeues it, before then,
    -- whatever the wall clock does. On another boot (a restart, a failover, a move) the
    -- wall clock alone decides (src/clock.rs).
    settle_boot_id   uuid,
    settle_boot_ms   bigint,
    CONSTRAINT message_effect_key_unique UNIQUE (tenant, effect_key),
    CONSTRAINT message_held_has_key CHECK (NOT held_by_key OR ordering_key IS NOT NULL)
) WITH (fillfactor = 80, autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.05);
ALTER SEQUENCE outbox._messages_id_seq OWNED BY outbox._messages.id;
COMMENT ON TABLE outbox._messages IS 'Outbox messages (private; read outbox.messages).';

-- Claiming due work: a small partial index that holds only queued rows, per channel, in
-- due order. At a backlog of millions the claim reads the head of it and nothing else.
-- Messages held behind their ordering key sort apart (held_by_key), so that the claim,
-- which reads `NOT held_by_key`, never steps over them; a count of a channel's queue
-- still reads one index.
CREATE INDEX _messages_due_idx ON outbox._messages (channel_id, held_by_key, next_attempt_at, id)
    WHERE state = 'queued';
-- Lanes: the queued messages of each tenant of a channel, in due order. A claim takes the
-- tenants of a shared channel in turn (src/worker/claim.rs, CLAIM_DUE): it walks a
-- channel's tenants here, one descent each, and reads each tenant's head, so that one
-- tenant's backlog never stands before another tenant's next message.
CREATE INDEX _messages_lane_idx ON outbox._messages (channel_id, tenant, next_attempt_at, id)
    WHERE state = 'queued' AND NOT held_by_key;
-- A message in flight is a queued row in a claim (outbox._claims): no row is `sending` but
-- one written so by hand, which recovery adopts into a claim whose lease has ended and then
-- takes back as an interrupted attempt. Empty, but for such rows.
CREATE INDEX _messages_sending_idx ON outbox._messages (id) WHERE state = 'sending';
-- Ordering keys: "is an earlier message with my key still pending?"
CREATE INDEX _messages_ordering_idx ON outbox._messages (tenant, ordering_key, id)
    WHERE ordering_key IS NOT NULL AND state IN ('queued', 'sending', 'uncertain');
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

-- Work queue: the (few) messages waiting for a human.
CREATE INDEX _messages_attention_idx ON outbox._messages (state, updated_at)
    WHERE state IN ('uncertain', 'exhausted', 'failed');
-- Retention: finished messages, oldest first.
CREATE INDEX _messages_finished_idx ON outbox._messages (updated_at)
    WHERE state IN ('delivered', 'cancelled');

-- Attempts under way. A claim writes one row for each channel it took messages of: their
-- ids, their lease and the worker that sends them. It locks the messages but does not write
-- them: a message row is written once its outcome is known, so that a delivery writes its
-- queue row twice (the enqueue, the record's deletion) and not a second version besides.
-- A message is `sending` while its id is in a row here, in the attempt after the ones its
-- row counts (attempts + 1). The record of an outcome takes the message's id out of its
-- row (and deletes a row left empty); recovery takes back the ids of a row whose lease ran
-- out. A handful of rows (at most a few batches per worker): every reader scans it whole.
-- Each claim and record leaves dead versions of its rows; a worker that claims vacuums the
-- table itself every two seconds or so (src/worker/claims_upkeep.rs), so that it
-- stays a few pages long between the runs of autovacuum.
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

-- Attempts: one row per finished send, reconcile lookup or recovery decision, written once
-- with its outcome (a send in progress is the `sending` message itself, and so is a send
-- that delivered it: outbox.attempts).
-- A database updated from 0.1.0 may still hold rows of sends open at the update
-- (finished_at NULL): recovery closes them.
CREATE SEQUENCE outbox._attempts_id_seq AS bigint;
CREATE TABLE outbox._attempts (
    id              bigint             NOT NULL DEFAULT nextval('outbox._attempts_id_seq') PRIMARY KEY,
    message_id      bigint             NOT NULL,
    tenant          text               NOT NULL,
    attempt         integer            NOT NULL,
    kind            text               NOT NULL,
    started_at      timestamptz        NOT NULL DEFAULT now(),
    finished_at     timestamptz,
    outcome         text,
    error_class     outbox.error_class,
    http_status     integer,
    error           text,
    retry_after_ms  bigint,
    external_id     text,
    effect_key_sent text,
    worker_pid      integer,
    CONSTRAINT attempt_kind_known CHECK (kind IN ('send', 'reconcile', 'recovery'))
) WITH (fillfactor = 85, autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.05);
ALTER SEQUENCE outbox._attempts_id_seq OWNED BY outbox._attempts.id;
CREATE INDEX _attempts_message_idx ON outbox._attempts (message_id, id);
COMMENT ON TABLE outbox._attempts IS 'Attempt history (private; read outbox.attempts).';

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

-- Every operator decision and channel change.
CREATE SEQUENCE outbox._operator_log_id_seq AS bigint;
CREATE TABLE outbox._operator_log (
    id           bigint       NOT NULL DEFAULT nextval('outbox._operator_log_id_seq') PRIMARY KEY,
    at           timestamptz  NOT NULL DEFAULT now(),
    actor        text         NOT NULL DEFAULT session_user,
    action       text         NOT NULL,
    message_id   bigint,
    -- The tenant of the message (or of the binding) acted on; NULL for channel changes.
    tenant       text,
    channel      text,
    reason       text,
    state_before outbox.state,
    state_after  outbox.state,
    detail       jsonb
);
ALTER SEQUENCE outbox._operator_log_id_seq OWNED BY outbox._operator_log.id;
CREATE INDEX _operator_log_message_idx ON outbox._operator_log (message_id, id);
COMMENT ON TABLE outbox._operator_log IS 'Audit log of operator actions and channel changes (private; read outbox.operator_log).';

SELECT pg_catalog.pg_extension_config_dump('outbox._channels', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._channels_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._channel_flow', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._messages', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._messages_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._attempts', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._claims', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._claims_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._attempts_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._ledger_0', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._ledger_1', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._ledger_2', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._ledger_generations', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._operator_log', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._operator_log_id_seq', '');

-- Per-channel figures the worker keeps as it records outcomes (one upsert per channel per
-- batch), so that metrics and alerts never count the message table. Totals only grow.
CREATE TABLE outbox._channel_stats (
    channel_id            integer     PRIMARY KEY,
    delivered_total       bigint      NOT NULL DEFAULT 0,
    attempts_failed_total bigint      NOT NULL DEFAULT 0,
    exhausted_total       bigint      NOT NULL DEFAULT 0,
    failed_total          bigint      NOT NULL DEFAULT 0,
    uncertain_total       bigint      NOT NULL DEFAULT 0,
    error_streak          integer     NOT NULL DEFAULT 0,
    error_streak_since    timestamptz,
    last_success_at       timestamptz,
    last_failure_at       timestamptz,
    -- Latency histograms since the start (src/metrics/latency.rs): per bucket of
    -- outbox._latency_bounds_ms() and +Inf, not cumulative, and the sum of the values in ms.
    -- How long each send took, from its start to its answer or failure:
    send_ms_counts        bigint[]    NOT NULL DEFAULT '{}',
    send_ms_sum           bigint      NOT NULL DEFAULT 0,
    -- How long each delivered message waited from enqueue:
    delivery_ms_counts    bigint[]    NOT NULL DEFAULT '{}',
    delivery_ms_sum       bigint      NOT NULL DEFAULT 0
) WITH (fillfactor = 50);
COMMENT ON TABLE outbox._channel_stats IS 'Per-channel counters kept by the worker (private; read outbox.metrics).';

-- Deliveries and failed attempts per channel and minute, for the 5-minute figures; the
-- worker removes buckets older than a day.
CREATE TABLE outbox._channel_minutes (
    channel_id integer     NOT NULL,
    minute     timestamptz NOT NULL,
    delivered  bigint      NOT NULL DEFAULT 0,
    failed     bigint      NOT NULL DEFAULT 0,
    -- Of the failed attempts, those whose outcome was ambiguous (outbox.alerts'
    -- ambiguity_high).
    ambiguous  bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (channel_id, minute),
    -- The minute's latency histograms, as in outbox._channel_stats (outbox.metrics' p50,
    -- p95 and p99 over 5 minutes).
    send_ms_counts     bigint[] NOT NULL DEFAULT '{}',
    delivery_ms_counts bigint[] NOT NULL DEFAULT '{}'
) WITH (fillfactor = 50);
COMMENT ON TABLE outbox._channel_minutes IS 'Per-minute delivery figures kept by the worker (private).';

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

SELECT pg_catalog.pg_extension_config_dump('outbox._channel_stats', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._channel_minutes', '');
