// GPTQ int4 with act-order: quantized reload into the layout the kernel reads.
//
// Checkpoint (input), for a linear layer with N outputs and K inputs (logical weight [N, K]):
//   qweight i32[K/8, N]: word (i, n) holds k = 8i + j in bits 4j..4j+3, unsigned 4-bit codes.
//   scales  f16[K/128, N]: one scale per group and output column.
//   g_idx   i32[K]: the group of input row k (act-order: groups are not contiguous in k).
// The checkpoint is symmetric (GPTQ sym=True): the zero point is 8 for every group, so
// w[n, k] = (code(k, n) - 8) * f32(scales[g_idx[k], n]). qzeros are not read.
//
// Kernel layout (storage, in this order):
//   qweight   i32[K/8, N]  the codes in sorted order: row k' of the sorted weight is input row perm[k']
//   scales    f16[K/128, N] copied; sorted row k' uses group k' / 128
//   perm      i32[K]        runtime: perm = stable argsort(g_idx); the GEMM gathers x[:, perm[k']]
//   workspace i32[ceil(N/64) + 1] runtime: zeroed; one counter per 64-column tile that the CUDA
//             GEMM's K-slices use to take turns (and leave at zero when they finish), then the
//             error flag a slice sets when it gives up waiting (read by gemm_check)
// Every group must hold exactly 128 rows (so that the sorted order has one group per 128 rows, as
// act-order kernels require); otherwise InvalidArgument. K must be a multiple of 128.
#pragma once

#include <span>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "kernels/quantize.h"

namespace ferry::kernels {

inline constexpr int64_t kGptqPackFactor = 8;  // int4 codes per i32 word
inline constexpr int64_t kGptqZeroPoint = 8;
inline constexpr int64_t kGptqTileN = 64;  // output columns per workspace counter

// The checkpoint tensors gptq_reload() reads for a logical weight `shape` = [N, K]:
// qweight, scales, g_idx (none runtime).
Result<std::vector<StorageTensor>> gptq_checkpoint_layout(const Shape& shape);
// The storage the kernel reads (what storage_layout(Scheme::kGptqInt4, shape, {}) returns).
Result<std::vector<StorageTensor>> gptq_storage_layout(const Shape& shape);

// gptq_int4 as vLLM's and SGLang's Marlin kernels read it (vLLM GPTQMarlinLinearMethod through
// MarlinLinearKernel.process_weights_after_loading; docs/engines.md), what
// storage_layout(Scheme::kGptqInt4, EngineLayout::kVllm or kSglang, shape) returns:
//   qweight            i32[K/16, 2N]  gptq_marlin_repack(qweight, perm = g_idx_sort_indices): the codes
//                      in sorted order, in Marlin's tiles (kernels/marlin_layout.h)
//   scales             model dtype [K/128, N]: the checkpoint's, converted, by marlin_permute_scales
//   g_idx              i32[K] runtime: g_idx sorted (marlin_sort_g_idx)
//   g_idx_sort_indices i32[K] runtime: the stable argsort of g_idx (perm above)
// N must be a multiple of 64; the model's dtype bf16 or f16.
Result<std::vector<StorageTensor>> gptq_marlin_layout(const Shape& shape, DType model);

// Derives perm from g_idx, repacks qweight into the sorted layout, copies scales and zeroes the
// workspace, writing into `outputs` (gptq_storage_layout order). All views on one device.
Status gptq_reload(const TensorView& qweight, const TensorView& scales, const TensorView& g_idx,
                   std::span<const TensorView> outputs, const Exec& exec = {});
// The same into an engine layout's storage (gptq_marlin_layout() for vllm and sglang).
Status gptq_reload(EngineLayout layout, const TensorView& qweight, const TensorView& scales, const TensorView& g_idx,
                   std::span<const TensorView> outputs, const Exec& exec = {});

}  // namespace ferry::kernels
