#!/usr/bin/env bash
# The worker's claim (crate::worker::claim::CLAIM_DUE) and the ledger lookup it inlines
# (outbox._ledger_entry, sql/ledger.sql) as a revision wrote them beside the tree's, in one
# pgbench run that alternates them (-M prepared, one client, each statement planned as the
# worker plans it: generic, sequential scans and JIT off). Each transaction claims a batch
# from a backlog of 100,000 and rolls back; the claims table is vacuumed between
# transactions, as the workers keep it. The ledger holds 300,000 entries in one
# generation, the other two are empty, as in a drain of the benchmark. pgbench's
# per-statement latencies (-r) give each claim's time. A throwaway cluster (port 54847) with the extension and no worker.
# A revision from before outbox._provider_key and outbox._epoch_ms were functions of the
# library calls its own SQL definitions of them, so that its side costs what it cost then.
# Figures only; nothing is asserted.
# CHANNELS (1) spreads the backlog over that many channels; IN_FLIGHT (0) puts that many of
# each channel's oldest messages in a claim of another worker, which every claim counts and
# passes over.
# Usage: bench/bench_claim_statement.sh [revision = HEAD] [seconds = 30] [batch = 200]
source "$(dirname "$0")/../scripts/lib.sh"
REV=${1:-HEAD}
SECONDS_RUN=${2:-30}
BATCH=${3:-200}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_claim_statement}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54847}
export OUTBOX_WORKERS=0
bash scripts/setup.sh >/dev/null
bash scripts/cluster.sh install >/dev/null
fresh_cluster >/dev/null
trap 'bash scripts/cluster.sh destroy >/dev/null 2>&1 || true' EXIT
P() { bash scripts/cluster.sh psql -qAt "$@"; }
CHANNELS=${CHANNELS:-1}
IN_FLIGHT=${IN_FLIGHT:-0}
P -c "SELECT count(outbox.create_channel('claim' || c, 'http://127.0.0.1:9/x', '{\"max_in_flight\": 512, \"max_unverifiable_in_flight\": 512}'))
        FROM generate_series(1, $CHANNELS) c" >/dev/null 2>&1
P -c "SELECT count(outbox.enqueue('claim' || (g % $CHANNELS + 1), jsonb_build_object('n', g, 'text', 'benchmark message'), 'k:' || g))
        FROM generate_series(1, 100000) g" >/dev/null
P -c "INSERT INTO outbox._claims (channel_id, lease_owner, worker_pid, lease_until, started_at, message_ids)
      SELECT m.channel_id, 1, 2, now() + interval '1 day', now(), array_agg(m.id ORDER BY m.id)
        FROM (SELECT id, channel_id, row_number() OVER (PARTITION BY channel_id ORDER BY id) AS n FROM outbox._messages) m
       WHERE m.n <= $IN_FLIGHT GROUP BY m.channel_id" >/dev/null
P -c "INSERT INTO outbox._ledger (tenant, effect_key, message_id, recorded_by, generation)
      SELECT 'default', 'd:' || g, 10000000 + g, 'worker', 0 FROM generate_series(1, 300000) g" >/dev/null
P -c "VACUUM ANALYZE" -c "CHECKPOINT" >/dev/null

DIR=$(mktemp -d)
# The claim's text in src/worker/claim.rs and the lookup's in sql/ledger.sql (from `git show
# REV:…`, or the tree's). The lookup is created under a name of its own for each side,
# which that side's claim calls; the claim's parameters are filled in.
git show "$REV:src/worker/claim.rs" >"$DIR/claim_rev.rs"
git show "$REV:sql/ledger.sql" >"$DIR/ledger_rev.sql"
# The revision's SQL definitions of the provider key and of a time in milliseconds, where
# it had them, under names of their own (_provider_key_rev, _epoch_ms_rev).
git show "$REV:sql/tenancy.sql" | python3 -c '
import sys
s, out = sys.stdin.read(), sys.argv[1]
for name in ("_provider_key", "_epoch_ms"):
    start = s.find("CREATE FUNCTION outbox." + name + "(")
    if start < 0:
        continue
    end = s.index("\nEND;", start) + len("\nEND;")
    open(f"{out}/{name}_rev.sql", "w").write(s[start:end].replace("outbox." + name + "(", "outbox." + name + "_rev(", 1) + "\n")
