#!/usr/bin/env bash
# ThreadSanitizer over the concurrent parts: the control plane (coordinator, trainer, ranks over real
# sockets), the host transports, and a sender's compare of a tensor's boxes on the work pool. Builds without CUDA; UCX's memory hooks are turned off at run
# time, since they patch madvise and crash the TSan runtime when a thread exits.
# usage: scripts/tsan.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-tsan}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFERRY_TSAN=ON -DFERRY_CUDA=OFF \
  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" > /dev/null
tests=(coordinator_io_loop_test coordinator_update_test coordinator_fault_test coordinator_fail_closed_test coordinator_stage_test
       transport_conformance_test core_cow_vector_test core_work_pool_test dataplane_tensor_scan_test)
cmake --build "$build" --target "${tests[@]}" ferry-fault-peer
export UCX_MEM_MMAP_HOOK_MODE=none UCX_MEM_MALLOC_HOOKS=no UCX_MEM_EVENTS=no
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}
for t in "${tests[@]}"; do
  echo "== $t"
  "$build/bin/$t"
done
