#!/usr/bin/env bash
# The no-regression checks of a change, before and after, in one run on this machine:
#
#   bash scripts/before_after.sh REV [OPTIMIZER]
#
# REV (a commit: the "before") is checked out in a temporary git worktree; the "after" is the
# working tree. For each, one after the other, it runs
#   - python -m mixedopt.bench.small: the dispatched-op table and the 64 x Linear(64, 64)
#     iteration times and ratios,
#   - python -m mixedopt.bench.launches: the kernel launches of the accelerator path,
#   - python -m mixedopt.bench --params 16 --numel 2000000 (steps only): the 16 x 2M step ratios,
#   - scripts/count_instructions.py --optimizer OPTIMIZER (sgd by default): instructions per
#     iteration (needs valgrind; set NO_VALGRIND=1 to leave it out).
# Each library is imported from its own tree (PYTHONPATH), with the environment it runs in here.
set -euo pipefail
rev=${1:?usage: bash scripts/before_after.sh REV [sgd|adamw|rmsprop]}
optimizer=${2:-sgd}
root=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
git -C "$root" worktree add --detach "$work/before" "$rev" >/dev/null
trap 'git -C "$root" worktree remove --force "$work/before"; rm -rf "$work"' EXIT

run() {  # run TREE COMMAND...: COMMAND with TREE's mixedopt, from TREE
  local tree=$1
  shift
  (cd "$tree" && PYTHONPATH="$tree" "$@")
}

for tree in "$work/before" "$root"; do
  if [ "$tree" = "$root" ]; then
    name="after: the working tree ($(git -C "$root" rev-parse --short HEAD) and its changes)"
  else
    name="before: $(git -C "$root" rev-parse --short "$rev")"
  fi
  echo "=================================================================== $name"
  run "$tree" python -c 'import mixedopt; print("mixedopt from", mixedopt.__file__)'
  run "$tree" python -m mixedopt.bench.small
  run "$tree" python -m mixedopt.bench.launches
  run "$tree" python -m mixedopt.bench --device cpu --params 16 --numel 2000000 --no-memory \
    --no-iteration --no-small --no-launches
  if [ -z "${NO_VALGRIND:-}" ]; then
    run "$tree" python scripts/count_instructions.py --optimizer "$optimizer"
  fi
done