' "$DIR"
for f in "$DIR"/_provider_key_rev.sql "$DIR"/_epoch_ms_rev.sql; do
  if [ -f "$f" ]; then P <"$f" >/dev/null; fi
done
cp src/worker/claim.rs "$DIR/claim_tree.rs"
cp sql/ledger.sql "$DIR/ledger_tree.sql"
for which in rev tree; do
  python3 - "$DIR/claim_$which.rs" "$DIR/ledger_$which.sql" "$which" "$BATCH" "$DIR/$which.fn" >"$DIR/$which.sql" <<'PY'
import os, re, sys
claim_rs, ledger_sql, which, batch, fn_path = sys.argv[1:]
src = open(claim_rs).read()
start = src.index('static CLAIM_DUE')
body = src[src.index('"', start) + 1:src.index('");', start)]
body = re.sub(r'--[^\n]*', '', body)
body = body.replace('outbox._ledger_entry(', f'outbox._ledger_entry_{which}(')
# A revision whose times and provider keys were SQL functions (sql/tenancy.sql before they
# moved into the library) calls its own copies of them (created below).
for name in ('_provider_key', '_epoch_ms'):
    if which == 'rev' and os.path.exists(f'{os.path.dirname(claim_rs)}/{name}_rev.sql'):
        body = body.replace(f'outbox.{name}(', f'outbox.{name}_rev(')
# $1..$4 stay parameters (pgbench's variables, sent as parameters with -M prepared), so
# that the statement is planned as the worker plans it; the positions and caps ($5..$9)
# are empty arrays.
values = [':batch', ':lease_ms', ':owner', ':pid', "'{}'", "'{}'", "'{}'", "'{}'", "'{}'"]
body = re.sub(r'\$(\d+)(?!\d)', lambda m: values[int(m.group(1)) - 1], body)
print(f'\\set batch {batch}')
print('\\set lease_ms 60000')
print('\\set owner 0')
print('\\set pid 1')
print('BEGIN;')
print(' '.join(body.split()) + ';')
print('ROLLBACK;')
print('VACUUM outbox._claims;')
ledger = open(ledger_sql).read()
fn = ledger[ledger.index('CREATE FUNCTION outbox._ledger_entry('):]
fn = fn[:fn.index('$fn$;') + len('$fn$;')]
open(fn_path, 'w').write(fn.replace('outbox._ledger_entry(', f'outbox._ledger_entry_{which}(', 1) + '\n')
PY
  P <"$DIR/$which.fn" >/dev/null
done
chmod -R a+rX "$DIR"
SOCK=$OUTBOX_BASE/sock
echo "claim of $BATCH from a backlog of 100,000 on $CHANNELS channel(s), $IN_FLIGHT of each in flight, $REV ($(git rev-parse --short "$REV")) beside the tree, alternated by pgbench for ${SECONDS_RUN} s:"
PGOPTIONS="-c plan_cache_mode=force_generic_plan -c enable_seqscan=off -c jit=off" runuser -u postgres -- /usr/lib/postgresql/15/bin/pgbench -h "$SOCK" -p "$OUTBOX_PGPORT" -n -M prepared -r \
    -c 1 -T "$SECONDS_RUN" -f "$DIR/rev.sql@1" -f "$DIR/tree.sql@1" \
    outbox 2>&1 |
  awk -v batch="$BATCH" '/^SQL script [0-9]+:/ { script = ($3 == "1:") ? "'"$REV"'" : "tree" }
       /^ - [0-9]+ transactions/ { n[script] = $2 }
       /^ +[0-9.]+ +[0-9]+ +WITH flying/ { ms[script] = $1 }
       END { for (s in ms) printf "  %-8s %s ms a claim (%.2f us a message), %s transactions\n", s, ms[s], ms[s] * 1000 / batch, n[s] }'
rm -rf "$DIR"
