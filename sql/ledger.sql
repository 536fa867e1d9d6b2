-- outbox_delivery: the ledger, the barrier against a second execution. An effect recorded
-- in outbox._ledger is never sent again: the worker looks it up before every send
-- (outbox._ledger_entry), and every confirmation — a provider's answer, a reconcile lookup
-- that found the message, an operator's `resolve(…, 'delivered', …)` — is recorded by the
-- one function below. Retention (src/ledger.rs) keeps each entry longer than any retry
-- horizon.

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
         WHERE m.id = d.id AND m.state <> 'delivered'
           AND NOT (leave_sending AND m.state = 'sending')
     RETURNING m.id, m.tenant, m.effect_key, m.external_id
    ), l AS (
        INSERT INTO outbox._ledger (tenant, effect_key, message_id, external_id, recorded_by)
        SELECT m.tenant, m.effect_key, m.id, m.external_id, recorder FROM m
            ON CONFLICT (tenant, effect_key) DO NOTHING
    )
    SELECT m.id FROM m;
END
$fn$;
COMMENT ON FUNCTION outbox._record_delivered(bigint[], text[], integer[], text, boolean) IS
    'Confirms effects: marks each message delivered (unless it already is, or is being sent and leave_sending is set), clears its lease and writes its ledger entry; an effect already in the ledger keeps its first entry. Returns the messages it marked.';
