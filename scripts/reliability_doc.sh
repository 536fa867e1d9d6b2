#!/usr/bin/env bash
# Rewrites the measured tables of docs/reliability.md (the crash matrix and the soak) from a
# fresh run against a real cluster. An ordinary test run only compares what its rows claim
# with the page and fails where they differ; run this when a change is meant to change what
# the page says, then read the diff and commit it with the change.
#   OUTBOX_SOAK_FULL=1 scripts/reliability_doc.sh     the soak with 10,000 messages
#   OUTBOX_SKIP_INSTALL=1 scripts/reliability_doc.sh  keep the extension already installed
source "$(dirname "$0")/lib.sh"

export OUTBOX_BASE=${OUTBOX_BASE:-/tmp/outbox_delivery_test}
export OUTBOX_PGPORT=${OUTBOX_PGPORT:-54816}
export OUTBOX_WORKERS=${OUTBOX_WORKERS:-2}
if [ "${OUTBOX_SKIP_INSTALL:-}" != 1 ]; then bash scripts/cluster.sh install; fi
fresh_cluster
trap 'bash scripts/cluster.sh stop immediate >/dev/null 2>&1 || true' EXIT
OUTBOX_WRITE_RELIABILITY=1 cargo test -p outbox_e2e --release --test crash_matrix -- --test-threads=1 --nocapture
git --no-pager diff --stat -- docs/reliability.md
