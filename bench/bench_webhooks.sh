#!/usr/bin/env bash
# Benchmark: what webhook-grade channels cost. Drains of a backlog on a plain HTTP channel,
# on one that signs every request (Standard Webhooks), on one that sends three unsigned
# headers of the same sizes, and on one over HTTPS to the loopback
# simulator behind a test CA (connections reused), in rounds on a throwaway cluster of its
# own, the lanes in a balanced order (each round starting with another lane) and every drain
# from the same emptied tables (`reset_tables` in pg_test/src/bin/bench.rs); the median rate
# and worker CPU per delivery of each beside the plain figures of the same run, and the TLS
# handshakes of each HTTPS drain; then the CPU one signature costs (benches/signing.rs) as a
# share of the worker CPU per plain delivery. Figures only; nothing is asserted.
# Usage: bench/bench_webhooks.sh [backlog=10000] [rounds=3]
source "$(dirname "$0")/../scripts/lib.sh"
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
OUT=$(mktemp)
"${CARGO_TARGET_DIR:-target}"/release/bench --backlog "$BACKLOG" --webhooks "$ROUNDS" | tee "$OUT"

# The CPU a signature costs, in CPU time of one thread (benches/signing.rs), beside the
# worker CPU per delivery of the plain drains above: the share of a delivery's work that
# signing adds, which holds on a loaded machine, where the drains' rates spread by ±20 %.
cargo bench -q --bench signing 2>/dev/null | tee -a "$OUT"
awk '/^worker_cpu_ms_per_1000_plain_http / { plain_us = $2 }
     /^signing_cpu_ns_per_message_100B_1_secret / { sign_ns = $2 }
     /^signing_cpu_ns_per_message_1KiB_2_secrets / { sign2_ns = $2 }
     END { if (plain_us > 0) printf "signing_share_of_worker_cpu_per_delivery %.2f%% (100 B, one secret; %.2f%% with 1 KiB and two secrets) of %d us of worker CPU per plain delivery\n", sign_ns / (plain_us * 10), sign2_ns / (plain_us * 10), plain_us }' "$OUT"
rm -f "$OUT"
