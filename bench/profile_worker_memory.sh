#!/usr/bin/env bash
# What a worker's private memory follows: drains a backlog on each of several channels, one
# channel after the other, to the provider simulator, and prints after each drain every
# worker's private memory (RssAnon) and its connections to the simulator. The idle
# connections a worker keeps are held to a budget across channels (src/channels/pool_budget.rs);
# this shows it. Figures only; nothing is asserted. Runs on a throwaway cluster (port 54839).
# Usage: bench/profile_worker_memory.sh [messages per channel = 20000] [channels = 5]
#   OUTBOX_WORKERS (2), BATCH (outbox.batch_size, 200), IDLE (seconds to wait at the end
#   before the last figures, 0), OUTBOX_PGBIN (a private PostgreSQL with a build of its own,
#   scripts/pg_prefix.sh: run as it is installed, to compare builds; else the current tree is
#   installed into the system PostgreSQL)
source "$(dirname "$0")/../scripts/lib.sh"
N=${1:-20000}
CHANNELS=${2:-5}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_worker_memory}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54839}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
export OUTBOX_EXTRA_CONF="outbox.batch_size = ${BATCH:-200}"
SINK_PORT=18805

bash scripts/setup.sh >/dev/null
[ -n "${OUTBOX_PGBIN:-}" ] || bash scripts/cluster.sh install >/dev/null
cargo build -q --release -p outbox_e2e --bin provider-sim
fresh_cluster >/dev/null
target/release/provider-sim --port $SINK_PORT --quiet --no-record-requests --no-record-bodies >/dev/null 2>&1 &
SINK_PID=$!
trap 'bash scripts/cluster.sh stop >/dev/null 2>&1 || true; kill $SINK_PID 2>/dev/null || true' EXIT
psql() { bash scripts/cluster.sh psql -qAt "$@"; }

show() {
  local line="$1:" pid
  for pid in $(psql -c "SELECT pid FROM outbox.worker_status() WHERE pid IS NOT NULL ORDER BY pid"); do
    line="$line worker $pid $(($(awk '/RssAnon/ {print $2}' /proc/$pid/status) / 1024)) MB, $(ss -tnp state established "( dport = :$SINK_PORT )" 2>/dev/null | grep -c "pid=$pid,") connections;"
  done
  echo "$line"
}

echo "$OUTBOX_WORKERS workers, batch ${BATCH:-200}, $N messages on each of $CHANNELS channels, drained one after the other"
show "before"
for c in $(seq 1 "$CHANNELS"); do
  ch="memory_$c"
  psql -c "SELECT outbox.create_channel('$ch', 'http://127.0.0.1:$SINK_PORT/ch/$ch', '{\"max_in_flight\": 512, \"idempotency_header\": \"Idempotency-Key\"}'::jsonb)" \
       -c "SELECT outbox.pause_channel('$ch', 'backlog')" >/dev/null
  psql -c "SELECT count(outbox.enqueue('$ch', jsonb_build_object('n', g, 'text', 'benchmark message'), '$ch:' || g)) FROM generate_series(1, $N) g" >/dev/null
  psql -c "SELECT outbox.resume_channel('$ch')" >/dev/null
  while [ "$(psql -c "SELECT EXISTS (SELECT 1 FROM outbox._messages WHERE state IN ('queued', 'sending'))")" != f ]; do sleep 0.3; done
  sleep 1
  show "after channel $c"
done
if [ "${IDLE:-0}" -gt 0 ]; then
  sleep "$IDLE"
  show "after ${IDLE} s idle"
fi
