#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ with clang (FERRY_FUZZ=ON: only the libraries they drive,
# under ASan and UBSan) and runs each for SECONDS (default 30) from its seed corpus, fuzz/corpus/NAME
# for target fuzz_NAME. Any crash, leak, sanitizer report or hang fails the script; the input that
# caused it is left in BUILD_DIR/artifacts/. New inputs go to BUILD_DIR/corpus/, never into fuzz/.
# Usage: scripts/fuzz.sh [SECONDS [TARGET...]]   (FERRY_FUZZ_BUILD_DIR, default build-fuzz)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then targets=(fuzz_frame fuzz_handlers fuzz_bucket fuzz_admission); fi
build_dir=${FERRY_FUZZ_BUILD_DIR:-build-fuzz}

cc=$(command -v clang-14 || command -v clang)
cxx=$(command -v clang++-14 || command -v clang++)
cmake -S . -B "$build_dir" -G Ninja -DFERRY_FUZZ=ON -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
cmake --build "$build_dir" --target "${targets[@]}"

# llvm-symbolizer-14 names the frames of a crash report.
if [ -d /usr/lib/llvm-14/bin ]; then export PATH="/usr/lib/llvm-14/bin:$PATH"; fi
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
mkdir -p "$build_dir/artifacts"
# The targets run side by side: the fuzz step takes SECONDS however many there are.
pids=()
for t in "${targets[@]}"; do
  name=${t#fuzz_}
  mkdir -p "$build_dir/corpus/$name"
  "$build_dir/bin/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$build_dir/artifacts/$t-" "$build_dir/corpus/$name" "fuzz/corpus/$name" \
    >"$build_dir/$t.log" 2>&1 &
  pids+=($!)
done
echo "fuzz: ${targets[*]} for ${seconds}s each"
failed=0
for i in "${!targets[@]}"; do
  t=${targets[$i]}
  if wait "${pids[$i]}"; then
    echo "fuzz: $t ok, $(grep -m1 '^stat::number_of_executed_units' "$build_dir/$t.log" | awk '{print $2}') inputs"
  else
    tail -n 60 "$build_dir/$t.log"
    echo "fuzz: $t failed; reproduce with $build_dir/bin/$t $build_dir/artifacts/$t-*" >&2
    failed=1
  fi
done
exit $failed
