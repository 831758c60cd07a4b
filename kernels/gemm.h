// Reference GEMMs y = x * W^T for every scheme, reading exactly the scheme's storage tensors (the
// act-order permutation and workspace included). Correct, not fast.
//   x: f32 or bf16 [M, K], contiguous. W: the scheme's storage for logical weight [N, K], in
//   storage_layout() order. y: f32 [M, N], contiguous, overwritten.
// Each product is f32(x) * dequantized weight (as dequantize() defines it), summed in f32. CPU sums
// k in increasing order; the CUDA GEMMs may sum in another order, so they agree with the CPU within
// rounding, not bit for bit.
// The CUDA gptq_int4 GEMM splits K into slices run by different blocks; the slices of one 64-column
// tile take turns through the tile's counter in the workspace (a slice waits until the counter
// equals its index, accumulates into y, then increments it; the last slice sets it back to 0). A
// workspace that is not zero on entry makes slices wait for a turn that never comes: after a
// bounded wait they give up and set the workspace's error flag (its last element), and y is wrong.
//
// gemm_async only enqueues work on exec.stream (no synchronization, no host copies), so a decode
// step that calls it can be captured into a CUDA graph; everything it touches is in the storage
// tensors. gemm_check reads the workspace back (it waits for exec.stream) and returns
// FailedPrecondition when a slice gave up or a counter was left non-zero; the flag stays set until
// gptq_reload zeroes the workspace. Other schemes have nothing to check (OK). On the CPU,
// gemm_async runs to completion. gemm = gemm_async, then (CUDA) wait and gemm_check.
#pragma once

#include <span>

#include "core/status.h"
#include "core/tensor.h"
#include "kernels/quantize.h"

namespace ferry::kernels {

Status gemm(Scheme scheme, const TensorView& x, std::span<const TensorView> weight, std::span<const int64_t> shard_rows,
            const TensorView& y, const Exec& exec = {});

Status gemm_async(Scheme scheme, const TensorView& x, std::span<const TensorView> weight,
                  std::span<const int64_t> shard_rows, const TensorView& y, const Exec& exec = {});

// `weight` as given to gemm_async (only the gptq_int4 workspace is read).
Status gemm_check(Scheme scheme, std::span<const TensorView> weight, const Exec& exec = {});

}  // namespace ferry::kernels
