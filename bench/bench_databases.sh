#!/usr/bin/env bash
# Benchmark: delivery with several databases served by one server. A backlog drained in one
# database alone, beside a backlog of the same size in each of three databases drained at
# once (the sum of their rates), in alternating rounds on a throwaway cluster of its own
# serving all three (outbox.database = 'bench_a, bench_b, bench_c', 2 workers each); the
# median of each. Figures only; nothing is asserted.
# Usage: bench/bench_databases.sh [backlog=10000] [rounds=3]
# With OUTBOX_PGBIN (a private copy of PostgreSQL, scripts/pg_prefix.sh) the extension is
# installed there; otherwise into the system PostgreSQL 15 (scripts/cluster.sh install).
source "$(dirname "$0")/../scripts/lib.sh"
BACKLOG=${1:-10000}
ROUNDS=${2:-3}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_bench_databases}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54821}
export OUTBOX_WORKERS=2
export OUTBOX_DB="bench_a, bench_b, bench_c"
export OUTBOX_EXTRA_CONF="outbox.batch_size = 200"

bash scripts/setup.sh >/dev/null
if [ -n "${OUTBOX_PGBIN:-}" ]; then
  cargo pgrx install --release --pg-config "$OUTBOX_PGBIN/pg_config" >/dev/null
else
  bash scripts/cluster.sh install
fi
cargo build -q --release -p outbox_e2e --bin bench
fresh_cluster >/dev/null
trap 'bash scripts/cluster.sh stop >/dev/null 2>&1 || true' EXIT

echo "machine: $(nproc) cores; databases: $OUTBOX_DB; $OUTBOX_WORKERS delivery workers each; backlog $BACKLOG; $ROUNDS rounds"
"${CARGO_TARGET_DIR:-target}/release/bench" --backlog "$BACKLOG" --several-databases "$ROUNDS"
