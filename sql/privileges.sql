-- outbox_delivery: who may do what (docs/security.md). Runs last, when every function of
-- the extension exists. Nothing is granted to PUBLIC but the functions row-level security
-- calls, which only tell the caller its own tenants and the channels it may see.

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox._visible_tenants() TO PUBLIC;
GRANT EXECUTE ON FUNCTION outbox._visible_channels() TO PUBLIC;
-- What outbox.channels calls as its reader (functions a view calls are checked against the
-- reader): masking, and whether the reader may see a channel (it answers about the reader
-- alone). Granted to the roles that read the view.
GRANT EXECUTE ON FUNCTION
    outbox._masked_url(text),
    outbox._masked_options(jsonb),
    outbox._channel_visible(jsonb),
    outbox._shown_tenants(jsonb)
    TO outbox_writer, outbox_operator, outbox_admin;

GRANT USAGE ON SCHEMA outbox TO outbox_writer, outbox_operator, outbox_admin, outbox_worker, pg_monitor;
-- The messages in flight that outbox.messages and outbox.attempts read as their reader;
-- it shows the reader's own tenants' messages alone.
GRANT SELECT ON outbox._under_way TO outbox_writer, outbox_operator, outbox_admin;

-- Writers: enqueue and follow their own tenant's messages.
GRANT EXECUTE ON FUNCTION
    outbox.effect_key(text, text),
    outbox.enqueue(text, jsonb, text, text, timestamptz, jsonb),
    outbox.status(bigint)
    TO outbox_writer;
GRANT SELECT ON outbox.messages, outbox.attempts, outbox.ledger, outbox.channels TO outbox_writer;
GRANT SELECT ON outbox._messages, outbox._attempts, outbox._ledger TO outbox_writer;

-- Operators: read and act on their own tenant's messages.
GRANT EXECUTE ON FUNCTION
    outbox.effect_key(text, text),
    outbox.status(bigint),
    outbox.reconcile(bigint),
    outbox.reconcile(),
    outbox.retry(bigint, text),
    outbox.resolve(bigint, text, text, text),
    outbox.cancel(bigint, text),
    outbox.assign(bigint, text),
    outbox.worker_status(),
    outbox.ambiguity_review(interval)
    TO outbox_operator;
GRANT SELECT ON outbox.messages, outbox.attempts, outbox.ledger, outbox.channels,
                outbox.work_queue, outbox.operator_log
    TO outbox_operator;
GRANT SELECT ON outbox._messages, outbox._attempts, outbox._ledger, outbox._operator_log
    TO outbox_operator;

-- Admins: channels, tenant bindings, figures across tenants, channel secrets.
GRANT EXECUTE ON FUNCTION
    outbox.effect_key(text, text),
    outbox.create_channel(text, text, jsonb),
    outbox.alter_channel(text, jsonb),
    outbox.pause_channel(text, text),
    outbox.drop_channel(text, text),
    outbox.resume_channel(text),
    outbox.bind_tenant(name, text),
    outbox.unbind_tenant(name, text),
    outbox.prometheus(),
    outbox.worker_status()
    TO outbox_admin;
GRANT SELECT ON outbox.channels, outbox._channels, outbox._tenant_bindings, outbox.metrics, outbox.alerts
    TO outbox_admin;

-- Figures across tenants, without message content. (Functions a view calls are checked
-- against the reader, so the metrics' helpers are granted with the views.)
GRANT EXECUTE ON FUNCTION
    outbox._setting(text, integer),
    outbox._state_counts(),
    outbox._prom_label(text),
    outbox._database_served(),
    outbox._add_counts(bigint[], bigint[]),
    outbox._counts_sum(bigint[]),
    outbox._latency_bounds_ms(),
    outbox._quantile_ms(bigint[], double precision),
    outbox._prom_histogram(text, text, bigint[], bigint)
    TO outbox_admin, pg_monitor;
GRANT SELECT ON outbox.metrics, outbox.alerts TO pg_monitor;
-- The latency histograms prometheus() exposes.
GRANT SELECT ON outbox._latency TO outbox_admin, pg_monitor;
-- outbox.alerts asks whether a channel can look an uncertain message up.
GRANT EXECUTE ON FUNCTION outbox._can_look_up(jsonb) TO pg_monitor;
GRANT EXECUTE ON FUNCTION outbox.prometheus(), outbox.worker_status() TO pg_monitor;

-- The worker: the private tables across tenants, nothing else.
GRANT SELECT ON outbox._channels TO outbox_worker;
GRANT SELECT, INSERT, UPDATE, DELETE ON
    outbox._messages, outbox._claims, outbox._attempts, outbox._ledger, outbox._operator_log,
    outbox._channel_stats, outbox._channel_minutes, outbox._channel_flow
    TO outbox_worker;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA outbox TO outbox_worker;
-- Retention of the ledger: the worker closes and opens generations, and empties the oldest
-- generation's table whole (src/ledger/generations.rs).
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox._ledger_generations TO outbox_worker;
GRANT TRUNCATE ON outbox._ledger_0, outbox._ledger_1, outbox._ledger_2 TO outbox_worker;
GRANT EXECUTE ON FUNCTION outbox._ledger_current_generation() TO outbox_worker;
GRANT EXECUTE ON FUNCTION outbox._provider_key(text, text), outbox._epoch_ms(timestamptz), outbox._epoch_us(timestamptz)
    TO outbox_worker;
-- The record adds each batch's latency histograms to its channels' rows.
GRANT EXECUTE ON FUNCTION outbox._add_counts(bigint[], bigint[]) TO outbox_worker;
-- What is left of a claim once its recorded messages are taken out (src/worker/claim_release.rs).
GRANT EXECUTE ON FUNCTION outbox._claim_ids_left(bigint[], bigint[]) TO outbox_worker;
-- Whether a claim's worker is alive (src/worker/liveness.rs), asked by recovery.
GRANT EXECUTE ON FUNCTION outbox._claim_holder(integer, integer, double precision) TO outbox_worker;
-- outbox.attempts (read as its reader) shows the key a send in progress carries.
GRANT EXECUTE ON FUNCTION outbox._provider_key(text, text) TO outbox_writer, outbox_operator;
-- The ledger: its check and its one way of recording (sql/ledger.sql).
GRANT EXECUTE ON FUNCTION
    outbox._ledger_entry(text, text),
    outbox._record_delivered(bigint[], text[], integer[], text, boolean)
    TO outbox_worker;
-- A channel's integer options, read by the worker and by outbox.messages (which runs as
-- its reader, like every view here).
GRANT EXECUTE ON FUNCTION outbox._option_int(jsonb, text[])
    TO outbox_worker, outbox_writer, outbox_operator, outbox_admin;
-- A channel's bound on attempts open at once and why (sql/channels.sql): read by the
-- worker's claim and by outbox.channels (as its reader).
GRANT EXECUTE ON FUNCTION
    outbox._can_verify(jsonb),
    outbox._can_look_up(jsonb),
    outbox._in_flight_bound(jsonb),
    outbox._in_flight_reason(jsonb)
    TO outbox_worker, outbox_writer, outbox_operator, outbox_admin;

-- Say at CREATE EXTENSION time when no worker will deliver.
SELECT outbox._check_preloaded();
