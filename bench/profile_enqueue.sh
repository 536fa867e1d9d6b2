#!/usr/bin/env bash
# Where the CPU of an enqueue goes, counted in instructions rather than timed: a
# single-user backend runs under callgrind (valgrind) one prepared statement, executed
# SMALL and then LARGE times, each execution a transaction of its own (as pgbench -M
# prepared sends it, without the client and the socket); the difference of the two counts,
# divided by LARGE - SMALL, is the cost of one committed call without the backend's
# start-up. The counts hardly move from run to run, unlike the pgbench ratios, which move
# by 0.15 here.
#
# Statements, each into a table of PREFILL rows:
#   insert              the benchmark's baseline: a plain INSERT of the row into a table
#                       of the same shape and indexes (LIKE outbox._messages INCLUDING ALL)
#   insert_on_conflict  the same INSERT with ON CONFLICT (tenant, effect_key) DO NOTHING,
#                       which enqueue's own INSERT carries
#   enqueue             SELECT outbox.enqueue(...) as the superuser
#   enqueue_as_writer   the same as a login role in outbox_writer bound to a tenant
#   insert_c, insert_on_conflict_c
#                       the first two into a copy whose tenant and effect_key are
#                       COLLATE "C" (the cluster's collation is C.UTF-8)
# Then, for the first three, the instructions of one call spent under a few functions.
# Figures only; nothing is asserted. Runs on a throwaway cluster (port 54822).
# Usage: bench/profile_enqueue.sh   (SMALL 200, LARGE 1200, PREFILL 300000)
source "$(dirname "$0")/../scripts/lib.sh"
SMALL=${SMALL:-200}
LARGE=${LARGE:-1200}
PREFILL=${PREFILL:-300000}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_profile_enqueue}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54822}
export OUTBOX_WORKERS=1 OUTBOX_EXTRA_CONF=
PGDATA=$OUTBOX_BASE/pgdata

bash scripts/setup.sh >/dev/null
command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind >/dev/null; }
bash scripts/cluster.sh install >/dev/null
fresh_cluster >/dev/null
trap 'bash scripts/cluster.sh stop >/dev/null 2>&1 || true' EXIT
psql() { bash scripts/cluster.sh psql -qAt "$@"; }

# The same row in every statement; a fresh effect key in every call.
ROW="'default', 1, md5(random()::text || clock_timestamp()::text), '{\"to\": \"user-1\", \"text\": \"benchmark message\"}'::jsonb, now()"
COLUMNS="tenant, channel_id, effect_key, payload, next_attempt_at"
psql >/dev/null <<SQL
SELECT outbox.create_channel('bench_enqueue', 'http://127.0.0.1:9/x');
SELECT outbox.pause_channel('bench_enqueue', 'enqueue profile: nothing is sent');
CREATE ROLE bench_writer LOGIN IN ROLE outbox_writer;
SELECT outbox.bind_tenant('bench_writer', 'default');
INSERT INTO outbox._messages ($COLUMNS)
SELECT 'default', c.id, md5(i::text), '{"to": "user-1", "text": "benchmark message"}', now()
  FROM generate_series(1, $PREFILL) i, outbox._channels c WHERE c.name = 'bench_enqueue';
CREATE TABLE public.plain_outbox (LIKE outbox._messages INCLUDING ALL);
CREATE TABLE public.plain_outbox_c (LIKE outbox._messages INCLUDING ALL);
ALTER TABLE public.plain_outbox_c ALTER COLUMN tenant TYPE text COLLATE "C",
                                  ALTER COLUMN effect_key TYPE text COLLATE "C";
INSERT INTO public.plain_outbox SELECT * FROM outbox._messages;
INSERT INTO public.plain_outbox_c SELECT * FROM outbox._messages;
CREATE SEQUENCE public.plain_outbox_seq START $((PREFILL + 1));
ALTER TABLE public.plain_outbox ALTER COLUMN id SET DEFAULT nextval('public.plain_outbox_seq');
ALTER TABLE public.plain_outbox_c ALTER COLUMN id SET DEFAULT nextval('public.plain_outbox_seq');
VACUUM ANALYZE;
SQL

