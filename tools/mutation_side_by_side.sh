#!/usr/bin/env bash
# Mutation runs side by side on a many-core machine: one tools/mutation.py process per group of
# modules, each with its own workers and report folder (their summary.txt lines are merged at the end).
#   bash tools/mutation_side_by_side.sh OUT "WORKERS MODULE..." ["WORKERS MODULE..." ...]
set -uo pipefail
out=$1; shift
mkdir -p "$out"
i=0
for group in "$@"; do
  read -r workers modules <<<"$group"
  i=$((i + 1))
  # shellcheck disable=SC2086  # the modules are words
  python3 -u tools/mutation.py --workers "$workers" --out "$out/part$i" $modules >"$out/part$i.log" 2>&1 &
done
wait
cat "$out"/part*/summary.txt 2>/dev/null | grep -v '^#' | sort >"$out/summary.txt"
