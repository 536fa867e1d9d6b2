#!/usr/bin/env bash
# Brings a fresh Debian 12 machine to a state where outbox_delivery builds, installs and
# tests against the system PostgreSQL 15. Idempotent: every step is skipped when its
# result is already there, so a second run takes seconds.
set -euo pipefail

PGRX_VERSION=0.18.1
PG_CONFIG=/usr/bin/pg_config
# openssl: the test CA of the HTTPS tests; prometheus (with promtool): the scrape test and the
# check of docs/prometheus-rules.yml.
# nats-server: the JetStream server the nats channel tests start on ports of their own.
# pgbouncer: the transaction-mode pooler the application examples reach the cluster through
# (pg_test/tests/pooler.rs starts one of its own; the packaged service is left alone).
# postgresql-15-pgq3: PgQ, the queue the delivery benchmark measures beside ours (bench/bench_anchors.sh).
# libfaketime: a wall clock the clock-step tests move under a server of their own
# (OUTBOX_FAKETIME_FILE, scripts/cluster.sh; pg_test/tests/clock_steps.rs).
# lintian: the package test checks the Debian packages with it.
APT_PACKAGES=(postgresql-15 postgresql-server-dev-15 postgresql-client-15 libclang-dev clang sudo pkg-config curl binutils pgbouncer nats-server openssl prometheus postgresql-15-pgq3 libfaketime lintian)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The Python example's psycopg, pinned in its requirements.txt, installed beside it with pip
# (--target: outside any environment Debian manages).
PY_DEPS=$ROOT/examples/python/.deps
PY_REQUIREMENTS=$ROOT/examples/python/requirements.txt

log() { printf '[setup] %s\n' "$*"; }

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing apt packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  log "apt packages present"
fi

psycopg_pin=$(sed -n 's/^psycopg\[binary\]==//p' "$PY_REQUIREMENTS")
if command -v python3 >/dev/null && PYTHONPATH=$PY_DEPS python3 -c \
     "import psycopg, sys; sys.exit(psycopg.__version__ != '$psycopg_pin')" 2>/dev/null; then
  log "psycopg $psycopg_pin present"
else
  if ! command -v python3 >/dev/null || ! python3 -m pip --version >/dev/null 2>&1; then
    log "installing python3-pip"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends python3 python3-pip >/dev/null
  fi
  log "installing psycopg $psycopg_pin into $PY_DEPS"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --upgrade --target "$PY_DEPS" -r "$PY_REQUIREMENTS"
fi

# The Debian package starts a cluster of its own on 5432; this project's clusters are
# throwaway ones on ports of their own, so the packaged one is left alone.

export PATH="$HOME/.cargo/bin:$PATH"
if cargo pgrx --version 2>/dev/null | grep -q "$PGRX_VERSION"; then
  log "cargo-pgrx $PGRX_VERSION present"
else
  log "installing cargo-pgrx $PGRX_VERSION (a few minutes on 2 cores)"
  cargo install cargo-pgrx --version "$PGRX_VERSION" --locked
fi

if [ -f "$HOME/.pgrx/config.toml" ] && grep -q "pg15" "$HOME/.pgrx/config.toml"; then
  log "pgrx already initialised for pg15"
else
  log "cargo pgrx init --pg15 $PG_CONFIG"
  cargo pgrx init --pg15 "$PG_CONFIG"
fi
log "done"
