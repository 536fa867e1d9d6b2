-- outbox_delivery: the operator's work queue and actions. Every action locks the message
-- row first (two operators acting at once are serialized: one effect, two log rows that
-- tell the story) and writes one row to outbox.operator_log.

CREATE VIEW outbox.work_queue AS
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
ALTER VIEW outbox.work_queue SET (security_invoker = true);
COMMENT ON VIEW outbox.work_queue IS
    'Every message that waits for a human (uncertain, exhausted, failed): why, who owns it, how old, and what to do.';

CREATE FUNCTION outbox._require_reason(reason text) RETURNS void
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

-- Locks one message for an operator action; unknown id, or another tenant's message: 02000.
-- A delivered message moved into its ledger entry is returned as it was, delivered; a
-- message in flight as `sending`.
CREATE FUNCTION outbox._lock_message(id bigint) RETURNS outbox._messages
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
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

-- Not held behind its key: the claim checks the order itself, and a worker holds the
-- message again if an earlier one of its key is pending.
CREATE FUNCTION outbox._requeue(id bigint) RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
    UPDATE outbox._messages m
       SET state = 'queued', next_attempt_at = pg_catalog.now(), budget_base = m.attempts,
           budget_started_at = pg_catalog.now(), lease_until = NULL, lease_owner = NULL,
           held_by_key = false, updated_at = pg_catalog.now()
     WHERE m.id = _requeue.id;
    SELECT outbox._wake_at_commit();
$fn$;

CREATE FUNCTION outbox.retry(id bigint, reason text DEFAULT NULL) RETURNS outbox.state
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

CREATE FUNCTION outbox.resolve(id bigint, outcome text, reason text DEFAULT NULL, external_id text DEFAULT NULL)
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
COMMENT ON FUNCTION outbox.resolve(bigint, text, text, text) IS
    'Operator: records a manual decision (delivered writes the ledger, so the effect is never sent again; failed; cancelled).';

CREATE FUNCTION outbox.cancel(id bigint, reason text DEFAULT NULL) RETURNS outbox.state
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
COMMENT ON FUNCTION outbox.cancel(bigint, text) IS
    'Cancels a message that is not delivered and not in flight (delivered or sending: 55000).';

CREATE FUNCTION outbox.assign(id bigint, owner text) RETURNS void
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
