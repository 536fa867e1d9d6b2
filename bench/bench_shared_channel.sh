#!/usr/bin/env bash
# Two tenants share a rate-limited channel: how long the quiet tenant's messages wait
# (enqueue → request, from the ledger) while the busy tenant has a backlog of N queued, next
# to the same figure with no backlog, in alternating rounds. A claim takes a shared
# channel's tenants in turn (src/worker/lane_turns.rs): the backlog should add about one
# turn. Figures only; nothing is asserted. Runs on a throwaway cluster (port 54852,
# simulator on 18852).
# Usage: bench/bench_shared_channel.sh [N = 10000] [ROUNDS = 2]
#   RATE: the channel's rate limit per second (500); SAMPLES: the quiet tenant's messages
#   per round (100, one every 50 ms).
source "$(dirname "$0")/../scripts/lib.sh"
N=${1:-10000}
ROUNDS=${2:-2}
RATE=${RATE:-500}
SAMPLES=${SAMPLES:-100}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_shared}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54852}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
SINK_PORT=18852
start_drain_bench $SINK_PORT
psql() { bash scripts/cluster.sh psql -qAt "$@"; }
run_statements "SET client_min_messages = warning;
SELECT outbox.create_channel('shared', 'http://127.0.0.1:$SINK_PORT/ch/shared',
       '{\"rate_limit\": {\"per_second\": $RATE, \"burst\": 50}, \"max_in_flight\": 512}');"

# Waits until no message of the channel is queued or in flight (at most 10 minutes).
drained() {
  for _ in $(seq 1 1200); do
    [ "$(psql -c "SELECT count(*) FROM outbox._messages WHERE state IN ('queued', 'sending')")" = 0 ] && return 0
    sleep 0.5
  done
  echo "the channel did not drain" >&2; return 1
}

# One round: $1 the busy tenant's backlog. Prints the quiet tenant's p50, p99 and max (ms)
# and how many of the backlog were still queued when its last message went out.
round() {
  local tag backlog=$1
  tag=r$RANDOM$RANDOM
  if [ "$backlog" -gt 0 ]; then
    psql -c "SET outbox.tenant = 'busy';
             SELECT count(outbox.enqueue('shared', '{}', 'b-$tag-' || g)) FROM generate_series(1, $backlog) g" >/dev/null
  fi
  for i in $(seq 1 "$SAMPLES"); do
    psql -c "SET outbox.tenant = 'quiet'; SELECT outbox.enqueue('shared', '{}', 'q-$tag-$i')" >/dev/null
    sleep 0.05
  done
  for _ in $(seq 1 600); do
    [ "$(psql -c "SELECT count(*) FROM outbox._ledger WHERE tenant = 'quiet' AND effect_key LIKE 'q-$tag-%'")" = "$SAMPLES" ] && break
    sleep 0.1
  done
  local left
  left=$(psql -c "SELECT count(*) FROM outbox._messages WHERE tenant = 'busy' AND effect_key LIKE 'b-$tag-%' AND state = 'queued'")
  psql -F ' ' -c "
    SELECT round(percentile_cont(0.5) WITHIN GROUP (ORDER BY w)), round(percentile_cont(0.99) WITHIN GROUP (ORDER BY w)),
           round(max(w)), count(*)
      FROM (SELECT extract(epoch FROM attempt_started_at - created_at) * 1000 AS w
              FROM outbox._ledger WHERE tenant = 'quiet' AND effect_key LIKE 'q-$tag-%') s" |
    while read -r p50 p99 max n; do
      printf '%-34s p50 %5s ms   p99 %5s ms   max %5s ms   (%s of %s delivered; %s of the backlog still queued after)\n' \
        "quiet tenant, busy backlog $backlog" "$p50" "$p99" "$max" "$n" "$SAMPLES" "$left"
    done
  drained
}

echo "== two tenants on one channel limited to $RATE/s: the quiet tenant's wait, enqueue -> request"
for r in $(seq 1 "$ROUNDS"); do
  echo "-- round $r"
  round 0
  round "$N"
done
