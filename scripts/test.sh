#!/usr/bin/env bash
# The full test suite: pure Rust tests and #[pg_test]s (cargo pgrx test), then the
# end-to-end tests against a real cluster with the worker and the provider simulator.
#   OUTBOX_SOAK_FULL=1 scripts/test.sh   also runs the full-size soak (10,000 messages)
source "$(dirname "$0")/lib.sh"

bash scripts/setup.sh

echo "== unit tests and #[pg_test]s (cargo pgrx test)"
mkdir -p /tmp/pgrx-test && chown postgres /tmp/pgrx-test && rm -rf /tmp/pgrx-test/15
cargo pgrx test pg15 --runas postgres --pgdata /tmp/pgrx-test

echo "== end-to-end: real cluster, real worker, provider simulator"
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_test}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54816}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
bash scripts/cluster.sh install
fresh_cluster
trap 'bash scripts/cluster.sh stop immediate >/dev/null 2>&1 || true' EXIT
cargo test -p outbox_e2e --release -- --test-threads=1
