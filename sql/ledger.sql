-- outbox_delivery: the ledger, the barrier against a second execution. An effect recorded
-- in outbox._ledger is never sent again: the worker looks it up before every send
-- (outbox._ledger_entry), and every confirmation — a provider's answer, a reconcile lookup
-- that found the message, an operator's `resolve(…, 'delivered', …)` — is recorded by the
-- one function below, which moves the confirmed message out of the queue into its entry.
-- Retention (src/ledger.rs) keeps each entry longer than any retry horizon, and at least
-- outbox.retention.

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
