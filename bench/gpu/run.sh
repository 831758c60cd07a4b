#!/usr/bin/env bash
# One command on a GPU machine: builds ferry (or unpacks the binaries bench/gpu/package.sh made),
# runs the GPU tests, compute-sanitizer memcheck, and the benchmarks, and writes into OUT_DIR:
#   env.txt        card, driver, CUDA, PyTorch versions, date
#   tests.log      every GPU test's output
#   sanitizer.log  compute-sanitizer memcheck of the CUDA tests
#   results.jsonl  benchmark lines ({"bench":...,"ratio":...})
#   kernels.png    kernel throughput beside the device-copy baseline
#   colocated.png  the colocated update per scheme beside its floor and the PyTorch baselines
# usage: bench/gpu/run.sh OUT_DIR [STEPS]
#   STEPS: comma-separated subset of tests,sanitizer,bench,colocated,torch,probe,multi,trainers,sharded,delta,
#          layouts,moe (default: all)
#   moe: the colocated update of a Qwen3-30B-A3B shaped model (experts stacked per layer in the rollout; the
#   trainer's stacked too: 531 tensors, or one per expert: 18,867) under fp8_block and fp8_per_channel,
#   beside its floor and the PyTorch baselines of the same trainer layout, same run
#   layouts: the colocated 8B update into vLLM's and SGLang's layouts (docs/engines.md) beside ferry's own,
#   per fp8 scheme and int4_group (Marlin's repack for vLLM), in the same run
#   trainers: ferry bench e2e --trainers 1,2,4 (the 117M-parameter and the demo model) over the host transports (CPU processes; the GPU
#   machine has the cores): a sharded trainer beside gather-then-send and the cost model
#   sharded: the colocated 8B fp8_per_channel update from 4 trainer processes on the GPU (each
#   holding Shard(0) rows), beside one trainer process and the floor
#   probe: copy_probe.cu (streaming kernels beside cudaMemcpy), quant_probe.cu and block_probe.cu (quantize
#   kernel shapes)
#   multi (two or more GPUs): nccl and cross-GPU cuda_ipc conformance, TP-2 updates from cuda:0 into a
#   replica on cuda:1,cuda:2 (both on cuda:1 with two GPUs; TP 4 with five or more) over nccl and
#   cuda_ipc (ferry-demo, mpirun ferry-mpi-example), ferry bench transport beside plain NCCL and
#   torch.distributed, the 8B update over nccl beside the cost model
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: bench/gpu/run.sh OUT_DIR [STEPS]}
steps=${2:-tests,sanitizer,bench,colocated,torch,probe,multi,trainers,sharded,delta,layouts,moe}
want() { [[ ",$steps," == *",$1,"* ]]; }
mkdir -p "$out"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLink multicast stays off
status=0

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvcc --version | tail -2
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' 2>&1
  uname -r
} > "$out/env.txt" 2>&1

pkg=${FERRY_GPU_DIR:-.gpu}/ferry-gpu.tar.xz  # FERRY_GPU_DIR: another package (bench/gpu/package.sh)
if [ -f "$pkg" ]; then
  root=/tmp/ferry-gpu
  rm -rf "$root" && mkdir -p "$root" && tar -C "$root" -xJf "$pkg"
  bin=$root/bin
  export LD_LIBRARY_PATH=$root/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  echo "binaries: prebuilt (bench/gpu/package.sh): $pkg" >> "$out/env.txt"
else
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFERRY_CUDA=ON > "$out/build.log" 2>&1 &&
    cmake --build build-gpu >> "$out/build.log" 2>&1 || { echo "build failed"; tail -50 "$out/build.log"; exit 1; }
  bin=build-gpu/bin
  echo "binaries: built here" >> "$out/env.txt"
fi

run() {  # run NAME CMD...: appends to tests.log, remembers failures
  echo "=== $*" >> "$out/tests.log"
  timeout "${FERRY_RUN_TIMEOUT:-300}" "$@" >> "$out/tests.log" 2>&1
  local rc=$?
  echo "=== rc=$rc" >> "$out/tests.log"
  [ $rc -eq 0 ] || status=1
}

if want tests; then
for t in kernels_quantize_test kernels_exhaustive_test kernels_gptq_test kernels_gemm_test kernels_bad_input_test \
         kernels_engine_layout_test kernels_marlin_test kernels_gptq_marlin_test dataplane_delta_device_test core_buffer_test dataplane_bucket_test \
         reload_gpu_test reload_stability_test reload_oracle_test reload_instrument_test reload_band_test reload_delta_test; do
  [ -x "$bin/$t" ] && run "$bin/$t"
