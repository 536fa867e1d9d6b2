#!/usr/bin/env bash
# Write paths of a delivery compared in plain SQL, on the extension's own tables, without the
# worker or HTTP: what each design writes, measured before it is built. A throwaway cluster
# (port 54845) with the extension; its channel stays paused, so the worker leaves the rows
# alone. Each round enqueues 20,000 messages with outbox.enqueue() for each design, vacuums,
# checkpoints, then drains them with one procedure call on one connection (100 batches of
# 200, a transaction for the claim and one for the record) and prints the WAL a message
# (pg_current_wal_lsn() around the drain) and the rate. Figures only; nothing is asserted.
#   today              the claim moves each message to sending, the record to delivered and
#                      inserts its ledger entry (what the worker did before the history)
#   batch_row          the claim writes one row per batch (the ids it took); the record moves
#                      each message to delivered and inserts its ledger entry
#   history            today's claim, and the record moves each delivered message out of the
#                      queue into an append-only history keyed by (tenant, effect_key), which
#                      is also the ledger (what the worker did before claims)
#   batch_row_history  batch rows, and the record moves each delivered message out of the
#                      queue into an append-only history keyed by (tenant, effect_key), which
#                      is also the ledger
#   batch_row_locked_history
#                      batch_row_history, with the claim locking each message it takes
#                      (FOR UPDATE SKIP LOCKED), as it must to pass over a message that an
#                      operator's open transaction is cancelling, and to keep that
#                      transaction from cancelling a message in flight (what the worker does:
#                      outbox._claims)
#   in_flight_history  the claim locks each message it takes and inserts a narrow row for it
#                      into a table of attempts under way (message id, attempt, lease); the
#                      record deletes that row and moves the message into the history
#   append_only        the queue is never written after its enqueue (as PgQ's event tables):
#                      batch rows without locks, a narrow ledger entry a message, the queue
#                      emptied whole afterwards (untimed); its "left" counts the rows it
#                      leaves for that emptying
# Usage: bench/bench_write_paths.sh [rounds = 3]   (DESIGNS="today history" picks designs)
source "$(dirname "$0")/../scripts/lib.sh"
ROUNDS=${1:-3}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_write_paths}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54845}
export OUTBOX_WORKERS=1
bash scripts/setup.sh >/dev/null
bash scripts/cluster.sh install >/dev/null
fresh_cluster >/dev/null
trap 'bash scripts/cluster.sh destroy >/dev/null 2>&1 || true' EXIT
P() { bash scripts/cluster.sh psql -qAt "$@"; }
# The columns of a message moved into the history, named once for the three designs that
# move one (each SELECT below gives them in this order).
HISTORY_COLUMNS="(id, tenant, channel_id, state, effect_key, ordering_key, payload, headers,
                  not_before, next_attempt_at, attempts, budget_base, budget_started_at,
                  reconcile_attempts, lease_until, lease_owner, first_attempt_at,
                  last_error_class, last_error, last_http_status, external_id, owner,
                  created_at, updated_at, delivered_at, attempt_started_at, attempt_pid,
                  held_by_key)"
