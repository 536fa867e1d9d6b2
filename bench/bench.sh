#!/usr/bin/env bash
# Benchmarks, side by side with their baselines in the same run, on a throwaway cluster:
#   1. enqueue: outbox.enqueue() vs a plain INSERT ... ON CONFLICT DO NOTHING into a table of the same shape and
#      indexes (pgbench, 1 and 8 clients; simple and prepared protocol);
#   2. the claim-only baseline: a hand-written SKIP LOCKED claim loop in plain SQL, three
#      rounds spread over the run (before the deliveries, after them, after the anchors);
#   3. delivery: deliveries/s for a backlog to a loopback sink, the sink's own ceiling
#      (wrk), and COMMIT -> request latency idle and under load (from the COMMIT call and
#      from its return), beside what one flush of this disk costs after a rest;
#   4. worker RSS and table/index sizes;
#   5. the anchors (bench/bench_anchors.sh): PgQ's insert rate as a third lane of the
#      enqueue rounds, the hand-written outbox's drains alternated with ours, PgQ's consume
#      rate; WAL per message of each; and the ratios of the run;
#   6. WAL a delivery with keys made by outbox.effect_key (SHA-256 in hex, scattered over
#      the ledger's key index), on a ledger already holding 1,000,000 such entries;
#   7. many endpoints (bench/bench_many_channels.sh, a cluster of its own): one channel x
#      20,000; 10,000 channels x 2; one channel x 20,000 beside the 10,000 now idle; the 10,000
#      where 10 % answer after 1 s and 1 % refuse connections; each worker's memory and files
#      (BENCH_CHANNELS: the number of channels, 10000; 0 skips the step);
#   8. the share of the run's CPU time the hypervisor took (steal).
# Figures only; nothing is asserted.
# Usage: bench/bench.sh [backlog=10000] [large_backlog=1000000]   (large_backlog 0: skip it)
# BENCH_SECONDS: length of each pgbench run (10); BENCH_STEADY_SECONDS: the steady load
# with retention (120; 0 skips it); BENCH_SINK_PORT: the port of the sink wrk measures (18799); BENCH_SIM_PORT: the
# simulator's port in the delivery and anchor drains (a free one).
# BENCH_EFFECT_PREFILL: the ledger entries keyed by outbox.effect_key before step 6's drain
# (1000000).
source "$(dirname "$0")/../scripts/lib.sh"
source bench/bench_anchors.sh
BACKLOG=${1:-10000}
LARGE_BACKLOG=${2:-1000000}
DURATION=${BENCH_SECONDS:-10}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_bench}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54817}
# Two delivery workers, one per core (OUTBOX_WORKERS=1 for the single-worker figures).
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
export OUTBOX_EXTRA_CONF=${OUTBOX_EXTRA_CONF:-"outbox.batch_size = 200"}

bash scripts/setup.sh >/dev/null
command -v wrk >/dev/null || { apt-get install -y -qq wrk >/dev/null 2>&1 || true; }
bash scripts/cluster.sh install
cargo build -q --release -p outbox_e2e --bin bench --bin provider-sim --bin handwritten-outbox
fresh_cluster >/dev/null
pgq_setup
trap 'bash scripts/cluster.sh stop >/dev/null 2>&1 || true; kill ${SINK_PID:-0} 2>/dev/null || true' EXIT

SOCK=$OUTBOX_BASE/sock
psql() { bash scripts/cluster.sh psql -q "$@"; }
pgb() { runuser -u postgres -- /usr/lib/postgresql/15/bin/pgbench -h "$SOCK" -p "$OUTBOX_PGPORT" -n "$@" outbox 2>/dev/null; }
tps() { awk '/^tps/ {print int($3)}'; }

echo "machine: $(nproc) cores, $(free -g | awk '/Mem/ {print $2}') GiB, load average $(cut -d' ' -f1-3 /proc/loadavg); PostgreSQL $(/usr/lib/postgresql/15/bin/postgres --version | awk '{print $3}'); $OUTBOX_WORKERS delivery worker(s)"
read -r RUN_TICKS RUN_STEAL <<<"$(machine_ticks)"