done
[ -x "$bin/transport_conformance_test" ] && run "$bin/transport_conformance_test" --gtest_filter='*cuda_ipc*:*nccl*'
# The cost model's buckets are the buckets sent, over the device transports (nccl skips itself below two GPUs).
[ -x "$bin/coordinator_bucket_plan_test" ] && run "$bin/coordinator_bucket_plan_test" --gtest_filter='*OnDevice*'
run "$bin/ferry-demo"
# Colocated on one GPU: the ranks read the trainer's device tensors in place, verified bit-exact.
run "$bin/ferry-demo" --device cuda:0 --tp 1
run "$bin/ferry-demo" --device cuda:0 --tp 2
# References to a bucket's worth of weights travel in a bucket of their own: many buckets here.
run env FERRY_BUCKET_BYTES=64K "$bin/ferry-demo" --device cuda:0 --tp 2
# Buckets in device memory (cuda_ipc): packed on the trainer's GPU, kept and lent on the ranks'.
run env FERRY_TRANSPORT=cuda_ipc FERRY_DIRECT=off "$bin/ferry-demo" --device cuda:0 --tp 2
run env FERRY_TRANSPORT=cuda_ipc FERRY_VERIFY=1 "$bin/ferry-demo" --device cuda:0 --tp 1
fi

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if want multi && [ "$gpus" -ge 2 ]; then
  # A replica of TP 2 on GPUs of its own where the machine has them (3+ GPUs), else both ranks on cuda:1.
  if [ "$gpus" -ge 3 ]; then ranks2=cuda:1,cuda:2; else ranks2=cuda:1; fi
  run env FERRY_TRANSPORT=nccl "$bin/ferry-demo" --device cuda:0 --rank-device $ranks2 --tp 2
  [ "$gpus" -ge 5 ] && run env FERRY_TRANSPORT=nccl "$bin/ferry-demo" --device cuda:0 --rank-device cuda:1,cuda:2,cuda:3,cuda:4 --tp 4
  run env FERRY_TRANSPORT=nccl FERRY_VERIFY=1 "$bin/ferry-demo" --device cuda:0 --rank-device cuda:1 --tp 1
  run env FERRY_TRANSPORT=cuda_ipc "$bin/ferry-demo" --device cuda:0 --rank-device $ranks2 --tp 2
  run env FERRY_TRANSPORT=nccl "$bin/ferry-demo" --device cpu --rank-device $ranks2 --tp 2
  if command -v mpirun > /dev/null && [ -x "$bin/ferry-mpi-example" ]; then
    # TP = the largest power of two the GPUs after the trainer's hold (2 at least: ranks then share).
    tp=2
    while [ $((tp * 2)) -le $((gpus - 1)) ]; do tp=$((tp * 2)); done
    run mpirun --allow-run-as-root --oversubscribe -np $((tp + 1)) -x FERRY_TRANSPORT=nccl -x NCCL_NVLS_ENABLE \
      -x LD_LIBRARY_PATH "$bin/ferry-mpi-example" --tp "$tp" --gpus "$gpus" --updates 5
  fi
  for t in nccl cuda_ipc; do
    for b in 67108864 268435456; do
      "$bin/ferry" bench transport --transport $t --json --bytes $b --iters 20 >> "$out/results.jsonl" 2>> "$out/tests.log"
    done
  done
  timeout 300 python3 bench/gpu/torch_nccl_baseline.py --bytes 67108864 --iters 50 >> "$out/results.jsonl" 2>> "$out/torch.log"
  timeout 300 python3 bench/gpu/torch_nccl_baseline.py --bytes 268435456 --iters 20 >> "$out/results.jsonl" 2>> "$out/torch.log"
  multi8b() {  # multi8b SCHEME TP RANK_DEVICES [BUCKET_BYTES]: the 8B update over nccl beside the cost model
    echo "=== multi-GPU 8B update $*" >> "$out/tests.log"
    FERRY_TRANSPORT=nccl FERRY_BUCKET_BYTES=${4:-64M} timeout 300 "$bin/ferry-bench-colocated" --scheme "$1" \
      --device cuda:0 --rank-device "$3" --tp "$2" --updates "${FERRY_GPU_UPDATES:-10}" --json \
      >> "$out/results.jsonl" 2>> "$out/tests.log" || { echo "multi-GPU $* failed" >> "$out/tests.log"; status=1; }
  }
  for s in ${FERRY_GPU_MULTI_SCHEMES:-fp8_per_channel none}; do
    multi8b "$s" 1 cuda:1
    multi8b "$s" 2 $ranks2
    multi8b "$s" 2 $ranks2 256M
  done
  [ "$gpus" -ge 5 ] && multi8b fp8_per_channel 4 cuda:1,cuda:2,cuda:3,cuda:4
  [ -x "$bin/transport_conformance_test" ] && {
    run "$bin/transport_conformance_test" --gtest_filter='*nccl*:*cuda_ipc_2gpu*:-*SenderJoinsWhileAnotherStreams*:*CloseWithBucketsUndelivered*'
    # Two senders of one process (may meet NCCL's limit on concurrent communicators; own time limit).
    FERRY_RUN_TIMEOUT=150 run "$bin/transport_conformance_test" --gtest_filter='*SenderJoinsWhileAnotherStreams*nccl*'
    FERRY_RUN_TIMEOUT=150 run "$bin/transport_conformance_test" --gtest_filter='*CloseWithBucketsUndelivered*nccl*:*CloseWithBucketsUndelivered*cuda_ipc_2gpu*'
  }
