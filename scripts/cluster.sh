#!/usr/bin/env bash
# A throwaway PostgreSQL 15 cluster with outbox_delivery preloaded, on a port of its own,
# run as the `postgres` user. The demo, the end-to-end tests and the benchmarks all use it.
#
#   scripts/cluster.sh install        build (release) and install the extension into PG 15
#                                     (the copy of OUTBOX_PGBIN when it is set)
#   scripts/cluster.sh start          initdb if needed, start, create database + extension
#   scripts/cluster.sh stop [mode]    stop (mode: fast | immediate)
#   scripts/cluster.sh restart [mode]
#   scripts/cluster.sh psql [args]    psql into the outbox database
#   scripts/cluster.sh destroy        stop and remove the data directory
#   scripts/cluster.sh env            print the connection settings
#   scripts/cluster.sh standby HOST PORT NAME
#                                     a streaming hot standby of the primary at HOST:PORT
#                                     (pg_basebackup -R; NAME is its application_name, for
#                                     synchronous_standby_names), on this cluster's port
#   scripts/cluster.sh promote        promote a standby (pg_ctl promote, waits)
#
# Settings (environment): OUTBOX_PGPORT (54815), OUTBOX_PGDATA (/tmp/outbox_delivery/pgdata),
# OUTBOX_DB (outbox: one database, or a comma-separated list, each created with the
# extension), OUTBOX_WORKERS (1), OUTBOX_EXTRA_CONF (extra postgresql.conf lines),
# OUTBOX_PGBIN (the server's binaries: a private copy of PostgreSQL, see scripts/pg_prefix.sh),
# OUTBOX_LOCALE (the cluster's locale at initdb, C.UTF-8; en_US.UTF-8 needs `locale-gen`),
# OUTBOX_FAKETIME_FILE (tests only: the server runs under libfaketime, its wall clock offset
# by what the file says, e.g. `+1h`, read again every second; its monotonic and boot
# clocks stay the machine's).
set -euo pipefail

PGBIN=${OUTBOX_PGBIN:-/usr/lib/postgresql/15/bin}
# `install` builds into the PostgreSQL of OUTBOX_PGBIN when it is set (a private copy), else
# into the system PostgreSQL 15.
PG_CONFIG=${OUTBOX_PGBIN:+$OUTBOX_PGBIN/pg_config}
PG_CONFIG=${PG_CONFIG:-/usr/bin/pg_config}
PORT=${OUTBOX_PGPORT:-54815}
BASE=${OUTBOX_BASE:-/tmp/outbox_delivery}
PGDATA=${OUTBOX_PGDATA:-$BASE/pgdata}
SOCKDIR=$BASE/sock
LOG=$BASE/postgres.log
DB=${OUTBOX_DB:-outbox}
WORKERS=${OUTBOX_WORKERS:-1}
ROOT=$(cd "$(dirname "$0")/.." && pwd)

export PATH="$HOME/.cargo/bin:$PATH"

as_pg() {
  if [ "$(id -un)" = postgres ]; then "$@"; else runuser -u postgres -- "$@"; fi
}

pg_ctl() { as_pg "$PGBIN/pg_ctl" -D "$PGDATA" "$@"; }

psql_db() {
  as_pg /usr/bin/psql -X -v ON_ERROR_STOP=1 -h "$SOCKDIR" -p "$PORT" -d "$1" "${@:2}"
}

running() { [ -f "$PGDATA/postmaster.pid" ] && pg_ctl status >/dev/null 2>&1; }

# Runs "$@" with the server's environment: under libfaketime when OUTBOX_FAKETIME_FILE is
# set (see the settings above).
server_env() {
  if [ -z "${OUTBOX_FAKETIME_FILE:-}" ]; then "$@"; return; fi
  local lib=/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1
  [ -f "$lib" ] || { echo "[cluster] $lib is missing: bash scripts/setup.sh installs libfaketime" >&2; return 1; }
  LD_PRELOAD=$lib FAKETIME_TIMESTAMP_FILE=$OUTBOX_FAKETIME_FILE FAKETIME_CACHE_DURATION=1 \
    DONT_FAKE_MONOTONIC=1 "$@"
}

cmd_install() {
  (cd "$ROOT" && cargo pgrx install --release --pg-config "$PG_CONFIG" >/dev/null)
  echo "[cluster] extension installed into $($PG_CONFIG --pkglibdir)"
}

# The servers of the tests, the benchmarks and the demo listen on ports 54800–54899, inside
# the kernel's range of ephemeral ports (32768–60999 by default). A client connection that
# the kernel gave one of them as its local port holds it as long as it stays open (a pooled
# connection, for minutes), and a server to start there cannot bind it. Reserved, the block is
# never given to a client connection. Run as root only (the setting is the machine's); kept
# until the machine restarts, and only added to what is reserved already.
RESERVED_PORTS=54800-54899
reserve_ports() {
  local f=/proc/sys/net/ipv4/ip_local_reserved_ports current
  [ -w "$f" ] || return 0
  current=$(cat "$f")
  case ",$current," in *",$RESERVED_PORTS,"*) return 0 ;; esac
  echo "${current:+$current,}$RESERVED_PORTS" >"$f" 2>/dev/null || true
}

