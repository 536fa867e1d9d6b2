#!/usr/bin/env bash
# The anchors of the delivery benchmark: what a user would otherwise pick, measured on the
# same cluster as the extension.
#   1. the outbox an application writes by hand (a plain table, one process claiming with
#      FOR UPDATE SKIP LOCKED and POSTing to the same simulator): `bench --anchors`, its
#      drains alternated with the extension's, with the WAL of each per message;
#   2. PgQ (postgresql-15-pgq3): its consume rate, a loop of pgq.ticker, pgq.next_batch,
#      pgq.get_batch_events and pgq.finish_batch over a backlog loaded in transactions of
#      PGQ_BATCH with a tick after each (batches of PGQ_BATCH, as outbox.batch_size); no
#      HTTP, so it reads beside the claim-only loop. Its insert rate is one lane of the
#      enqueue rounds of bench/bench.sh (pgq_insert.sql).
# bench/bench.sh sources this file (pgq_setup, handwritten_anchors, pgq_consume,
# anchor_ratios); run alone it starts a throwaway cluster of its own and runs 1 and 2.
# Usage: bench/bench_anchors.sh [backlog=10000] [rounds=3]
# With OUTBOX_PGBIN (a private copy of PostgreSQL, scripts/pg_prefix.sh) the extension and
# PgQ are installed there.
PGQ_BATCH=${PGQ_BATCH:-200}

