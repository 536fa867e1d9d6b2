#!/usr/bin/env bash
# A drain over many channels (one per endpoint, as a webhook sender with a channel per
# customer has), beside a drain of the same number of messages on one channel, on a
# throwaway cluster of its own with two workers and the provider simulator as the sink:
# deliveries/s of each, and how many attempts recovery took back during each (none should
# be: a live worker's leases hold however long its claims take, src/worker/liveness.rs).
# In order: one channel; the many channels; one channel again beside the many, now idle;
# the many channels again, where 10 % answer after 1 s (a second simulator) and 1 % refuse
# connections (a closed port), timed to the last delivery of the healthy ones. Each worker's
# resident memory and open files after each drain.
# Figures only; nothing is asserted. With STATEMENTS=1 the cluster loads pg_stat_statements
# and each drain is followed by the statements that took the most time in it.
# Usage: bench/bench_many_channels.sh [channels=10000] [messages_per_channel=2]
source "$(dirname "$0")/../scripts/lib.sh"
CHANNELS=${1:-10000}
PER_CHANNEL=${2:-2}
MESSAGES=$((CHANNELS * PER_CHANNEL))
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_bench_channels}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54829}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
SIM_PORT=${BENCH_SIM_PORT:-18797}
SLOW_PORT=${BENCH_SLOW_SIM_PORT:-18798}
CLOSED_PORT=9
psql_q() { bash scripts/cluster.sh psql -qAt -v ON_ERROR_STOP=1 "$@"; }
if [ "${STATEMENTS:-0}" = 1 ]; then
  export OUTBOX_EXTRA_CONF="shared_preload_libraries = 'outbox_delivery,pg_stat_statements'
pg_stat_statements.track = all"
fi

# The statements that took the most time since the last call (STATEMENTS=1).
top_statements() {
  [ "${STATEMENTS:-0}" = 1 ] || return 0
  psql_q -F ' | ' -c "SELECT round(total_exec_time)::int AS ms, calls, round((total_exec_time / calls)::numeric, 3) AS ms_a_call,
                             regexp_replace(left(regexp_replace(query, '\s+', ' ', 'g'), 90), '\|', '/', 'g')
                        FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT 8" | sed 's/^/        /'
  psql_q -c "SELECT pg_stat_statements_reset()" >/dev/null
}

start_drain_bench "$SIM_PORT"
"${CARGO_TARGET_DIR:-$ROOT/target}"/release/provider-sim --port "$SLOW_PORT" --quiet --no-record-requests \
  --no-record-bodies --answer-after-ms 1000 >/dev/null 2>&1 &
SLOW_PID=$!
trap 'bash scripts/cluster.sh stop immediate >/dev/null 2>&1 || true; kill $SINK_PID $SLOW_PID 2>/dev/null || true' EXIT
if [ "${STATEMENTS:-0}" = 1 ]; then
  run_statements "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; SELECT pg_stat_statements_reset();"
fi
OPTIONS='{"idempotency_header": "Idempotency-Key", "max_in_flight": 512}'

# The endpoint of channel number c (SQL) of a drain: $1 "healthy" for all of them on the
# simulator, "mixed" for every tenth on the slow simulator and every hundredth on a closed
# port.
endpoint_sql() {
  local healthy="'http://127.0.0.1:$SIM_PORT/ch/' || c"
  case "$1" in
    healthy) echo "$healthy" ;;
    mixed) echo "CASE WHEN c % 100 = 0 THEN 'http://127.0.0.1:$CLOSED_PORT/ch/' || c
                      WHEN c % 10 = 0 THEN 'http://127.0.0.1:$SLOW_PORT/ch/' || c
                      ELSE $healthy END" ;;
  esac
}

# Resident memory (MiB) and open files of each worker, space-separated.
worker_footprint() {
  local pid out=""
  for pid in $(psql_q -c "SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox_delivery worker' ORDER BY pid"); do
    out+="$(awk '/^VmRSS/ { printf "%.0f MiB", $2 / 1024 }' "/proc/$pid/status") $(ls "/proc/$pid/fd" | wc -l) files; "
  done
  echo "${out%; }"
}

# $1: channel name prefix, $2: channels, $3: messages per channel, $4: endpoints (endpoint_sql).
# Messages are enqueued paused, resumed together, and the drain is timed from the resume to
# the last delivery on a healthy endpoint.
drain() {
  local prefix=$1 channels=$2 per=$3 kind=${4:-healthy} started ended taken_back healthy
  run_statements "
    SELECT outbox.create_channel('$prefix' || c, $(endpoint_sql "$kind"), '$OPTIONS')
      FROM generate_series(1, $channels) c;
    SELECT outbox.pause_channel('$prefix' || c, 'bench') FROM generate_series(1, $channels) c;
    SELECT count(outbox.enqueue('$prefix' || c, jsonb_build_object('n', m), '$prefix' || c || '-' || m))
      FROM generate_series(1, $channels) c, generate_series(1, $per) m;"
  healthy="channel LIKE '$prefix%' AND endpoint LIKE 'http://127.0.0.1:$SIM_PORT/%'"
  run_statements "SELECT outbox.resume_channel('$prefix' || c) FROM generate_series(1, $channels) c;"
  started=$(date +%s.%N)
  if [ "$kind" = healthy ]; then
    while [ "$(psql_q -c "SELECT $DRAINING")" = t ]; do sleep 0.05; done
  else
    # A probe of the queue's due index per healthy channel (a delivered message leaves the
    # queue): the view outbox.messages joined to the channels took a core's 0.4 s a look.
    while [ "$(psql_q -c "SELECT EXISTS (SELECT 1 FROM outbox._channels c
                                          WHERE c.name LIKE '$prefix%' AND c.endpoint LIKE 'http://127.0.0.1:$SIM_PORT/%'
                                            AND EXISTS (SELECT 1 FROM outbox._messages m
                                                         WHERE m.channel_id = c.id AND m.state = 'queued'))")" = t ]; do
      sleep 0.05
    done
  fi
  ended=$(date +%s.%N)
  taken_back=$(psql_q -c "SELECT count(*) FROM outbox.attempts WHERE kind = 'recovery' AND message_id IN
                            (SELECT id FROM outbox.messages WHERE channel LIKE '$prefix%')")
  local n=$((channels * per))
  [ "$kind" = healthy ] || n=$(psql_q -c "SELECT count(*) FROM outbox.messages m JOIN outbox.channels c ON c.name = m.channel
                                           WHERE c.name LIKE '$prefix%' AND c.endpoint LIKE 'http://127.0.0.1:$SIM_PORT/%'")
  awk -v n="$n" -v s="$started" -v e="$ended" -v c="$channels" -v per="$per" -v t="$taken_back" -v k="$kind" \
    'BEGIN { printf "%6d channel(s) x %d, %-7s: %8.0f deliveries/s%s, %d attempt(s) taken back\n", c, per, k, n / (e - s),
             k == "healthy" ? "" : " (healthy endpoints)", t }'
  echo "        workers: $(worker_footprint)"
  top_statements
  # What is left on slow and refusing endpoints waits no longer.
  run_statements "SELECT outbox.pause_channel('$prefix' || c, 'bench') FROM generate_series(1, $channels) c;"
}

echo "== $MESSAGES messages: one channel, then $CHANNELS channels (two workers, the simulator as the sink)"
drain one_ 1 "$MESSAGES"
drain many_ "$CHANNELS" "$PER_CHANNEL"
drain one_again_ 1 "$MESSAGES"
drain mixed_ "$CHANNELS" "$PER_CHANNEL" mixed
