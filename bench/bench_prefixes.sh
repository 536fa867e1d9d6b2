#!/usr/bin/env bash
# Delivery figures of two builds of the extension, side by side in one run, without
# installing anything: each build is already installed into a private copy of PostgreSQL of
# its own (scripts/pg_prefix.sh create P; cargo pgrx install --release --pg-config
# P/lib/postgresql/15/bin/pg_config). Round by round, the builds alternate: a fresh cluster
# on the build's prefix, a backlog enqueued on a paused channel to the provider simulator,
# VACUUM ANALYZE, CHECKPOINT, statistics reset, then the channel resumed and drained by the
# workers. Per drain: deliveries/s, the workers' CPU a message (their backends and their send
# threads apart), WAL bytes and full-page images per message (the drain starts right after a
# CHECKPOINT: every page's first change writes a full-page image),
# the rows each table took (inserts, updates, HOT updates) and the autovacuums it had, and
# the load average of the machine at its end. Figures only; nothing is asserted.
#
# Usage: bench/bench_prefixes.sh OLD_PREFIX NEW_PREFIX [backlog=10000] [rounds=3]
#   OUTBOX_BASE (/tmp/outbox_delivery_bench_prefixes), OUTBOX_PGPORT (54822), SINK_PORT
#   (18802), OUTBOX_WORKERS (2), BATCH (outbox.batch_size, 200), PREFILL (ledger entries
#   written before each drain, spread over the generations of a build that has them; 0),
#   OLD_SQL / NEW_SQL (statements run in each drain's fresh cluster of that side before its
#   backlog is enqueued, one after another, each in a transaction of its own, so that ALTER
#   SYSTEM runs too; a failing one stops the run. E.g. to try a storage setting on one side:
#   give the same prefix twice), OLD_OPTIONS / NEW_OPTIONS (a JSON object merged into that side's channel options,
#   e.g. '{"max_in_flight": 2048}'), EVERY (seconds between the drain's rate samples,
#   printed as rate_each, each taken by a psql of its own while another psql every 0.1 s
#   asks whether the drain ended; unset: no samples, and one session asks every 5 ms, so
#   that no psql starts beside the drain), SINK_ARGS (more arguments of the simulator,
#   e.g. "--answer-after-ms 20" for a provider that answers in 20 ms), KEYS (`effect`: every
#   effect key, of the backlog and of the prefill, made by outbox.effect_key, a SHA-256 in
#   hex as an application that derives its keys gets, whose entries fall all over the
#   ledger's key index; unset: `k:1`, `k:2`, … for the backlog and `prefill:` and an md5 for
#   the prefill, which the backlog's entries follow in one corner of the index).
# Each drain starts once the workers serve the database (workers_ready). Besides
# deliveries/s from the resume to the end seen, each drain prints the rate from its
# first claim to its last record (the ledger's times) and the simulator's CPU a message.
source "$(dirname "$0")/../scripts/lib.sh"
OLD=${1:?usage: bench/bench_prefixes.sh OLD_PREFIX NEW_PREFIX [backlog] [rounds]}
NEW=${2:?usage: bench/bench_prefixes.sh OLD_PREFIX NEW_PREFIX [backlog] [rounds]}
N=${3:-10000}
ROUNDS=${4:-3}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_bench_prefixes}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54822}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
export OUTBOX_EXTRA_CONF="outbox.batch_size = ${BATCH:-200}"
SINK_PORT=${SINK_PORT:-18802}
# The keys of row `g` of the backlog and of the prefill (KEYS above).
if [ "${KEYS:-}" = effect ]; then
  BACKLOG_KEY="outbox.effect_key('backlog:' || g, 'deliver')"
  PREFILL_KEY="outbox.effect_key('prefill:' || g, 'deliver')"
else
  BACKLOG_KEY="'k:' || g"
  PREFILL_KEY="'prefill:' || md5(g::text)"