# PgQ's files in the PostgreSQL of OUTBOX_PGBIN, copied from the Debian package when that
# PostgreSQL is a private copy made before the package was installed.
pgq_into_prefix() {
  [ -n "${OUTBOX_PGBIN:-}" ] || return 0
  local share lib f
  share=$("$OUTBOX_PGBIN/pg_config" --sharedir)
  lib=$("$OUTBOX_PGBIN/pg_config" --pkglibdir)
  [ -f "$share/extension/pgq.control" ] && return 0
  for f in $(dpkg -L postgresql-15-pgq3 | grep -E '/(extension|contrib)/[^/]+\.(sql|control)$|/lib/[^/]+\.so$'); do
    case "$f" in
      /usr/share/postgresql/15/*) cp "$f" "$share/${f#/usr/share/postgresql/15/}" ;;
      /usr/lib/postgresql/15/lib/*) cp "$f" "$lib/" ;;
    esac
  done
}

# PgQ in the benchmark's database: the extension, the queue of the insert lane, the queue
# and consumer of the consume rounds, and the two procedures that load and drain it.
pgq_setup() {
  pgq_into_prefix
  bash scripts/cluster.sh psql -q >/dev/null <<SQL
CREATE EXTENSION IF NOT EXISTS pgq;
SELECT pgq.create_queue('bench_insert');
SELECT pgq.create_queue('bench_consume');
SELECT pgq.set_queue_config('bench_consume', 'ticker_max_count', '$PGQ_BATCH');
SELECT pgq.register_consumer('bench_consume', 'bench');
-- n events in transactions of per_tx, a tick after each: batches of per_tx.
CREATE PROCEDURE public.bench_pgq_load(queue text, n int8, per_tx int8) LANGUAGE plpgsql AS \$\$
DECLARE done int8 := 0;
BEGIN
  WHILE done < n LOOP
    PERFORM pgq.insert_event(queue, 'bench', jsonb_build_object('n', g, 'text', 'benchmark message')::text)
       FROM generate_series(done + 1, least(done + per_tx, n)) g;
    done := least(done + per_tx, n);
    COMMIT;
    PERFORM pgq.ticker(queue);
    COMMIT;
  END LOOP;
END \$\$;
-- A consumer's loop until n events are read (or 300 s pass): tick, next batch, its events,
-- finish, commit.
CREATE PROCEDURE public.bench_pgq_drain(queue text, consumer text, n int8, INOUT consumed int8 DEFAULT 0,
    INOUT batches int8 DEFAULT 0, INOUT seconds float8 DEFAULT 0, INOUT wal_bytes int8 DEFAULT 0)
LANGUAGE plpgsql AS \$\$
DECLARE batch int8; k int8; t0 timestamptz := clock_timestamp(); lsn0 pg_lsn := pg_current_wal_lsn();
BEGIN
  consumed := 0; batches := 0;
  WHILE consumed < n AND clock_timestamp() - t0 < interval '300 s' LOOP
    PERFORM pgq.ticker(queue);
    batch := pgq.next_batch(queue, consumer);
    IF batch IS NOT NULL THEN
      SELECT count(*) INTO k FROM pgq.get_batch_events(batch) e WHERE length(e.ev_data) > 0;
      PERFORM pgq.finish_batch(batch);
      consumed := consumed + k;
      batches := batches + 1;
    END IF;
    COMMIT;
  END LOOP;
  seconds := extract(epoch FROM clock_timestamp() - t0);
  wal_bytes := pg_wal_lsn_diff(pg_current_wal_lsn(), lsn0);
END \$\$;
SQL
}

# ROUNDS rounds of: BACKLOG events loaded, checkpoint, drained. Prints the median rate and
# WAL per event, and leaves the median rate in PGQ_CONSUME.
pgq_consume() {
  local backlog=$1 rounds=$2 round out rates="" wal="" wal_in="" lsn
  for round in $(seq "$rounds"); do
    lsn=$(bash scripts/cluster.sh psql -Atc "SELECT pg_current_wal_lsn()")
    bash scripts/cluster.sh psql -qc "CALL public.bench_pgq_load('bench_consume', $backlog, $PGQ_BATCH)"
    wal_in="$wal_in $(bash scripts/cluster.sh psql -Atc "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '$lsn')::int8 / $backlog")"
    bash scripts/cluster.sh psql -qc "CHECKPOINT"
    out=$(bash scripts/cluster.sh psql -AtF ' ' -c "CALL public.bench_pgq_drain('bench_consume', 'bench', $backlog)")
    set -- $out
    [ "$1" = "$backlog" ] || echo "pgq_consume: round $round read $1 of $backlog events" >&2
    rates="$rates $(awk -v n="$1" -v s="$3" 'BEGIN { printf "%d", n / s }')"
    wal="$wal $(( $4 / backlog ))"
    PGQ_BATCHES=$2
  done
  PGQ_CONSUME=$(echo $rates | median)
  echo "pgq_consume $PGQ_CONSUME msg/s (rounds:$rates; $backlog events in $PGQ_BATCHES batches, one connection, no HTTP)"
  echo "wal_per_pgq_consume $(echo $wal | median) B (rounds:$wal B); wal_per_pgq_insert $(echo $wal_in | median) B (rounds:$wal_in B; transactions of $PGQ_BATCH)"
}

# The extension's drains beside the hand-written outbox's (one loop, and as many loops as
# delivery workers), ROUNDS alternating rounds.
handwritten_anchors() {
  local backlog=$1 rounds=$2
  "${CARGO_TARGET_DIR:-target}/release/bench" --sim-port "${BENCH_SIM_PORT:-0}" --backlog "$backlog" --anchors "$rounds" \
    --handwritten-loops "1,${OUTBOX_WORKERS:-2}"
}

# The ratios of one run of bench/bench.sh, from the lines of its delivery part ($1) and of
# handwritten_anchors ($2), the claim-only loop's rounds ($3, their rates separated by
# spaces), PgQ's consume rate ($4), the 8-client prepared tps of enqueue ($5) and of
# pgq.insert_event ($6), and the backlog of the drains ($7).
anchor_ratios() {
  # Ours against the claim-only loop: the median of every drain of BACKLOG ($7) in the run
  # (three before the large backlog, three after it, three alternated with the hand-written
  # outbox) over the median of the loop's three rounds ($3), which are spread over the run
  # too; then the first three drains over the first round alone, as measured before.
  awk -v rounds="$3" -v pgq="$4" -v e="$5" -v q="$6" -v backlog="$7" '
    function median(list,    v, n, i, j, t) {
      n = split(list, v, " ")
      for (i = 2; i <= n; i++) for (j = i; j > 1 && v[j - 1] + 0 > v[j] + 0; j--) { t = v[j]; v[j] = v[j - 1]; v[j - 1] = t }
      return n ? v[int((n + 1) / 2)] : 0
    }
    function drains(line,    d) {
      d = line; sub(/.*drains: /, "", d); sub(/\).*/, "", d); gsub(/ \/ /, " ", d)
      return d
    }
    FILENAME == ARGV[1] && $1 == "deliveries_per_s_backlog_" backlog { first = $2; all = all " " drains($0) }
    FILENAME == ARGV[1] && $1 == "deliveries_per_s_backlog_" backlog "_after_large" { all = all " " drains($0) }
    FILENAME == ARGV[1] && /^wal_per_delivery / { wd = $2 }
    FILENAME == ARGV[1] && /^wal_per_enqueue / { we = $2 }
    FILENAME == ARGV[2] && $1 == "anchors_outbox_delivery_backlog_" backlog { all = all " " drains($0) }
    FILENAME == ARGV[2] && /^handwritten_outbox_/ { hand = hand sprintf(", %s %s", $1, $10) }
    END {
      n = split(all, ignored, " "); split(rounds, r, " ")
      ours = median(all); claim = median(rounds)
      printf "ratios: outbox/claim_only_loop %.2fx (the median of our %d drains of %d, %d msg/s, over the loop'"'"'s median of 3 rounds, %d msg/s; the first three drains over the first round: %.2fx, %d / %d)", ours / claim, n, backlog, ours, claim, first / r[1], first, r[1]
      printf " | outbox/pgq_consume %.2fx (PgQ %d msg/s; claim_only_loop/pgq_consume %.2fx)", ours / pgq, pgq, claim / pgq
      printf " | outbox/handwritten (alternated rounds)%s | enqueue/pgq_insert_8c_prepared %.2fx (%d / %d tps)", hand, e / q, e, q
      printf " | wal_per_delivery %s B, wal_per_enqueue %s B\n", wd, we
    }' "$1" "$2"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  source "$(dirname "$0")/../scripts/lib.sh"
  BACKLOG=${1:-10000}
  ROUNDS=${2:-3}
  export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_bench_anchors}
  export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54823}
  export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
  export OUTBOX_EXTRA_CONF=${OUTBOX_EXTRA_CONF:-"outbox.batch_size = 200"}
  bash scripts/setup.sh >/dev/null
  bash scripts/cluster.sh install
  cargo build -q --release -p outbox_e2e --bin bench --bin handwritten-outbox
  fresh_cluster >/dev/null
  trap 'bash scripts/cluster.sh stop >/dev/null 2>&1 || true' EXIT
  echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg); $OUTBOX_WORKERS delivery workers; backlog $BACKLOG; $ROUNDS rounds"
  pgq_setup
  handwritten_anchors "$BACKLOG" "$ROUNDS"
  pgq_consume "$BACKLOG" "$ROUNDS"
fi
