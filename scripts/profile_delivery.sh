#!/usr/bin/env bash
# Where the time of a delivery goes: drains a backlog to the provider simulator with the
# cluster's workers and prints the rate, the writes each table took (inserts, updates and
# how many of them were HOT), and with PROFILE=1 a perf profile of the whole machine
# during the drain: the CPU share of each process, then the hottest functions. Figures
# only; nothing is asserted. Runs on a throwaway cluster (port 54821).
# Usage: scripts/profile_delivery.sh [backlog = 60000]
#   OUTBOX_WORKERS (2), BATCH (outbox.batch_size, 200), PROFILE=1 (needs perf), RUNS (1)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PATH="$HOME/.cargo/bin:$PATH"
N=${1:-60000}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_profile}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54821}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
export OUTBOX_EXTRA_CONF="outbox.batch_size = ${BATCH:-200}"
SINK_PORT=18801

bash scripts/setup.sh >/dev/null
bash scripts/cluster.sh install >/dev/null
cargo build -q --release -p outbox_e2e --bin provider-sim
target/release/provider-sim --port $SINK_PORT --quiet --no-record-requests --no-record-bodies >/dev/null 2>&1 &
SINK_PID=$!
trap 'bash scripts/cluster.sh stop >/dev/null 2>&1 || true; kill $SINK_PID 2>/dev/null || true' EXIT
psql() { bash scripts/cluster.sh psql -qAt "$@"; }

for run in $(seq 1 "${RUNS:-1}"); do
  bash scripts/cluster.sh destroy >/dev/null 2>&1 || true
  bash scripts/cluster.sh start >/dev/null
  psql -c "SELECT outbox.create_channel('profile', 'http://127.0.0.1:$SINK_PORT/ch/profile', '{\"max_in_flight\": 512, \"external_id\": \"/id\"}'::jsonb)" \
       -c "SELECT outbox.pause_channel('profile', 'loading the backlog')" >/dev/null
  psql -c "SELECT count(outbox.enqueue('profile', jsonb_build_object('n', g, 'text', 'benchmark message'), 'k:' || g)) FROM generate_series(1, $N) g" >/dev/null
  psql -c "VACUUM ANALYZE outbox._messages" >/dev/null
  psql -c "CHECKPOINT" >/dev/null
  psql -c "SELECT pg_stat_reset()" >/dev/null
  t0=$(date +%s%N)
  psql -c "SELECT outbox.resume_channel('profile')" >/dev/null
  if [ -n "${PROFILE:-}" ]; then
    sleep 1
    perf record -a -g -o "$OUTBOX_BASE/perf.data" -- sleep 4 >/dev/null 2>&1
  fi
  while [ "$(psql -c "SELECT count(*) FROM outbox._messages WHERE state <> 'delivered'")" != 0 ]; do sleep 0.2; done
  t1=$(date +%s%N)
  echo "run $run: $N messages delivered in $(( (t1 - t0) / 1000000 )) ms: $(( N * 1000000000 / (t1 - t0) )) msg/s ($OUTBOX_WORKERS workers, batch ${BATCH:-200})"
  sleep 1  # the workers report their table statistics before they sleep
  psql -F ' ' -c "SELECT 'writes ' || relname, 'inserts ' || n_tup_ins, 'updates ' || n_tup_upd, 'hot ' || n_tup_hot_upd
                    FROM pg_stat_user_tables WHERE schemaname = 'outbox' AND relname IN ('_messages', '_attempts', '_ledger')
                   ORDER BY relname"
  if [ -n "${PROFILE:-}" ]; then
    echo "CPU by process (perf, whole machine, 4 s):"
    perf report -i "$OUTBOX_BASE/perf.data" --sort comm --stdio -g none 2>/dev/null | grep '%' | head -6
    echo "hottest functions, self time:"
    perf report -i "$OUTBOX_BASE/perf.data" --no-children --sort comm,sym --stdio -g none 2>/dev/null | grep '%' | head -25
  fi
done
