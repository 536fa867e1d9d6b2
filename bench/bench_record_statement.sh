#!/usr/bin/env bash
# The worker's record of confirmed deliveries (crate::ledger::RECORD_SENT) as a revision
# wrote it beside the tree's, in one pgbench run that alternates them (-M prepared, one
# client, each statement planned as the worker plans it: generic). Each transaction puts
# 200 messages in flight by a plain INSERT (queued, no attempt counted yet: attempt 1 is
# under way), then records them with one statement or the other; pgbench's per-statement
# latencies (-r) give each record's time. A revision from before claims (outbox._claims),
# whose record looked for `sending` rows, records none of them here. A throwaway cluster (port 54846) with the extension; its channel stays paused.
# Figures only; nothing is asserted.
# Usage: bench/bench_record_statement.sh [revision = HEAD] [seconds = 30]
source "$(dirname "$0")/../scripts/lib.sh"
REV=${1:-HEAD}
SECONDS_RUN=${2:-30}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_record_statement}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54846}
export OUTBOX_WORKERS=1
bash scripts/setup.sh >/dev/null
bash scripts/cluster.sh install >/dev/null
fresh_cluster >/dev/null
trap 'bash scripts/cluster.sh destroy >/dev/null 2>&1 || true' EXIT
P() { bash scripts/cluster.sh psql -qAt "$@"; }
P -c "SELECT outbox.create_channel('record', 'http://127.0.0.1:9/x')" \
  -c "SELECT outbox.pause_channel('record', 'records measured in SQL: nothing is sent')" >/dev/null 2>&1
CHANNEL_ID=$(P -c "SELECT id FROM outbox._channels WHERE name = 'record'")

DIR=$(mktemp -d)
# The statement's text in src/ledger.rs (from `git show REV:src/ledger.rs`, or the tree's),
# its parameters $1..$8 named for pgbench (the claims found every key unrecorded).
statement() {
  python3 - "$1" <<'PY'
import sys
src = open(sys.argv[1]).read()
start = src.index('static RECORD_SENT')
body = src[src.index('"', start) + 1:src.index('",\n);', start)]
for n, name in reversed(list(enumerate(['ids', 'attempts', 'external_ids', 'statuses', 'outcomes', 'written', 'started', 'unrecorded'], 1))):
    body = body.replace(f'${n}::', f':{name}::')
print(body.strip() + ';')
PY
}
git show "$REV:src/ledger.rs" >"$DIR/ledger_rev.rs"
for which in rev tree; do
  src=$DIR/ledger_rev.rs
  [ $which = tree ] && src=src/ledger.rs
  {
    echo "WITH ins AS (INSERT INTO outbox._messages (tenant, channel_id, state, effect_key, payload, attempts, attempt_started_at, attempt_pid)"
    echo "             SELECT 'default', $CHANNEL_ID, 'queued', md5(random()::text || g), '{\"n\": 1}', 0, NULL, NULL"
    echo "               FROM generate_series(1, 200) g RETURNING id)"
    echo "SELECT array_agg(id)::text AS ids, array_fill(1, ARRAY[200])::text AS attempts,"
    echo "       array_fill(NULL::text, ARRAY[200])::text AS external_ids, array_fill(200, ARRAY[200])::text AS statuses,"
    echo "       array_fill('delivered'::text, ARRAY[200])::text AS outcomes, array_fill(false, ARRAY[200])::text AS written,"
    echo "       array_fill((extract(epoch FROM clock_timestamp()) * 1000000)::int8, ARRAY[200])::text AS started,"
    echo "       array_fill(true, ARRAY[200])::text AS unrecorded"
    echo "  FROM ins \\gset"
    statement "$src"
  } >"$DIR/$which.sql"
done
chmod -R a+rX "$DIR"
SOCK=$OUTBOX_BASE/sock
echo "record of 200 confirmed deliveries, $REV ($(git rev-parse --short "$REV")) beside the tree, alternated by pgbench for ${SECONDS_RUN} s:"
PGOPTIONS="-c plan_cache_mode=force_generic_plan" runuser -u postgres -- /usr/lib/postgresql/15/bin/pgbench -h "$SOCK" -p "$OUTBOX_PGPORT" -n -M prepared -r \
    -c 1 -T "$SECONDS_RUN" -f "$DIR/rev.sql@1" -f "$DIR/tree.sql@1" \
    outbox 2>&1 |
  awk '/^SQL script [0-9]+:/ { script = ($3 == "1:") ? "'"$REV"'" : "tree" }
       /^ - [0-9]+ transactions/ { n[script] = $2 }
       /^ +[0-9.]+ +[0-9]+ +WITH d AS/ { ms[script] = $1 }
       /^ +[0-9.]+ +[0-9]+ +WITH ins AS/ { ins[script] = $1 }
       END { for (s in ms) printf "  %-8s %s ms a record (%.1f us a message), %s transactions; the insertion of the 200: %s ms\n", s, ms[s], ms[s] * 1000 / 200, n[s], ins[s] }'
rm -rf "$DIR"
