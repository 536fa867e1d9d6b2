#!/usr/bin/env bash
# Delivery figures of two builds of the extension, side by side in one run: each build is
# checked out at its revision (a git worktree of its own, built with its own target
# directory), installed, and measured on a fresh cluster; the builds alternate round by
# round, so that both see the same machine. Figures only; nothing is asserted.
#
# Usage: bench/bench_builds.sh OLD_REV NEW_REV [backlog=10000] [rounds=2]
#   e.g. bench/bench_builds.sh 9a356d9 HEAD
# Leaves the NEW_REV build installed when it ends (the build the tree at NEW_REV expects).
source "$(dirname "$0")/../scripts/lib.sh"
OLD=${1:?usage: bench/bench_builds.sh OLD_REV NEW_REV [backlog] [rounds]}
NEW=${2:?usage: bench/bench_builds.sh OLD_REV NEW_REV [backlog] [rounds]}
BACKLOG=${3:-10000}
ROUNDS=${4:-2}
export OUTBOX_BASE=/tmp/outbox_delivery_bench_builds
export OUTBOX_PGPORT=54821
export OUTBOX_WORKERS=2
export OUTBOX_EXTRA_CONF="outbox.batch_size = 200"

bash scripts/setup.sh >/dev/null
# The benchmark client and the provider simulator are this tree's (they do not depend on
# the extension's build).
cargo build -q --release -p outbox_e2e --bin bench --bin provider-sim
BENCH="$ROOT/target/release/bench"

# A build of REV: its worktree and target directory, built once and kept for reruns.
worktree_of() { echo "/tmp/outbox_build_$(git rev-parse --short "$1")"; }
prepare() {
  local rev=$1 dir
  dir=$(worktree_of "$rev")
  if [ ! -d "$dir" ]; then
    git worktree add -q --detach "$dir" "$(git rev-parse "$rev")"
  fi
  echo "$dir"
}
install_build() {
  local dir=$1
  (cd "$dir" && CARGO_TARGET_DIR="$dir/target" cargo pgrx install --release --pg-config /usr/bin/pg_config >/dev/null 2>&1)
}

OLD_DIR=$(prepare "$OLD")
NEW_DIR=$(prepare "$NEW")
echo "building $OLD ($OLD_DIR) and $NEW ($NEW_DIR) ..."
install_build "$OLD_DIR"
install_build "$NEW_DIR"

trap 'bash scripts/cluster.sh stop immediate >/dev/null 2>&1 || true' EXIT
echo "machine: $(nproc) cores; $OUTBOX_WORKERS delivery workers; backlog $BACKLOG; $ROUNDS rounds, builds alternating"
declare -A lines
for round in $(seq "$ROUNDS"); do
  for side in old new; do
    if [ "$side" = old ]; then dir=$OLD_DIR; rev=$OLD; else dir=$NEW_DIR; rev=$NEW; fi
    install_build "$dir"
    fresh_cluster >/dev/null
    out=$("$BENCH" --backlog "$BACKLOG" --large-backlog 0 --latency-samples 200 --steady-seconds 0 2>&1 |
      grep -E '^(deliveries_per_s|latency_)' || true)
    while read -r name value unit _; do
      [ -n "$name" ] || continue
      lines["$name $side"]="${lines["$name $side"]:-}${lines["$name $side"]:+, }$value"
    done <<<"$out"
    echo "round $round $side ($rev): $(echo "$out" | tr '\n' ';')"
  done
done
bash scripts/cluster.sh destroy >/dev/null 2>&1 || true
echo
echo "figure | $OLD (rounds) | $NEW (rounds)"
for key in "${!lines[@]}"; do
  name=${key% *}
  [ "${key##* }" = old ] || continue
  echo "$name | ${lines["$name old"]} | ${lines["$name new"]:-}"
done | sort
