#!/usr/bin/env bash
# Benchmark: deliveries into NATS JetStream beside HTTP and `sql`, and beside a plain client.
#   1. a nats-server of its own (JetStream, file storage in a throwaway directory) on a free
#      loopback port, and a throwaway cluster (2 delivery workers, batches of 200);
#   2. in each of ROUNDS alternating rounds, a backlog drained over HTTP (the provider
#      simulator), into one JetStream stream, and into a `sql` effect; the median of each,
#      and what one delivery cost (CPU of the workers, of the server and of the sink; WAL;
#      growth of the extension's tables) and what one enqueue cost;
#   3. the baseline: a plain async-nats program publishing the same number of messages
#      with acknowledgement, 256 in flight, on the same server (src/bin/nats_publish_baseline.rs).
#   4. the disk's fdatasync rate (pg_test_fsync), and bench/scaling_model.py on all of it.
# Figures only; nothing is asserted. The costs are also written to $OUTBOX_BASE/costs.json
# and the baseline to $OUTBOX_BASE/baseline.json, for bench/scaling_model.py.
# Usage: bench/bench_nats.sh [backlog=10000] [rounds=3]
# With OUTBOX_PGBIN (a private copy of PostgreSQL, scripts/pg_prefix.sh) the extension is
# installed there; otherwise into the system PostgreSQL 15 (scripts/cluster.sh install).
source "$(dirname "$0")/../scripts/lib.sh"
BACKLOG=${1:-10000}
ROUNDS=${2:-3}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_bench_nats}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54822}
export OUTBOX_WORKERS=2
export OUTBOX_EXTRA_CONF="outbox.batch_size = 200"
BIN=${CARGO_TARGET_DIR:-target}/release

bash scripts/setup.sh >/dev/null
if [ -n "${OUTBOX_PGBIN:-}" ]; then
  cargo pgrx install --release --pg-config "$OUTBOX_PGBIN/pg_config" >/dev/null
else
  bash scripts/cluster.sh install
fi
cargo build -q --release -p outbox_e2e --bin bench --bin nats-publish-baseline
fresh_cluster >/dev/null

NATS_DIR=$(mktemp -d)
NATS_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
nats-server -js -a 127.0.0.1 -p "$NATS_PORT" -sd "$NATS_DIR" >"$NATS_DIR.log" 2>&1 &
NATS_PID=$!
trap 'bash scripts/cluster.sh stop >/dev/null 2>&1 || true; kill $NATS_PID 2>/dev/null || true; rm -rf "$NATS_DIR" "$NATS_DIR.log"' EXIT
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$NATS_PORT) 2>/dev/null && break; sleep 0.1; done
NATS_URL=nats://127.0.0.1:$NATS_PORT

echo "machine: $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg); nats-server $(nats-server --version | awk '{print $NF}') (JetStream, file storage); $OUTBOX_WORKERS delivery workers, batches of 200; backlog $BACKLOG; $ROUNDS rounds"
"$BIN/bench" --backlog "$BACKLOG" --kinds "$ROUNDS" --nats-url "$NATS_URL" --nats-pid "$NATS_PID" \
  --costs-json "$OUTBOX_BASE/costs.json"
"$BIN/nats-publish-baseline" --url "$NATS_URL" --messages "$BACKLOG" --in-flight 256 --rounds "$ROUNDS" \
  --server-pid "$NATS_PID" --json "$OUTBOX_BASE/baseline.json"
python3 - "$OUTBOX_BASE/costs.json" "$OUTBOX_BASE/baseline.json" <<'PY'
import json, sys
costs, base = (json.load(open(p)) for p in sys.argv[1:3])
n, h, b = costs["nats"]["rate"], costs["http"]["rate"], base["rate"]
print(f"ratio_nats_to_baseline {n / b:.2f} (nats channel {n:.0f} msg/s, plain client {b:.0f} msg/s)")
print(f"ratio_nats_to_http {n / h:.2f} (target: nats >= 10,000 msg/s or >= 0.8x http)")
PY
# The disk's flushes per second (one 8 kB write + fdatasync, as a WAL flush), for the model.
FSYNCS=$("${OUTBOX_PGBIN:-/usr/lib/postgresql/15/bin}/pg_test_fsync" -s 2 -f "$OUTBOX_BASE/fsync_probe" 2>/dev/null \
  | awk '/one 8kB write/ {on = 1} on && $1 == "fdatasync" {print int($2); exit}')
rm -f "$OUTBOX_BASE/fsync_probe"
echo "fdatasync_per_s ${FSYNCS:-?} (pg_test_fsync, one 8 kB write each)"
echo "--- bench/scaling_model.py (the measured figures above; see docs/scaling.md for its assumptions)"
python3 bench/scaling_model.py "$OUTBOX_BASE/costs.json" "$OUTBOX_BASE/baseline.json" --fsyncs-s "${FSYNCS:-1000}"
