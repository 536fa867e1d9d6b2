#!/usr/bin/env bash
# Enqueues of larger payloads under each compression the server may give a queue row:
# `pglz` (PostgreSQL's default_toast_compression) and `lz4`, set on the queue's payload
# column for the round, alternated over three rounds. Two kinds of payload, built before
# the rounds and stored uncompressed, as a client sends them: hexadecimal digits (they do
# not compress; a token, an encrypted or encoded attachment) and an order of small JSON
# objects (they compress as JSON does). Prints each round's time for the enqueues and the
# size a payload is stored in, then the time to read every payload back as text. The
# extension itself sets no compression on its columns: the server's setting decides.
# Figures only; nothing is asserted. Runs on a throwaway cluster (port 54848).
# Usage: bench/bench_payload_compression.sh [messages per round = 20000] [payload bytes = 4096]
source "$(dirname "$0")/../scripts/lib.sh"
N=${1:-20000}
BYTES=${2:-4096}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_payload_compression}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54848}
export OUTBOX_WORKERS=0 OUTBOX_EXTRA_CONF=

bash scripts/setup.sh >/dev/null
bash scripts/cluster.sh install >/dev/null
fresh_cluster >/dev/null
trap 'bash scripts/cluster.sh destroy >/dev/null 2>&1 || true' EXIT
psql() { bash scripts/cluster.sh psql -qAt "$@"; }

psql >/dev/null <<SQL
SELECT outbox.create_channel('compression', 'http://127.0.0.1:9/x');
SELECT outbox.pause_channel('compression', 'payload compression benchmark: nothing is sent');
CREATE TABLE public.payloads (kind text, g int, p jsonb);
ALTER TABLE public.payloads ALTER COLUMN p SET STORAGE EXTERNAL;
INSERT INTO public.payloads
SELECT 'hex', g, jsonb_build_object('n', g, 'text', $(payload_items_sql hex "$BYTES")) FROM generate_series(1, $N) g;
INSERT INTO public.payloads
SELECT 'json', g, jsonb_build_object('n', g, 'lines', $(payload_items_sql json "$BYTES")) FROM generate_series(1, $N) g;
SQL
echo "enqueue of $N payloads a round (their text $(psql -c "SELECT string_agg(kind || ' ' || round(avg_text) || ' B', ', ') FROM (SELECT kind, avg(octet_length(p::text)) AS avg_text FROM public.payloads GROUP BY kind ORDER BY kind) s"))"
ms() { psql -c '\timing on' -c "$1" | awk '/^Time:/ { print $2 }'; }
for round in 1 2 3; do
  for kind in hex json; do
    for method in pglz lz4; do
      psql -c "TRUNCATE outbox._messages" \
           -c "ALTER TABLE outbox._messages ALTER COLUMN payload SET COMPRESSION $method" -c "CHECKPOINT" >/dev/null
      enqueue=$(ms "SELECT count(outbox.enqueue('compression', p, 'k:' || g)) FROM public.payloads WHERE kind = '$kind'")
      stored=$(psql -c "SELECT round(avg(pg_catalog.pg_column_size(payload))) || ' B ' || coalesce(min(pg_catalog.pg_column_compression(payload)), 'uncompressed') FROM outbox._messages")
      read=$(ms "SELECT sum(octet_length(payload::text)) FROM outbox._messages")
      printf "  round %d  %-4s  %-4s  enqueue %9.1f ms (%5.1f us a message)  stored %-18s  read back %7.1f ms\n" \
        "$round" "$kind" "$method" "$enqueue" "$(echo "$enqueue $N" | awk '{ print $1 * 1000 / $2 }')" "$stored" "$read"
    done
  done
done
