#!/usr/bin/env bash
# Builds the Debian package of this version for the system PostgreSQL 15 and prints its path:
#   postgresql-15-outbox-delivery_<version>_amd64.deb
#
#   scripts/package.sh            (written to $CARGO_TARGET_DIR/debian, else target/debian)
#
# Also the package of its debug symbols, postgresql-15-outbox-delivery-dbgsym (the library in
# the package is stripped; its symbols go to /usr/lib/debug/.build-id/, found by gdb and
# debuginfod by the library's build id). Settings: OUTBOX_DEB_MAINTAINER ("Name <address>";
# by default the author of the commit built), OUTBOX_DEB_HOMEPAGE (the Homepage field, left
# out when unset).
#
# Its files come from `cargo pgrx package`: the shared library, the control file, the install
# script of this version and every upgrade script in sql/; to them are added the frozen
# install scripts of the released versions (sql/outbox_delivery--X.sql) and the README and
# RELEASES.md, the runbook, the Prometheus rules and the Grafana dashboard, the copyright
# (Apache-2.0) and a Debian changelog. Installing the package needs no Rust toolchain:
#   apt-get install ./postgresql-15-outbox-delivery_<version>_amd64.deb
# The staged tree (OUT/tree) is what the upgrade tests install into a private PostgreSQL.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PG_CONFIG=/usr/bin/pg_config
MAJOR=15
NAME=postgresql-$MAJOR-outbox-delivery
OUT=${CARGO_TARGET_DIR:-$ROOT/target}/debian
export PATH="$HOME/.cargo/bin:$PATH"

version=$(awk -F'"' '/^version *=/ { print $2; exit }' "$ROOT/Cargo.toml")
TREE=$OUT/tree
LIB=$TREE/usr/lib/postgresql/$MAJOR/lib
EXT=$TREE/usr/share/postgresql/$MAJOR/extension
DEB=$OUT/${NAME}_${version}_amd64.deb

mkdir -p "$OUT"
rm -rf "$TREE"
if ! (cd "$ROOT" && cargo pgrx package --pg-config "$PG_CONFIG" --out-dir "$TREE") >"$OUT/build.log" 2>&1; then
  echo "package: cargo pgrx package failed; the end of $OUT/build.log:" >&2
  tail -n 30 "$OUT/build.log" >&2
  exit 1
fi

# Released install scripts (no second "--": upgrade scripts are already there). The one of
# this version, if it is frozen already, is the generated one.
for f in "$ROOT"/sql/outbox_delivery--*.sql; do
  name=$(basename "$f")
  case "$name" in outbox_delivery--*--*) continue ;; esac
  [ -e "$EXT/$name" ] || cp "$f" "$EXT/$name"
done
for f in "$ROOT"/sql/outbox_delivery--*--*.sql; do
  [ -e "$f" ] || continue
  [ -e "$EXT/$(basename "$f")" ] || { echo "package: $(basename "$f") missing from the package" >&2; exit 1; }
done
[ -e "$EXT/outbox_delivery--$version.sql" ] || { echo "package: no install script for $version" >&2; exit 1; }

MAINTAINER=${OUTBOX_DEB_MAINTAINER:-$(git -C "$ROOT" log -1 --format='%an <%ae>' 2>/dev/null || true)}
if [ -z "$MAINTAINER" ]; then
  echo "package: no maintainer: set OUTBOX_DEB_MAINTAINER=\"Name <address>\"" >&2
  exit 1
fi
# The date of the commit built, so that the same commit gives the same changelog.
DATE=$(git -C "$ROOT" log -1 --format=%cD 2>/dev/null || date -R)

# The documentation an operator needs on the server, the copyright, and the changelog of a
# native package (changelog.gz). The Prometheus rules and the Grafana dashboard stay
# uncompressed: they are loaded by Prometheus and imported into Grafana as they are.
doc=$TREE/usr/share/doc/$NAME
mkdir -p "$doc"
cp "$ROOT/README.md" "$ROOT/RELEASES.md" "$ROOT/docs/runbook.md" "$ROOT/docs/prometheus-rules.yml" \
  "$ROOT/docs/grafana-dashboard.json" "$doc/"
gzip -9n "$doc/README.md" "$doc/RELEASES.md" "$doc/runbook.md"
cat >"$doc/copyright" <<COPYRIGHT
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: outbox_delivery
Upstream-Contact: $MAINTAINER

Files: *
Copyright: 2026 the outbox_delivery authors
License: Apache-2.0

