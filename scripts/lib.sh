# Sourced by the benchmark, profile, demo and test scripts: strict mode, the repository root
# as the working directory, cargo on PATH, and the throwaway cluster's common steps.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export PATH="$HOME/.cargo/bin:$PATH"

# A new throwaway cluster (scripts/cluster.sh, located by the OUTBOX_* settings): the old
# one is removed first, so that it always matches the extension installed. Arguments go to
# `scripts/cluster.sh start`.
fresh_cluster() {
  bash scripts/cluster.sh destroy >/dev/null 2>&1 || true
  bash scripts/cluster.sh start "$@"
}

# Runs the statements of $1 on the cluster one after another, each in a transaction of its
# own, as psql runs a file: `psql -c` would send them as one query in one transaction, where
# ALTER SYSTEM and VACUUM cannot run. Stops at the first error, which psql prints, and fails.
run_statements() {
  bash scripts/cluster.sh psql -qAt -v ON_ERROR_STOP=1 <<<"$1" >/dev/null
}

# Exits (2) unless every argument is a private copy of PostgreSQL (scripts/pg_prefix.sh).
require_prefixes() {
  local p
  for p in "$@"; do
    [ -x "$p/lib/postgresql/15/bin/postgres" ] || { echo "$p is not a PostgreSQL prefix (scripts/pg_prefix.sh create)" >&2; exit 2; }
  done
}

# Writes $1 entries straight into the cluster's ledger, keyed by the SQL expression $2 of
# row `g` (message ids -1, -2, …), as a ledger kept for weeks holds them: spread over the
# three generations of a build that has them (0.1.0 has none). Then VACUUM ANALYZE.
prefill_ledger() {
  local generations
  generations=$(bash scripts/cluster.sh psql -qAt -c "SELECT count(*) FROM pg_attribute
                  WHERE attrelid = 'outbox._ledger'::regclass AND attname = 'generation'")
  if [ "$generations" = 1 ]; then
    bash scripts/cluster.sh psql -qAt -c "INSERT INTO outbox._ledger (tenant, effect_key, message_id, recorded_by, generation)
      SELECT 'default', $2, -g, 'operator', g % 3 FROM generate_series(1, $1) g" >/dev/null
  else
    bash scripts/cluster.sh psql -qAt -c "INSERT INTO outbox._ledger (tenant, effect_key, message_id, recorded_by)
      SELECT 'default', $2, -g, 'operator' FROM generate_series(1, $1) g" >/dev/null
  fi
  bash scripts/cluster.sh psql -qAt -c "VACUUM ANALYZE outbox._ledger" >/dev/null
}

# Waits (30 s at most) until the cluster's $OUTBOX_WORKERS workers serve its database: a
# worker started with the cluster looks for the extension once a second, so a drain resumed
# right after fresh_cluster would otherwise measure up to a second of that wait.
workers_ready() {
  local i
  for i in $(seq 300); do
    [ "$(bash scripts/cluster.sh psql -qAt -c "SELECT count(*) FROM outbox.worker_status()
           WHERE state IN ('idle', 'claiming', 'sending', 'recording')")" -ge "${OUTBOX_WORKERS:-2}" ] && return 0
    sleep 0.1
  done
  echo "the workers did not start serving within 30 s" >&2
  return 1
}

# The provider simulator on port $1, quiet and keeping no requests or bodies (for drains
# measured by rate), in the background as SINK_PID; on exit the throwaway cluster is stopped
# at once and the simulator killed. SINK_ARGS: more of its arguments (e.g.
# "--answer-after-ms 20", a provider that answers in 20 ms).
start_quiet_sink() {
  cargo build -q --release -p outbox_e2e --bin provider-sim
  # shellcheck disable=SC2086  # SINK_ARGS is split into arguments
  "${CARGO_TARGET_DIR:-$ROOT/target}"/release/provider-sim --port "$1" --quiet --no-record-requests --no-record-bodies ${SINK_ARGS:-} >/dev/null 2>&1 &
  SINK_PID=$!
  trap 'bash scripts/cluster.sh stop immediate >/dev/null 2>&1 || true; kill $SINK_PID 2>/dev/null || true' EXIT
}

# The start of a drain benchmark on a throwaway cluster of its own: the machine set up, the
# tree's build installed, the quiet simulator on port $1 (start_quiet_sink), then a fresh
# cluster whose workers serve its database.
start_drain_bench() {
  bash scripts/setup.sh >/dev/null
  bash scripts/cluster.sh install >/dev/null
  start_quiet_sink "$1"
  fresh_cluster >/dev/null
  workers_ready
}

# SQL for the content of a larger payload of about $2 bytes, for row `g` of a
# generate_series: with $1 `hex`, hexadecimal digits, which compress little (a token, an
# encrypted or encoded attachment); with `json`, an array of small objects, which compress
# as JSON does.
payload_items_sql() {
  case "$1" in
    hex) echo "(SELECT string_agg(md5(g::text || ':' || i), '') FROM generate_series(1, greatest(1, $2 / 32)) i)" ;;
    json) echo "(SELECT jsonb_agg(jsonb_build_object('line', i, 'sku', 'sku-' || (g * 31 + i) % 997, 'qty', (g + i) % 7 + 1, 'note', 'benchmark message')) FROM generate_series(1, greatest(1, $2 / 64)) i)" ;;
    *) echo "payload_items_sql: no payload kind $1 (hex or json)" >&2; return 1 ;;
  esac
}

