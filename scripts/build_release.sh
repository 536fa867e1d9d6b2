#!/usr/bin/env bash
# Builds a released version of outbox_delivery from the commit RELEASES.md records for it
# and prints the directory of its package tree (as `cargo pgrx package` writes it:
# usr/lib/postgresql/15/lib/outbox_delivery.so, usr/share/postgresql/15/extension/…).
#
#   scripts/build_release.sh 0.1.0
#
# The release is built in a git worktree of its commit, with the same toolchain and a target
# directory of its own, both kept under OUTBOX_RELEASES_CACHE (default:
# $CARGO_TARGET_DIR/releases, else target/releases): a second run finds the tree built and
# returns at once. The upgrade tests install these trees into a private copy of PostgreSQL.
set -euo pipefail

VERSION=${1:?usage: scripts/build_release.sh VERSION}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PG_CONFIG=/usr/bin/pg_config
CACHE=${OUTBOX_RELEASES_CACHE:-${CARGO_TARGET_DIR:-$ROOT/target}/releases}/$VERSION
export PATH="$HOME/.cargo/bin:$PATH"

# The commit of a released version: the second column of its row in RELEASES.md.
release_commit() {
  awk -F'|' -v v="$1" '
    { gsub(/[ `]/, "", $2); gsub(/[ `]/, "", $3) }
    $2 == v && $3 ~ /^[0-9a-f]+$/ { print $3; exit }' "$ROOT/RELEASES.md"
}

commit=$(release_commit "$VERSION")
if [ -z "$commit" ]; then
  echo "build_release: version $VERSION has no commit in RELEASES.md (not released?)" >&2
  exit 2
fi
if ! git -C "$ROOT" cat-file -e "$commit^{commit}" 2>/dev/null; then
  echo "build_release: commit $commit of $VERSION is not in this clone (a shallow clone? run git fetch --unshallow)" >&2
  exit 2
fi

TREE=$CACHE/tree
if [ "$(cat "$TREE/.commit" 2>/dev/null)" = "$commit" ]; then
  echo "$TREE"
  exit 0
fi

mkdir -p "$CACHE"
if [ "$(git -C "$CACHE/src" rev-parse HEAD 2>/dev/null)" != "$commit" ]; then
  git -C "$ROOT" worktree prune
  rm -rf "$CACHE/src"
  git -C "$ROOT" worktree add --detach --force "$CACHE/src" "$commit" >/dev/null 2>&1
fi

echo "[build_release] building $VERSION from $commit (log: $CACHE/build.log)" >&2
rm -rf "$TREE"
if ! (cd "$CACHE/src" && CARGO_TARGET_DIR="$CACHE/target" \
      cargo pgrx package --pg-config "$PG_CONFIG" --out-dir "$TREE") >"$CACHE/build.log" 2>&1; then
  echo "build_release: building $VERSION failed; the end of $CACHE/build.log:" >&2
  tail -n 30 "$CACHE/build.log" >&2
  exit 1
fi
echo "$commit" >"$TREE/.commit"
echo "$TREE"
