#!/usr/bin/env bash
# Moves one tenant from one cluster (database) to another without sending any of its effects
# twice (docs/scaling.md, "Moving a tenant"; docs/runbook.md).
#
#   scripts/move_tenant.sh SOURCE TARGET TENANT
#
# SOURCE and TARGET are libpq connection strings of a superuser (or the database owner) in
# each database with outbox_delivery. Before: on TARGET, the tenant's channels exist under
# the same names, paused (create_channel ... then pause_channel), and the roles bound to the
# tenant exist. The script:
#   1. unbinds the tenant's roles on SOURCE (kept for TARGET), pauses every channel the tenant has messages on, and waits until none of
#      the tenant's messages is `sending` (an attempt in flight would end after the copy);
#   2. copies the tenant's messages (channels by name), attempts, ledger entries and role
#      bindings into a staging schema on TARGET (COPY ... WHERE tenant = ...);
#   3. in one transaction on TARGET: refuses if the tenant has any message or ledger entry
#      there already, inserts the rows with new ids (the ledger and attempts follow their
#      message by (tenant, effect key)), and binds the roles;
#   4. the ledger check: the tenant's ledger on TARGET must equal SOURCE's (count and a hash
#      of its effect keys), and its messages by state too; otherwise it stops, and nothing
#      on SOURCE has changed but the pause;
#   5. cancels, on SOURCE, the tenant's unfinished messages (reason: moved), so that resuming
#      a channel on SOURCE cannot send them. (Its roles were unbound there at step 1: its
#      writers stop; a message enqueued on SOURCE after the copy is reported, exit 4.)
# Then resume the channels on TARGET: the worker checks the ledger before each send, so an
# effect delivered on SOURCE is never sent again, even when the application enqueues its key
# anew. Message ids change (the application keeps its effect keys, not ids).
set -euo pipefail
SOURCE=${1:?source conninfo}
TARGET=${2:?target conninfo}
TENANT=${3:?tenant}
PSQL=${PSQL:-psql}
export PGOPTIONS="${PGOPTIONS:-} -c client_min_messages=warning"

# Every session runs as a superuser: it looks names up in pg_catalog alone (and the
# session's own temporary schema, where functions and operators are never looked up), never
# under the database's or the role's search_path, where a role that may create in a schema
# could plant a function or an operator (`public.||(bigint, text)`) for this script to run.
# What the SQL below calls is qualified besides; its operators resolve in pg_catalog.
PIN_SEARCH_PATH="SET search_path = pg_catalog, pg_temp"
# psql reads its SQL from stdin (variables such as :'tenant' are not interpolated in -c),
# after the SET above; with -c instead, the SET and that command.
psql_on() { # $1: conninfo; then psql's arguments
  local conninfo=$1
  shift
  if [[ " $* " == *" -c "* ]]; then
    "$PSQL" -X -q -v ON_ERROR_STOP=1 -v tenant="$TENANT" -d "$conninfo" -c "$PIN_SEARCH_PATH" "$@"
  else
    "$PSQL" -X -q -v ON_ERROR_STOP=1 -v tenant="$TENANT" -d "$conninfo" -c "$PIN_SEARCH_PATH" "$@" -f -
  fi
}
src() { psql_on "$SOURCE" "$@"; }
tgt() { psql_on "$TARGET" "$@"; }
say() { echo "[move_tenant] $*"; }

# 1. Pause and wait for the attempts in flight to end.
src -At <<'SQL' | sed 's/^/[move_tenant] paused on source: /'
SELECT p.name FROM (
    SELECT ch.name, outbox.pause_channel(ch.name, 'moving tenant ' || :'tenant') AS paused
      FROM outbox._channels ch
     WHERE EXISTS (SELECT 1 FROM outbox._messages m WHERE m.channel_id = ch.id AND m.tenant = :'tenant')
       AND NOT ch.paused) p;
