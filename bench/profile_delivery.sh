#!/usr/bin/env bash
# Where the time of a delivery goes: drains a backlog to the provider simulator with the
# cluster's workers and prints the rate, the writes each table took (inserts, updates and
# how many of them were HOT), and with PROFILE=1 a perf profile of the whole machine
# during the drain: the CPU share of each process, then the hottest functions. Figures
# only; nothing is asserted. Runs on a throwaway cluster (port 54821).
# Usage: bench/profile_delivery.sh [backlog = 60000]
#   OUTBOX_WORKERS (2), BATCH (outbox.batch_size, 200), PROFILE=1 (needs perf), RUNS (1),
#   PROFILE_AT (seconds into the drain when the 4 s profile starts, 1),
#   CONF (more postgresql.conf lines for the cluster, e.g. "max_wal_size = 8GB"),
#   STATEMENTS=1 (the workers' statements by total time, from pg_stat_statements),
#   STATEMENTS_AT (with STATEMENTS=1: seconds into the drain, e.g. "4 12 20 28", at which
#   pg_stat_statements is read; prints each statement's cost in each window between two
#   readings, to see whether a statement grows dearer as a large drain goes on),
#   SETUP_SQL (statements run before the backlog is enqueued, one after another, each in a
#   transaction of its own, e.g. to try a schema change or ALTER SYSTEM a setting),
#   PAYLOAD_BYTES (each payload about that long: hexadecimal digits, which compress little,
#   or with PAYLOAD_KIND=json an array of small objects; default a short text),
#   WALDUMP=1 (the drain's WAL by record type, from pg_waldump --stats=record),
#   SINK_ARGS (more provider-sim arguments, e.g. "--random 503=0.5,seed=7" for failed
#   attempts and their records), CHANNEL_OPTIONS (more options of the channel, a JSON
#   object merged into the defaults, e.g. '{"retry": {"base_ms": 20, "max_attempts": 30}}'),
#   TIMELINE=1 (every 5 s of the drain: its rate, the whole machine's CPU by kind from
#   /proc/stat, including the kernel's own threads and time taken by the host, the
#   page cache's dirty and writeback memory, the WAL bytes and full-page images a message,
#   and the checkpoints begun), WAITS=1 (what the workers' backends were
#   doing, sampled from pg_stat_activity every 10 ms of the drain: on the CPU, or waiting and
#   for what: a lock, the WAL's flush at a commit, a read), SYSCALLS=1 (the system calls of
#   the workers, every thread, and of the simulator during the drain, a message each, from
#   strace -c, which it needs: a drain traced so is several times slower, and its rate means
#   nothing), SCHEDSTAT=1 (each thread of the workers and of the simulator: its time on a
#   CPU and its time runnable but waiting for one, a message each, from the kernel's
#   /proc/PID/task/TID/schedstat read before and after the drain)
source "$(dirname "$0")/../scripts/lib.sh"
N=${1:-60000}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_profile}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54821}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
export OUTBOX_EXTRA_CONF="outbox.batch_size = ${BATCH:-200}
${STATEMENTS:+shared_preload_libraries = 'outbox_delivery, pg_stat_statements'}
${WALDUMP:+wal_keep_size = 4GB}
${CONF:-}"
SINK_PORT=18801
CHANNEL_OPTIONS=${CHANNEL_OPTIONS:-"{}"}

