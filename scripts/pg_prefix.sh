#!/usr/bin/env bash
# A private copy of the system PostgreSQL 15 under a prefix of its own, so that a test can
# install a release of outbox_delivery into it without touching the system directories
# (other clusters load the library from there). PostgreSQL finds its share and lib
# directories relative to its binaries: PREFIX/lib/postgresql/15/bin/postgres reads
# PREFIX/share/postgresql/15 and PREFIX/lib/postgresql/15/lib.
#
#   scripts/pg_prefix.sh create PREFIX         copy the server (bin, lib, share) under PREFIX
#   scripts/pg_prefix.sh install PREFIX TREE   install a package tree (scripts/package.sh,
#                                              scripts/build_release.sh) into PREFIX
#   scripts/pg_prefix.sh bindir PREFIX         print the directory of its binaries
#
# Start a cluster on it with OUTBOX_PGBIN=$(scripts/pg_prefix.sh bindir PREFIX) scripts/cluster.sh start.
set -euo pipefail

MAJOR=15
cmd=${1:-}
PREFIX=${2:-}
[ -n "$cmd" ] && [ -n "$PREFIX" ] || { sed -n '2,13p' "$0"; exit 2; }

case "$cmd" in
  create)
    rm -rf "$PREFIX"
    mkdir -p "$PREFIX/lib/postgresql" "$PREFIX/share/postgresql"
    cp -a "/usr/lib/postgresql/$MAJOR" "$PREFIX/lib/postgresql/"
    cp -a "/usr/share/postgresql/$MAJOR" "$PREFIX/share/postgresql/"
    # What an earlier install into the system directories left there is not part of the copy.
    rm -f "$PREFIX/lib/postgresql/$MAJOR/lib/outbox_delivery"*.so
    rm -f "$PREFIX/share/postgresql/$MAJOR/extension/outbox_delivery"*
    chmod -R a+rX "$PREFIX"
    ;;
  install)
    TREE=${3:?usage: scripts/pg_prefix.sh install PREFIX TREE}
    lib=$PREFIX/lib/postgresql/$MAJOR/lib
    ext=$PREFIX/share/postgresql/$MAJOR/extension
    [ -d "$lib" ] || { echo "pg_prefix: $PREFIX is not a PostgreSQL prefix (create it first)" >&2; exit 2; }
    # A new file (not one overwritten in place): a running server keeps the old mapping.
    for f in "$TREE/usr/lib/postgresql/$MAJOR/lib/"*.so; do
      rm -f "$lib/$(basename "$f")"
      cp "$f" "$lib/"
    done
    cp "$TREE/usr/share/postgresql/$MAJOR/extension/"* "$ext/"
    chmod -R a+rX "$lib" "$ext"
    ;;
  bindir)
    echo "$PREFIX/lib/postgresql/$MAJOR/bin"
    ;;
  *) sed -n '2,13p' "$0"; exit 2 ;;
esac
