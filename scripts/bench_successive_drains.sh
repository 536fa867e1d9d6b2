#!/usr/bin/env bash
# Drains one after another in one cluster, as scripts/bench.sh runs them: whether a drain
# pays for the ones before it. Each drain has a channel of its own; its backlog is enqueued
# paused (keys in the order bench.sh gives them, so that each drain's ledger entries fall
# between the earlier drains'), then VACUUM ANALYZE, CHECKPOINT, and the workers drain it.
# Between the first drains and the last ones, a large drain, then `TRUNCATE` of the queue,
# the attempts and the ledger, as bench.sh does after its large backlog. Per drain:
# deliveries/s, WAL bytes a message, the workers' CPU a message (backends and send threads
# apart), and the pages of `outbox._claims` and of the ledger's primary key after it.
# Figures only; nothing is asserted. Runs on a throwaway cluster (port 54831).
# Usage: scripts/bench_successive_drains.sh [backlog = 60000] [drains before and after = 3]
#   [large backlog = 600000]
#   OUTBOX_WORKERS (2), BATCH (outbox.batch_size, 200)
source "$(dirname "$0")/lib.sh"
N=${1:-60000}
EACH=${2:-3}
LARGE=${3:-600000}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_successive}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54831}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
export OUTBOX_EXTRA_CONF="outbox.batch_size = ${BATCH:-200}"
SINK_PORT=${SINK_PORT:-18831}

bash scripts/setup.sh >/dev/null
bash scripts/cluster.sh install >/dev/null
start_quiet_sink "$SINK_PORT"
psql() { bash scripts/cluster.sh psql -qAt "$@"; }
TICK_US=$((1000000 / $(getconf CLK_TCK)))

# One drain of $2 messages on a new channel named $1; prints its line.
drain() {
  local ch=$1 n=$2 lsn0 t0 t1 cpu0 cpu1 wal pages
  psql -c "SELECT outbox.create_channel('$ch', 'http://127.0.0.1:$SINK_PORT/ch/$ch', '{\"max_in_flight\": 512, \"max_unverifiable_in_flight\": 512, \"external_id\": \"/id\"}'::jsonb)" \
       -c "SELECT outbox.pause_channel('$ch', 'loading the backlog')" >/dev/null 2>&1
  psql -c "SELECT count(outbox.enqueue('$ch', jsonb_build_object('n', g, 'text', 'benchmark message'), lpad(g::text, 9, '0') || ':$ch')) FROM generate_series(1, $n) g" >/dev/null
  psql -c "VACUUM ANALYZE outbox._messages" >/dev/null
  psql -c "CHECKPOINT" >/dev/null
  lsn0=$(psql -c "SELECT pg_current_wal_lsn()")
  read -r -a cpu0 <<<"$(workers_cpu_ticks)"
  t0=$(date +%s%N)
  psql -c "SELECT outbox.resume_channel('$ch')" >/dev/null
  while [ "$(psql -c "SELECT EXISTS (SELECT 1 FROM outbox._messages m JOIN outbox._channels c ON c.id = m.channel_id WHERE c.name = '$ch')")" = t ]; do
    sleep 0.05
  done
  t1=$(date +%s%N)
  read -r -a cpu1 <<<"$(workers_cpu_ticks)"
  wal=$(psql -c "SELECT round((pg_current_wal_lsn() - '$lsn0') / $n)")
  pages=$(psql -c "SELECT pg_relation_size('outbox._claims') / 8192 || ' ' || pg_relation_size('outbox._ledger_0_pkey') / 8192")
  echo "$ch: $((n * 1000000000 / (t1 - t0))) msg/s; WAL $wal B a message;" \
       "workers $(((cpu1[0] - cpu0[0]) * TICK_US / n)) + $(((cpu1[1] - cpu0[1]) * TICK_US / n)) µs a message (backends + send threads);" \
       "pages: _claims ${pages% *}, ledger key ${pages#* }"
}

fresh_cluster >/dev/null
workers_ready
echo "drains of $N, one after another in one cluster ($OUTBOX_WORKERS workers, batch ${BATCH:-200}); a drain of $LARGE and TRUNCATE in between"
for i in $(seq "$EACH"); do drain "before_$i" "$N"; done
drain large "$LARGE"
psql -c "TRUNCATE outbox._messages, outbox._attempts, outbox._ledger" -c "VACUUM ANALYZE outbox._messages" >/dev/null
for i in $(seq "$EACH"); do drain "after_$i" "$N"; done