bash scripts/setup.sh >/dev/null
bash scripts/cluster.sh install >/dev/null
cargo build -q --release -p outbox_e2e --bin provider-sim
# shellcheck disable=SC2086  # SINK_ARGS is a list of arguments
target/release/provider-sim --port $SINK_PORT --quiet --no-record-requests --no-record-bodies ${SINK_ARGS:-} >/dev/null 2>&1 &
SINK_PID=$!
trap 'bash scripts/cluster.sh stop >/dev/null 2>&1 || true; kill $SINK_PID 2>/dev/null || true' EXIT
psql() { bash scripts/cluster.sh psql -qAt "$@"; }
LOG=$OUTBOX_BASE/postgres.log
TICK=$(getconf CLK_TCK)
# Every second, the CPU ticks so far of each server process: "pid kind ticks" lines.
sample_server_cpu() {
  local p t kind
  while :; do
    for p in $(pgrep -u postgres -x postgres); do
      t=$(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null) || continue
      case "$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null)" in
        *"outbox_delivery worker"*) kind=workers ;;
        *autovacuum\ worker*) kind=autovacuum ;;
        *) kind=other ;;
      esac
      echo "$p $kind $t"
      # A worker's send threads apart: the worker's figure above counts every thread.
      if [ "$kind" = workers ]; then
        echo "$p-http http $(awk '$2 == "(outbox-http)" {t += $14 + $15} END {print t + 0}' \
                               /proc/"$p"/task/*/stat 2>/dev/null)"
      fi
    done
    sleep 1
  done
}
# The pids of the workers' backends.
worker_pids() { psql -c "SELECT pid FROM pg_stat_activity WHERE backend_type LIKE 'outbox_delivery worker%'"; }
# One line per thread of the processes $@: pid, tid, name, ns on a CPU, ns runnable and
# waiting for a CPU, time slices (schedstat).
thread_schedstats() {
  local p t
  for p in "$@"; do
    for t in /proc/"$p"/task/*; do
      echo "$p ${t##*/} $(tr ' ' _ <"$t/comm") $(cat "$t/schedstat")"
    done
  done
}
# Every 5 s: seconds, messages delivered so far, the vacuums running, WAL bytes and full-page
# images so far, checkpoints so far, the machine's CPU ticks (user nice system idle iowait
# irq softirq steal) and the page cache's Dirty and Writeback kB.
sample_machine() {
  local d
  while :; do
    d=$(psql -F ' ' -c "SELECT coalesce(sum(delivered_total), 0),
                               coalesce((SELECT string_agg(relid::regclass::text || ':' || replace(phase, ' ', '_'), ',')
                                           FROM pg_stat_progress_vacuum), '-'),
                               (SELECT wal_bytes || ' ' || wal_fpi FROM pg_stat_wal),
                               (SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter)
                          FROM outbox._channel_stats" 2>/dev/null || echo "- - - - -")
    echo "$(date +%s.%N) $d $(awk '/^cpu /{print $2, $3, $4, $5, $6, $7, $8, $9}' /proc/stat)" \
         "$(awk '/^Dirty:/{d=$2} /^Writeback:/{w=$2} END{print d, w}' /proc/meminfo)"
    sleep 5
  done
}
print_timeline() {
  echo "timeline (each 5 s: msg/s; machine CPU %: user system iowait softirq steal idle; dirty, writeback MB; WAL bytes and full-page images a message; checkpoints begun; the vacuums running, by table and phase):"
  awk 'NR > 1 && $2 != "-" && p2 != "-" {
         dt = $1 - p1; tot = 0; for (i = 7; i <= 14; i++) tot += $i - p[i]; n = $2 - p2
         if (tot > 0) printf "  %5.0f s %7.0f msg/s  cpu %3.0f %3.0f %3.0f %3.0f %3.0f %3.0f  dirty %5.0f wb %4.0f  wal %5.0f B %4.2f fpi  ckpt %d  %s\n",
           $1 - t0, n / dt, 100 * ($7 + $8 - p[7] - p[8]) / tot, 100 * ($9 - p[9]) / tot,
           100 * ($11 - p[11]) / tot, 100 * ($12 + $13 - p[12] - p[13]) / tot, 100 * ($14 - p[14]) / tot,
           100 * ($10 - p[10]) / tot, $15 / 1024, $16 / 1024,
           (n > 0 ? ($4 - p[4]) / n : 0), (n > 0 ? ($5 - p[5]) / n : 0), $6 - p[6], $3 }
       NR == 1 { t0 = $1 }
       { p1 = $1; p2 = $2; for (i = 4; i <= 14; i++) p[i] = $i }' "$1"
}

