#!/usr/bin/env bash
# Sets up a fresh machine, builds everything with warnings as errors under ASan and UBSan, runs
# every test, the concurrent ones again under ThreadSanitizer, then runs each libFuzzer target for a
# bounded time. CUDA code is compiled whenever nvcc is present; GPU tests skip without a device.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
build_dir=${FERRY_TEST_BUILD_DIR:-build-test}
# The Python tests run in a venv over the system python that adds PyTorch (PyPI, ~100 s and 5 GB
# the first time; kept in the build directory), so the FSDP2 test runs; FERRY_TORCH=0 leaves torch
# out (the torch tests then skip).
pytest_python=()
if [ "${FERRY_TORCH:-1}" != 0 ]; then
  mkdir -p "$build_dir"
  torch_python=$(scripts/torch-venv.sh "$(cd "$build_dir" && pwd)/torch-venv")
  pytest_python=(-DFERRY_PYTEST_PYTHON="$torch_python")
fi
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFERRY_WERROR=ON -DFERRY_SANITIZE=ON \
  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" "${pytest_python[@]}"
cmake --build "$build_dir"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:protect_shadow_gap=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
ctest_status=0
ctest --test-dir "$build_dir" --output-on-failure -j2 "$@" || ctest_status=$?
if [ "$ctest_status" != 0 ]; then
  # The failing cases and their assertions again, last, where a long log's tail shows them.
  echo "== failed test cases (from $build_dir/Testing/Temporary/LastTest.log)"
  grep -a -A6 -E ': Failure$|^\[  FAILED  \] [^ ]+\.[^ ]+|^FAILED |ERROR: (Address|Undefined|Leak)Sanitizer|runtime error:' "$build_dir/Testing/Temporary/LastTest.log" | cut -c1-300 | tail -n 80 || true
  exit "$ctest_status"
fi
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
