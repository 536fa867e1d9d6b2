#!/usr/bin/env bash
# Where the time of an enqueue goes: microseconds per committed transaction for a plain
# INSERT statement, for a SECURITY DEFINER PL/pgSQL function with SET search_path holding
# only the same INSERT (the machinery enqueue had before it was written in Rust), and for
# outbox.enqueue() as the superuser and as a tenant-bound writer role. Each is called by a
# procedure that commits after every call (synchronous_commit off: CPU only), N times, in
# three alternating rounds.
# Figures only; nothing is asserted. Runs on a throwaway cluster (port 54818).
# Usage: bench/bench_enqueue_parts.sh [calls per round = 50000]
source "$(dirname "$0")/../scripts/lib.sh"
N=${1:-50000}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_bench_parts}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54818}
export OUTBOX_WORKERS=1 OUTBOX_EXTRA_CONF=

bash scripts/setup.sh >/dev/null
bash scripts/cluster.sh install >/dev/null
fresh_cluster >/dev/null
trap 'bash scripts/cluster.sh stop >/dev/null 2>&1 || true' EXIT
psql() { bash scripts/cluster.sh psql -qAt "$@"; }

psql >/dev/null <<'SQL'
SELECT outbox.create_channel('bench_enqueue', 'http://127.0.0.1:9/x');
SELECT outbox.pause_channel('bench_enqueue', 'enqueue benchmark: nothing is sent');
CREATE TABLE public.plain_outbox (LIKE outbox._messages INCLUDING ALL);
CREATE SEQUENCE public.plain_outbox_seq;
ALTER TABLE public.plain_outbox ALTER COLUMN id SET DEFAULT nextval('public.plain_outbox_seq');
-- The baseline: the same row by a plain INSERT statement, no function.
CREATE PROCEDURE public.calls_plain_insert(n int) LANGUAGE plpgsql AS $fn$
BEGIN
  FOR i IN 1..n LOOP
    INSERT INTO public.plain_outbox (tenant, channel_id, effect_key, payload, next_attempt_at)
    VALUES ('default', 1, md5(random()::text || clock_timestamp()::text),
            '{"to": "user-1", "text": "benchmark message"}'::jsonb, now());
    COMMIT;
  END LOOP;
END $fn$;
SQL

# The shape enqueue had as a PL/pgSQL function: SECURITY DEFINER with SET search_path, and
# only the INSERT (no argument check, no tenant): the cost of that function machinery.
psql >/dev/null <<'SQL'
CREATE FUNCTION public.definer_plpgsql(channel text, payload jsonb, effect_key text) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_column
DECLARE v_id bigint;
BEGIN
  INSERT INTO outbox._messages AS m (tenant, channel_id, effect_key, payload, next_attempt_at)
  SELECT 'default', c.id, definer_plpgsql.effect_key, definer_plpgsql.payload, now()
    FROM outbox._channels c WHERE c.name = definer_plpgsql.channel
  ON CONFLICT (tenant, effect_key) DO NOTHING RETURNING m.id INTO v_id;
  RETURN v_id;
END $fn$;
-- enqueue as an application connects: a login role in outbox_writer bound to a tenant.
CREATE ROLE bench_writer LOGIN IN ROLE outbox_writer;
SELECT outbox.bind_tenant('bench_writer', 'default');
SQL

# One procedure per function, each calling it with a static statement and committing.
for fn in public.definer_plpgsql outbox.enqueue; do
  psql >/dev/null <<SQL
CREATE PROCEDURE public.calls_${fn#*.}(n int) LANGUAGE plpgsql AS \$fn\$
BEGIN
  FOR i IN 1..n LOOP
    PERFORM $fn('bench_enqueue', '{"to": "user-1", "text": "benchmark message"}'::jsonb, md5(random()::text || clock_timestamp()::text));
    COMMIT;
  END LOOP;
END \$fn\$;
SQL
done
psql -c "GRANT EXECUTE ON PROCEDURE public.calls_enqueue(int) TO bench_writer" >/dev/null

echo "enqueue parts: microseconds per committed call, $N calls per round, 3 alternating rounds (synchronous_commit off)"
declare -A rounds
fns="plain_insert definer_plpgsql enqueue enqueue_as_writer"
for round in 1 2 3; do
  for fn in $fns; do
    psql -c "CHECKPOINT" >/dev/null
    t0=$(date +%s%N)
    case $fn in
      enqueue_as_writer) psql -c "SET synchronous_commit = off" -c "SET ROLE bench_writer" -c "CALL public.calls_enqueue($N)" ;;
      *) psql -c "SET synchronous_commit = off" -c "CALL public.calls_$fn($N)" ;;
    esac
    t1=$(date +%s%N)
    rounds[$fn]="${rounds[$fn]:-} $(( (t1 - t0) / N / 1000 ))"
  done
done
for fn in $fns; do echo "$fn:${rounds[$fn]} us"; done
