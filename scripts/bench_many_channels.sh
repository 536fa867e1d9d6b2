#!/usr/bin/env bash
# A drain over many channels (one per endpoint, as a webhook sender with a channel per
# customer has), beside a drain of the same number of messages on one channel, on a
# throwaway cluster of its own with two workers and the provider simulator as the sink:
# deliveries/s of each, and how many attempts recovery took back during each (none should
# be: a live worker's leases hold however long its claims take, src/worker/liveness.rs).
# Figures only; nothing is asserted.
# Usage: scripts/bench_many_channels.sh [channels=10000] [messages_per_channel=2]
source "$(dirname "$0")/lib.sh"
CHANNELS=${1:-10000}
PER_CHANNEL=${2:-2}
MESSAGES=$((CHANNELS * PER_CHANNEL))
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_bench_channels}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54829}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
SIM_PORT=${BENCH_SIM_PORT:-18797}
psql_q() { bash scripts/cluster.sh psql -qAt -v ON_ERROR_STOP=1 "$@"; }

start_drain_bench "$SIM_PORT"
OPTIONS='{"idempotency_header": "Idempotency-Key", "max_in_flight": 512}'

# $1: channel name prefix, $2: channels, $3: messages per channel. Messages are enqueued
# paused, resumed together, and the drain is timed from the resume to the last delivery.
drain() {
  local prefix=$1 channels=$2 per=$3 started ended taken_back
  run_statements "
    SELECT outbox.create_channel('$prefix' || c, 'http://127.0.0.1:$SIM_PORT/ch/$prefix' || c, '$OPTIONS')
      FROM generate_series(1, $channels) c;
    SELECT outbox.pause_channel('$prefix' || c, 'bench') FROM generate_series(1, $channels) c;
    SELECT count(outbox.enqueue('$prefix' || c, jsonb_build_object('n', m), '$prefix' || c || '-' || m))
      FROM generate_series(1, $channels) c, generate_series(1, $per) m;"
  run_statements "SELECT outbox.resume_channel('$prefix' || c) FROM generate_series(1, $channels) c;"
  started=$(date +%s.%N)
  while [ "$(psql_q -c "SELECT $DRAINING")" = t ]; do sleep 0.05; done
  ended=$(date +%s.%N)
  taken_back=$(psql_q -c "SELECT count(*) FROM outbox.attempts WHERE kind = 'recovery' AND message_id IN
                            (SELECT id FROM outbox.messages WHERE channel LIKE '$prefix%')")
  awk -v n=$((channels * per)) -v s="$started" -v e="$ended" -v c="$channels" -v t="$taken_back" \
    'BEGIN { printf "%6d channel(s) x %d: %8.0f deliveries/s, %d attempt(s) taken back\n", c, n / c, n / (e - s), t }'
}

echo "== $MESSAGES messages: one channel, then $CHANNELS channels (two workers, the simulator as the sink)"
drain one_ 1 "$MESSAGES"
drain many_ "$CHANNELS" "$PER_CHANNEL"
drain one_again_ 1 "$MESSAGES"
