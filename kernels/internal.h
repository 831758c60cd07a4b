// Shared between the kernel front ends (dispatch.cc) and the CPU and CUDA back ends: arguments
// after validation, as raw pointers and sizes, so the back ends never re-check shapes.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "kernels/quantize.h"
#include "kernels/scalar_ops.h"

namespace ferry::kernels::detail {

// How a scheme views a weight of some shape: `batch` stacked matrices of `rows` x `cols`. Rank <= 2,
// and every rank under none and fp8_per_tensor: batch 1, rows = dim 0, cols = the rest. Rank >= 3
// under the per-channel, per-group and block schemes: [E, rows, cols...] is E matrices of dim 1
// rows (fused expert weights), each with its own scales.
struct Geometry {
  int64_t batch = 1;
  int64_t rows = 0;  // of one matrix
  int64_t cols = 0;
};
Geometry geometry(Scheme scheme, const Shape& shape);

struct QuantArgs {
  Scheme scheme = Scheme::kNone;
  const void* in = nullptr;
  DType in_dtype = DType::kF32;
  int64_t rows = 0;         // all rows: batch * matrix_rows
  int64_t matrix_rows = 0;  // rows of one stacked matrix (fp8_block's bands restart at each)
  int64_t cols = 0;
  void* out = nullptr;  // the weight tensor
  DType out_dtype = DType::kF32;
  void* scale = nullptr;             // null for none
  std::vector<int64_t> shard_begin;  // S + 1 row boundaries: 0, ..., rows
  ops::Fp8Rule fp8;                  // the fp8 schemes' arithmetic (an engine layout's, or ferry's)
};

// A scheme's stored weight, for dequantize and the GEMMs. Logical weight is rows x cols ([N, K]).
struct WeightArgs {
  Scheme scheme = Scheme::kNone;
  const void* w = nullptr;  // weight / gptq sorted qweight
  DType w_dtype = DType::kF32;
  const void* scale = nullptr;  // null for none
  int64_t rows = 0;             // all rows (batch * matrix_rows); N for gptq_int4
  int64_t matrix_rows = 0;      // rows of one stacked matrix
  int64_t cols = 0;
  std::vector<int64_t> shard_begin;
  const int32_t* perm = nullptr;  // gptq_int4 only
  int32_t* workspace = nullptr;   // gptq_int4 only
  int64_t workspace_len = 0;
};

struct GemmArgs {
  WeightArgs w;
  const void* x = nullptr;
  DType x_dtype = DType::kF32;
  int64_t m = 0;
  float* y = nullptr;
};

struct GptqArgs {
  const int32_t* qweight = nullptr;
  const uint16_t* scales = nullptr;
  const int32_t* g_idx = nullptr;
  int64_t n = 0;
  int64_t k = 0;
  int32_t* out_qweight = nullptr;
  uint16_t* out_scales = nullptr;
  int32_t* perm = nullptr;  // Marlin: g_idx_sort_indices
  int32_t* workspace = nullptr;
  int64_t workspace_len = 0;
  // Marlin's layout (an engine layout, gptq_marlin_layout()): qweight repacked, scales permuted in
  // the model's dtype, g_idx sorted into out_g_idx; no workspace.
  bool marlin = false;
  bool scale_bf16 = false;
  int32_t* out_g_idx = nullptr;
};

// int4_group in Marlin's layout (kernels/marlin_layout.h): `batch` matrices of [n, k], ferry's
// int4 arithmetic with the scale rounded to the scales' dtype.
// The input holds outputs [n0, n0 + n) of each matrix's n_total (n0 and n multiples of 64).
struct MarlinArgs {
  const void* in = nullptr;  // [batch, n, k]
  DType in_dtype = DType::kF32;
  int64_t batch = 1;
  int64_t n = 0;
  int64_t k = 0;
  int64_t n_total = 0;
  int64_t n0 = 0;
  int32_t* out = nullptr;     // [batch, k / 16, 2 n_total]
  uint16_t* scale = nullptr;  // [batch, k / 128, n_total], permuted
  bool scale_bf16 = false;    // else f16
};

// Logical shards of one fused parameter (q, k, v; gate, up) are few; kernels keep their bounds in
// kernel arguments.
inline constexpr size_t kMaxShards = 64;

// A scheme as an engine layout stores it (engine_layouts.cc): its tensors, and the ferry layout that
// holds the same bytes, given by the shards it is quantized with and the engine's fp8 arithmetic.
struct EngineFormat {
  std::vector<StorageTensor> tensors;  // the engine's names and shapes
  std::vector<int64_t> shard_rows;     // the shards of the ferry layout with these bytes
  ops::Fp8Rule fp8;
  // Stacked matrices with one scale each: quantized matrix by matrix, each as this layout's 2-D
  // parameter (a per-tensor scale per expert).
  bool per_matrix = false;
  // int4_group repacked for Marlin: no ferry layout holds these bytes (check_marlin, MarlinArgs).
  bool marlin = false;
};
Result<EngineFormat> engine_format(Scheme scheme, EngineLayout layout, const Shape& shape,
                                   std::span<const int64_t> shard_rows, DType none_dtype);

// Rows [row0, row0 + input.dim(0)) of a Marlin int4 parameter of shape `whole` (EngineFormat::marlin),
// its outputs checked against the format's tensors: outputs of a 2-D weight (row0 and the count
// multiples of 64), matrices of a stacked one.
Result<MarlinArgs> check_marlin(const EngineFormat& f, EngineLayout layout, const Shape& whole, const TensorView& input,
                                int64_t row0, std::span<const TensorView> outputs);

// Validation (validate.cc). Every message names the tensor and what was wrong.
Result<std::vector<int64_t>> shard_bounds(std::span<const int64_t> shard_rows, int64_t rows);
Result<QuantArgs> check_quantize(Scheme scheme, const TensorView& input, std::span<const int64_t> shard_rows,
                                 std::span<const TensorView> outputs);
// `views` against `layout` (count, dtype, shape, contiguity, device); errors name them by `what`.
Status check_storage(std::string_view what, const std::vector<StorageTensor>& layout, std::span<const TensorView> views,
                     Device device);
// The same for an engine layout's outputs, given its format (engine_format()): checked against its
// tensors, then viewed as the ferry layout with the same bytes, with the engine's arithmetic in the
// result.
Result<QuantArgs> check_quantize(Scheme scheme, EngineLayout layout, const EngineFormat& f, const TensorView& input,
                                 std::span<const TensorView> outputs);
// `shape`: the logical weight ([N, K] for the GEMMs, the dequantize output's shape otherwise).
Result<WeightArgs> check_weight(Scheme scheme, std::span<const TensorView> storage, std::span<const int64_t> shard_rows,
                                const Shape& shape, Device device);
Result<GptqArgs> check_gptq(EngineLayout layout, const TensorView& qweight, const TensorView& scales,
                            const TensorView& g_idx, std::span<const TensorView> outputs);
// The act-order permutation: stable argsort of g_idx, after checking every group holds exactly 128
// rows and every entry is in [0, k/128).
Result<std::vector<int32_t>> gptq_permutation(const int32_t* g_idx, int64_t k);

// Runs fn(begin, end) over [0, n) in chunks of at least `grain` items on up to `threads` workers
// (0: host_threads(): FERRY_THREADS, else the hardware's). Runs inline when one chunk suffices.
void parallel_for(int64_t n, int64_t grain, int threads, const std::function<void(int64_t, int64_t)>& fn);

namespace cpu {
Status quantize(const QuantArgs& a, int threads);
// fp8_per_tensor (quantize.h, quantize_rows_keeping_scales): the codes of `rows` (sorted,
// disjoint) in shards whose scale comes out as a.scale holds, every other shard whole; returns the
// rows written.
int64_t fp8_per_tensor_rows(const QuantArgs& a, std::span<const std::pair<int64_t, int64_t>> rows, int threads);
Status dequantize(const WeightArgs& w, float* out, int threads);
Status gemm(const GemmArgs& a, int threads);
Status gptq_reload(const GptqArgs& a, int threads);
Status marlin_quantize(const MarlinArgs& a, int threads);
// gptq_reload into Marlin's layout (GptqArgs::marlin), given perm = gptq_permutation(g_idx).
Status gptq_marlin(const GptqArgs& a, std::span<const int32_t> perm, int threads);
}  // namespace cpu

// Implemented in kernels/cuda/*.cu, or by cuda_unavailable.cc (Unavailable) without CUDA.
namespace cuda {
Status quantize(const QuantArgs& a, void* stream);
Status dequantize(const WeightArgs& w, float* out, void* stream);
Status gemm(const GemmArgs& a, void* stream);  // enqueues only
// Waits for `stream`, then reads the gptq workspace: counters (len - 1) and the error flag.
Status gemm_check(const int32_t* workspace, int64_t len, void* stream);
Status gptq_reload(const GptqArgs& a, void* stream);
Status marlin_quantize(const MarlinArgs& a, void* stream);
// gptq_reload into Marlin's layout once a.perm holds the sort permutation on the device.
Status gptq_marlin(const GptqArgs& a, void* stream);
// fp8_per_tensor kernels launched in one piece (quantize_tensor.cu) by this process so far.
uint64_t fused_per_tensor_launches();
// The smallest shard, in input bytes, that the current device quantizes in one piece (0: none).
int64_t fused_per_tensor_min_bytes();
}  // namespace cuda

}  // namespace ferry::kernels::detail
