#!/usr/bin/env bash
# COMMIT → request latency of two builds of the extension, side by side in one run: each
# build already installed into a private copy of PostgreSQL of its own (scripts/pg_prefix.sh
# create P; cargo pgrx install --release --pg-config P/lib/postgresql/15/bin/pg_config).
# Round by round the builds alternate, each on a fresh cluster: `bench` takes 200 samples
# of one message committed alone (idle) and 100 while another channel's backlog is being
# delivered (loaded), and drains three backlogs of BACKLOG; then a backlog of BACKLOG is
# drained on a channel with the default bound of 64 attempts at once, fewer than two batches
# of 200, so that one worker's batch often fills the channel while the other finds no room:
# its rate and the transactions committed per 1,000 deliveries. Beside the latencies from the
# COMMIT call (the targets' figures), the same from the COMMIT's return, the COMMIT call
# alone, and what a flush of this disk costs after a 5 ms rest: each idle sample waits for
# two. The medians over the rounds are printed beside each other, with the CPU the delivery
# workers used per round.
# Figures only; nothing is asserted.
#
# Usage: bench/bench_latency_prefixes.sh OLD_PREFIX NEW_PREFIX [rounds=3]
#   OUTBOX_BASE (/tmp/outbox_delivery_bench_latency), OUTBOX_PGPORT (54823),
#   OUTBOX_WORKERS (2), BACKLOG (2000), SINK_PORT (18803, the simulator of the bound-64 drain).
source "$(dirname "$0")/../scripts/lib.sh"
OLD=${1:?usage: bench/bench_latency_prefixes.sh OLD_PREFIX NEW_PREFIX [rounds]}
NEW=${2:?usage: bench/bench_latency_prefixes.sh OLD_PREFIX NEW_PREFIX [rounds]}
ROUNDS=${3:-3}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_bench_latency}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54823}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
export OUTBOX_EXTRA_CONF="outbox.batch_size = 200"
BACKLOG=${BACKLOG:-2000}
require_prefixes "$OLD" "$NEW"
cargo build -q --release -p outbox_e2e --bin bench
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release/bench
SINK_PORT=${SINK_PORT:-18803}
start_quiet_sink "$SINK_PORT"

# CPU time (ms) of the delivery workers of the running cluster so far.
worker_cpu_ms() {
  local backends sends
  read -r backends sends <<<"$(workers_cpu_ticks)"
  echo $(((backends + sends) * 1000 / $(getconf CLK_TCK)))
}

psql() { bash scripts/cluster.sh psql -qAtX "$@"; }

# A backlog of BACKLOG on a channel with the default options but for the key header (bound
# 64), enqueued while paused, then resumed and drained to the simulator started above.
bound_64_drain() {
  local ch=bound64 start end commits_before commits_after
  psql -c "SELECT outbox.create_channel('$ch', 'http://127.0.0.1:$SINK_PORT/ch/$ch', '{\"idempotency_header\": \"Idempotency-Key\"}')" \
       -c "SELECT outbox.pause_channel('$ch', 'loading')" \
       -c "SELECT count(outbox.enqueue('$ch', '{\"to\": \"user-1\", \"text\": \"benchmark message\"}', lpad(g::text, 9, '0') || ':$ch')) FROM generate_series(1, $BACKLOG) g" \
       -c "VACUUM ANALYZE" -c "CHECKPOINT" >/dev/null
  commits_before=$(psql -c "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
  start=$(date +%s%N)
  psql -c "SELECT outbox.resume_channel('$ch')" >/dev/null
  while [ "$(psql -c "SELECT count(*) FROM outbox._messages m JOIN outbox._channels c ON c.id = m.channel_id WHERE c.name = '$ch' AND m.state <> 'delivered'")" != 0 ]; do
    sleep 0.05
  done
  end=$(date +%s%N)
  sleep 1.2   # statistics reach pg_stat_database within a second
  commits_after=$(psql -c "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
  echo "bound_64_deliveries_per_s $(( BACKLOG * 1000000000 / (end - start) ))"
  # The waiting loop's own statements are counted too, the same on both sides.
  echo "bound_64_transactions_per_1000 $(( (commits_after - commits_before) * 1000 / BACKLOG ))"
}

# One round on the build in prefix $1; prints "figure value" lines.
round() {
  export OUTBOX_PGBIN=$1/lib/postgresql/15/bin
  fresh_cluster >/dev/null
  workers_ready
  sleep 2
  local before out
  before=$(worker_cpu_ms)
  out=$("$BIN" --backlog "$BACKLOG" --latency-samples 200)
  echo "$out" | awk '/^latency_(idle|loaded)_p(50|99) / { print $1, $2 }
                     /^latency_(idle|loaded)_(after_)?commit_p50 / { print $1, $2; print substr($1, 1, length($1) - 2) "99", $(NF - 1) }
                     /^disk_flush_after_rest_p50 / { print $1, $2; print "disk_flush_after_rest_p99", $(NF - 1) }
                     /^deliveries_per_s_backlog_/ { print "deliveries_per_s", $2 }'
  echo "worker_cpu_ms_per_round $(( $(worker_cpu_ms) - before ))"
  bound_64_drain
  bash scripts/cluster.sh stop immediate >/dev/null 2>&1 || true
}

declare -A seen
echo "machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $OUTBOX_WORKERS workers; $ROUNDS rounds; old $OLD, new $NEW"
for r in $(seq 1 "$ROUNDS"); do
  for side in old new; do
    prefix=$OLD; [ "$side" = new ] && prefix=$NEW
    while read -r name value; do
      seen[$side.$name]="${seen[$side.$name]:-} $value"
    done < <(round "$prefix")
  done
  echo "round $r done, load $(cut -d' ' -f1-3 /proc/loadavg)"
done
printf '%-32s %-34s %-34s\n' figure "old (median; rounds)" "new (median; rounds)"
for name in latency_idle_p50 latency_idle_p99 latency_idle_after_commit_p50 latency_idle_after_commit_p99 \
            latency_idle_commit_p50 latency_idle_commit_p99 \
            disk_flush_after_rest_p50 disk_flush_after_rest_p99 latency_loaded_p50 latency_loaded_p99 \
            latency_loaded_after_commit_p50 latency_loaded_after_commit_p99 deliveries_per_s worker_cpu_ms_per_round bound_64_deliveries_per_s bound_64_transactions_per_1000; do
  o=${seen[old.$name]:-}; n=${seen[new.$name]:-}
  printf '%-32s %-34s %-34s\n' "$name" "$(echo "$o" | median) ($(echo $o))" "$(echo "$n" | median) ($(echo $n))"
done
