#!/usr/bin/env bash
# A queue behind one ordering key, beside another channel: N messages of one key wait
# behind its first message, scheduled a year ahead (not_before), and 5,000 plain messages
# of another channel are enqueued 2 s later and drained. Prints how many of the waiting
# messages the workers had held by then (src/worker/key_hold.rs), how long the plain
# messages took and, with STATEMENTS=1, the workers' statements by total time. Figures only;
# nothing is asserted. Runs on a throwaway cluster (port 54851, simulator on 18851).
# Usage: bench/bench_ordering_backlog.sh [N = 20000]
#   PAUSE_KEYED=1: the keyed channel is paused before the drain (what docs/runbook.md
#   advises while a key holds back its queue).
#   HELD_FIRST=1: the drain starts once every waiting message is held (at most 2 minutes).
#   DISTINCT_KEYS=1: the N messages have a key each and are all scheduled a year ahead, so
#   that none waits and none is due: what reading the keys' index costs while nothing is
#   held (STATEMENTS=1 shows the statement that holds).
#   UNCERTAIN_HEADS=1: N keys, each stopped at a first message left `uncertain` (as a
#   provider that drops every connection leaves them on a channel that cannot be asked),
#   with one due message behind it.
source "$(dirname "$0")/../scripts/lib.sh"
N=${1:-20000}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_ordering}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54851}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
export OUTBOX_EXTRA_CONF="outbox.batch_size = 200
${STATEMENTS:+shared_preload_libraries = 'outbox_delivery, pg_stat_statements'}"
SINK_PORT=18851

bash scripts/setup.sh >/dev/null
bash scripts/cluster.sh install >/dev/null
cargo build -q --release -p outbox_e2e --bin provider-sim
fresh_cluster >/dev/null
workers_ready
"${CARGO_TARGET_DIR:-target}/release/provider-sim" --port $SINK_PORT --quiet --no-record-requests --no-record-bodies >/dev/null 2>&1 &
SINK_PID=$!
trap 'kill $SINK_PID 2>/dev/null || true; bash scripts/cluster.sh stop >/dev/null 2>&1 || true' EXIT
psql() { bash scripts/cluster.sh psql -qAt "$@"; }
OPTIONS='{"max_in_flight": 512, "max_unverifiable_in_flight": 512}'
if [ -n "${DISTINCT_KEYS:-}" ]; then
  KEY="'k-' || g" NOT_BEFORE="now() + interval '1 year'" WHAT="of as many keys, scheduled a year ahead"
elif [ -n "${UNCERTAIN_HEADS:-}" ]; then
  KEY="'k-' || g" NOT_BEFORE="NULL" WHAT="each behind an uncertain message of its key"
  HEADS="SELECT count(outbox.enqueue('keyed', '{}', 'head-' || g, ordering_key => 'k-' || g,
                                     not_before => now() + interval '1 year'))
  FROM generate_series(1, $N) g;
UPDATE outbox._messages SET state = 'uncertain', attempts = 1
 WHERE effect_key LIKE 'head-%';"
else
  KEY="'k'" NOT_BEFORE="NULL" WHAT="waiting behind one key"
fi
run_statements "SET client_min_messages = warning;
SELECT outbox.create_channel('keyed', 'http://127.0.0.1:$SINK_PORT/ch/keyed', '$OPTIONS');
SELECT outbox.create_channel('plain', 'http://127.0.0.1:$SINK_PORT/ch/plain', '$OPTIONS');
SELECT outbox.enqueue('keyed', '{}', 'first', ordering_key => 'k', not_before => now() + interval '1 year');
${HEADS:-}
SELECT count(outbox.enqueue('keyed', '{}', 'waiting-' || g, ordering_key => $KEY, not_before => $NOT_BEFORE))
  FROM generate_series(1, $N) g;
${PAUSE_KEYED:+SELECT outbox.pause_channel('keyed', 'a key holds back its queue');}
${STATEMENTS:+CREATE EXTENSION pg_stat_statements;}"
sleep 2
[ -n "${STATEMENTS:-}" ] && psql -c "SELECT pg_stat_statements_reset()" >/dev/null
held_now() { psql -c "SELECT count(*) FROM outbox._messages WHERE held_by_key"; }
if [ -n "${HELD_FIRST:-}" ]; then
  for _ in $(seq 600); do
    [ "$(held_now)" -ge "$N" ] && break
    sleep 0.2
  done
fi
held=$(held_now)
start=$(date +%s.%N)
psql -c "SELECT count(outbox.enqueue('plain', '{}', 'plain-' || g)) FROM generate_series(1, 5000) g" >/dev/null
until [ "$(psql -c "SELECT count(*) FROM outbox.ledger WHERE effect_key LIKE 'plain-%'")" -ge 5000 ]; do
  sleep 0.02
done
end=$(date +%s.%N)
echo "ordering_backlog $N $WHAT${PAUSE_KEYED:+ (their channel paused)}, $held of them held at the start: 5000 plain messages of another channel delivered in $(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.2f", b - a }') s"
if [ -n "${STATEMENTS:-}" ]; then
  psql -c "SELECT round(total_exec_time)::int || ' ms | ' || calls || ' calls | ' || round((total_exec_time / calls)::numeric, 2) || ' ms a call | ' || left(regexp_replace(query, '\s+', ' ', 'g'), 80)
             FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT 5"
fi
