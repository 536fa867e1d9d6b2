-- outbox_delivery: the application-facing SQL API written in SQL.
-- Channel validation and effect_key live in Rust (src/channels, src/effect_key.rs) because
-- they are shared with the worker.

-- The options reach Rust as the text of the jsonb: a document nested too deeply for its
-- parser is then refused with 22023 instead of failing in the argument conversion.
CREATE FUNCTION outbox.create_channel(name text, endpoint text, options jsonb DEFAULT '{}')
RETURNS void
LANGUAGE sql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$ SELECT outbox._create_channel($1, $2, $3::text) $fn$;
COMMENT ON FUNCTION outbox.create_channel(text, text, jsonb) IS
    'Creates a delivery channel; every option is validated (unknown or mistyped option: 22023 naming it; existing name: 42710).';

CREATE FUNCTION outbox.alter_channel(name text, options jsonb) RETURNS void
LANGUAGE sql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$ SELECT outbox._alter_channel($1, $2::text) $fn$;
COMMENT ON FUNCTION outbox.alter_channel(text, jsonb) IS
    'Changes channel options (merged; null resets a key to its default; "endpoint" moves the channel). Queued messages follow the new policy at their next decision.';

-- When enqueue inserted nothing, the effect key already names a message of the tenant:
-- its id is returned, with a warning if its channel or payload differs. Called only by
-- enqueue, as its owner.
CREATE FUNCTION outbox._enqueue_existing(channel_id integer, payload jsonb, effect_key text, tenant text)
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

-- enqueue is a C-language function (src/outbox/enqueue.rs): it checks its arguments,
-- resolves the tenant and inserts the row with a plan kept for the session. SECURITY
-- DEFINER without SET search_path: its statements are schema-qualified, operators
-- included, and are planned and run under a search path of pg_catalog alone that the
-- function pushes itself (src/pinned_statement.rs); a SET clause would cost a
-- configuration save and restore in every call.
CREATE FUNCTION outbox.enqueue(
    channel      text,
    payload      jsonb,
    effect_key   text,
    ordering_key text        DEFAULT NULL,
    not_before   timestamptz DEFAULT NULL,
    headers      jsonb       DEFAULT NULL
) RETURNS bigint
LANGUAGE c VOLATILE
SECURITY DEFINER
AS 'MODULE_PATHNAME', 'outbox_enqueue';
COMMENT ON FUNCTION outbox.enqueue(text, jsonb, text, text, timestamptz, jsonb) IS
    'Writes a message in the caller''s transaction; it exists if and only if that transaction commits. The same (tenant, effect key) returns the existing message id.';

CREATE FUNCTION outbox.status(id bigint) RETURNS outbox.state
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

CREATE FUNCTION outbox.pause_channel(name text, reason text DEFAULT NULL) RETURNS void
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
COMMENT ON FUNCTION outbox.pause_channel(text, text) IS
    'Stops sending on a channel; messages keep queueing and are held until resume_channel.';

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

CREATE FUNCTION outbox.resume_channel(name text) RETURNS void
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    UPDATE outbox._channels c
       SET paused = false, paused_reason = NULL, paused_at = NULL, updated_at = pg_catalog.now()
     WHERE c.name = resume_channel.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'channel "%" does not exist', resume_channel.name
            USING ERRCODE = '42704', HINT = 'List channels in outbox.channels.';
    END IF;
    INSERT INTO outbox._operator_log (action, channel) VALUES ('resume_channel', resume_channel.name);
    PERFORM outbox._wake_at_commit();
END
$fn$;
COMMENT ON FUNCTION outbox.resume_channel(text) IS 'Resumes sending on a paused channel.';