fi

# compute-sanitizer on the CUDA paths (the tests compare CUDA against the CPU bit for bit).
if want sanitizer && command -v compute-sanitizer > /dev/null; then
  for t in "kernels_quantize_test --gtest_filter=*Cuda*:*PerTensorLargerThanL2*:*PerTensorOnePiece*" "kernels_gptq_test --gtest_filter=*Cuda*" \
           "kernels_gemm_test --gtest_filter=*Cuda*" "kernels_engine_layout_test --gtest_filter=*Cuda*" "reload_gpu_test" "reload_band_test" \
           "dataplane_delta_device_test" "reload_delta_test --gtest_filter=*OnTheGpu*"; do
    set -- $t
    [ -x "$bin/$1" ] || continue
    echo "=== compute-sanitizer memcheck $t" >> "$out/sanitizer.log"
    timeout 600 compute-sanitizer --tool memcheck --error-exitcode 3 "$bin/$@" >> "$out/sanitizer.log" 2>&1
    echo "=== rc=$?" >> "$out/sanitizer.log"
  done
fi

if want trainers; then
  echo "=== bench e2e --trainers" >> "$out/tests.log"
  for model in delta demo; do
    FERRY_LOG_LEVEL=error timeout 600 "$bin/ferry" bench e2e --transport all --trainers 1,2,4 --model $model --updates 8 \
      --json >> "$out/results.jsonl" 2>> "$out/tests.log" || { echo "bench e2e --trainers failed" >> "$out/tests.log"; status=1; }
  done
fi

if want bench; then
  "$bin/ferry" bench kernels --device all --json --rows 8192 --cols 8192 >> "$out/results.jsonl" 2>> "$out/tests.log"
  "$bin/ferry" bench reload --json --device all >> "$out/results.jsonl" 2>> "$out/tests.log"
  python3 bench/gpu/plot.py "$out/results.jsonl" "$out/kernels.png" >> "$out/tests.log" 2>&1
fi
# The colocated update of a Llama-3-8B shaped model (issue workload), per scheme, and what users do
# today in PyTorch, in the same run.
schemes=${FERRY_GPU_SCHEMES:-fp8_per_channel fp8_per_tensor int4_group}
if want sharded; then
  for n in 1 4; do
    echo "=== colocated fp8_per_channel --trainers $n" >> "$out/tests.log"
    timeout 300 "$bin/ferry-bench-colocated" --scheme fp8_per_channel --trainers $n --updates "${FERRY_GPU_UPDATES:-10}" \
      --json >> "$out/results.jsonl" 2>> "$out/tests.log" || { echo "sharded --trainers $n failed" >> "$out/tests.log"; status=1; }
  done
fi
# delta: the colocated 8B fp8_per_channel update whose weights follow Adam steps (lr 1e-6): direct
# reads (dense, the default path), bytes over shm, deltas over shm, and deltas staged while serving;
# then deltas compared and applied on the GPU (device copy at the trainer, device shadows at the ranks).
if want delta; then
  for how in "FERRY_DELTA=off" "FERRY_DIRECT=off FERRY_DELTA=off" "FERRY_DIRECT=off FERRY_DELTA=on" \
             "FERRY_DIRECT=off FERRY_DELTA=on FERRY_STAGE=on" \
             "FERRY_DIRECT=off FERRY_DELTA=on FERRY_DELTA_COPY=device FERRY_DELTA_SHADOW=device" \
             "FERRY_DIRECT=off FERRY_DELTA=on FERRY_DELTA_COPY=device FERRY_DELTA_SHADOW=device FERRY_STAGE=on"; do
    echo "=== colocated adam $how" >> "$out/tests.log"
    env $how timeout 500 "$bin/ferry-bench-colocated" --scheme fp8_per_channel --change adam \
      --updates "${FERRY_GPU_DELTA_UPDATES:-3}" --json >> "$out/results.jsonl" 2>> "$out/tests.log" ||
      { echo "colocated adam $how failed" >> "$out/tests.log"; status=1; }
  done
