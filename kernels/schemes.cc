// The storage each scheme needs.
#include <numeric>
#include <string>

#include <fmt/format.h>

#include "kernels/gptq.h"
#include "kernels/internal.h"
#include "kernels/quantize.h"

namespace ferry::kernels {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

namespace detail {

Geometry geometry(Scheme scheme, const Shape& shape) {
  Geometry g;
  if (shape.empty()) return g;
  const bool stacks = scheme == Scheme::kNone || scheme == Scheme::kFp8PerChannel || scheme == Scheme::kFp8Block ||
                      scheme == Scheme::kInt8PerChannel || scheme == Scheme::kInt4Group;
  const size_t lead = stacks && shape.size() >= 3 ? 1 : 0;
  g.batch = lead ? shape[0] : 1;
  g.rows = shape[lead];
  g.cols = 1;
  for (size_t i = lead + 1; i < shape.size(); ++i) g.cols *= shape[i];
  return g;
}

}  // namespace detail

Result<std::vector<StorageTensor>> storage_layout(Scheme scheme, const Shape& shape, std::span<const int64_t> shard_rows,
                                                  DType none_dtype) {
  if (shape.empty()) return Status::invalid_argument("storage_layout: a weight needs rank >= 1, got a scalar shape");
  for (int64_t d : shape) {
    if (d < 0) return Status::invalid_argument(fmt::format("storage_layout: negative dim in {}", shape_to_string(shape)));
  }
  // fp8_per_tensor takes any shape as dim 0 x the rest, its shards splitting dim 0; shards that
  // split the rows of each stacked matrix instead (fused experts' gate and up) are not its layout.
  if (scheme == Scheme::kFp8PerTensor && shape.size() >= 3 && !shard_rows.empty() &&
      std::accumulate(shard_rows.begin(), shard_rows.end(), int64_t{0}) != shape[0]) {
    return Status::invalid_argument(fmt::format(
        "storage_layout: fp8_per_tensor in ferry's layout keeps one scale per logical shard of dim 0, and the "
        "{} logical shards of stacked matrices {} split each matrix's rows instead: use the vllm or sglang "
        "layout (a scale per expert) or another scheme",
        shard_rows.size(), shape_to_string(shape)));
  }
  const detail::Geometry g = detail::geometry(scheme, shape);
  const int64_t rows = g.rows, cols = g.cols;
  // Per-matrix scale shapes of stacked weights carry E in front.
  auto stacked = [&](Shape per_matrix) {
    if (shape.size() >= 3) per_matrix.insert(per_matrix.begin(), g.batch);
    return per_matrix;
  };
  FERRY_ASSIGN_OR_RETURN(std::vector<int64_t> bounds, detail::shard_bounds(shard_rows, rows));
  const auto shards = static_cast<int64_t>(bounds.size()) - 1;

  std::vector<StorageTensor> out;
  switch (scheme) {
    case Scheme::kNone:
      if (none_dtype != DType::kF32 && none_dtype != DType::kBF16 && none_dtype != DType::kF16) {
        return Status::invalid_argument(
            fmt::format("storage_layout: scheme none stores f32, bf16 or f16, not {}", dtype_name(none_dtype)));
      }
      out.push_back({"weight", none_dtype, shape, false});
      break;
    case Scheme::kFp8PerTensor:
      out.push_back({"weight", DType::kF8E4M3FN, shape, false});
      out.push_back({"weight_scale", DType::kF32, {shards}, false});
      break;
    case Scheme::kFp8PerChannel:
      out.push_back({"weight", DType::kF8E4M3FN, shape, false});
      out.push_back({"weight_scale", DType::kF32, stacked({rows}), false});
      break;
    case Scheme::kFp8Block:
      out.push_back({"weight", DType::kF8E4M3FN, shape, false});
      out.push_back({"weight_scale", DType::kF32,
                     stacked({ceil_div(rows, kFp8BlockSize), ceil_div(cols, kFp8BlockSize)}), false});
      break;
    case Scheme::kInt8PerChannel:
      out.push_back({"weight", DType::kI8, shape, false});
      out.push_back({"weight_scale", DType::kF32, stacked({rows}), false});
      break;
    case Scheme::kInt4Group:
      if (cols % kGroupSize != 0) {
        return Status::invalid_argument(fmt::format(
            "storage_layout: int4_group needs cols divisible by {}, shape {} has {} cols", kGroupSize,
            shape_to_string(shape), cols));
      }
      out.push_back({"weight", DType::kI4Packed, stacked({rows, cols}), false});
      out.push_back({"weight_scale", DType::kF16, stacked({rows, cols / kGroupSize}), false});
      break;
    case Scheme::kGptqInt4:
      return gptq_storage_layout(shape);
  }
  return out;
}

namespace {

Status check_gptq_shape(const Shape& shape) {
  if (shape.size() != 2) {
    return Status::invalid_argument(
        fmt::format("gptq_int4: the logical weight must be [N, K], got {}", shape_to_string(shape)));
  }
  if (shape[0] <= 0 || shape[1] <= 0 || shape[1] % kGroupSize != 0) {
    return Status::invalid_argument(fmt::format(
        "gptq_int4: weight {} needs N > 0 and K a positive multiple of {}", shape_to_string(shape), kGroupSize));
  }
  return ok_status();
}

}  // namespace

Result<std::vector<StorageTensor>> gptq_checkpoint_layout(const Shape& shape) {
  FERRY_RETURN_IF_ERROR(check_gptq_shape(shape));
  const int64_t n = shape[0], k = shape[1];
  return std::vector<StorageTensor>{{"qweight", DType::kI32, {k / kGptqPackFactor, n}, false},
                                    {"scales", DType::kF16, {k / kGroupSize, n}, false},
                                    {"g_idx", DType::kI32, {k}, false}};
}

Result<std::vector<StorageTensor>> gptq_marlin_layout(const Shape& shape, DType model) {
  FERRY_RETURN_IF_ERROR(check_gptq_shape(shape));
  const int64_t n = shape[0], k = shape[1];
  return std::vector<StorageTensor>{{"qweight", DType::kI32, {k / 16, 2 * n}, false},
                                    {"scales", model, {k / kGroupSize, n}, false},
                                    {"g_idx", DType::kI32, {k}, true},
                                    {"g_idx_sort_indices", DType::kI32, {k}, true}};
}

Result<std::vector<StorageTensor>> gptq_storage_layout(const Shape& shape) {
  FERRY_RETURN_IF_ERROR(check_gptq_shape(shape));
  const int64_t n = shape[0], k = shape[1];
  return std::vector<StorageTensor>{{"qweight", DType::kI32, {k / kGptqPackFactor, n}, false},
                                    {"scales", DType::kF16, {k / kGroupSize, n}, false},
                                    {"perm", DType::kI32, {k}, true},
                                    {"workspace", DType::kI32, {ceil_div(n, kGptqTileN) + 1}, true}};
}

}  // namespace ferry::kernels