cmd_start() {
  mkdir -p "$BASE" "$SOCKDIR"
  chown postgres "$BASE" "$SOCKDIR"
  reserve_ports
  if [ ! -f "$PGDATA/PG_VERSION" ]; then
    as_pg "$PGBIN/initdb" -D "$PGDATA" -U postgres -A trust -E UTF8 --locale="${OUTBOX_LOCALE:-C.UTF-8}" >/dev/null
    cat >>"$PGDATA/postgresql.conf" <<CONF
# --- outbox_delivery throwaway cluster ---
port = $PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$SOCKDIR'
shared_preload_libraries = 'outbox_delivery'
outbox.database = '$DB'
outbox.workers = $WORKERS
outbox.poll_interval_ms = 500
max_connections = 200
max_worker_processes = 32
shared_buffers = 512MB
log_line_prefix = '%m [%p] %q%a '
log_min_messages = log
CONF
    if [ -n "${OUTBOX_EXTRA_CONF:-}" ]; then printf '%s\n' "$OUTBOX_EXTRA_CONF" >>"$PGDATA/postgresql.conf"; fi
  fi
  if ! running; then
    touch "$LOG" && chown postgres "$LOG"
    # Where the block could not be reserved (not root), an outgoing connection that used
    # the port as its local port may still hold it, for a minute after it closes (TIME_WAIT).
    local deadline=$((SECONDS + 90)) from
    while from=$(stat -c %s "$LOG"); ! server_env pg_ctl -l "$LOG" -w -t 60 start >/dev/null 2>&1; do
      if [ $SECONDS -ge $deadline ] || ! tail -c +"$((from + 1))" "$LOG" | grep -q 'Address already in use'; then
        echo "[cluster] the server did not start; the end of $LOG:" >&2
        tail -n 20 "$LOG" >&2
        return 1
      fi
      echo "[cluster] port $PORT is still held by a closed connection; starting again in 2 s" >&2
      sleep 2
    done
  fi
  if [ -f "$PGDATA/standby.signal" ]; then
    echo "[cluster] running (hot standby): port $PORT, data $PGDATA, log $LOG"
    return
  fi
  local db
  for db in $(databases); do
    if [ "$(psql_db postgres -Atc "SELECT count(*) FROM pg_database WHERE datname = '$db'")" = 0 ]; then
      psql_db postgres -qc "CREATE DATABASE $db"
    fi
    psql_db "$db" -qc "CREATE EXTENSION IF NOT EXISTS outbox_delivery" 2>&1 | grep -v '^$' || true
  done
  echo "[cluster] running: port $PORT, database $DB, data $PGDATA, log $LOG"
}

# The databases of OUTBOX_DB, one a line.
databases() { tr ',' '\n' <<<"$DB" | tr -d ' \t' | grep -v '^$'; }

# A hot standby of the primary at $1:$2 in this cluster's data directory, streaming under
# the application_name $3, with this cluster's port and socket directory.
cmd_standby() {
  local host=${1:?primary host} port=${2:?primary port} name=${3:?application_name}
  cmd_stop immediate >/dev/null
  rm -rf "$PGDATA"
  mkdir -p "$BASE" "$SOCKDIR"
  chown postgres "$BASE" "$SOCKDIR"
  as_pg "$PGBIN/pg_basebackup" -D "$PGDATA" -R -X stream -c fast \
    -d "host=$host port=$port user=postgres application_name=$name" >/dev/null
  cat >>"$PGDATA/postgresql.conf" <<CONF
# --- the standby's own ---
port = $PORT
unix_socket_directories = '$SOCKDIR'
hot_standby = on
CONF
  cmd_start
}

cmd_promote() {
  pg_ctl promote -w -t 60 >/dev/null
  echo "[cluster] promoted: port $PORT"
}

cmd_stop() {
  local mode=${1:-fast}
  if running; then pg_ctl -m "$mode" -w -t 60 stop >/dev/null; fi
  echo "[cluster] stopped ($mode)"
}

case "${1:-}" in
  install) cmd_install ;;
  start) cmd_start ;;
  stop) cmd_stop "${2:-fast}" ;;
  restart) cmd_stop "${2:-fast}"; cmd_start ;;
  psql) shift; psql_db "$(databases | head -n1)" "$@" ;;
  standby) shift; cmd_standby "$@" ;;
  promote) cmd_promote ;;
  destroy) cmd_stop immediate || true; rm -rf "$PGDATA" ;;
  env) echo "OUTBOX_PGHOST=$SOCKDIR OUTBOX_PGPORT=$PORT OUTBOX_DB=$DB OUTBOX_PGDATA=$PGDATA OUTBOX_LOG=$LOG" ;;
  *) sed -n '2,22p' "$0"; exit 2 ;;
esac
