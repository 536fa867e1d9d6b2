#!/usr/bin/env bash
# Builds the Debian package of this version for the system PostgreSQL 15 and prints its path:
#   postgresql-15-outbox-delivery_<version>_amd64.deb
#
#   scripts/package.sh            (written to $CARGO_TARGET_DIR/debian, else target/debian)
#
# Its files come from `cargo pgrx package`: the shared library, the control file, the install
# script of this version and every upgrade script in sql/; to them are added the frozen
# install scripts of the released versions (sql/outbox_delivery--X.sql) and the README and
# RELEASES.md. Installing the package needs no Rust toolchain:
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

doc=$TREE/usr/share/doc/$NAME
mkdir -p "$doc"
cp "$ROOT/README.md" "$ROOT/RELEASES.md" "$doc/"

# The lowest glibc the library needs, from its versioned symbols.
glibc=$(objdump -T "$LIB/outbox_delivery.so" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -n 1)
mkdir -p "$TREE/DEBIAN"
cat >"$TREE/DEBIAN/control" <<CONTROL
Package: $NAME
Version: $version
Architecture: amd64
Maintainer: outbox_delivery maintainers <outbox-delivery@localhost>
Depends: postgresql-$MAJOR, libc6 (>= ${glibc:-2.17})
Section: database
Priority: optional
Installed-Size: $(du -sk --exclude=DEBIAN "$TREE" | cut -f1)
Description: durable delivery of side effects from PostgreSQL $MAJOR transactions
 outbox_delivery is a PostgreSQL extension with a background worker: a message enqueued in
 a transaction exists if and only if the transaction commits, is sent to its HTTP endpoint
 (or runs as a function in the database) with a stable effect key, and is recorded in a
 ledger that stops a second execution. Add outbox_delivery to shared_preload_libraries,
 restart the server and run CREATE EXTENSION outbox_delivery (or ALTER EXTENSION
 outbox_delivery UPDATE after an upgrade).
CONTROL
(cd "$TREE" && find usr -type f -print0 | sort -z | xargs -0 md5sum >DEBIAN/md5sums)
find "$TREE" -type d -exec chmod 755 {} +
find "$TREE/usr" -type f -exec chmod 644 {} +
chmod 644 "$TREE/DEBIAN/control" "$TREE/DEBIAN/md5sums"

rm -f "$DEB"
dpkg-deb --root-owner-group -Zxz --build "$TREE" "$DEB" >/dev/null
# The staged tree stays for the tests; its DEBIAN directory is not part of an install.
echo "$DEB"