# 1. Enqueue vs a plain INSERT ... ON CONFLICT DO NOTHING (the conflict check an enqueue
#    must make too) into a table of the same shape and indexes ------------------------------------------------------------
psql <<'SQL'
SELECT outbox.create_channel('bench_enqueue', 'http://127.0.0.1:9/x');
SELECT outbox.pause_channel('bench_enqueue', 'enqueue benchmark: nothing is sent');
CREATE TABLE public.plain_outbox (LIKE outbox._messages INCLUDING ALL);
CREATE SEQUENCE public.plain_outbox_seq;
ALTER TABLE public.plain_outbox ALTER COLUMN id SET DEFAULT nextval('public.plain_outbox_seq');
SQL
WORK=$(mktemp -d)
chmod 755 "$WORK"
cat >"$WORK/enqueue.sql" <<'SQL'
SELECT outbox.enqueue('bench_enqueue', '{"to": "user-1", "text": "benchmark message"}'::jsonb, md5(random()::text || clock_timestamp()::text));
SQL
cat >"$WORK/insert.sql" <<'SQL'
INSERT INTO public.plain_outbox (tenant, channel_id, effect_key, payload, next_attempt_at)
VALUES ('default', 1, md5(random()::text || clock_timestamp()::text), '{"to": "user-1", "text": "benchmark message"}'::jsonb, now())
ON CONFLICT DO NOTHING;
SQL
cat >"$WORK/pgq_insert.sql" <<'SQL'
SELECT pgq.insert_event('bench_insert', 'bench', '{"to": "user-1", "text": "benchmark message"}');
SQL
# Three alternating rounds of pgbench (arguments: its options) over the scripts named in
# LANES (enqueue, insert, pgq_insert), each after a CHECKPOINT: each lane's rounds' tps,
# space-separated, in ROUNDS[lane]; the median of each is shown. A single pair of runs
# moves by a third from run to run here (commit flushes, checkpoints, autovacuum of the
# growing tables).
declare -A ROUNDS
alternate_rounds() {
  local round lane
  for lane in $LANES; do ROUNDS[$lane]=""; done
  for round in 1 2 3; do
    for lane in $LANES; do
      psql -c "CHECKPOINT" >/dev/null
      ROUNDS[$lane]="${ROUNDS[$lane]} $(pgb "$@" -T "$DURATION" -f "$WORK/$lane.sql" | tps)"
    done
  done
}
# Each side by pgbench's simple protocol (every statement parsed and planned, as psql or a
# driver without prepared statements sends it) and by -M prepared (planned once per
# connection, as a driver with prepared statements sends it).
psql -c "CREATE ROLE bench_writer LOGIN IN ROLE outbox_writer" -c "SELECT outbox.bind_tenant('bench_writer', 'default')" >/dev/null
declare -A insert_tps enqueue_tps pgq_tps
LANES="enqueue insert pgq_insert"
for spec in "1 simple" "8 simple" "8 prepared"; do
  set -- $spec
  clients=$1; mode=$2; label="${clients}c"; [ "$mode" = prepared ] && label="${clients}c_prepared"
  alternate_rounds -M "$mode" -c $clients -j $clients
  es=${ROUNDS[enqueue]}; ps=${ROUNDS[insert]}; qs=${ROUNDS[pgq_insert]}
  e=$(echo $es | median); p=$(echo $ps | median); q=$(echo $qs | median)
  insert_tps[$label]=$p; enqueue_tps[$label]=$e; pgq_tps[$label]=$q
  awk -v l="$label" -v e="$e" -v p="$p" -v es="$es" -v ps="$ps" 'BEGIN { printf "enqueue_%s %d tps (rounds:%s) | plain_insert_on_conflict_%s %d tps (rounds:%s) | plain/enqueue %.2fx\n", l, e, es, l, p, ps, p / e }'
  awk -v l="$label" -v e="$e" -v q="$q" -v qs="$qs" 'BEGIN { printf "pgq_insert_%s %d tps (rounds:%s) | enqueue/pgq_insert %.2fx\n", l, q, qs, e / q }'
