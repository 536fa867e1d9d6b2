#!/usr/bin/env bash
# Benchmark: the price of safety on a channel that can neither dedupe nor be asked. Drains
# of a backlog on such a channel at its default bound on attempts open at once
# (max_unverifiable_in_flight, 8) and at 4, 16 and 32, beside an ordinary channel
# (idempotency_header, max_in_flight 64 by default), in alternating rounds on a throwaway
# cluster of its own; the median of each. Figures only; nothing is asserted.
# Usage: bench/bench_unverifiable.sh [backlog=10000] [rounds=3]
source "$(dirname "$0")/../scripts/lib.sh"
BACKLOG=${1:-10000}
ROUNDS=${2:-3}
export OUTBOX_BASE=/tmp/outbox_delivery_bench_unverifiable
export OUTBOX_PGPORT=54820
export OUTBOX_WORKERS=2
export OUTBOX_EXTRA_CONF="outbox.batch_size = 200"

bash scripts/setup.sh >/dev/null
bash scripts/cluster.sh install
cargo build -q --release -p outbox_e2e --bin bench
fresh_cluster >/dev/null
trap 'bash scripts/cluster.sh stop >/dev/null 2>&1 || true' EXIT

echo "machine: $(nproc) cores; $OUTBOX_WORKERS delivery workers; backlog $BACKLOG; $ROUNDS rounds"
target/release/bench --backlog "$BACKLOG" --price-of-safety "$ROUNDS"