License: Apache-2.0
 Licensed under the Apache License, Version 2.0 (the "License"); you may not use
 this file except in compliance with the License.
 .
 On Debian systems, the full text of the Apache License, Version 2.0 can be found
 in the file /usr/share/common-licenses/Apache-2.0.
COPYRIGHT
cat >"$doc/changelog" <<CHANGELOG
$NAME ($version) unstable; urgency=medium

  * Release $version of outbox_delivery for PostgreSQL $MAJOR: what changed is in
    /usr/share/doc/$NAME/RELEASES.md.gz.

 -- $MAINTAINER  $DATE
CHANGELOG
gzip -9n "$doc/changelog"

# The library stripped, its debug symbols kept apart, by build id, for the -dbgsym package.
so=$LIB/outbox_delivery.so
build_id=$(readelf -n "$so" | awk '/Build ID:/ { print $3 }')
if [ -z "$build_id" ]; then
  echo "package: $so has no build id" >&2
  exit 1
fi
DBG_TREE=$OUT/dbgsym-tree
DBG_NAME=$NAME-dbgsym
rm -rf "$DBG_TREE"
debug=$DBG_TREE/usr/lib/debug/.build-id/${build_id:0:2}/${build_id:2}.debug
mkdir -p "$(dirname "$debug")" "$DBG_TREE/usr/share/doc"
objcopy --only-keep-debug --compress-debug-sections "$so" "$debug"
objcopy --strip-debug --strip-unneeded --remove-section=.comment "$so"
objcopy --add-gnu-debuglink="$debug" "$so"
ln -s "$NAME" "$DBG_TREE/usr/share/doc/$DBG_NAME"

# The lowest glibc the library needs, from its versioned symbols.
glibc=$(objdump -T "$LIB/outbox_delivery.so" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -n 1)
mkdir -p "$TREE/DEBIAN"
cat >"$TREE/DEBIAN/control" <<CONTROL
Package: $NAME
Version: $version
Architecture: amd64
Maintainer: $MAINTAINER
Depends: postgresql-$MAJOR, libc6 (>= ${glibc:-2.17})
Section: database
Priority: optional
${OUTBOX_DEB_HOMEPAGE:+Homepage: $OUTBOX_DEB_HOMEPAGE
}Installed-Size: $(du -sk --exclude=DEBIAN "$TREE" | cut -f1)
Description: durable delivery of side effects from PostgreSQL $MAJOR transactions
 outbox_delivery is a PostgreSQL extension with a background worker: a
 message enqueued in a transaction exists if and only if the transaction
 commits, is sent to its HTTP endpoint (or runs as a function in the
 database) with a stable effect key, and is recorded in a ledger that stops
 a second execution. Add outbox_delivery to shared_preload_libraries,
 restart the server and run CREATE EXTENSION outbox_delivery (or ALTER
 EXTENSION outbox_delivery UPDATE after an upgrade).
CONTROL
(cd "$TREE" && find usr -type f -print0 | sort -z | xargs -0 md5sum >DEBIAN/md5sums)
find "$TREE" -type d -exec chmod 755 {} +
find "$TREE/usr" -type f -exec chmod 644 {} +
chmod 644 "$TREE/DEBIAN/control" "$TREE/DEBIAN/md5sums"

rm -f "$DEB"
dpkg-deb --root-owner-group -Zxz --build "$TREE" "$DEB" >/dev/null

mkdir -p "$DBG_TREE/DEBIAN"
cat >"$DBG_TREE/DEBIAN/control" <<CONTROL
Package: $DBG_NAME
Version: $version
Architecture: amd64
Maintainer: $MAINTAINER
Depends: $NAME (= $version)
Section: debug
Priority: optional
Auto-Built-Package: debug-symbols
Build-Ids: $build_id
Installed-Size: $(du -sk --exclude=DEBIAN "$DBG_TREE" | cut -f1)
Description: debug symbols for $NAME
CONTROL
(cd "$DBG_TREE" && find usr -type f -print0 | sort -z | xargs -0 md5sum >DEBIAN/md5sums)
find "$DBG_TREE" -type d -exec chmod 755 {} +
find "$DBG_TREE/usr" -type f -exec chmod 644 {} +
chmod 644 "$DBG_TREE/DEBIAN/control" "$DBG_TREE/DEBIAN/md5sums"
DBG_DEB=$OUT/${DBG_NAME}_${version}_amd64.deb
rm -f "$DBG_DEB"
dpkg-deb --root-owner-group -Zxz --build "$DBG_TREE" "$DBG_DEB" >/dev/null
# The staged tree stays for the tests; its DEBIAN directory is not part of an install.
echo "$DEB"