SQL
# Its writers stop here: the bindings are kept for the target, then removed on the source.
BINDINGS=$(src -At <<<"SELECT pg_catalog.string_agg(role_name, ' ') FROM outbox._tenant_bindings WHERE tenant = :'tenant'")
src -At <<<"SELECT pg_catalog.count(*) || ' binding(s) removed on source' FROM (SELECT outbox.unbind_tenant(role_name::name, tenant)
              FROM outbox._tenant_bindings WHERE tenant = :'tenant') u" | sed 's/^/[move_tenant] /'
# A move that stops from here on gives the source its writers back (its channels stay paused:
# resume them there to go on without moving).
restore() {
  for role in $BINDINGS; do src -v role="$role" <<<"SELECT outbox.bind_tenant(:'role', :'tenant')" >/dev/null; done
  say "not moved: the bindings are back on the source; its channels stay paused"
}
trap restore ERR
for _ in $(seq 600); do
  # In flight: in a claim (outbox._claims), or marked so by hand.
  sending=$(src -At <<<"SELECT pg_catalog.count(*) FROM outbox._messages m WHERE m.tenant = :'tenant'
                           AND (m.state = 'sending' OR m.id IN (SELECT pg_catalog.unnest(w.message_ids) FROM outbox._claims w))")
  [ "$sending" = 0 ] && break
  sleep 0.1
done
[ "$sending" = 0 ] || { say "still $sending message(s) of $TENANT sending after 60 s"; restore; exit 1; }

# 2. Staging on the target.
tgt <<'SQL'
DROP SCHEMA IF EXISTS outbox_move CASCADE;
CREATE SCHEMA outbox_move;
CREATE TABLE outbox_move.messages (LIKE outbox._messages);
ALTER TABLE outbox_move.messages ADD COLUMN channel_name text;
CREATE TABLE outbox_move.attempts (LIKE outbox._attempts);
ALTER TABLE outbox_move.attempts ADD COLUMN effect_key text;
CREATE TABLE outbox_move.ledger (LIKE outbox._ledger);
ALTER TABLE outbox_move.ledger ADD COLUMN channel_name text;
CREATE TABLE outbox_move.bindings (role_name text, tenant text);
SQL
copy() { # $1: query on the source, $2: staging table on the target
  src -c "\\copy ($1) TO STDOUT" | tgt -c "\\copy outbox_move.$2 FROM STDIN"
}
LAST_ID=$(src -At <<<"SELECT coalesce(pg_catalog.max(id), 0) FROM outbox._messages WHERE tenant = :'tenant'")
T=$(printf "%s" "$TENANT" | sed "s/'/''/g")
copy "SELECT m.*, ch.name FROM outbox._messages m JOIN outbox._channels ch ON ch.id = m.channel_id WHERE m.tenant = '$T' AND m.id <= $LAST_ID" messages
# The attempts of queued messages and of delivered ones (which live in their ledger entries).
copy "SELECT a.*, coalesce(m.effect_key, l.effect_key) FROM outbox._attempts a
        LEFT JOIN outbox._messages m ON m.id = a.message_id
        LEFT JOIN outbox._ledger l ON l.message_id = a.message_id AND l.tenant = a.tenant AND l.channel_id IS NOT NULL
       WHERE a.tenant = '$T' AND coalesce(m.effect_key, l.effect_key) IS NOT NULL" attempts
copy "SELECT l.*, ch.name FROM outbox._ledger l LEFT JOIN outbox._channels ch ON ch.id = l.channel_id WHERE l.tenant = '$T'" ledger
for role in $BINDINGS; do
  tgt -v role="$role" <<<"INSERT INTO outbox_move.bindings VALUES (:'role', :'tenant')"
done

# The figures both sides must agree on: the ledger (count and a hash of its entries) and the
# messages by state.
SIGNATURE="SELECT (SELECT pg_catalog.count(*) || ' ' || coalesce(pg_catalog.md5(pg_catalog.string_agg(effect_key || '=' || coalesce(external_id, ''), ',' ORDER BY effect_key)), '-')
                     FROM outbox._ledger WHERE tenant = :'tenant')
              || ' | ' || (SELECT coalesce(pg_catalog.string_agg(state || ':' || n, ' ' ORDER BY state), '-')
                             FROM (SELECT state::text, pg_catalog.count(*) n FROM outbox._messages WHERE tenant = :'tenant' GROUP BY 1) s)"
