#!/usr/bin/env bash
# The steady load alone: STEADY_RATE messages a second (1,000) enqueued and delivered for SECONDS
# (default 3600) with a retention of 15 s (outbox.retention, outbox.ledger_retention, and
# every channel's retry horizon shortened to 10 s), printing the size of the queue, claim,
# attempt and ledger tables as it goes: they must stay flat. At the end it prints, for every
# table of the extension, its largest size in each sixth of the run and the rows written to
# it (inserted, updated, deleted one by one, emptied whole), and how many ledger rows were
# deleted one by one (none: retention empties whole generations). The same load is the last
# part of bench/bench.sh (BENCH_STEADY_SECONDS).
#
# Usage: bench/bench_steady.sh [SECONDS]
#   STEADY_RATE (messages a second, enqueued a tenth every 100 ms: 1000),
#   OUTBOX_BASE (/tmp/outbox_delivery_steady), OUTBOX_PGPORT (54823), OUTBOX_WORKERS (2),
#   OUTBOX_PGBIN (a private prefix's bin directory with the build installed: scripts/
#   pg_prefix.sh; by default the tree is installed into the system PostgreSQL).
source "$(dirname "$0")/../scripts/lib.sh"
SECONDS_OF_LOAD=${1:-3600}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_steady}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54823}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
export OUTBOX_EXTRA_CONF=${OUTBOX_EXTRA_CONF:-"outbox.batch_size = 200"}

bash scripts/setup.sh >/dev/null
[ -n "${OUTBOX_PGBIN:-}" ] || bash scripts/cluster.sh install
cargo build -q --release -p outbox_e2e --bin bench
fresh_cluster >/dev/null
trap 'bash scripts/cluster.sh stop >/dev/null 2>&1 || true' EXIT
echo "machine: $(nproc) cores; $OUTBOX_WORKERS delivery workers; steady load of ${STEADY_RATE:-1000} msg/s for $SECONDS_OF_LOAD s"
"${CARGO_TARGET_DIR:-target}/release/bench" --steady-only "$SECONDS_OF_LOAD" --steady-rate "${STEADY_RATE:-1000}"
