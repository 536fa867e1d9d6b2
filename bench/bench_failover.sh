#!/usr/bin/env bash
# Measurement: what a failover to a promoted standby exposes under asynchronous replication.
# A primary and a streaming hot standby on this machine; a steady 1,000 messages per second
# over a deduping, a reconcile-only and a neither channel; the primary killed
# (pg_ctl stop -m immediate) and the standby promoted, RUNS times (5). Prints per run:
# committed messages lost, messages the provider had whose claim or ledger entry was in the
# lost WAL, resends the deduping provider absorbed, messages the neither-provider received
# twice, and the time from the promotion to the first request. Nothing is asserted.
# Usage: bench/bench_failover.sh [runs=5] [seconds_of_load=3]
# With OUTBOX_PGBIN (a private copy of PostgreSQL, scripts/pg_prefix.sh) the extension is
# installed there; otherwise into the system PostgreSQL 15 (scripts/cluster.sh install).
source "$(dirname "$0")/../scripts/lib.sh"
export OUTBOX_FAILOVER_RUNS=${1:-5}
export OUTBOX_FAILOVER_LOAD_S=${2:-3}
export OUTBOX_HA_BASE=${OUTBOX_HA_BASE:-/tmp/outbox_ha_bench}
export OUTBOX_HA_PGPORT=${OUTBOX_HA_PGPORT:-54866}

bash scripts/setup.sh >/dev/null
if [ -n "${OUTBOX_PGBIN:-}" ]; then
  cargo pgrx install --release --pg-config "$OUTBOX_PGBIN/pg_config" >/dev/null
else
  bash scripts/cluster.sh install
fi
echo "machine: $(nproc) cores; $OUTBOX_FAILOVER_RUNS failovers after $OUTBOX_FAILOVER_LOAD_S s of load each"
cargo test -q -p outbox_e2e --release --test replicas exposure -- --ignored --nocapture --test-threads=1 2>&1 \
  | grep -v '^running\|^test \|^$\|test result'