fi
if want colocated; then
  for s in $schemes; do
    echo "=== colocated $s" >> "$out/tests.log"
    timeout 300 "$bin/ferry-bench-colocated" --scheme "$s" --updates "${FERRY_GPU_UPDATES:-10}" --json \
      >> "$out/results.jsonl" 2>> "$out/tests.log" || { echo "colocated $s failed" >> "$out/tests.log"; status=1; }
  done
fi
if want layouts; then
  for sl in fp8_per_tensor:ferry fp8_per_tensor:vllm fp8_per_channel:ferry fp8_per_channel:vllm fp8_per_channel:sglang \
            fp8_block:ferry fp8_block:vllm int4_group:ferry int4_group:vllm; do
    echo "=== colocated ${sl%%:*} --layout ${sl#*:}" >> "$out/tests.log"
    timeout 300 "$bin/ferry-bench-colocated" --scheme "${sl%%:*}" --layout "${sl#*:}" --updates "${FERRY_GPU_UPDATES:-10}" \
      --json >> "$out/results.jsonl" 2>> "$out/tests.log" || { echo "colocated $sl failed" >> "$out/tests.log"; status=1; }
  done
fi
if want torch && [ -f bench/gpu/torch_baseline.py ]; then
  for s in $schemes; do
    timeout 400 python3 bench/gpu/torch_baseline.py --scheme "$s" --baseline all --updates "${FERRY_GPU_UPDATES:-10}" \
      >> "$out/results.jsonl" 2>> "$out/torch.log" || echo "torch baseline $s failed" >> "$out/tests.log"
  done
fi
if want moe; then
  for ex in stacked per-expert; do
    for s in ${FERRY_GPU_MOE_SCHEMES:-fp8_block fp8_per_channel}; do
      echo "=== colocated qwen3-30b-a3b --experts $ex $s" >> "$out/tests.log"
      timeout 400 "$bin/ferry-bench-colocated" --model qwen3-30b-a3b --experts $ex --scheme "$s" \
        --updates "${FERRY_GPU_MOE_UPDATES:-5}" --json >> "$out/results.jsonl" 2>> "$out/tests.log" ||
        { echo "colocated qwen3-30b-a3b $ex $s failed" >> "$out/tests.log"; status=1; }
      [ -f bench/gpu/torch_baseline.py ] && { timeout 500 python3 bench/gpu/torch_baseline.py --model qwen3-30b-a3b \
        --experts $ex --scheme "$s" --baseline "${FERRY_GPU_MOE_BASELINES:-all}" --updates "${FERRY_GPU_MOE_UPDATES:-5}" \
        --warmup 1 >> "$out/results.jsonl" 2>> "$out/torch.log" || echo "torch baseline qwen3-30b-a3b $ex $s failed" >> "$out/tests.log"; }
    done
  done
  python3 bench/gpu/plot_colocated.py "$out/results.jsonl" "$out/colocated-moe.png" qwen3-30b-a3b >> "$out/tests.log" 2>&1
fi
want colocated && python3 bench/gpu/plot_colocated.py "$out/results.jsonl" "$out/colocated.png" >> "$out/tests.log" 2>&1
if want probe && command -v nvcc > /dev/null; then
  nvcc -O3 -I. -gencode=arch=compute_90,code=sm_90 -o /tmp/copy_probe bench/gpu/copy_probe.cu >> "$out/tests.log" 2>&1 &&
    /tmp/copy_probe >> "$out/probe.jsonl" 2>> "$out/tests.log"
  nvcc -O3 -std=c++20 -I. -gencode=arch=compute_90,code=sm_90 -o /tmp/quant_probe bench/gpu/quant_probe.cu \
    >> "$out/tests.log" 2>&1 && /tmp/quant_probe >> "$out/probe.jsonl" 2>> "$out/tests.log"
  nvcc -O3 -std=c++20 -I. -gencode=arch=compute_90,code=sm_90 -o /tmp/block_probe bench/gpu/block_probe.cu \
    >> "$out/tests.log" 2>&1 && /tmp/block_probe >> "$out/probe.jsonl" 2>> "$out/tests.log"
fi
grep -E "^=== (rc=|.*(PASSED|FAILED))|^update v.*(verified|MISMATCH)|failed" "$out/tests.log" | tail -60
grep -E "ERROR SUMMARY|=== rc" "$out/sanitizer.log" 2>/dev/null
cat "$out/results.jsonl" 2>/dev/null
cat "$out/probe.jsonl" 2>/dev/null
exit $status