SOURCE_SIGNATURE=$(src -At <<<"$SIGNATURE")
say "source: ledger and messages $SOURCE_SIGNATURE"

# 3. The import and 4. the ledger check, in one transaction: committed only if they agree.
tgt -v source_signature="$SOURCE_SIGNATURE" <<SQL
BEGIN;
SET LOCAL outbox_move.tenant = :'tenant';
DO \$move\$
DECLARE
    v_tenant  text := pg_catalog.current_setting('outbox_move.tenant');
    v_missing text;
    -- Every column but the ones the target gives anew (ids) or maps (channel, message).
    v_cols    text;
BEGIN
    IF EXISTS (SELECT 1 FROM outbox._messages WHERE tenant = v_tenant)
       OR EXISTS (SELECT 1 FROM outbox._ledger WHERE tenant = v_tenant) THEN
        RAISE EXCEPTION 'tenant % already has messages or ledger entries here', v_tenant
            USING ERRCODE = '55000', HINT = 'A tenant is moved into a database that has none of its rows.';
    END IF;
    SELECT pg_catalog.string_agg(DISTINCT s.channel_name, ', ') INTO v_missing
      FROM (SELECT channel_name FROM outbox_move.messages
            UNION ALL
            SELECT channel_name FROM outbox_move.ledger WHERE channel_name IS NOT NULL) s
      LEFT JOIN outbox._channels ch ON ch.name = s.channel_name
     WHERE ch.id IS NULL;
    IF v_missing IS NOT NULL THEN
        RAISE EXCEPTION 'channels missing here: %', v_missing
            USING ERRCODE = '42704', HINT = 'Create them (paused) with the options they have on the source.';
    END IF;
    SELECT pg_catalog.string_agg(b.role_name, ', ') INTO v_missing
      FROM outbox_move.bindings b WHERE pg_catalog.to_regrole(b.role_name) IS NULL;
    IF v_missing IS NOT NULL THEN
        RAISE EXCEPTION 'roles missing here: %', v_missing
            USING ERRCODE = '42704', HINT = 'Create the roles bound to the tenant on the source.';
    END IF;

    SELECT pg_catalog.string_agg(pg_catalog.quote_ident(attname), ', ' ORDER BY attnum) INTO v_cols
      FROM pg_catalog.pg_attribute WHERE attrelid = 'outbox._messages'::regclass AND attnum > 0
       AND NOT attisdropped AND attname NOT IN ('id', 'channel_id');
    -- In the source's id order: ordering keys follow it.
    EXECUTE pg_catalog.format('INSERT INTO outbox._messages (channel_id, %s) SELECT ch.id, %s
                      FROM outbox_move.messages s JOIN outbox._channels ch ON ch.name = s.channel_name
                     ORDER BY s.id', v_cols, (SELECT pg_catalog.string_agg('s.' || c, ', ') FROM pg_catalog.unnest(pg_catalog.string_to_array(v_cols, ', ')) c));

    -- A ledger entry follows its message; one whose message retention removed gets an id of
    -- this database's sequence, so that status() never reads it for another message, and so
    -- does a delivered message, which lives in its entry (on the channel of the same name).
    -- An entry goes to this database's current generation of the ledger (the column's
    -- default), whatever generation held it there.
    SELECT pg_catalog.string_agg(pg_catalog.quote_ident(attname), ', ' ORDER BY attnum) INTO v_cols
      FROM pg_catalog.pg_attribute WHERE attrelid = 'outbox._ledger'::regclass AND attnum > 0
       AND NOT attisdropped AND attname NOT IN ('message_id', 'channel_id', 'generation');
    EXECUTE pg_catalog.format('INSERT INTO outbox._ledger (message_id, channel_id, %s)
                    SELECT CASE WHEN l.channel_id IS NULL THEN coalesce(m.id, pg_catalog.nextval(''outbox._messages_id_seq''))
                                ELSE pg_catalog.nextval(''outbox._messages_id_seq'') END,
                           ch.id, %s
                      FROM outbox_move.ledger l
                      LEFT JOIN outbox._messages m ON m.tenant = l.tenant AND m.effect_key = l.effect_key
                      LEFT JOIN outbox._channels ch ON ch.name = l.channel_name
                     ORDER BY l.message_id', v_cols,
                   (SELECT pg_catalog.string_agg('l.' || c, ', ') FROM pg_catalog.unnest(pg_catalog.string_to_array(v_cols, ', ')) c));

    SELECT pg_catalog.string_agg(pg_catalog.quote_ident(attname), ', ' ORDER BY attnum) INTO v_cols
      FROM pg_catalog.pg_attribute WHERE attrelid = 'outbox._attempts'::regclass AND attnum > 0
       AND NOT attisdropped AND attname NOT IN ('id', 'message_id');
    EXECUTE pg_catalog.format('INSERT INTO outbox._attempts (message_id, %s) SELECT t.id, %s
                      FROM outbox_move.attempts a
                      JOIN LATERAL (SELECT m.id FROM outbox._messages m
                                     WHERE m.tenant = a.tenant AND m.effect_key = a.effect_key
                                    UNION ALL
                                    SELECT l.message_id FROM outbox._ledger l
                                     WHERE l.tenant = a.tenant AND l.effect_key = a.effect_key
                                       AND l.channel_id IS NOT NULL
                                     LIMIT 1) t ON true
                     ORDER BY a.id', v_cols, (SELECT pg_catalog.string_agg('a.' || c, ', ') FROM pg_catalog.unnest(pg_catalog.string_to_array(v_cols, ', ')) c));

    INSERT INTO outbox._tenant_bindings (role_name, role, tenant)
    SELECT b.role_name, b.role_name::regrole, b.tenant FROM outbox_move.bindings b
    ON CONFLICT DO NOTHING;
END
\$move\$;
SELECT ($SIGNATURE) AS target_signature \gset
SELECT :'target_signature' = :'source_signature' AS agree \gset
\if :agree
COMMIT;
\echo [move_tenant] target: ledger and messages :target_signature (the same): committed
\else
ROLLBACK;
\echo [move_tenant] target: ledger and messages :target_signature differ from the source: rolled back
\endif
DROP SCHEMA outbox_move CASCADE;
\if :agree
\else
DO \$\$ BEGIN RAISE EXCEPTION 'the ledger check failed: nothing was moved' USING ERRCODE = 'P0001'; END \$\$;
\endif
SQL

trap - ERR
# 5. The source keeps its history and its ledger; nothing of the tenant is sent from it again.
src -At -v last="$LAST_ID" <<'SQL' | sed 's/^/[move_tenant] on source: /'
SELECT pg_catalog.count(*) || ' unfinished message(s) cancelled'
  FROM (SELECT outbox.cancel(id, 'moved to another cluster') FROM outbox._messages
         WHERE tenant = :'tenant' AND id <= :last AND state IN ('queued', 'uncertain', 'exhausted', 'failed')) c;
SQL
late=$(src -At -v last="$LAST_ID" <<<"SELECT pg_catalog.count(*) FROM outbox._messages WHERE tenant = :'tenant' AND id > :last")
[ "$late" = 0 ] || { say "$late message(s) of $TENANT were enqueued on the source after the copy: move them too"; exit 4; }
say "done: resume the tenant's channels on the target"
