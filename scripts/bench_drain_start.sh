#!/usr/bin/env bash
# Where the first milliseconds of a short drain go, on a channel new to the workers (its
# connections still to be opened, as each drain of scripts/bench.sh is) and on the same
# channel drained again right after (its connections open): when the first claim took
# messages, when the first record committed, when 1,000 were delivered, and the drain's
# rate. The drain is watched from the server by a loop that looks every 2 ms (the channel's
# counter and the claims in flight), on the server's clock from just before the resume's
# call; that loop shares the cores with the drain, and its rates run a little below
# bench.sh's. Figures only; nothing is asserted. Runs on a throwaway cluster (port 54849).
# Usage: scripts/bench_drain_start.sh [backlog = 10000] [rounds = 3]
#   OUTBOX_WORKERS (2), BATCH (outbox.batch_size, 200)
source "$(dirname "$0")/lib.sh"
N=${1:-10000}
ROUNDS=${2:-3}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_drain_start}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54849}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
export OUTBOX_EXTRA_CONF="outbox.batch_size = ${BATCH:-200}"
SINK_PORT=${SINK_PORT:-18808}

bash scripts/setup.sh >/dev/null
bash scripts/cluster.sh install >/dev/null
start_quiet_sink "$SINK_PORT"
psql() { bash scripts/cluster.sh psql -qAt "$@"; }
fresh_cluster >/dev/null
workers_ready

# One drain of channel $1, its backlog loaded and settled first (as bench.sh does); prints
# "first claim, first record, 1,000 delivered (ms after the resume's call), msg/s".
drain() {
  local ch=$1 before
  psql -c "SELECT outbox.pause_channel('$ch', 'loading the backlog')" >/dev/null
  psql -c "SELECT count(outbox.enqueue('$ch', jsonb_build_object('n', g, 'text', 'benchmark message'),
                                       '$ch:' || g || ':' || clock_timestamp()::text))
             FROM generate_series(1, $N) g" >/dev/null
  psql -c "VACUUM ANALYZE outbox._messages" -c "CHECKPOINT" >/dev/null
  before=$(psql -c "SELECT coalesce((SELECT s.delivered_total FROM outbox._channel_stats s
                      JOIN outbox._channels c ON c.id = s.channel_id WHERE c.name = '$ch'), 0)")
  # One session: the resume (committed by itself, so that it wakes the workers), then the
  # looks, each statement of the loop under a snapshot of its own.
  psql -F ' ' -c "CREATE TEMP TABLE looks (ms float8, delivered bigint, first_claim_ms float8)" \
    -c "CREATE TEMP TABLE resumed AS SELECT clock_timestamp() AS at" \
    -c "SELECT outbox.resume_channel('$ch')" -c "
      DO \$\$
      DECLARE t0 timestamptz := (SELECT at FROM resumed); d bigint;
      BEGIN
        LOOP
          d := coalesce((SELECT s.delivered_total FROM outbox._channel_stats s
                          JOIN outbox._channels c ON c.id = s.channel_id WHERE c.name = '$ch'), 0) - $before;
          INSERT INTO looks
          SELECT extract(epoch FROM clock_timestamp() - t0) * 1000, d,
                 (SELECT extract(epoch FROM min(w.started_at) - t0) * 1000 FROM outbox._claims w
                   JOIN outbox._channels c ON c.id = w.channel_id WHERE c.name = '$ch');
          EXIT WHEN d >= $N;
          PERFORM pg_sleep(0.002);
        END LOOP;
      END \$\$" -c "
      SELECT round(min(first_claim_ms)::numeric, 1), round(min(ms) FILTER (WHERE delivered > 0)::numeric, 1),
             round(min(ms) FILTER (WHERE delivered >= least(1000, $N))::numeric, 1),
             round($N / (max(ms) / 1000))
        FROM looks"
}

echo "drain of $N: first claim ms | first record ms | 1,000 delivered ms | msg/s"
for r in $(seq 1 "$ROUNDS"); do
  ch="start_$r"
  psql -c "SELECT outbox.create_channel('$ch', 'http://127.0.0.1:$SINK_PORT/ch/$ch', '{\"max_in_flight\": 512, \"max_unverifiable_in_flight\": 512, \"external_id\": \"/id\"}'::jsonb)" >/dev/null 2>&1
  echo "round $r, a new channel:     $(drain "$ch" | tail -n1 | tr ' ' '|' | sed 's/|/ | /g')"
  echo "round $r, the same again:    $(drain "$ch" | tail -n1 | tr ' ' '|' | sed 's/|/ | /g')"
done