SETUP_SQL=$(cat <<'SQL'
SELECT outbox.create_channel('proto', 'http://127.0.0.1:9/x', '{"idempotency_header": "Idempotency-Key"}'::jsonb);
SELECT outbox.pause_channel('proto', 'write paths measured in SQL: nothing is sent');
CREATE TABLE public.claim_batches (id bigserial PRIMARY KEY, channel_id int NOT NULL, worker int NOT NULL,
  lease_until timestamptz NOT NULL, started_at timestamptz NOT NULL, ids int8[] NOT NULL);
-- The ledger entries of the messages `ids`, as the worker writes them.
CREATE FUNCTION public.write_ledger(ids int8[]) RETURNS void LANGUAGE sql AS $$
    INSERT INTO outbox._ledger (tenant, effect_key, message_id, external_id, recorded_by)
    SELECT m.tenant, m.effect_key, m.id, 'msg-' || m.id, 'worker' FROM outbox._messages m WHERE m.id = ANY (ids)
    ON CONFLICT DO NOTHING
$$;
-- A claim that writes one row for its batch: the next 200 queued messages of channel `ch`
-- after message `after`, in due order.
CREATE FUNCTION public.claim_batch(ch int, after int8) RETURNS public.claim_batches LANGUAGE sql AS $$
    WITH d AS (SELECT m.id FROM outbox._messages m
                WHERE m.channel_id = ch AND m.state = 'queued' AND NOT m.held_by_key AND m.id > after
                ORDER BY m.next_attempt_at, m.id LIMIT 200)
    INSERT INTO public.claim_batches (channel_id, worker, lease_until, started_at, ids)
    SELECT ch, 1, now() + interval '1 min', clock_timestamp(), array_agg(id) FROM d
    RETURNING *
$$;
-- Today's claim: the next 200 queued messages move to sending; returns their ids.
CREATE FUNCTION public.claim_sending() RETURNS int8[] LANGUAGE sql AS $$
    WITH d AS (SELECT m.id FROM outbox._messages m
                WHERE m.channel_id = (SELECT id FROM outbox._channels WHERE name = 'proto')
                  AND m.state = 'queued' AND NOT m.held_by_key ORDER BY m.next_attempt_at, m.id LIMIT 200 FOR UPDATE SKIP LOCKED),
         c AS (UPDATE outbox._messages m SET state = 'sending', attempts = m.attempts + 1,
                      lease_until = now() + interval '1 min', lease_owner = 1,
                      first_attempt_at = coalesce(m.first_attempt_at, now()),
                      attempt_started_at = clock_timestamp(), attempt_pid = 1, updated_at = now()
                 FROM d WHERE m.id = d.id RETURNING m.id)
    SELECT array_agg(id) FROM c
$$;
-- Today: the claim moves each message to sending, the record to delivered and writes the ledger.
CREATE PROCEDURE public.drain_today(batches int) LANGUAGE plpgsql AS $$
DECLARE ids int8[];
BEGIN
  FOR i IN 1..batches LOOP
    ids := public.claim_sending();
    COMMIT;
    UPDATE outbox._messages m SET state = 'delivered', lease_until = NULL, lease_owner = NULL,
           last_http_status = 200, external_id = 'msg-' || m.id, delivered_at = now(), updated_at = now()
     WHERE m.id = ANY (ids);
    PERFORM public.write_ledger(ids);
    COMMIT;
  END LOOP;
END $$;
-- One batch row per claim: the message rows are written once, at the record.
CREATE PROCEDURE public.drain_batch_row(batches int) LANGUAGE plpgsql AS $$
DECLARE ids int8[]; b int8; ch int; pos int8 := 0;
BEGIN
  SELECT id INTO ch FROM outbox._channels WHERE name = 'proto';
  FOR i IN 1..batches LOOP
    SELECT c.id, c.ids INTO b, ids FROM public.claim_batch(ch, pos) c;
    pos := ids[array_length(ids, 1)];
    COMMIT;
    UPDATE outbox._messages m SET state = 'delivered', attempts = m.attempts + 1,
           first_attempt_at = coalesce(m.first_attempt_at, now()),
           attempt_started_at = clock_timestamp(), attempt_pid = 1,
           last_http_status = 200, external_id = 'msg-' || m.id, delivered_at = now(), updated_at = now()
     WHERE m.id = ANY (ids);
    PERFORM public.write_ledger(ids);
    DELETE FROM public.claim_batches WHERE id = b;
    COMMIT;
  END LOOP;
END $$;
-- Batch-row claims, and a delivered message leaves the queue: its row moves to an
-- append-only history that is also the ledger (its key is (tenant, effect_key)).
CREATE TABLE public.history (LIKE outbox._messages, PRIMARY KEY (tenant, effect_key));
CREATE INDEX ON public.history (id);
-- A drain of batch-row claims (`locked`: the claim locks what it takes) whose record moves
-- each delivered message into the history.
CREATE PROCEDURE public.drain_batch_rows_into_history(batches int, locked bool) LANGUAGE plpgsql AS $$
DECLARE ids int8[]; b int8; ch int; pos int8 := 0;
BEGIN
  SELECT id INTO ch FROM outbox._channels WHERE name = 'proto';
  FOR i IN 1..batches LOOP
    IF locked THEN
      SELECT c.id, c.ids INTO b, ids FROM public.claim_batch_locked(ch, pos) c;
    ELSE
      SELECT c.id, c.ids INTO b, ids FROM public.claim_batch(ch, pos) c;
    END IF;
    pos := ids[array_length(ids, 1)];
    COMMIT;
    WITH gone AS (DELETE FROM outbox._messages m WHERE m.id = ANY (ids) RETURNING m.*)
    INSERT INTO public.history @HISTORY_COLUMNS@
    SELECT g.id, g.tenant, g.channel_id, 'delivered', g.effect_key, g.ordering_key, g.payload, g.headers,
           g.not_before, g.next_attempt_at, g.attempts + 1, g.budget_base, g.budget_started_at,
           g.reconcile_attempts, NULL, NULL, coalesce(g.first_attempt_at, now()), NULL, NULL, 200,
           'msg-' || g.id, g.owner, g.created_at, now(), now(), clock_timestamp(), 1, false
      FROM gone g;
    DELETE FROM public.claim_batches WHERE id = b;
    COMMIT;
  END LOOP;
END $$;
CREATE PROCEDURE public.drain_batch_row_history(batches int) LANGUAGE plpgsql AS $$
BEGIN CALL public.drain_batch_rows_into_history(batches, false); END $$;
-- Batch-row claims that lock the messages they take.
CREATE FUNCTION public.claim_batch_locked(ch int, after int8) RETURNS public.claim_batches LANGUAGE sql AS $$
    WITH d AS (SELECT m.id FROM outbox._messages m
                WHERE m.channel_id = ch AND m.state = 'queued' AND NOT m.held_by_key AND m.id > after
                ORDER BY m.next_attempt_at, m.id LIMIT 200 FOR UPDATE SKIP LOCKED)
    INSERT INTO public.claim_batches (channel_id, worker, lease_until, started_at, ids)
    SELECT ch, 1, now() + interval '1 min', clock_timestamp(), array_agg(id) FROM d
    RETURNING *
$$;
CREATE PROCEDURE public.drain_batch_row_locked_history(batches int) LANGUAGE plpgsql AS $$
BEGIN CALL public.drain_batch_rows_into_history(batches, true); END $$;
-- Attempts under way as narrow rows of their own: a message in flight keeps its queue row
-- unchanged, and the claim passes over it by its row here.
CREATE TABLE public.in_flight (message_id int8 PRIMARY KEY, channel_id int NOT NULL, attempt int NOT NULL,
  lease_owner int NOT NULL, lease_until timestamptz NOT NULL, started_at timestamptz NOT NULL, pid int NOT NULL);
CREATE FUNCTION public.claim_in_flight(ch int, after int8) RETURNS int8[] LANGUAGE sql AS $$
    WITH d AS (SELECT m.id, m.attempts FROM outbox._messages m
                WHERE m.channel_id = ch AND m.state = 'queued' AND NOT m.held_by_key AND m.id > after
                  AND NOT EXISTS (SELECT 1 FROM public.in_flight f WHERE f.message_id = m.id)
                ORDER BY m.next_attempt_at, m.id LIMIT 200 FOR UPDATE OF m SKIP LOCKED),
         c AS (INSERT INTO public.in_flight
               SELECT d.id, ch, d.attempts + 1, 1, now() + interval '1 min', clock_timestamp(), 1 FROM d
               RETURNING message_id)
    SELECT array_agg(message_id) FROM c
$$;
CREATE PROCEDURE public.drain_in_flight_history(batches int) LANGUAGE plpgsql AS $$
DECLARE ids int8[]; ch int; pos int8 := 0;
BEGIN
  SELECT id INTO ch FROM outbox._channels WHERE name = 'proto';
  FOR i IN 1..batches LOOP
    ids := public.claim_in_flight(ch, pos);
    pos := ids[array_length(ids, 1)];
    COMMIT;
    WITH f AS (DELETE FROM public.in_flight f WHERE f.message_id = ANY (ids) RETURNING f.*),
         gone AS (DELETE FROM outbox._messages m USING f WHERE m.id = f.message_id
                  RETURNING m.*, f.attempt AS attempt_sent, f.started_at AS sent_at, f.pid AS sent_by)
    INSERT INTO public.history @HISTORY_COLUMNS@
    SELECT g.id, g.tenant, g.channel_id, 'delivered', g.effect_key, g.ordering_key, g.payload, g.headers,
           g.not_before, g.next_attempt_at, g.attempt_sent, g.budget_base, g.budget_started_at,
           g.reconcile_attempts, NULL, NULL, coalesce(g.first_attempt_at, g.sent_at), NULL, NULL, 200,
           'msg-' || g.id, g.owner, g.created_at, now(), now(), g.sent_at, g.sent_by, false
      FROM gone g;
    COMMIT;
  END LOOP;
END $$;
-- A queue that is never written after its enqueue, as PgQ's event tables: the claim writes
-- one row for its batch and locks nothing, the record writes a narrow ledger entry a message
-- (its key, its id, the external id) and nothing else; which messages are delivered is read
-- from the ledger, and retention empties the queue's table whole (here after the drain,
-- untimed). What a delivery costs at the least, with no state kept per message.
CREATE PROCEDURE public.drain_append_only(batches int) LANGUAGE plpgsql AS $$
DECLARE ids int8[]; tenants text[]; keys text[]; b int8; ch int; pos int8 := 0;
BEGIN
  SELECT id INTO ch FROM outbox._channels WHERE name = 'proto';
  FOR i IN 1..batches LOOP
    WITH d AS (SELECT m.id, m.tenant, m.effect_key FROM outbox._messages m
                WHERE m.channel_id = ch AND m.state = 'queued' AND NOT m.held_by_key AND m.id > pos
                ORDER BY m.next_attempt_at, m.id LIMIT 200),
         c AS (INSERT INTO public.claim_batches (channel_id, worker, lease_until, started_at, ids)
               SELECT ch, 1, now() + interval '1 min', clock_timestamp(), array_agg(d.id ORDER BY d.id) FROM d
               RETURNING id)
    SELECT (SELECT c.id FROM c), array_agg(d.id ORDER BY d.id), array_agg(d.tenant ORDER BY d.id),
           array_agg(d.effect_key ORDER BY d.id)
      INTO b, ids, tenants, keys FROM d;
    pos := ids[array_length(ids, 1)];
    COMMIT;
    INSERT INTO outbox._ledger (tenant, effect_key, message_id, external_id, recorded_by, generation)
    SELECT u.tenant, u.effect_key, u.id, 'msg-' || u.id, 'worker', (SELECT outbox._ledger_current_generation())
      FROM unnest(tenants, keys, ids) AS u(tenant, effect_key, id)
    ON CONFLICT DO NOTHING;
    DELETE FROM public.claim_batches WHERE id = b;
    COMMIT;
  END LOOP;