declare -A statement=(
  [insert]="INSERT INTO public.plain_outbox ($COLUMNS) VALUES ($ROW)"
  [insert_on_conflict]="INSERT INTO public.plain_outbox ($COLUMNS) VALUES ($ROW) ON CONFLICT (tenant, effect_key) DO NOTHING"
  [insert_c]="INSERT INTO public.plain_outbox_c ($COLUMNS) VALUES ($ROW)"
  [insert_on_conflict_c]="INSERT INTO public.plain_outbox_c ($COLUMNS) VALUES ($ROW) ON CONFLICT (tenant, effect_key) DO NOTHING"
  [enqueue]="SELECT outbox.enqueue('bench_enqueue', '{\"to\": \"user-1\", \"text\": \"benchmark message\"}'::jsonb, md5(random()::text || clock_timestamp()::text))"
)
statement[enqueue_as_writer]=${statement[enqueue]}
bash scripts/cluster.sh stop >/dev/null

OUT=$(mktemp -d)
chmod 777 "$OUT"
# callgrind of a single-user backend executing `label`'s statement n times (as `role` if
# given); every line it reads is a transaction of its own.
profile() { # label, n, role
  {
    echo "SET synchronous_commit = off"
    [ -n "${3:-}" ] && echo "SET ROLE $3"
    echo "PREPARE measured AS ${statement[$1]}"
    for _ in $(seq "$2"); do echo "EXECUTE measured"; done
  } | runuser -u postgres -- valgrind --tool=callgrind --callgrind-out-file="$OUT/$1.$2" \
      /usr/lib/postgresql/15/bin/postgres --single -D "$PGDATA" outbox >"$OUT/$1.$2.stdout" 2>"$OUT/$1.$2.err"
  if grep -q ERROR "$OUT/$1.$2.stdout"; then cat "$OUT/$1.$2.stdout" >&2; exit 1; fi
}
# Instructions per call under each function (inclusive), or in all: "count<TAB>function".
per_call() { # label
  f() {
    callgrind_annotate --inclusive=yes --threshold=100 "$OUT/$1.$2" 2>/dev/null |
      grep -E '^ *[0-9,]+ \(' | sed -E 's/ \[.*\]//; s/^ *([0-9,]+) \( *[0-9.]+%\) +(\?\?\?:)?/\1\t/; s/,//g' |
      sort -t $'\t' -k2,2
  }
  join -t $'\t' -1 2 -2 2 <(f "$1" "$LARGE") <(f "$1" "$SMALL") |
    awk -F'\t' -v n=$((LARGE - SMALL)) '{ printf "%d\t%s\n", ($2 - $3) / n, $1 }'
}

echo "instructions per committed call (callgrind; $LARGE calls minus $SMALL), $PREFILL rows in each table, synchronous_commit off"
declare -A total
for spec in insert insert_on_conflict enqueue "enqueue_as_writer bench_writer" insert_c insert_on_conflict_c; do
  set -- $spec
  profile "$1" "$SMALL" "${2:-}"
  profile "$1" "$LARGE" "${2:-}"
  per_call "$1" >"$OUT/$1.per_call"
  total[$1]=$(awk -F'\t' '$2 == "PROGRAM TOTALS" { print $1 }' "$OUT/$1.per_call")
  base=${total[insert]}; [[ $1 == *_c ]] && base=${total[insert_c]}
  awk -v l="$1" -v t="${total[$1]}" -v b="$base" 'BEGIN { printf "  %-22s %8d  (%.2fx %s)\n", l, t, t / b, (l ~ /_c$/ ? "insert_c" : "insert") }'
done

echo "where they go (instructions per call under each function, inclusive)"
printf '  %-34s %10s %20s %10s\n' function insert insert_on_conflict enqueue
for fn in PortalStart ExecutorStart ExecutorRun ExecInsertIndexTuples ExecCheckIndexConstraints \
  SpeculativeInsertionLockAcquire heap_finish_speculative bttextcmp XLogInsert \
  CommitTransactionCommand PortalDrop outbox_enqueue SPI_execute_plan; do
  printf '  %-34s' "$fn"
  for l in insert insert_on_conflict enqueue; do
    v=$(awk -F'\t' -v f="$fn" '$2 == f { print $1 }' "$OUT/$l.per_call")
    printf ' %*s' $([ $l = insert_on_conflict ] && echo 20 || echo 10) "${v:--}"
  done
  echo
done
echo "  (a SELECT starts its executor in PortalStart and ends it in PortalDrop, an INSERT in PortalRun;"
echo "   outbox_enqueue is the C function; SPI_execute_plan, inside it, is its INSERT … ON CONFLICT)"
rm -rf "$OUT"
