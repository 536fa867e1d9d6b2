#!/usr/bin/env bash
# Benchmark: a batch of 200 provider answers of 10 MB each against the same batch of small
# answers, side by side in one run, on a throwaway cluster of its own. The worker reads at
# most max_response_bytes (65536 by default) of each body and holds at most 16 MiB of
# bodies at once; this shows what that costs in time and what private memory (RssAnon of
# /proc/PID/status) each delivery worker peaks at. Figures only; nothing is asserted.
#
# Each round: restart the cluster (fresh workers), enqueue 200 messages in one transaction,
# sample every worker's RssAnon every 10 ms until all 200 are delivered. "delivered in"
# is max(delivered_at) - min(created_at) of the round's messages.
# Usage: bench/bench_large_answers.sh [answer_bytes=10000000] [messages=200]
source "$(dirname "$0")/../scripts/lib.sh"
ANSWER_BYTES=${1:-10000000}
N=${2:-200}
export OUTBOX_BASE=/tmp/outbox_delivery_bench_answers
export OUTBOX_PGPORT=54819
export OUTBOX_WORKERS=2
LARGE_PORT=18801
SMALL_PORT=18802

bash scripts/cluster.sh install
cargo build -q --release -p outbox_e2e --bin provider-sim
fresh_cluster >/dev/null
WORK=$(mktemp -d)
trap 'bash scripts/cluster.sh stop >/dev/null 2>&1 || true; kill ${LARGE_PID:-} ${SMALL_PID:-} ${SAMPLER_PID:-} 2>/dev/null || true; rm -rf "$WORK"' EXIT

psql() { bash scripts/cluster.sh psql -q "$@"; }

# Starts provider-sim on port $1 with extra arguments; waits for its "listening" line.
start_sim() {
  local port=$1 out=$WORK/sim_$1.out
  shift
  target/release/provider-sim --port "$port" --quiet --no-record-bodies --no-record-requests "$@" >"$out" 2>&1 &
  SIM_PID=$!
  for _ in $(seq 100); do
    grep -q '^listening on' "$out" && return 0
    sleep 0.05
  done
  echo "provider-sim on port $port did not start:" >&2
  cat "$out" >&2
  return 1
}
start_sim "$LARGE_PORT" --answer-bytes "$ANSWER_BYTES"
LARGE_PID=$SIM_PID
start_sim "$SMALL_PORT"
SMALL_PID=$SIM_PID

psql >/dev/null <<SQL
SELECT outbox.create_channel('large_answers', 'http://127.0.0.1:$LARGE_PORT/ch/large_answers', '{"external_id": "/id"}');
SELECT outbox.create_channel('small_answers', 'http://127.0.0.1:$SMALL_PORT/ch/small_answers', '{"external_id": "/id"}');
SQL

# The worker PIDs once all $OUTBOX_WORKERS have finished their start.
worker_pids() {
  local pids
  for _ in $(seq 600); do
    pids=$(psql -Atc "SELECT pid FROM outbox.worker_status() WHERE pid IS NOT NULL AND state NOT IN ('starting', 'stopped') ORDER BY pid") || pids=""
    if [ "$(echo "$pids" | grep -c .)" -eq "$OUTBOX_WORKERS" ]; then
      echo $pids
      return 0
    fi
    sleep 0.1
  done
  echo "the delivery workers did not come up" >&2
  return 1
}

# RssAnon of a process in kB (builtins only: no fork per sample).
rss_anon() {
  local k v _
  if [ -r "/proc/$1/status" ]; then
    while read -r k v _; do
      if [ "$k" = RssAnon: ]; then echo "$v"; return; fi
    done <"/proc/$1/status"
  fi
  echo 0
}

# Samples the RssAnon of the given PIDs every 10 ms until $WORK/stop exists; writes
# "pid peak_kB" lines to $WORK/peaks.
sample() {
  local -A peak=()
  local pid v
  for pid in "$@"; do peak[$pid]=0; done
  while [ ! -e "$WORK/stop" ]; do
    for pid in "$@"; do
      v=$(rss_anon "$pid")
      if [ "$v" -gt "${peak[$pid]}" ]; then peak[$pid]=$v; fi
    done
    sleep 0.01
  done
  for pid in "$@"; do echo "$pid ${peak[$pid]}"; done >"$WORK/peaks"
}

mb() { echo $(( ($1 + 512) / 1024 )); }

# One round on channel $1 (label $2); sets RESULT to its line.
round() {
  local ch=$1 label=$2 pids pid idle="" peaks="" done_n secs ids
  bash scripts/cluster.sh restart >/dev/null
  pids=$(worker_pids)
  for pid in $pids; do idle="$idle${idle:+, }$(mb "$(rss_anon "$pid")") MB"; done
  rm -f "$WORK/stop" "$WORK/peaks"
  sample $pids &
  SAMPLER_PID=$!
  psql -c "SELECT outbox.enqueue('$ch', jsonb_build_object('n', g), '$ch:' || g) FROM generate_series(1, $N) g" >/dev/null
  for _ in $(seq 1200); do
    done_n=$(psql -Atc "SELECT count(*) FROM outbox.messages WHERE channel = '$ch' AND state = 'delivered'")
    [ "$done_n" -ge "$N" ] && break
    sleep 0.1
  done
  touch "$WORK/stop"
  wait "$SAMPLER_PID" || true
  SAMPLER_PID=
  while read -r pid v; do peaks="$peaks${peaks:+, }$(mb "$v") MB"; done <"$WORK/peaks"
  read -r secs ids < <(psql -AtF ' ' -c "
    SELECT round(extract(epoch FROM max(m.delivered_at) - min(m.created_at))::numeric, 2),
           count(m.external_id)
      FROM outbox.messages m
     WHERE m.channel = '$ch'")
  RESULT="$label: delivered $done_n in $secs s; worker peak private memory $peaks (target < 64 MB; idle $idle); external id read on $ids"
}

echo "machine: $(nproc) cores; $OUTBOX_WORKERS delivery workers; answers of $ANSWER_BYTES bytes vs the plain accept (about 40 bytes)"
round small_answers "small_answers $N x ~40 B"
SMALL=$RESULT
round large_answers "large_answers $N x $((ANSWER_BYTES / 1000000)) MB"
LARGE=$RESULT
echo "$LARGE"
echo "$SMALL"
