#!/usr/bin/env bash
# Drains one after another in one cluster, as bench/bench.sh runs them: whether a drain
# pays for the ones before it. Each drain has a channel of its own; its backlog is enqueued
# paused (keys in the order bench.sh gives them, so that each drain's ledger entries fall
# between the earlier drains'), then VACUUM ANALYZE, CHECKPOINT, and the workers drain it.
# Between the first drains and the last ones, a large drain, then `TRUNCATE` of the queue,
# the attempts and the ledger, as bench.sh does after its large backlog. Per drain:
# deliveries/s (from the resume to a poll every 20 ms that sees the queue empty, and from
# the first attempt's start to the last record, read from the ledger), the share of the
# machine's CPU left idle, WAL bytes a message, the CPU a message of the workers (backends
# and send threads apart) and of the sink, and the pages of `outbox._claims` and of the
# ledger's primary key after it. With 0 for the large backlog, `drains before` drains of
# the same backlog one after another, and nothing else: how far identical drains spread.
# Figures only; nothing is asserted. Runs on a throwaway cluster (port 54831).
# Usage: bench/bench_successive_drains.sh [backlog = 60000] [drains before and after = 3]
#   [large backlog = 600000; 0: no large drain, no TRUNCATE, no drains after]
#   OUTBOX_WORKERS (2), BATCH (outbox.batch_size, 200)
source "$(dirname "$0")/../scripts/lib.sh"
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
  local ch=$1 n=$2 lsn0 t0 t1 cpu0 cpu1 sink0 sink1 idle0 idle1 wal pages inner
  psql -c "SELECT outbox.create_channel('$ch', 'http://127.0.0.1:$SINK_PORT/ch/$ch', '{\"max_in_flight\": 512, \"max_unverifiable_in_flight\": 512, \"external_id\": \"/id\"}'::jsonb)" \
       -c "SELECT outbox.pause_channel('$ch', 'loading the backlog')" >/dev/null 2>&1
  psql -c "SELECT count(outbox.enqueue('$ch', jsonb_build_object('n', g, 'text', 'benchmark message'), lpad(g::text, 9, '0') || ':$ch')) FROM generate_series(1, $n) g" >/dev/null
  psql -c "VACUUM ANALYZE outbox._messages" >/dev/null
  psql -c "CHECKPOINT" >/dev/null
  lsn0=$(psql -c "SELECT pg_current_wal_lsn()")
  read -r -a cpu0 <<<"$(workers_cpu_ticks)"
  sink0=$(process_ticks "$SINK_PID")
  read -r -a idle0 <<<"$(machine_idle_ticks)"
  t0=$(date +%s%N)
  psql -c "SELECT outbox.resume_channel('$ch')" >/dev/null
  while [ "$(psql -c "SELECT EXISTS (SELECT 1 FROM outbox._messages m JOIN outbox._channels c ON c.id = m.channel_id WHERE c.name = '$ch')")" = t ]; do
    sleep 0.05
  done
  t1=$(date +%s%N)
  read -r -a cpu1 <<<"$(workers_cpu_ticks)"
  sink1=$(process_ticks "$SINK_PID")
  read -r -a idle1 <<<"$(machine_idle_ticks)"
  inner=$(psql -c "SELECT round($n / extract(epoch FROM max(l.recorded_at) - min(l.attempt_started_at)))
                     FROM outbox._ledger l JOIN outbox._channels c ON c.id = l.channel_id WHERE c.name = '$ch'")
  wal=$(psql -c "SELECT round((pg_current_wal_lsn() - '$lsn0') / $n)")
  pages=$(psql -c "SELECT pg_relation_size('outbox._claims') / 8192 || ' ' || pg_relation_size('outbox._ledger_0_pkey') / 8192")
  echo "$ch: $((n * 1000000000 / (t1 - t0))) msg/s ($inner first attempt to last record);" \
       "idle $((100 * (idle1[1] - idle0[1]) / (idle1[0] - idle0[0]))) %; WAL $wal B a message;" \
       "workers $(((cpu1[0] - cpu0[0]) * TICK_US / n)) + $(((cpu1[1] - cpu0[1]) * TICK_US / n)) µs a message (backends + send threads), sink $(((sink1 - sink0) * TICK_US / n)) µs;" \
       "pages: _claims ${pages% *}, ledger key ${pages#* }"
}

fresh_cluster >/dev/null
workers_ready
if [ "$LARGE" -gt 0 ]; then
  echo "drains of $N, one after another in one cluster ($OUTBOX_WORKERS workers, batch ${BATCH:-200}); a drain of $LARGE and TRUNCATE in between"
else
  echo "$EACH drains of $N, one after another in one cluster ($OUTBOX_WORKERS workers, batch ${BATCH:-200})"
fi
for i in $(seq "$EACH"); do drain "before_$i" "$N"; done
[ "$LARGE" -gt 0 ] || exit 0
drain large "$LARGE"
psql -c "TRUNCATE outbox._messages, outbox._attempts, outbox._ledger" -c "VACUUM ANALYZE outbox._messages" >/dev/null
for i in $(seq "$EACH"); do drain "after_$i" "$N"; done
