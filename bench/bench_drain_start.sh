#!/usr/bin/env bash
# Where the first milliseconds of a short drain go, on a channel new to the workers (its
# connections still to be opened, as each drain of bench/bench.sh is) and on the same
# channel drained again right after (its connections open): when the first claim took
# messages, when the first record began, when the record of the 1,000th message began,
# and the drain's rate to the start of its last record. Every time is the server's own,
# from the resume's transaction (its `outbox.operator_log` row): the claims' times as the
# ledger keeps them (`attempt_started_at`) and the records' (`recorded_at`, when each
# record's transaction began), so nothing looks at the drain while it starts; a look
# every 20 ms waits for its end. Figures only; nothing is asserted. Runs on a throwaway
# cluster (port 54849).
# Usage: bench/bench_drain_start.sh [backlog = 10000] [rounds = 3]
#   OUTBOX_WORKERS (2), BATCH (outbox.batch_size, 200)
source "$(dirname "$0")/../scripts/lib.sh"
# A statement that fails inside `$(drain …)` stops the script, not only the substitution.
shopt -s inherit_errexit
N=${1:-10000}
ROUNDS=${2:-3}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_drain_start}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54849}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
export OUTBOX_EXTRA_CONF="outbox.batch_size = ${BATCH:-200}"
SINK_PORT=${SINK_PORT:-18808}

psql() { bash scripts/cluster.sh psql -qAt "$@"; }
start_drain_bench "$SINK_PORT"

# One drain of channel $1, its backlog loaded and settled first (as bench.sh does); prints
# "first claim | first record | the 1,000th message's record (ms after the resume) | msg/s".
drain() {
  local ch=$1 before
  psql -c "SELECT outbox.pause_channel('$ch', 'loading the backlog')" >/dev/null
  psql -c "SELECT count(outbox.enqueue('$ch', jsonb_build_object('n', g, 'text', 'benchmark message'),
                                       '$ch:' || g || ':' || clock_timestamp()::text))
             FROM generate_series(1, $N) g" >/dev/null
  psql -c "VACUUM ANALYZE outbox._messages" -c "CHECKPOINT" >/dev/null
  # The ledger entries of this drain: its messages' ids come after every earlier one's.
  before=$(psql -c "SELECT coalesce(max(message_id), 0) FROM outbox._ledger")
  psql -c "SELECT outbox.resume_channel('$ch')" -c "
      DO \$\$ BEGIN
        FOR i IN 1 .. 3000 LOOP
          IF NOT EXISTS (SELECT 1 FROM outbox._messages m JOIN outbox._channels c ON c.id = m.channel_id
                          WHERE c.name = '$ch' AND m.state = 'queued') THEN
            RETURN;
          END IF;
          PERFORM pg_sleep(0.02);
        END LOOP;
        RAISE EXCEPTION 'the drain of $ch did not end within 60 s';
      END \$\$" -c "
      WITH resumed AS (
          SELECT max(o.at) AS at FROM outbox._operator_log o
           WHERE o.action = 'resume_channel' AND o.channel = '$ch'
      ), moved AS (
          SELECT l.attempt_started_at, l.recorded_at,
                 row_number() OVER (ORDER BY l.recorded_at) AS nth
            FROM outbox._ledger l JOIN outbox._channels c ON c.id = l.channel_id
           WHERE c.name = '$ch' AND l.message_id > $before
      )
      SELECT round(extract(epoch FROM min(m.attempt_started_at) - r.at)::numeric * 1000, 1),
             round(extract(epoch FROM min(m.recorded_at) - r.at)::numeric * 1000, 1),
             round(extract(epoch FROM min(m.recorded_at) FILTER (WHERE m.nth = least(1000, $N)) - r.at)::numeric * 1000, 1),
             round(count(*) / extract(epoch FROM max(m.recorded_at) - r.at)::numeric)
        FROM moved m, resumed r GROUP BY r.at"
}

echo "drain of $N: first claim | first record | the 1,000th message's record (ms after the resume) | msg/s to the last record"
for r in $(seq 1 "$ROUNDS"); do
  ch="start_$r"
  psql -c "SELECT outbox.create_channel('$ch', 'http://127.0.0.1:$SINK_PORT/ch/$ch', '{\"max_in_flight\": 512, \"max_unverifiable_in_flight\": 512, \"external_id\": \"/id\"}'::jsonb)" >/dev/null 2>&1
  echo "round $r, a new channel:     $(drain "$ch" | tail -n1 | sed 's/|/ | /g')"
  echo "round $r, the same again:    $(drain "$ch" | tail -n1 | sed 's/|/ | /g')"
done
