#!/usr/bin/env bash
# The main job: a local cluster with outbox_delivery, a demo provider on loopback, a few
# messages enqueued in one transaction and delivered by the worker, and the views.
source "$(dirname "$0")/lib.sh"
SIM_PORT=${OUTBOX_DEMO_PORT:-8788}

bash scripts/setup.sh
echo "[demo] building and installing the extension and the demo provider"
bash scripts/cluster.sh install
cargo build -q --release -p outbox_e2e --bin provider-sim
# The demo's cluster is throwaway: start from a fresh one, so that it always matches the
# extension just installed.
fresh_cluster

pkill -f "provider-sim --port $SIM_PORT" 2>/dev/null || true
target/release/provider-sim --port "$SIM_PORT" --dedupe-header Idempotency-Key >/tmp/outbox_demo_provider.log 2>&1 &
SIM_PID=$!
trap 'kill $SIM_PID 2>/dev/null || true' EXIT
for _ in $(seq 50); do grep -q listening /tmp/outbox_demo_provider.log && break; sleep 0.1; done

psql() { bash scripts/cluster.sh psql "$@"; }

echo "[demo] channel 'demo' -> http://127.0.0.1:$SIM_PORT/ch/demo (dedupes by Idempotency-Key)"
psql -q <<SQL
SELECT outbox.create_channel('demo', 'http://127.0.0.1:$SIM_PORT/ch/demo',
       '{"idempotency_header": "Idempotency-Key", "external_id": "/id"}')
 WHERE NOT EXISTS (SELECT 1 FROM outbox.channels WHERE name = 'demo');
SQL

RUN=$(date +%s)
echo "[demo] one application transaction enqueues three replies"
psql <<SQL
BEGIN;
SELECT outbox.enqueue('demo', jsonb_build_object('to', 'user-' || g, 'text', 'Your answer #' || g),
                      outbox.effect_key('turn-$RUN-' || g, 'send_reply')) AS message_id
  FROM generate_series(1, 3) AS g;
COMMIT;
SQL

for _ in $(seq 100); do
  left=$(psql -Atc "SELECT count(*) FROM outbox.messages WHERE effect_key IN (SELECT outbox.effect_key('turn-$RUN-' || g, 'send_reply') FROM generate_series(1,3) g) AND state <> 'delivered'")
  [ "$left" = 0 ] && break
  sleep 0.1
done

echo "[demo] outbox.messages"
psql -c "SELECT id, channel, state, attempts, max_attempts, external_id, last_error, created_at, delivered_at FROM outbox.messages ORDER BY id DESC LIMIT 6"
echo "[demo] outbox.attempts"
psql -c "SELECT message_id, attempt, kind, outcome, http_status, external_id, round(extract(epoch FROM finished_at - started_at) * 1000, 1) AS ms FROM outbox.attempts ORDER BY attempt_id DESC LIMIT 6"
echo "[demo] outbox.ledger"
psql -c "SELECT message_id, left(effect_key, 16) || '…' AS effect_key, external_id, recorded_by, recorded_at FROM outbox.ledger ORDER BY recorded_at DESC LIMIT 6"
echo "[demo] outbox.metrics and outbox.work_queue"
psql -c "SELECT scope, channel, queued, sending, uncertain, exhausted, failed, delivered_5m, success_rate_5m, error_streak FROM outbox.metrics"
psql -c "SELECT id, channel, state, reason, owner, suggested_action FROM outbox.work_queue"
echo "[demo] outbox.worker_status()"
psql -c "SELECT * FROM outbox.worker_status()"
echo "[demo] what the provider received"
cat /tmp/outbox_demo_provider.log
[ "$left" = 0 ] || { echo "[demo] messages still undelivered" >&2; exit 1; }
echo "[demo] all three delivered. The cluster keeps running: scripts/cluster.sh psql | stop"