fi
require_prefixes "$OLD" "$NEW"

start_quiet_sink "$SINK_PORT"
psql() { bash scripts/cluster.sh psql -qAt "$@"; }

# One drain on the build installed in prefix $1, with the statements $2 run first and the
# channel options $3 merged into the defaults; prints "figure value" lines.
drain() {
  export OUTBOX_PGBIN=$1/lib/postgresql/15/bin
  local options=${3:-"{}"}
  fresh_cluster >/dev/null
  # In a command substitution, where `set -e` does not hold: a side whose statements fail
  # stops the whole comparison instead of being measured without them.
  if [ -n "${2:-}" ] && ! run_statements "$2"; then
    echo "bench_prefixes: the statements of this side failed: $2" >&2
    exit 2
  fi
  # 0.1.0 knows no bound of its own for a channel that can neither dedupe nor be asked.
  local bound='"max_unverifiable_in_flight": 512, '
  [ "$(psql -c "SELECT extversion FROM pg_extension WHERE extname = 'outbox_delivery'")" != 0.1.0 ] || bound=
  psql -c "SELECT outbox.create_channel('drain', 'http://127.0.0.1:$SINK_PORT/ch/drain', '{\"max_in_flight\": 512, $bound\"external_id\": \"/id\"}'::jsonb || '$options'::jsonb)" \
       -c "SELECT outbox.pause_channel('drain', 'loading the backlog')" >/dev/null
  psql -c "SELECT count(outbox.enqueue('drain', jsonb_build_object('n', g, 'text', 'benchmark message'), $BACKLOG_KEY)) FROM generate_series(1, $N) g" >/dev/null
  if [ "${PREFILL:-0}" -gt 0 ]; then
    # A ledger that already holds PREFILL entries, as one kept for weeks does.
    prefill_ledger "$PREFILL" "$PREFILL_KEY"
  fi
  psql -c "VACUUM ANALYZE outbox._messages" >/dev/null
  psql -c "CHECKPOINT" >/dev/null
  psql -c "SELECT pg_stat_reset(), pg_stat_reset_shared('wal'), pg_stat_reset_shared('bgwriter')" >/dev/null
  local t0 t1 cpu0 cpu1 b0 s0 b1 s1 m0 st0 sim0 sim1
  cpu0=$(workers_cpu_ticks)
  sim0=$(process_ticks "$SINK_PID")
  read -r m0 st0 <<<"$(machine_ticks)"
  workers_ready
  t0=$(date +%s%N)
  psql -c "SELECT outbox.resume_channel('drain')" >/dev/null
  local every=${EVERY:-} done0=0 done1 rates=""
  if [ -z "$every" ]; then
    # Each statement of the loop sees what committed before it (READ COMMITTED).
    psql -c "DO \$\$ BEGIN WHILE $DRAINING LOOP PERFORM pg_sleep(0.005); END LOOP; END \$\$"
  else
    local next=$((SECONDS + every))
    while [ "$(psql -c "SELECT $DRAINING")" != f ]; do
      sleep 0.1
      if [ $SECONDS -ge $next ]; then
        done1=$(psql -c "SELECT coalesce(sum(delivered_total), 0) FROM outbox._channel_stats")
        rates="$rates${rates:+/}$(( (done1 - done0) / every ))"
        done0=$done1; next=$((next + every))
      fi
    done
  fi
  t1=$(date +%s%N)
  cpu1=$(workers_cpu_ticks)
  sim1=$(process_ticks "$SINK_PID")
  [ -z "$rates" ] || echo "rate_each_${every}s $rates"
  psql -F ' ' -c "SELECT 'deliveries_per_s_first_claim_to_last_record', round($N / extract(epoch FROM max(recorded_at) - min(attempt_started_at)))
                    FROM outbox._ledger WHERE recorded_by = 'worker'" 2>/dev/null || true
  local delivered
  delivered=$(psql -c "SELECT count(*) FROM outbox.messages WHERE state = 'delivered'")
  [ "$delivered" = "$N" ] || echo "warning: $delivered of $N delivered" >&2
  sleep 1  # the workers report their table statistics before they sleep
  echo "deliveries_per_s $(( N * 1000000000 / (t1 - t0) ))"
  # The workers' CPU a message, in µs: their backends and their send threads.
  read -r b0 s0 <<<"$cpu0"; read -r b1 s1 <<<"$cpu1"
  local us_a_tick=$((1000000 / $(getconf CLK_TCK)))
  echo "worker_backend_us_per_message $(( (b1 - b0) * us_a_tick / N ))"
  echo "worker_send_threads_us_per_message $(( (s1 - s0) * us_a_tick / N ))"
  echo "simulator_us_per_message $(( (sim1 - sim0) * us_a_tick / N ))"
  echo "machine_steal_percent $(steal_percent_since "$m0" "$st0")"
  psql -F ' ' -c "SELECT 'wal_bytes_per_message', round(wal_bytes / $N) FROM pg_stat_wal"
  psql -F ' ' -c "SELECT 'wal_records_per_message', round(wal_records::numeric / $N, 2) FROM pg_stat_wal"
  psql -F ' ' -c "SELECT 'full_page_images_per_message', round(wal_fpi::numeric / $N, 2) FROM pg_stat_wal"
  psql -F ' ' -c "SELECT 'rows' || relname, n_tup_ins || '_ins/' || n_tup_upd || '_upd/' || n_tup_hot_upd || '_hot/' || autovacuum_count || '_autovacuums'
                    FROM pg_stat_user_tables WHERE schemaname = 'outbox' AND relname IN ('_messages', '_attempts', '_ledger', '_ledger_0', '_ledger_1', '_ledger_2')
                   ORDER BY relname"
  echo "load_average_1m $(cut -d' ' -f1 /proc/loadavg)"
  bash scripts/cluster.sh destroy >/dev/null 2>&1 || true
}