# At each of STATEMENTS_AT's seconds after the drain began ($1, ns since the epoch): the
# messages delivered so far and each statement's counters, "at|delivered|queryid|calls|ms|
# rows|buffers|text" lines.
sample_statements() {
  local at
  for at in $STATEMENTS_AT; do
    while [ $(( $(date +%s%N) - $1 )) -lt $((at * 1000000000)) ]; do sleep 0.1; done
    psql -F '|' -c "SELECT $at, (SELECT coalesce(sum(delivered_total), 0) FROM outbox._channel_stats),
                           queryid, calls, total_exec_time, rows, shared_blks_hit + shared_blks_read,
                           left(regexp_replace(query, '\s+', ' ', 'g'), 60)
                      FROM pg_stat_statements WHERE calls > 10 AND query NOT LIKE '%pg_stat%'"
  done
}
print_statement_windows() {
  echo "statements in each window of the drain (us a message, calls, rows and buffers a call):"
  awk -F'|' '
    !($1 in seen) { seen[$1] = 1; order[++k] = $1; delivered[$1] = $2 }
    { key = $1 SUBSEP $3; calls[key] = $4; ms[key] = $5; rows[key] = $6; bufs[key] = $7; text[$3] = $8 }
    END {
      for (i = 2; i <= k; i++) {
        a = order[i - 1]; b = order[i]; n = delivered[b] - delivered[a]
        printf "  %s-%s s, %d delivered\n", a, b, n
        for (id in text) {
          if (!((b SUBSEP id) in calls)) continue
          c = calls[b SUBSEP id] - calls[a SUBSEP id]
          if (c <= 0 || n <= 0) continue
          printf "    %6.1f us  %5d calls  %6.1f rows  %6.0f buffers  %s\n", (ms[b SUBSEP id] - ms[a SUBSEP id]) * 1000 / n,
                 c, (rows[b SUBSEP id] - rows[a SUBSEP id]) / c, (bufs[b SUBSEP id] - bufs[a SUBSEP id]) / c, text[id]
        }
      }
    }' "$1"
}