done
psql -c "SELECT pgq.drop_queue('bench_insert')" >/dev/null
# The same 8 clients as an application connects: a login role in outbox_writer bound to a
# tenant (the superuser above skips the tenant bindings and every privilege check),
# alternated with a plain INSERT by the same role (granted INSERT on the plain table), and
# also read against the superuser's INSERT figures above.
psql -c "GRANT INSERT ON public.plain_outbox TO bench_writer" -c "GRANT USAGE ON SEQUENCE public.plain_outbox_seq TO bench_writer" >/dev/null
for mode in simple prepared; do
  label=8c; [ "$mode" = prepared ] && label=8c_prepared
  LANES="enqueue insert" alternate_rounds -M "$mode" -U bench_writer -c 8 -j 8
  ws=${ROUNDS[enqueue]}; wps=${ROUNDS[insert]}
  w=$(echo $ws | median); wp=$(echo $wps | median)
  awk -v l="$label" -v w="$w" -v wp="$wp" -v p="${insert_tps[$label]}" -v ws="$ws" -v wps="$wps" 'BEGIN { printf "enqueue_%s_as_writer %d tps (rounds:%s) | plain_insert_on_conflict_%s_as_writer %d tps (rounds:%s) | plain/enqueue %.2fx (%.2fx to the superuser'"'"'s INSERT above)\n", l, w, ws, l, wp, wps, wp / w, p / w }'
done

# The same two statements in one pgbench run, three rounds: every client picks one of them
# at random for each transaction, so both meet the same commit flushes, checkpoints and
# table sizes, which move separate runs by a third from one to the next here; pgbench
# reports each script's mean latency. plain/enqueue is the enqueue's mean latency over the
# plain INSERT's (8 clients, prepared: as the separate runs above, whose tps ratio is the
# inverse ratio of their latencies), the median of the rounds' ratios.
interleaved_latencies() {
  pgb "$@" -T "$DURATION" -f "$WORK/enqueue.sql@1" -f "$WORK/insert.sql@1" |
    awk '/^SQL script/ { s++ } /- latency average/ { lat[s] = $5 } END { printf "%.3f %.3f\n", lat[1], lat[2] }'
}
for who in superuser bench_writer; do
  ratios=""; rounds=""
  for round in 1 2 3; do
    psql -c "CHECKPOINT" >/dev/null
    # shellcheck disable=SC2046  # -U only for the writer
    read -r ours plain < <(interleaved_latencies -M prepared -c 8 -j 8 $([ "$who" = bench_writer ] && echo -U bench_writer))
    rounds="$rounds $ours/$plain"
    ratios="$ratios $(awk -v o="$ours" -v p="$plain" 'BEGIN { printf "%.3f", o / p }')"
  done
  label=8c_prepared; [ "$who" = bench_writer ] && label=8c_prepared_as_writer
  echo "enqueue_interleaved_$label mean latency enqueue/plain ms (rounds:$rounds) | plain/enqueue $(echo $ratios | median | awk '{ printf "%.2f", $1 }')x"
done

# The enqueue rounds leave their messages queued on the paused channel, as many as the
# rounds' length allows (millions with BENCH_SECONDS=20): they are removed, so that the
# delivery figures below do not depend on how long the enqueue rounds ran.
psql -c "TRUNCATE outbox._messages" >/dev/null
psql -c "VACUUM ANALYZE outbox._messages" >/dev/null

# 2. Claim-only baseline: what a user would write (claim 100 with SKIP LOCKED, mark done) --
#    Three rounds, each on 2,000,000 fresh rows: before the deliveries, between them and the
#    anchors, and after the anchors. The loop moves by a third from one run to the next on
#    this machine; its rounds spread over the run, like the drains of ours they are compared
#    with (anchor_ratios).
#    The table has the queue's indexes; its due index sorts messages held behind their
#    ordering key apart, so the loop reads the part a user's own index would be.
cat >"$WORK/claim.sql" <<'SQL'
WITH c AS (SELECT id FROM public.plain_outbox WHERE channel_id = 1 AND state = 'queued' AND NOT held_by_key
              AND next_attempt_at <= now()
            ORDER BY next_attempt_at, id LIMIT 100 FOR UPDATE SKIP LOCKED)
