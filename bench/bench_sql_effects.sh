#!/usr/bin/env bash
# Drains into a `sql` effect of two builds, side by side in one run: each build installed
# into a private copy of PostgreSQL of its own (scripts/pg_prefix.sh create P; cargo pgrx
# install --release --pg-config P/lib/postgresql/15/bin/pg_config). Round by round, the
# builds alternate: a fresh cluster on the build's prefix, the application's side of the
# effect (a table, a function that inserts into it and returns the new id, the role it
# runs as), a backlog enqueued on a paused `sql` channel, VACUUM ANALYZE, CHECKPOINT, then
# the channel resumed and drained by the workers. Per drain: deliveries/s, the workers' CPU
# a message, and how many effects the application's table holds (the backlog, when every
# effect ran). Figures only; nothing is asserted. Runs on a throwaway cluster (port 54832).
# Usage: bench/bench_sql_effects.sh OLD_PREFIX NEW_PREFIX [backlog=10000] [rounds=4]
source "$(dirname "$0")/../scripts/lib.sh"
OLD=${1:?usage: bench/bench_sql_effects.sh OLD_PREFIX NEW_PREFIX [backlog] [rounds]}
NEW=${2:?usage: bench/bench_sql_effects.sh OLD_PREFIX NEW_PREFIX [backlog] [rounds]}
N=${3:-10000}
ROUNDS=${4:-4}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_sql_effects}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54832}
export OUTBOX_WORKERS=2
export OUTBOX_EXTRA_CONF="outbox.batch_size = 200"
require_prefixes "$OLD" "$NEW"
trap 'bash scripts/cluster.sh destroy >/dev/null 2>&1 || true' EXIT
psql() { bash scripts/cluster.sh psql -qAt "$@"; }
TICK_US=$((1000000 / $(getconf CLK_TCK)))

echo "machine: $(nproc) cores; $OUTBOX_WORKERS delivery workers, batch 200; backlog $N; $ROUNDS rounds, builds alternating"
echo "old: $OLD"
echo "new: $NEW"
for round in $(seq "$ROUNDS"); do
  for side in old new; do
    if [ "$side" = old ]; then prefix=$OLD; else prefix=$NEW; fi
    export OUTBOX_PGBIN=$prefix/lib/postgresql/15/bin
    fresh_cluster >/dev/null
    workers_ready
    psql -v ON_ERROR_STOP=1 >/dev/null <<'SQL'
SET client_min_messages = warning;
CREATE SCHEMA bench_app;
CREATE TABLE bench_app.effects (id bigserial PRIMARY KEY, effect_key text NOT NULL, payload jsonb NOT NULL);
CREATE ROLE bench_effects NOLOGIN;
GRANT USAGE ON SCHEMA bench_app TO bench_effects;
GRANT INSERT ON bench_app.effects TO bench_effects;
-- RETURNING reads the id it returns.
GRANT SELECT (id) ON bench_app.effects TO bench_effects;
GRANT USAGE ON SEQUENCE bench_app.effects_id_seq TO bench_effects;
CREATE FUNCTION bench_app.record(payload jsonb, effect_key text) RETURNS text LANGUAGE sql AS
  $f$ INSERT INTO bench_app.effects (effect_key, payload) VALUES (effect_key, payload) RETURNING 'effect-' || id $f$;
GRANT EXECUTE ON FUNCTION bench_app.record(jsonb, text) TO bench_effects;
SELECT outbox.create_channel('effects', 'sql', '{"kind": "sql", "function": "bench_app.record", "run_as": "bench_effects", "max_in_flight": 512, "tenants": ["*"]}');
SELECT outbox.pause_channel('effects', 'loading the backlog');
SQL
    psql -c "SELECT count(outbox.enqueue('effects', jsonb_build_object('n', g, 'text', 'benchmark message'), 'k:' || g)) FROM generate_series(1, $N) g" >/dev/null
    psql -c "VACUUM ANALYZE outbox._messages" >/dev/null
    psql -c "CHECKPOINT" >/dev/null
    read -r -a cpu0 <<<"$(workers_cpu_ticks)"
    t0=$(date +%s%N)
    psql -c "SELECT outbox.resume_channel('effects')" >/dev/null
    # Until nothing is queued or under way: a failed effect ends its message too.
    psql -c "DO \$\$ BEGIN WHILE EXISTS (SELECT 1 FROM outbox._messages WHERE state = 'queued') LOOP PERFORM pg_sleep(0.005); END LOOP; END \$\$"
    t1=$(date +%s%N)
    read -r -a cpu1 <<<"$(workers_cpu_ticks)"
    echo "round $round $side: $((N * 1000000000 / (t1 - t0))) msg/s;" \
         "workers $(((cpu1[0] + cpu1[1] - cpu0[0] - cpu0[1]) * TICK_US / N)) µs a message;" \
         "effects $(psql -c "SELECT count(*) FROM bench_app.effects") of $N"
  done
done
