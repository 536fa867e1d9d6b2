#!/usr/bin/env bash
# Where an idle worker's time goes between the wake at a COMMIT and its request: one message
# at a time is enqueued and committed (pgbench: BEGIN, outbox.enqueue, COMMIT, a rest of
# REST_MS), and uprobes on the server's functions time each step of the worker that claims it,
# as it runs (perf probe; no rebuild, no debug symbols). For each claim that took a message
# (its commit flushed WAL), from the worker's wake:
#   - the start of its transaction;
#   - each statement of the claim (loading the channels, the claim lock, the claim itself):
#     setting its GUCs and binding its arguments, the plan cache's checks, the executor's
#     start (building the plan's run-time state), its run and its end;
#   - the work of the worker between statements;
#   - the commit and the WAL flush in it;
#   - from the commit's return to the sends' hand-over to the send thread (the worker's
#     write to the thread's eventfd), from there to the send thread's wake (its return from
#     epoll_wait), and to the request's write (`write`, or `writev` through reqwest).
# Medians and 90th percentiles over the claims seen, then the same steps of the record
# transaction that follows. Figures only; nothing is asserted. Runs on a throwaway cluster
# (port 54824); needs root, and perf (Debian's linux-perf, installed here when missing).
# Usage: bench/profile_idle_path.sh [seconds profiled = 3]
#   OUTBOX_WORKERS (2), REST_MS (5), OUTBOX_PGBIN (the binaries of a private copy of
#   PostgreSQL, scripts/pg_prefix.sh: the build installed there is profiled as it is).
source "$(dirname "$0")/../scripts/lib.sh"
SECONDS_PROFILED=${1:-3}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_idle_path}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54824}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
export OUTBOX_EXTRA_CONF="outbox.batch_size = 200"
SINK_PORT=18804
PGBIN=${OUTBOX_PGBIN:-/usr/lib/postgresql/15/bin}
GROUP=outbox_idle_path

bash scripts/setup.sh >/dev/null
command -v perf >/dev/null || apt-get install -y -qq linux-perf >/dev/null 2>&1 || true
command -v perf >/dev/null || { echo "perf is not installed (apt-get install linux-perf)" >&2; exit 2; }
# A private copy of PostgreSQL is profiled with the build installed in it; otherwise this
# tree is built and installed.
[ -n "${OUTBOX_PGBIN:-}" ] || bash scripts/cluster.sh install >/dev/null
cargo build -q --release -p outbox_e2e --bin provider-sim
target/release/provider-sim --port $SINK_PORT --quiet --no-record-requests --no-record-bodies >/dev/null 2>&1 &
SINK_PID=$!
cleanup() {
  perf probe -q -d "$GROUP:*" >/dev/null 2>&1 || true
  bash scripts/cluster.sh stop >/dev/null 2>&1 || true
  kill $SINK_PID 2>/dev/null || true
}
trap cleanup EXIT
psql() { bash scripts/cluster.sh psql -qAt "$@"; }
fresh_cluster >/dev/null
psql -c "SELECT outbox.create_channel('idle', 'http://127.0.0.1:$SINK_PORT/ch/idle', '{\"idempotency_header\": \"Idempotency-Key\"}'::jsonb)" >/dev/null

# The probes: NAME=FUNCTION, and NAME_ret=FUNCTION%return where the end matters.
perf probe -q -d "$GROUP:*" >/dev/null 2>&1 || true
for f in WaitEventSetWait%return StartTransactionCommand CommitTransactionCommand \
         CommitTransactionCommand%return NewGUCNestLevel SPI_execute_plan \
         standard_ExecutorStart standard_ExecutorStart%return standard_ExecutorRun \
         standard_ExecutorRun%return standard_ExecutorEnd%return XLogFlush \
         XLogFlush%return; do
  name=${f%\%return}
  [ "$name" != "$f" ] && name=${name}_ret
  perf probe -q -x "$PGBIN/postgres" -a "$GROUP:$name=$f" >/dev/null
done
# The claim's own function marks a claim transaction: a probe on the extension's symbol,
# placed by its offset in the file (perf cannot parse a Rust name). `claim_due` may be
# inlined into its caller; `claim_from`, which it calls, then stands for it.
LIB=$("$PGBIN/pg_config" --pkglibdir)/outbox_delivery.so
ADDR=$(nm "$LIB" | awk '/ t .*worker5claim(9claim_due|10claim_from)17h/ && !found {print $1; found = 1}')
[ -n "$ADDR" ] || { echo "no claim function found in $LIB to probe" >&2; exit 2; }
read -r SEG_OFF SEG_VADDR < <(readelf -lW "$LIB" | awk '$1 == "LOAD" && /R E/ && !found {print $2, $3; found = 1}')
perf probe -q -x "$LIB" -a "$GROUP:claim_due=$(printf '0x%x' $((16#$ADDR - SEG_VADDR + SEG_OFF)))" >/dev/null

cat >"$OUTBOX_BASE/one.sql" <<SQL
BEGIN;
SELECT outbox.enqueue('idle', '{"t": 1}', 'idle:' || random()::text);
COMMIT;
\sleep ${REST_MS:-5} ms
SQL
DB=$(bash scripts/cluster.sh env | sed 's/.*OUTBOX_DB=\([^ ]*\).*/\1/' | cut -d, -f1)
for _ in $(seq 1 50); do
  WORKERS=$(pgrep -f "outbox_delivery worker" | paste -sd, || true)
  [ "$(tr ',' '\n' <<<"$WORKERS" | grep -c .)" -ge "$OUTBOX_WORKERS" ] && break
  sleep 0.2
done
PGHOST="$OUTBOX_BASE/sock" pgbench -U postgres -n -T $((SECONDS_PROFILED + 3)) -p "$OUTBOX_PGPORT" \
  -f "$OUTBOX_BASE/one.sql" "$DB" >"$OUTBOX_BASE/pgbench.out" 2>&1 &
LOAD=$!
sleep 1
perf record -q -o "$OUTBOX_BASE/probes.data" -e "$GROUP:*" -e syscalls:sys_enter_writev -e syscalls:sys_enter_write -e syscalls:sys_exit_epoll_wait \
  -p "$WORKERS" -- sleep "$SECONDS_PROFILED" >/dev/null 2>&1
wait $LOAD
echo "idle load: $(awk '/^tps/ {printf "%d commits a second", $3}' "$OUTBOX_BASE/pgbench.out"), one message each, ${REST_MS:-5} ms apart; workers $WORKERS"

perf script -i "$OUTBOX_BASE/probes.data" -F pid,tid,time,event 2>/dev/null |
  sed "s/$GROUP://; s/__return//; s/syscalls:sys_enter_writev/writev/; s/syscalls:sys_enter_write/write/; s/syscalls:sys_exit_epoll_wait/epoll_woke/; s/: *$//" |
  awk -f bench/idle_path.awk
