#!/usr/bin/env bash
# Before and after a change on one GPU machine, in one sitting: bench/gpu/run.sh passes with the
# binaries of two packages, in the order given, so old and new can alternate and show the noise.
# Pack them first: `bench/gpu/package.sh build` (the new build, into .gpu) and
# `FERRY_GPU_DIR=.gpu-old bench/gpu/package.sh OLD_BUILD` (a second build folder of the old commit,
# e.g. a `git worktree` of it).
# usage: bench/gpu/before_after.sh OUT_DIR PASS...
#   PASS: old:STEPS or new:STEPS (STEPS as for run.sh), e.g.
#     bench/gpu/before_after.sh OUT old:bench,colocated new:bench,colocated new:tests,trainers \
#       old:colocated new:colocated
#   FERRY_GPU_OLD, FERRY_GPU_NEW: the package folders (default .gpu-old, .gpu)
#   FERRY_GPU_DEADLINE_S: seconds after which no pass starts and a running one is stopped (default 560)
# Writes OUT_DIR/results.jsonl (every pass's lines, each led by "pass":"N-old|new"), tests.log and
# env.txt (the passes' logs one after another), passes.txt (each pass's steps, exit status and
# seconds, or why it was skipped) and passes.tar.xz (every pass's own run.sh folder, plots included).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
out=${1:?usage: bench/gpu/before_after.sh OUT_DIR PASS...}
shift
[ $# -gt 0 ] || { echo "no passes given" >&2; exit 2; }
old=${FERRY_GPU_OLD:-.gpu-old}
new=${FERRY_GPU_NEW:-.gpu}
deadline=${FERRY_GPU_DEADLINE_S:-560}
for p in "$@"; do  # refuse a bad pass before anything runs: run.sh would build from source
  side=${p%%:*}
  case $side in old) dir=$old ;; new) dir=$new ;; *) echo "bad pass '$p': old:STEPS or new:STEPS" >&2; exit 2 ;; esac
  if [ "$p" = "$side" ] || [ -z "${p#*:}" ]; then echo "bad pass '$p': no steps" >&2; exit 2; fi
  [ -f "$dir/ferry-gpu.tar.xz" ] || { echo "$dir/ferry-gpu.tar.xz missing (bench/gpu/package.sh)" >&2; exit 2; }
done
mkdir -p "$out"
work=$(mktemp -d)
: > "$out/results.jsonl"; : > "$out/tests.log"; : > "$out/env.txt"; : > "$out/passes.txt"
status=0
i=0
for p in "$@"; do
  i=$((i + 1))
  side=${p%%:*}
  steps=${p#*:}
  name=$i-$side
  if [ "$side" = old ]; then dir=$old; else dir=$new; fi
  left=$((deadline - SECONDS))
  if [ $left -lt 20 ]; then
    echo "$name $steps skipped (${SECONDS} s of $deadline gone)" | tee -a "$out/passes.txt"
    continue
  fi
  start=$SECONDS
  FERRY_GPU_DIR=$dir timeout $left bench/gpu/run.sh "$work/$name" "$steps" > "$work/$name.summary" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  echo "$name $steps rc=$rc $((SECONDS - start)) s" | tee -a "$out/passes.txt"
  sed "s/^{/{\"pass\":\"$name\",/" "$work/$name/results.jsonl" >> "$out/results.jsonl" 2> /dev/null
  grep -h '"bench":"colocated"' "$work/$name/results.jsonl" 2> /dev/null |
    sed -E 's/.*"case":"([^"]*)".*"seconds":([0-9.]+),.*"ratio_to_floor":([0-9.]+).*/  \1 \2 s, x\3 floor/'
  for f in tests.log env.txt; do
    { echo "##### pass $name ($steps) rc=$rc"; cat "$work/$name/$f" 2> /dev/null; } >> "$out/$f"
  done
done
tar -C "$work" -cJf "$out/passes.tar.xz" .
rm -rf "$work"
grep -E "^##### pass|^=== (rc=[^0]|.*FAILED)|failed" "$out/tests.log" | tail -40
exit $status
