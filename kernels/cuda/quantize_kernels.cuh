// The CUDA quantize kernels' launchers, split over quantize.cu (dispatch, fp8_block, int4_group,
// none), quantize_rows.cu (per-channel and per-tensor, vectorized) and quantize_generic.cu (any
// alignment and row length, used when the vectorized kernels cannot be).
#pragma once

#include <cuda_runtime.h>

#include "core/status.h"
#include "kernels/internal.h"

namespace ferry::kernels::detail::cuda {

// Row modes of the row kernels.
// kFp8Rule: fp8_per_channel by an engine layout's rule (QuantArgs::fp8), kFp8Channel by ferry's.
enum RowMode : int { kFp8Channel, kInt8Channel, kAmaxOnly, kFp8Given, kFp8Rule };

Status quantize_per_channel(const QuantArgs& a, bool int8, cudaStream_t st);
Status quantize_per_tensor(const QuantArgs& a, cudaStream_t st);

// fp8_per_tensor in one cooperative kernel per shard (quantize_tensor.cu), for 16-byte aligned
// inputs whose shards all start on a vector and hold at least fused_per_tensor_min_bytes() (the
// larger of 4 MiB and the device's L2); `begin`: S + 1 element
// offsets. kNotUsed: nothing was launched (too small, a capturing stream, a device before sm_90 or
// with fewer SMs than it reports); the caller takes the two-kernel path. kFailed: `error` says why.
enum class FusedResult { kUsed, kNotUsed, kFailed };
FusedResult quantize_per_tensor_fused(const QuantArgs& a, const int64_t* begin, size_t shards, cudaStream_t st,
                                      cudaError_t* error);

// One block per row (per 128x128 tile), any alignment, rows of any length; any fp8 rule.
Status generic_rows(const QuantArgs& a, cudaStream_t st);  // fp8_per_channel, int8_per_channel
Status generic_per_tensor(const QuantArgs& a, cudaStream_t st);
Status generic_block(const QuantArgs& a, cudaStream_t st);

}  // namespace ferry::kernels::detail::cuda
