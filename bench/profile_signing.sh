#!/usr/bin/env bash
# Where a signed delivery's worker CPU goes, beside a plain one's: drains of a backlog on a
# plain HTTP channel and on one that signs (Standard Webhooks, one secret), alternating,
# each from emptied tables (as in `--webhooks` of pg_test/src/bin/bench.rs), with
# `perf record` of the two delivery workers during each drain. Prints per drain its rate,
# the worker CPU and the committed transactions of the database per 1,000 deliveries (the
# workers' claims, records and the claims that found the channel's bound reached), and the
# share of the perf samples in the signing code (sha2, hmac, base64) and per library.
# Figures only; nothing is asserted. Runs on a throwaway cluster (port 54822).
# Usage: bench/profile_signing.sh [backlog=40000] [rounds=2]
#   PERF_DIR (keeps the perf data there, LABEL.data, for `perf report` and `perf diff`)
source "$(dirname "$0")/../scripts/lib.sh"
N=${1:-40000}
ROUNDS=${2:-2}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_profile_signing}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54822}
export OUTBOX_WORKERS=2
export OUTBOX_EXTRA_CONF="outbox.batch_size = 200"
SINK_PORT=${SINK_PORT:-18802}
OUT=${PERF_DIR:-$(mktemp -d)}
mkdir -p "$OUT"

bash scripts/setup.sh >/dev/null
if [ -z "${OUTBOX_PGBIN:-}" ]; then bash scripts/cluster.sh install >/dev/null; fi
cargo build -q --release -p outbox_e2e --bin provider-sim
"${CARGO_TARGET_DIR:-target}"/release/provider-sim --port "$SINK_PORT" --quiet \
  --no-record-requests --no-record-bodies >/dev/null 2>&1 &
SINK_PID=$!
fresh_cluster >/dev/null
trap 'bash scripts/cluster.sh stop >/dev/null 2>&1 || true; kill $SINK_PID 2>/dev/null || true; [ -n "${PERF_DIR:-}" ] || rm -rf "$OUT"' EXIT
psql() { bash scripts/cluster.sh psql -qAt "$@"; }
TICK_MS=$((1000 / $(getconf CLK_TCK)))
TABLES="_channels _channel_flow _channel_stats _channel_minutes _messages _attempts _ledger _operator_log"
PLAIN='{"idempotency_header": "Idempotency-Key"}'
SIGNED='{"idempotency_header": "Idempotency-Key", "signing": {"secrets": ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]}}'

# The delivery workers' CPU so far, in ms.
workers_cpu_ms() {
  local total=0 p
  for p in $WORKERS; do total=$((total + $(awk '{print $14 + $15}' "/proc/$p/stat") * TICK_MS)); done
  echo $total
}
# Transactions committed in the database so far (a new connection each time; the workers
# flush their statistics whenever they wait).
commits() { psql -c "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"; }

# One drain of N on a new channel with options $2, labelled $1, from emptied tables.
drain() {
  local label=$1 options=$2 ch=bench_sign_$1
  psql -c "TRUNCATE $(for t in $TABLES; do printf 'outbox.%s, ' "$t"; done | sed 's/, $//')"
  for t in $TABLES; do psql -c "VACUUM ANALYZE outbox.$t"; done
  psql -c "SELECT outbox.create_channel('$ch', 'http://127.0.0.1:$SINK_PORT/send/$ch', '$options'::jsonb)" >/dev/null
  psql -c "SELECT outbox.pause_channel('$ch', 'loading the backlog')" >/dev/null
  psql -c "SELECT count(outbox.enqueue('$ch', jsonb_build_object('n', g, 'text', 'benchmark message'),
                                       lpad(g::text, 9, '0') || ':$ch'))
             FROM generate_series(1, $N) g" >/dev/null
  psql -c "VACUUM ANALYZE outbox._messages"
  psql -c "CHECKPOINT"
  WORKERS=$(psql -c "SELECT string_agg(pid::text, ' ') FROM pg_stat_activity WHERE backend_type = 'outbox_delivery worker'")
  local x0 c0 t0 t1 c1 x1 perf
  sleep 1
  x0=$(commits); c0=$(workers_cpu_ms); t0=$(date +%s%N)
  perf record -q -F 499 -g -o "$OUT/$label.data" -p "${WORKERS// /,}" >/dev/null 2>&1 &
  perf=$!
  psql -c "SELECT outbox.resume_channel('$ch')" >/dev/null
  while [ "$(psql -c "SELECT count(*) FROM outbox._messages WHERE state IN ('queued', 'sending')")" != 0 ]; do
    sleep 0.05
  done
  t1=$(date +%s%N); c1=$(workers_cpu_ms)
  kill -INT $perf; wait $perf 2>/dev/null || true
  sleep 1
  x1=$(commits)
  # The loop above commits one transaction per look (about 15 a second): counted apart.
  printf '%s rate %d msg/s; worker_cpu_ms_per_1000 %d; transactions_per_1000 %d (the loop above included); ' \
    "$label" $((N * 1000000000 / (t1 - t0))) $(((c1 - c0) * 1000 / N)) $(((x1 - x0) * 1000 / N))
  perf report -i "$OUT/$label.data" --no-children -g none --sort sym --stdio 2>/dev/null |
    awk '/^ +[0-9.]+%/ && /sha2|hmac|base64|signing/ { s += $1 } END { printf "signing_code_share_of_samples %.2f%%; ", s }'
  perf report -i "$OUT/$label.data" --no-children -g none --sort dso --stdio 2>/dev/null |
    awk '/^ +[0-9.]+%/ && n < 4 { printf "%s %s ", $2, $1; n++ } END { print "" }'
}

echo "machine: $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg); backlog $N; $ROUNDS rounds"
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then
    drain "plain_$r" "$PLAIN"; drain "signed_$r" "$SIGNED"
  else
    drain "signed_$r" "$SIGNED"; drain "plain_$r" "$PLAIN"
  fi
done
echo "load at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
