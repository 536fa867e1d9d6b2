#!/usr/bin/env bash
# How much of a short drain's measured time is the wait for someone to see that it ended.
# A poll every 20 ms (then a look for anything still queued or in flight), as bench/bench.sh
# timed drains until it began to look every millisecond near a drain's end: a drain of
# 10,000 lasts about a third of a second, so that wait weighs in its rate. Each drain here
# is timed both ways on the server's clock: to the poll that saw its end,
# and to the start of its last record's transaction (`recorded_at` of its newest ledger
# entry; that transaction commits a few milliseconds later, so this figure is the upper
# bound). Figures only; nothing is asserted. Runs on a throwaway cluster (port 54847).
# Usage: bench/bench_drain_end.sh [backlog = 10000] [drains = 6]
#   OUTBOX_WORKERS (2), BATCH (outbox.batch_size, 200)
source "$(dirname "$0")/../scripts/lib.sh"
N=${1:-10000}
DRAINS=${2:-6}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_drain_end}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54847}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
export OUTBOX_EXTRA_CONF="outbox.batch_size = ${BATCH:-200}"
SINK_PORT=${SINK_PORT:-18807}

psql() { bash scripts/cluster.sh psql -qAt "$@"; }
start_drain_bench "$SINK_PORT"

echo "drain of $N: msg/s to the poll that saw its end | to its last record | the poll's wait (ms)"
polled="" recorded="" waits=""
for d in $(seq 1 "$DRAINS"); do
  ch="end_$d"
  psql -c "SELECT outbox.create_channel('$ch', 'http://127.0.0.1:$SINK_PORT/ch/$ch', '{\"max_in_flight\": 512, \"max_unverifiable_in_flight\": 512, \"external_id\": \"/id\"}'::jsonb)" \
       -c "SELECT outbox.pause_channel('$ch', 'loading the backlog')" >/dev/null 2>&1
  psql -c "SELECT count(outbox.enqueue('$ch', jsonb_build_object('n', g, 'text', 'benchmark message'), '$ch:' || g)) FROM generate_series(1, $N) g" >/dev/null
  psql -c "VACUUM ANALYZE outbox._messages" -c "CHECKPOINT" >/dev/null
  # One session: the resume, then bench.sh's poll (its two statements, every 20 ms), then
  # the times, all on the server's clock.
  line=$(psql -F ' ' -c "CREATE TEMP TABLE resumed AS SELECT clock_timestamp() AS at" \
    -c "SELECT outbox.resume_channel('$ch')" -c "
      DO \$\$ BEGIN
        LOOP
          EXIT WHEN coalesce((SELECT s.delivered_total FROM outbox._channel_stats s
                               JOIN outbox._channels c ON c.id = s.channel_id WHERE c.name = '$ch'), 0) >= $N
                AND NOT (SELECT EXISTS (SELECT 1 FROM outbox._messages m WHERE m.channel_id = c.id AND m.state = 'queued')
                             OR EXISTS (SELECT 1 FROM outbox._messages m WHERE m.channel_id = c.id AND m.state = 'sending')
                           FROM outbox._channels c WHERE c.name = '$ch');
          PERFORM pg_sleep(0.02);
          PERFORM pg_stat_clear_snapshot();
        END LOOP;
      END \$\$" -c "
      SELECT round($N / extract(epoch FROM clock_timestamp() - r.at)),
             round($N / extract(epoch FROM l.last - r.at)),
             round(extract(epoch FROM clock_timestamp() - l.last) * 1000)
        FROM resumed r,
             (SELECT max(e.recorded_at) AS last FROM outbox._ledger e
                JOIN outbox._channels c ON c.id = e.channel_id WHERE c.name = '$ch') l" | tail -1)
  echo "  $line"
  read -r p r w <<<"$line"
  polled="$polled $p" recorded="$recorded $r" waits="$waits $w"
done
echo "median: $(echo $polled | median) | $(echo $recorded | median) msg/s | $(echo $waits | median) ms"
