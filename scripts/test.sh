#!/usr/bin/env bash
# The full test suite: pure Rust tests and #[pg_test]s (cargo pgrx test), then the
# end-to-end tests against a real cluster with the worker and the provider simulator, and the
# release tests (upgrade from every released version, dump and restore, the Debian package).
#   OUTBOX_SOAK_FULL=1 scripts/test.sh   also runs the full-size soak (10,000 messages)
source "$(dirname "$0")/lib.sh"

bash scripts/setup.sh

# The suite installs into the system PostgreSQL 15 directories (cluster.sh install, the
# Debian package test), and its clusters load the library from there: one writer at a time.
if [ "${OUTBOX_SYSTEM_PG_LOCK_HELD:-}" != 1 ]; then
  exec 9>/tmp/outbox-system-pg.lock
  echo "== waiting for the system PostgreSQL directories (/tmp/outbox-system-pg.lock)"
  flock 9
  export OUTBOX_SYSTEM_PG_LOCK_HELD=1
fi
# Only this shell holds the lock: the commands below get no copy of its descriptor (9>&-), so
# that no server they start keeps the lock after the suite.

echo "== the module graph: no import cycle, no import from a lower layer to a higher one"
if ! python3 scripts/module_graph.py > /tmp/outbox_module_graph.txt; then
  head -n 4 /tmp/outbox_module_graph.txt
  exit 1
fi

echo "== unit tests and #[pg_test]s (cargo pgrx test)"
mkdir -p /tmp/pgrx-test && chown postgres /tmp/pgrx-test && rm -rf /tmp/pgrx-test/15
cargo pgrx test pg15 --runas postgres --pgdata /tmp/pgrx-test 9>&-

echo "== end-to-end: real cluster, real worker, provider simulator"
export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_test}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54816}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
bash scripts/cluster.sh install
fresh_cluster 9>&-
trap 'bash scripts/cluster.sh stop immediate >/dev/null 2>&1 || true' EXIT

echo "== releases: every released version built from its commit (cached), this version's package"
for script in sql/outbox_delivery--*.sql; do
  version=${script#sql/outbox_delivery--}; version=${version%.sql}
  case "$version" in *--*) continue ;; esac
  bash scripts/build_release.sh "$version" >/dev/null
done
bash scripts/package.sh

cargo test -p outbox_e2e --release -- --test-threads=1 9>&-