UPDATE public.plain_outbox p SET state = 'delivered', updated_at = now() FROM c WHERE p.id = c.id;
SQL
# One round: prints "claim_only_loop_round N msg/s (WHEN)", with the WAL and full-page
# images a message, and adds the rate to CLAIM_ROUNDS.
# The load is checkpointed before the loop starts, as every drain it is compared with is
# (the bench program's settle, the anchors): the load's WAL passes max_wal_size, and
# without it the loop ran while the checkpoint that began wrote 12,000-25,000 buffers, its
# rounds spread wider (BENCHMARKS.md, 2026-12-06, the loop after a checkpoint).
CLAIM_ROUNDS=""
claim_only_round() {
  psql >/dev/null <<SQL
TRUNCATE public.plain_outbox;
INSERT INTO public.plain_outbox (tenant, channel_id, effect_key, payload, next_attempt_at)
SELECT 'default', 1, 'k' || g, '{"text": "benchmark message"}', now() FROM generate_series(1, 2000000) g;
VACUUM ANALYZE public.plain_outbox;
CHECKPOINT;
SQL
  local rate lsn0 fpi0 wal
  read -r lsn0 fpi0 <<<"$(psql -AtF' ' -c "SELECT pg_current_wal_lsn(), wal_fpi FROM pg_stat_wal")"
  rate=$(( $(pgb -c 1 -j 1 -T "$DURATION" -f "$WORK/claim.sql" | tps) * 100 ))
  wal=$(psql -AtF' ' -c "SELECT round((pg_current_wal_lsn() - '$lsn0') / greatest($rate * $DURATION, 1)) || ' B,',
                                round((wal_fpi - $fpi0)::numeric / greatest($rate * $DURATION, 1), 3)
                           FROM pg_stat_wal")
  psql -c "TRUNCATE public.plain_outbox" >/dev/null
  CLAIM_ROUNDS="$CLAIM_ROUNDS $rate"
  echo "claim_only_loop_round $rate msg/s ($1; plain SQL, 100 per claim, 1 connection, no HTTP; after a CHECKPOINT; WAL a message $wal full-page images)"
}
claim_only_round "before the deliveries"

# 3. The sink's own ceiling (wrk, keep-alive POSTs to the simulator) ----------------------
SINK_PORT=${BENCH_SINK_PORT:-18799}
BIN=${CARGO_TARGET_DIR:-target}/release
"$BIN/provider-sim" --port "$SINK_PORT" --quiet --no-record-requests --no-record-bodies >/dev/null 2>&1 &
SINK_PID=$!
sleep 0.5
if command -v wrk >/dev/null; then
  cat >"$WORK/post.lua" <<'LUA'
wrk.method = "POST"
wrk.body = '{"to": "user-1", "text": "benchmark message"}'
wrk.headers["Content-Type"] = "application/json"
LUA
  sink=$(wrk -t1 -c64 -d"${DURATION}s" -s "$WORK/post.lua" "http://127.0.0.1:$SINK_PORT/ch/sink" | awk '/Requests\/sec/ {print int($2)}')
  echo "sink_ceiling $sink req/s (wrk, 64 keep-alive connections)"
fi
kill $SINK_PID 2>/dev/null || true

# 4. Delivery throughput and latency ------------------------------------------------------
#    1,000 idle samples and 500 under load: a p99 of 200 samples is their second slowest,
#    of 100 their slowest. Then 200 idle samples 300 ms apart, as an application that
#    commits now and then finds the workers (about a minute).
"$BIN/bench" --sim-port "${BENCH_SIM_PORT:-0}" --backlog "$BACKLOG" --large-backlog "$LARGE_BACKLOG" --latency-samples 1000 \
  --rested-samples 200 --rested-ms 300 --steady-seconds "${BENCH_STEADY_SECONDS:-120}" | tee "$WORK/delivery.out"

claim_only_round "after the deliveries"

# 5. Footprint ----------------------------------------------------------------------------
for pid in $(psql -Atc "SELECT pid FROM outbox.worker_status() WHERE pid IS NOT NULL"); do
  # Private memory (RssAnon) is the worker's own; RssShmem is shared_buffers pages it touched.
  echo "worker_rss_private $(($(awk '/RssAnon/ {print $2}' /proc/$pid/status) / 1024)) MB, shared $(($(awk '/RssShmem/ {print $2}' /proc/$pid/status) / 1024)) MB (pid $pid)"
done

# 6. The anchors: the hand-written outbox and PgQ's consumer, and the ratios of this run ---
handwritten_anchors "$BACKLOG" 3 | tee "$WORK/anchors.out"
pgq_consume "$BACKLOG" 3
claim_only_round "after the anchors"
psql -c "DROP TABLE public.plain_outbox; DROP SEQUENCE public.plain_outbox_seq;" >/dev/null
echo "claim_only_loop $(echo $CLAIM_ROUNDS | median) msg/s (median of 3 rounds: $(echo $CLAIM_ROUNDS | sed 's/ / \/ /g'))"
anchor_ratios "$WORK/delivery.out" "$WORK/anchors.out" "$CLAIM_ROUNDS" "$PGQ_CONSUME" \
  "${enqueue_tps[8c_prepared]}" "${pgq_tps[8c_prepared]}" "$BACKLOG"
# 6. WAL a delivery with keys as applications make them: outbox.effect_key's SHA-256 in hex,
#    whose ledger entries fall all over the ledger's key index, on a ledger already holding
#    1,000,000 such entries (BENCH_EFFECT_PREFILL). The drains above key their messages in
#    the order they are enqueued; docs/scaling.md, "Effect keys and the WAL of the ledger's
#    index", says what scattered keys cost and what lowers it.
effect_keys_wal() {
  local n=20000 prefill=${BENCH_EFFECT_PREFILL:-1000000} port=${BENCH_SINK_PORT:-18799} lsn0 fpi0 i
  "$BIN/provider-sim" --port "$port" --quiet --no-record-requests --no-record-bodies >/dev/null 2>&1 &
  SINK_PID=$!
  psql -v ON_ERROR_STOP=1 >/dev/null <<SQL
SET client_min_messages = warning;
SELECT outbox.create_channel('bench_effect_keys', 'http://127.0.0.1:$port/ch/bench_effect_keys',
                             '{"max_in_flight": 512, "max_unverifiable_in_flight": 512, "external_id": "/id"}');
SELECT outbox.pause_channel('bench_effect_keys', 'loading the backlog');
SELECT count(outbox.enqueue('bench_effect_keys', jsonb_build_object('n', g, 'text', 'benchmark message'),
                            outbox.effect_key('backlog:' || g, 'deliver')))
  FROM generate_series(1, $n) g;
VACUUM ANALYZE outbox._messages;
SQL
  prefill_ledger "$prefill" "outbox.effect_key('prefill:' || g, 'deliver')"
  psql -c "CHECKPOINT" >/dev/null
  read -r lsn0 fpi0 <<<"$(psql -AtF' ' -c "SELECT pg_current_wal_lsn(), wal_fpi FROM pg_stat_wal")"
  psql -c "SELECT outbox.resume_channel('bench_effect_keys')" >/dev/null
  for i in $(seq 1200); do
    [ "$(psql -Atc "SELECT EXISTS (SELECT 1 FROM outbox._messages m JOIN outbox._channels c ON c.id = m.channel_id
                                    WHERE c.name = 'bench_effect_keys')")" = f ] && break
    sleep 0.1
  done
  [ "$i" -lt 1200 ] || echo "warning: the drain keyed by outbox.effect_key did not end within 120 s" >&2
  psql -AtF' ' -c "SELECT 'wal_per_delivery_effect_keys', round((pg_current_wal_lsn() - '$lsn0') / $n) || ' B,',
                          round((wal_fpi - $fpi0)::numeric / $n, 2),
                          'full-page images a delivery (a drain of $n keyed by outbox.effect_key, from a CHECKPOINT, on a ledger with $prefill more such entries; wal_per_delivery above: keys in enqueue order)'
                     FROM pg_stat_wal"
  kill "$SINK_PID" 2>/dev/null || true
}
effect_keys_wal

# 7. Many endpoints, on a cluster of its own (its own ports) ------------------------------------
if [ "${BENCH_CHANNELS:-10000}" -gt 0 ]; then
  (unset OUTBOX_BASE OUTBOX_PGPORT BENCH_SIM_PORT; bash bench/bench_many_channels.sh "${BENCH_CHANNELS:-10000}" 2)
fi

echo "machine_steal $(steal_percent_since "$RUN_TICKS" "$RUN_STEAL") % of the CPU time of the run (taken by the hypervisor: a run with much of it measured a slower machine)"
rm -rf "$WORK"
