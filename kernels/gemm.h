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
// bounded wait they give up, y is wrong, and the call returns FailedPrecondition. The CUDA GEMMs
// wait for the stream before returning (they report such errors).
#pragma once

#include <span>

#include "core/status.h"
#include "core/tensor.h"
#include "kernels/quantize.h"

namespace ferry::kernels {

Status gemm(Scheme scheme, const TensorView& x, std::span<const TensorView> weight, std::span<const int64_t> shard_rows,
            const TensorView& y, const Exec& exec = {});

}  // namespace ferry::kernels