END $$;
-- Today's claim; the record moves each delivered message into the history.
CREATE PROCEDURE public.drain_history(batches int) LANGUAGE plpgsql AS $$
DECLARE ids int8[];
BEGIN
  FOR i IN 1..batches LOOP
    ids := public.claim_sending();
    COMMIT;
    WITH gone AS (DELETE FROM outbox._messages m WHERE m.id = ANY (ids) RETURNING m.*)
    INSERT INTO public.history @HISTORY_COLUMNS@
    SELECT g.id, g.tenant, g.channel_id, 'delivered', g.effect_key, g.ordering_key, g.payload, g.headers,
           g.not_before, g.next_attempt_at, g.attempts, g.budget_base, g.budget_started_at,
           g.reconcile_attempts, NULL, NULL, g.first_attempt_at, NULL, NULL, 200,
           'msg-' || g.id, g.owner, g.created_at, now(), now(), g.attempt_started_at, g.attempt_pid, false
      FROM gone g;
    COMMIT;
  END LOOP;
END $$;
SQL
)
P <<<"${SETUP_SQL//@HISTORY_COLUMNS@/$HISTORY_COLUMNS}"
for round in $(seq 1 "$ROUNDS"); do
for design in ${DESIGNS:-today batch_row history batch_row_history batch_row_locked_history in_flight_history append_only}; do
  P -c "SELECT count(outbox.enqueue('proto', jsonb_build_object('n', g, 'text', 'benchmark message'), 'p$round$design:' || g)) FROM generate_series(1, 20000) g" >/dev/null
  P -c "VACUUM ANALYZE outbox._messages" -c "VACUUM ANALYZE outbox._ledger" -c "CHECKPOINT" >/dev/null
  start=$(P -c "SELECT pg_current_wal_lsn()")
  t0=$(date +%s.%N)
  P -c "CALL public.drain_$design(100)" >/dev/null
  t1=$(date +%s.%N)
  end=$(P -c "SELECT pg_current_wal_lsn()")
  left=$(P -c "SELECT count(*) FROM outbox._messages WHERE state IN ('queued','sending')")
  P -c "SELECT round(pg_wal_lsn_diff('$end', '$start') / 20000.0) || ' B a message, ' || round(20000 / ($t1 - $t0)) || ' msg/s (one connection, no HTTP), left $left'" | sed "s/^/round $round $design: /"
  # The append-only queue leaves its rows as they were: its retention's TRUNCATE, untimed.
  if [ "$design" = append_only ]; then P -c "TRUNCATE outbox._messages" >/dev/null; fi
done
done
