#!/usr/bin/env bash
# Sets up a fresh machine, builds everything with warnings as errors under ASan and UBSan, runs
# every test, the concurrent ones again under ThreadSanitizer, then runs each libFuzzer target for a
# bounded time. CUDA code is compiled whenever nvcc is present; GPU tests skip without a device.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
build_dir=${FERRY_TEST_BUILD_DIR:-build-test}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFERRY_WERROR=ON -DFERRY_SANITIZE=ON \
  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1"
cmake --build "$build_dir"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:protect_shadow_gap=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
ctest --test-dir "$build_dir" --output-on-failure -j2 "$@"
# ThreadSanitizer over the concurrent parts (control plane, host transports); FERRY_TSAN_TESTS=0
# skips it.
if [ "${FERRY_TSAN_TESTS:-1}" != 0 ]; then
  scripts/tsan.sh
fi
# The fuzz targets over their seed corpus, FERRY_FUZZ_SECONDS each (scripts/fuzz.sh; 0 skips them).
fuzz_seconds=${FERRY_FUZZ_SECONDS:-30}
if [ "$fuzz_seconds" -gt 0 ]; then
  scripts/fuzz.sh "$fuzz_seconds"
fi
