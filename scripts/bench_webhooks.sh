#!/usr/bin/env bash
# Benchmark: what webhook-grade channels cost. Drains of a backlog on a plain HTTP channel,
# on one that signs every request (Standard Webhooks) and on one over HTTPS to the loopback
# simulator behind a test CA (connections reused), in alternating rounds on a throwaway
# cluster of its own; the median of each beside the plain figure of the same run, and the
# TLS handshakes of each HTTPS drain. Figures only; nothing is asserted.
# Usage: scripts/bench_webhooks.sh [backlog=10000] [rounds=3]
source "$(dirname "$0")/lib.sh"
BACKLOG=${1:-10000}
ROUNDS=${2:-3}
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_bench_webhooks}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54821}
export OUTBOX_WORKERS=2
export OUTBOX_EXTRA_CONF="outbox.batch_size = 200"

bash scripts/setup.sh >/dev/null
if [ -z "${OUTBOX_PGBIN:-}" ]; then bash scripts/cluster.sh install; fi
cargo build -q --release -p outbox_e2e --bin bench
fresh_cluster >/dev/null
trap 'bash scripts/cluster.sh stop >/dev/null 2>&1 || true' EXIT

echo "machine: $(nproc) cores; $OUTBOX_WORKERS delivery workers; backlog $BACKLOG; $ROUNDS rounds"
"${CARGO_TARGET_DIR:-target}"/release/bench --backlog "$BACKLOG" --webhooks "$ROUNDS"