for run in $(seq 1 "${RUNS:-1}"); do
  STATEMENT_SAMPLER=
  fresh_cluster >/dev/null
  if [ -n "${SETUP_SQL:-}" ]; then run_statements "$SETUP_SQL"; fi
  psql -c "SELECT outbox.create_channel('profile', 'http://127.0.0.1:$SINK_PORT/ch/profile', '{\"max_in_flight\": 512, \"max_unverifiable_in_flight\": 512, \"external_id\": \"/id\"}'::jsonb || '$CHANNEL_OPTIONS'::jsonb)" \
       -c "SELECT outbox.pause_channel('profile', 'loading the backlog')" >/dev/null
  # Each payload: a short text, or with PAYLOAD_BYTES a larger one (lib.sh).
  ITEMS="'benchmark message'"
  if [ -n "${PAYLOAD_BYTES:-}" ]; then ITEMS=$(payload_items_sql "${PAYLOAD_KIND:-hex}" "$PAYLOAD_BYTES"); fi
  psql -c "SELECT count(outbox.enqueue('profile', jsonb_build_object('n', g, 'text', $ITEMS), 'k:' || g)) FROM generate_series(1, $N) g" >/dev/null
  psql -c "SELECT 'payload ' || round(avg(octet_length(payload::text))) || ' bytes as text, ' || round(avg(pg_column_size(payload))) || ' bytes stored' FROM (SELECT payload FROM outbox._messages LIMIT 1000) s"
  psql -c "VACUUM ANALYZE outbox._messages" >/dev/null
  psql -c "CHECKPOINT" >/dev/null
  psql -c "SELECT pg_stat_reset(), pg_stat_reset_shared('wal'), pg_stat_reset_shared('bgwriter')" >/dev/null
  if [ -n "${STATEMENTS:-}" ]; then
    psql -c "CREATE EXTENSION IF NOT EXISTS pg_stat_statements" -c "SELECT pg_stat_statements_reset()" >/dev/null
  fi
  sample_server_cpu >"$OUTBOX_BASE/cpu.samples" &
  SAMPLER=$!
  if [ -n "${TIMELINE:-}" ]; then sample_machine >"$OUTBOX_BASE/machine.samples" & MACHINE=$!; fi
  if [ -n "${WAITS:-}" ]; then
    # One session samples until the backlog is gone; pg_stat_activity is read afresh at
    # each sample (pg_stat_clear_snapshot), into a temporary table that writes no WAL.
    psql -F ' ' -c "CREATE TEMP TABLE s (what text)" -c "
      DO \$\$ BEGIN
        FOR i IN 1..300000 LOOP
          PERFORM pg_stat_clear_snapshot();
          INSERT INTO s SELECT coalesce(wait_event_type || ':' || wait_event, 'on the CPU')
                          FROM pg_stat_activity WHERE backend_type LIKE 'outbox_delivery worker%';
          EXIT WHEN i % 10 = 0 AND NOT ($DRAINING);
          PERFORM pg_sleep(0.01);
        END LOOP;
      END \$\$" -c "SELECT '  ' || what, count(*), round(100.0 * count(*) / sum(count(*)) OVER (), 1) || ' %'
                        FROM s GROUP BY what ORDER BY count(*) DESC LIMIT 12" >"$OUTBOX_BASE/waits.txt" 2>&1 &
    WAITER=$!
  fi
  STRACES=""
  if [ -n "${SYSCALLS:-}" ]; then
    rm -f "$OUTBOX_BASE"/strace.*
    workers_ready
    for p in $(worker_pids); do
      strace -c -f -p "$p" -o "$OUTBOX_BASE/strace.worker.$p" 2>/dev/null & STRACES="$STRACES $!"
    done
    strace -c -f -p "$SINK_PID" -o "$OUTBOX_BASE/strace.sink" 2>/dev/null & STRACES="$STRACES $!"
    sleep 1
  fi
  if [ -n "${SCHEDSTAT:-}" ]; then
    workers_ready
    # shellcheck disable=SC2046  # a list of pids
    thread_schedstats $(worker_pids) $SINK_PID >"$OUTBOX_BASE/schedstat.0"
  fi
  k0=$(process_ticks $SINK_PID)
  lsn0=$(psql -c "SELECT pg_current_wal_lsn()")
  t0=$(date +%s%N)
  psql -c "SELECT outbox.resume_channel('profile')" >/dev/null
  if [ -n "${STATEMENTS:-}" ] && [ -n "${STATEMENTS_AT:-}" ]; then
    sample_statements "$t0" >"$OUTBOX_BASE/statements.samples" 2>/dev/null & STATEMENT_SAMPLER=$!
  fi
  if [ -n "${PROFILE:-}" ]; then
    sleep "${PROFILE_AT:-1}"
    perf record -a -g -o "$OUTBOX_BASE/perf.data" -- sleep 4 >/dev/null 2>&1
  fi
  while [ "$(psql -c "SELECT $DRAINING")" != f ]; do sleep 0.2; done
  t1=$(date +%s%N)
  if [ -n "${SCHEDSTAT:-}" ]; then
    # shellcheck disable=SC2046  # the threads read before the drain
    thread_schedstats $(cut -d' ' -f1 "$OUTBOX_BASE/schedstat.0" | sort -u) >"$OUTBOX_BASE/schedstat.1"
  fi
  k1=$(process_ticks $SINK_PID)
  kill $SAMPLER; wait $SAMPLER 2>/dev/null || true
  # Readings of the statements due after the drain ended are not taken.
  if [ -n "$STATEMENT_SAMPLER" ]; then kill $STATEMENT_SAMPLER 2>/dev/null || true; wait $STATEMENT_SAMPLER 2>/dev/null || true; fi
  if [ -n "${TIMELINE:-}" ]; then kill $MACHINE; wait $MACHINE 2>/dev/null || true; fi
  # shellcheck disable=SC2086  # a list of pids
  if [ -n "$STRACES" ]; then kill -INT $STRACES 2>/dev/null || true; wait $STRACES 2>/dev/null || true; fi
  echo "run $run: $N messages delivered in $(( (t1 - t0) / 1000000 )) ms: $(( N * 1000000000 / (t1 - t0) )) msg/s ($OUTBOX_WORKERS workers, batch ${BATCH:-200})"
  sleep 1  # the workers report their table statistics before they sleep
  # Per process, its last sample less its first; a process that exits between two samples
  # loses at most a second.
  awk -v k=$((k1 - k0)) -v hz="$TICK" -v n="$N" -v ns=$((t1 - t0)) '
    !($1 in first) { first[$1] = $3; kind[$1] = $2 } { last[$1] = $3 }
    END {
      for (p in last) cpu[kind[p]] += (last[p] - first[p]) / hz
      printf "cpu s during the drain (of %.1f on 2 cores): workers %.1f (%.0f us a message: %.0f in the backend, %.0f in its send threads), autovacuum %.1f, other server processes %.1f, sink %.1f\n",
             2 * ns / 1e9, cpu["workers"], cpu["workers"] / n * 1e6, (cpu["workers"] - cpu["http"]) / n * 1e6,
             cpu["http"] / n * 1e6, cpu["autovacuum"], cpu["other"], k / hz
    }' "$OUTBOX_BASE/cpu.samples"
  psql -F ' ' -c "SELECT 'writes ' || relname, 'inserts ' || n_tup_ins, 'updates ' || n_tup_upd, 'hot ' || n_tup_hot_upd
                    FROM pg_stat_user_tables WHERE schemaname = 'outbox' AND relname IN ('_messages', '_attempts', '_ledger', '_ledger_0', '_ledger_1', '_ledger_2')
                   ORDER BY relname"
  psql -F ' ' -c "SELECT 'wal', pg_size_pretty(wal_bytes) || ',', round(wal_bytes / $N) || ' bytes a message,',
                         round(wal_fpi::numeric / $N, 2) || ' full-page images a message,',
                         (SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter) || ' checkpoints,',
                         (SELECT buffers_backend FROM pg_stat_bgwriter) || ' buffers written by backends'
                    FROM pg_stat_wal"
  if [ -n "${WALDUMP:-}" ]; then
    lsn1=$(psql -c "SELECT pg_current_wal_lsn()")
    echo "WAL of the drain by record type, a message: bytes (of which full-page images), records"
    runuser -u postgres -- "${OUTBOX_PGBIN:-/usr/lib/postgresql/15/bin}/pg_waldump" --stats=record \
        -p "$OUTBOX_BASE/pgdata/pg_wal" -s "$lsn0" -e "$lsn1" 2>/dev/null |
      awk -v n="$N" '$1 ~ /\// || $1 == "Total" {
        line = $0; gsub(/[[(][ 0-9.%]*[])]/, "", line); split(line, f, " ")
        if (f[5] > 0) printf "  %-36s %8.1f B (%6.1f) %6.2f\n", f[1], f[5] / n, f[4] / n, f[2] / n }' |
      sort -k2 -g -r | head -18
  fi
  if [ -n "${WAITS:-}" ]; then
    wait $WAITER || true
    echo "the workers' backends during the drain, sampled every 10 ms (samples, share):"
    cat "$OUTBOX_BASE/waits.txt"
  fi
  if [ -n "${TIMELINE:-}" ]; then print_timeline "$OUTBOX_BASE/machine.samples"; fi
  if [ -n "${SCHEDSTAT:-}" ]; then
    echo "threads during the drain, a message each (schedstat): us on a CPU, us runnable and waiting for a CPU, time slices"
    # Threads that ran under 0.1 us a message (idle helpers) are left out.
    awk -v n="$N" 'NR == FNR { cpu[$2] = $4; wait[$2] = $5; slices[$2] = $6; next }
                   ($2 in cpu) && ($4 - cpu[$2]) / n >= 100 {
                     printf "  %-7s %-7s %-16s %6.1f %6.1f %8d\n", $1, $2, $3,
                            ($4 - cpu[$2]) / n / 1e3, ($5 - wait[$2]) / n / 1e3, $6 - slices[$2] }' \
      "$OUTBOX_BASE/schedstat.0" "$OUTBOX_BASE/schedstat.1"
  fi
  if [ -n "$STRACES" ]; then
    echo "system calls a message, the workers (every thread) and the simulator (strace -c; calls, of which failed):"
    for who in worker sink; do
      { cat "$OUTBOX_BASE"/strace."$who"* 2>/dev/null || true; } |
        awk -v n="$N" -v who="$who" '$NF != "total" && $4 ~ /^[0-9]+$/ {
               calls[$NF] += $4; if (NF == 6) errors[$NF] += $5 }
             END { for (c in calls) if (calls[c] / n >= 0.01)
                     printf "  %-7s %-16s %6.2f (%.2f)\n", who, c, calls[c] / n, errors[c] / n }' |
        sort -k3 -g -r
    done
  fi
  if [ -n "$STATEMENT_SAMPLER" ]; then print_statement_windows "$OUTBOX_BASE/statements.samples"; fi
  if [ -n "${STATEMENTS:-}" ]; then
    echo "statements by total time (ms; buffers and rows per call):"
    psql -F ' | ' -c "SELECT round(total_exec_time), calls, round((total_exec_time / calls)::numeric, 3) || ' ms a call', round((total_plan_time / calls)::numeric, 3) || ' ms planning',
                             round((shared_blks_hit + shared_blks_read)::numeric / calls) || ' buffers',
                             round(rows::numeric / calls, 1) || ' rows',
                             regexp_replace(left(query, 110), '\s+', ' ', 'g')
                        FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat%'
                       ORDER BY total_exec_time DESC LIMIT 8"
  fi
  if [ -n "${PROFILE:-}" ]; then
    echo "CPU by process (perf, whole machine, 4 s):"
    perf report -i "$OUTBOX_BASE/perf.data" --sort comm --stdio -g none 2>/dev/null | grep '%' | head -6
    echo "hottest functions, self time:"
    perf report -i "$OUTBOX_BASE/perf.data" --no-children --sort comm,sym --stdio -g none 2>/dev/null | grep '%' | head -25
  fi
done