echo "machine: $(nproc) cores; $OUTBOX_WORKERS delivery workers, batch ${BATCH:-200}; backlog $N; $ROUNDS rounds, builds alternating"
[ -z "${SINK_ARGS:-}" ] || echo "simulator: $SINK_ARGS"
[ "${PREFILL:-0}" = 0 ] || echo "prefill: $PREFILL ledger entries before each drain"
echo "effect keys: backlog $BACKLOG_KEY, prefill $PREFILL_KEY"
echo "old: $OLD"
echo "new: $NEW"
[ -z "${OLD_SQL:-}" ] || echo "old runs first: $OLD_SQL"
[ -z "${NEW_SQL:-}" ] || echo "new runs first: $NEW_SQL"
[ -z "${OLD_OPTIONS:-}" ] || echo "old channel options: $OLD_OPTIONS"
[ -z "${NEW_OPTIONS:-}" ] || echo "new channel options: $NEW_OPTIONS"
declare -A lines
for round in $(seq "$ROUNDS"); do
  for side in old new; do
    if [ "$side" = old ]; then prefix=$OLD sql=${OLD_SQL:-} options=${OLD_OPTIONS:-}
    else prefix=$NEW sql=${NEW_SQL:-} options=${NEW_OPTIONS:-}; fi
    out=$(drain "$prefix" "$sql" "$options")
    while read -r name value; do
      [ -n "$name" ] || continue
      lines["$name $side"]="${lines["$name $side"]:-}${lines["$name $side"]:+, }$value"
    done <<<"$out"
    echo "round $round $side: $(echo "$out" | tr '\n' ';')"
  done
done
echo
echo "figure | old (rounds) | new (rounds)"
for key in "${!lines[@]}"; do
  name=${key% *}
  [ "${key##* }" = old ] || continue
  echo "$name | ${lines["$name old"]} | ${lines["$name new"]:-}"
done | sort