# The median of the numbers on standard input (separated by spaces or lines; the upper one
# of an even count).
median() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

# SQL that is true while messages are still queued or in flight: two probes of the heads of
# partial indexes; a count of the table would cost a drain a fifth of the machine at a
# backlog of a million.
DRAINING="EXISTS (SELECT 1 FROM outbox._messages WHERE state = 'queued')
          OR EXISTS (SELECT 1 FROM outbox._messages WHERE state = 'sending')"

# The CPU ticks (user and system) used so far by the process $1, all its threads; 0 when it
# is gone.
process_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat" 2>/dev/null || echo 0; }

# The CPU ticks used so far by the delivery workers of the running cluster: "backends
# send_threads", the send threads being each worker's `outbox-http` threads and the backend
# the rest of its process.
workers_cpu_ticks() {
  local postmaster pid all http backends=0 sends=0
  postmaster=$(head -1 "$OUTBOX_BASE/pgdata/postmaster.pid" 2>/dev/null || echo 0)
  for pid in $(pgrep -P "$postmaster" -f 'outbox_delivery worker' || true); do
    all=$(process_ticks "$pid")
    http=$(awk '$2 == "(outbox-http)" { t += $14 + $15 } END { print t + 0 }' /proc/"$pid"/task/*/stat 2>/dev/null || echo 0)
    backends=$((backends + all - http))
    sends=$((sends + http))
  done
  echo "$backends $sends"
}

# The machine's CPU ticks so far, from /proc/stat: "all steal". Steal is the time the
# hypervisor ran something else while this machine had work: a run with much of it
# measures a slower machine.
machine_ticks() { awk '/^cpu / { t = 0; for (i = 2; i <= 9; i++) t += $i; print t, $9 }' /proc/stat; }

# The share of the CPU time since `machine_ticks` printed $1 $2 that was stolen, in %.
steal_percent_since() {
  machine_ticks | awk -v t0="$1" -v s0="$2" '{ d = $1 - t0; printf "%.1f\n", (d > 0 ? 100 * ($2 - s0) / d : 0) }'
}

# The machine's CPU ticks so far, from /proc/stat: "all idle", idle counting the time
# waiting for I/O.
machine_idle_ticks() { awk '/^cpu / { t = 0; for (i = 2; i <= 9; i++) t += $i; print t, $5 + $6 }' /proc/stat; }
