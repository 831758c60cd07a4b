// Argument checks shared by every back end: shapes, dtypes, contiguity, devices, shard splits.
#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "kernels/gptq.h"
#include "kernels/internal.h"
#include "kernels/marlin_layout.h"

namespace ferry::kernels::detail {
namespace {

// `what` names the tensors in errors; it is only called to build one (a kernel call that passes
// costs no string).
template <typename What>
Status check_outputs(const What& what, const std::vector<StorageTensor>& layout, std::span<const TensorView> views,
                     Device device) {
  if (views.size() != layout.size()) {
    std::string names;
    for (const auto& t : layout) names += (names.empty() ? "" : ", ") + t.suffix;
    return Status::invalid_argument(
        fmt::format("{}: {} tensors given where the layout has {} ({})", what(), views.size(), layout.size(), names));
  }
  for (size_t i = 0; i < views.size(); ++i) {
    const TensorView& v = views[i];
    if (v.dtype() == layout[i].dtype && v.shape() == layout[i].shape && v.is_contiguous() && v.device() == device &&
        (v.numel() == 0 || v.data() != nullptr)) {
      continue;
    }
    // expect_tensor() checks all the above but the device, so past it the device is what is wrong.
    const std::string name = fmt::format("{} '{}'", what(), layout[i].suffix);
    FERRY_RETURN_IF_ERROR(expect_tensor(v, name, layout[i].dtype, layout[i].shape));
    return Status::invalid_argument(
        fmt::format("{}: on {} while the other tensors are on {}", name, v.device().to_string(), device.to_string()));
  }
  return ok_status();
}

}  // namespace

Status check_storage(std::string_view what, const std::vector<StorageTensor>& layout, std::span<const TensorView> views,
                     Device device) {
  return check_outputs([&] { return std::string(what); }, layout, views, device);
}

Result<std::vector<int64_t>> shard_bounds(std::span<const int64_t> shard_rows, int64_t rows) {
  std::vector<int64_t> bounds{0};
  if (shard_rows.empty()) {
    bounds.push_back(rows);
    return bounds;
  }
  if (shard_rows.size() > kMaxShards) {
    return Status::invalid_argument(fmt::format("shard_rows: {} shards (at most {})", shard_rows.size(), kMaxShards));
  }
  for (int64_t r : shard_rows) {
    if (r <= 0) return Status::invalid_argument(fmt::format("shard_rows: shard of {} rows (must be > 0)", r));
    bounds.push_back(bounds.back() + r);
  }
  if (bounds.back() != rows) {
    return Status::invalid_argument(
        fmt::format("shard_rows: shards sum to {} rows but the tensor has {}", bounds.back(), rows));
  }
  return bounds;
}

Result<QuantArgs> check_quantize(Scheme scheme, const TensorView& input, std::span<const int64_t> shard_rows,
                                 std::span<const TensorView> outputs) {
  if (scheme == Scheme::kGptqInt4) {
    return Status::invalid_argument("quantize: gptq_int4 is a quantized reload; call gptq_reload()");
  }
  const DType dt = input.dtype();
  if (dt != DType::kF32 && dt != DType::kBF16 && dt != DType::kF16) {
    return Status::invalid_argument(fmt::format("quantize input: dtype {} (expected f32, bf16 or f16)", dtype_name(dt)));
  }
  if (input.rank() < 1) return Status::invalid_argument("quantize input: rank 0 (expected rows x cols)");
  if (!input.is_contiguous()) {
    return Status::invalid_argument(fmt::format("quantize input: {} must be contiguous", input.describe()));
  }
  if (input.numel() > 0 && input.empty()) return Status::invalid_argument("quantize input: null data");
  if (outputs.empty()) return Status::invalid_argument("quantize: no output tensors given");
  FERRY_ASSIGN_OR_RETURN(auto layout, storage_layout(scheme, input.shape(), shard_rows, outputs[0].dtype()));
  FERRY_RETURN_IF_ERROR(check_outputs([&] { return fmt::format("quantize {} output", scheme_name(scheme)); }, layout,
                                      outputs, input.device()));
  QuantArgs a;
  a.scheme = scheme;
  a.in = input.data();
  a.in_dtype = dt;
  const Geometry g = geometry(scheme, input.shape());
  a.rows = g.batch * g.rows;
  a.matrix_rows = g.rows;
  a.cols = g.cols;
  a.out = outputs[0].data();
  a.out_dtype = outputs[0].dtype();
  a.scale = outputs.size() > 1 ? outputs[1].data() : nullptr;
  FERRY_ASSIGN_OR_RETURN(a.shard_begin, shard_bounds(shard_rows, g.rows));
  return a;
}

Result<QuantArgs> check_quantize(Scheme scheme, EngineLayout layout, const EngineFormat& f, const TensorView& input,
                                 std::span<const TensorView> outputs) {
  if (outputs.empty()) return Status::invalid_argument("quantize: no output tensors given");
  FERRY_RETURN_IF_ERROR(check_outputs(
      [&] { return fmt::format("quantize {} output ({} layout)", scheme_name(scheme), engine_layout_name(layout)); },
      f.tensors, outputs, input.device()));
  FERRY_ASSIGN_OR_RETURN(auto ferry, storage_layout(scheme, input.shape(), f.shard_rows, outputs[0].dtype()));
  std::vector<TensorView> views;
  views.reserve(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    views.emplace_back(outputs[i].data(), ferry[i].dtype, ferry[i].shape, outputs[i].device());
  }
  FERRY_ASSIGN_OR_RETURN(QuantArgs a, check_quantize(scheme, input, f.shard_rows, views));
  a.fp8 = f.fp8;
  return a;
}

Result<MarlinArgs> check_marlin(const EngineFormat& f, EngineLayout layout, const Shape& whole, const TensorView& input,
                                int64_t row0, std::span<const TensorView> outputs) {
  const DType dt = input.dtype();
  if (dt != DType::kF32 && dt != DType::kBF16 && dt != DType::kF16) {
    return Status::invalid_argument(
        fmt::format("quantize input: dtype {} (expected f32, bf16 or f16)", dtype_name(dt)));
  }
  if (!input.is_contiguous() || (input.numel() > 0 && input.empty())) {
    return Status::invalid_argument(fmt::format("quantize input: {} must be contiguous", input.describe()));
  }
  FERRY_RETURN_IF_ERROR(check_outputs(
      [&] { return fmt::format("quantize int4_group output ({} layout, Marlin)", engine_layout_name(layout)); },
      f.tensors, outputs, input.device()));
  const int64_t rows = input.rank() ? input.dim(0) : 0;
  bool fits = input.rank() == static_cast<int>(whole.size()) && row0 >= 0 && row0 + rows <= whole[0];
  for (size_t d = 1; fits && d < whole.size(); ++d) fits = input.dim(static_cast<int>(d)) == whole[d];
  const bool stacked = whole.size() >= 3;
  if (!fits) {
    return Status::invalid_argument(
        fmt::format("quantize int4_group ({} layout, Marlin): input {} is not rows {}+{} of a weight of shape {}",
                    engine_layout_name(layout), input.describe(), row0, rows, shape_to_string(whole)));
  }
  if (!stacked && (row0 % marlin::kChunkN != 0 || rows % marlin::kChunkN != 0)) {
    return Status::invalid_argument(
        fmt::format("quantize int4_group ({} layout, Marlin): rows {}+{} of a weight of shape {}: a 2-D weight's rows "
                    "go in runs of whole {}-output chunks",
                    engine_layout_name(layout), row0, rows, shape_to_string(whole), marlin::kChunkN));
  }
  const Geometry g = geometry(Scheme::kInt4Group, whole);
  MarlinArgs a;
  a.in = input.data();
  a.in_dtype = dt;
  a.k = g.cols;
  a.n_total = g.rows;
  a.out = outputs[0].data_as<int32_t>();
  a.scale = static_cast<uint16_t*>(outputs[1].data());
  a.scale_bf16 = outputs[1].dtype() == DType::kBF16;
  if (stacked) {  // whole matrices, each with its own storage
    a.batch = rows;
    a.n = g.rows;
    a.out += row0 * (g.cols / marlin::kTile) * 2 * g.rows;
    a.scale += row0 * (g.cols / kGroupSize) * g.rows;
  } else {
    a.n = rows;
    a.n0 = row0;
  }
  return a;
}

Result<WeightArgs> check_weight(Scheme scheme, std::span<const TensorView> storage, std::span<const int64_t> shard_rows,
                                const Shape& shape, Device device) {
  if (storage.empty()) return Status::invalid_argument("weight storage: no tensors given");
  if (shape.empty()) return Status::invalid_argument("weight storage: a weight needs rank >= 1");
  // A weight stored with rank > 2 may be named by its 2-D view (dim 0 x the rest): its own shape
  // is the logical one.
  Shape logical = shape;
  const TensorView& w0 = storage[0];
  if (scheme != Scheme::kGptqInt4 && shape.size() <= 2 && w0.rank() > 2 && w0.dim(0) == shape[0] &&
      w0.numel() == shape_numel(shape)) {
    logical = w0.shape();
  }
  FERRY_ASSIGN_OR_RETURN(auto layout, storage_layout(scheme, logical, shard_rows, w0.dtype()));
  FERRY_RETURN_IF_ERROR(
      check_outputs([&] { return fmt::format("{} storage", scheme_name(scheme)); }, layout, storage, device));
  const Geometry g = geometry(scheme, logical);
  WeightArgs w;
  w.scheme = scheme;
  w.w = storage[0].data();
  w.w_dtype = storage[0].dtype();
  w.scale = storage.size() > 1 ? storage[1].data() : nullptr;
  w.rows = g.batch * g.rows;
  w.matrix_rows = g.rows;
  w.cols = g.cols;
  FERRY_ASSIGN_OR_RETURN(w.shard_begin, shard_bounds(shard_rows, g.rows));
  if (scheme == Scheme::kGptqInt4) {
    w.perm = storage[2].data_as<const int32_t>();
    w.workspace = storage[3].data_as<int32_t>();
    w.workspace_len = storage[3].numel();
  }
  return w;
}

Result<GptqArgs> check_gptq(EngineLayout layout, const TensorView& qweight, const TensorView& scales,
                            const TensorView& g_idx, std::span<const TensorView> outputs) {
  if (qweight.rank() != 2 || qweight.dtype() != DType::kI32) {
    return Status::invalid_argument(
        fmt::format("gptq_reload qweight: {} (expected i32[K/8, N])", qweight.describe()));
  }
  const int64_t n = qweight.dim(1);
  const int64_t k = qweight.dim(0) * kGptqPackFactor;
  FERRY_ASSIGN_OR_RETURN(auto in_layout, gptq_checkpoint_layout({n, k}));
  const TensorView ins[] = {qweight, scales, g_idx};
  FERRY_RETURN_IF_ERROR(check_outputs([] { return std::string("gptq_reload checkpoint"); }, in_layout, ins, qweight.device()));
  // The model's dtype, which an engine layout keeps the scales in, from the scales given.
  const DType model = outputs.size() > 1 ? outputs[1].dtype() : DType::kBF16;
  FERRY_ASSIGN_OR_RETURN(auto out_layout, storage_layout(Scheme::kGptqInt4, layout, {n, k}, {}, model));
  FERRY_RETURN_IF_ERROR(
      check_outputs([&] { return fmt::format("gptq_reload output ({} layout)", engine_layout_name(layout)); },
                    out_layout, outputs, qweight.device()));
  GptqArgs a;
  a.qweight = qweight.data_as<const int32_t>();
  a.scales = scales.data_as<const uint16_t>();
  a.g_idx = g_idx.data_as<const int32_t>();
  a.n = n;
  a.k = k;
  a.out_qweight = outputs[0].data_as<int32_t>();
  a.out_scales = outputs[1].data_as<uint16_t>();
  if (layout != EngineLayout::kFerry) {
    a.marlin = true;
    a.scale_bf16 = model == DType::kBF16;
    a.out_g_idx = outputs[2].data_as<int32_t>();
    a.perm = outputs[3].data_as<int32_t>();
    return a;
  }
  a.perm = outputs[2].data_as<int32_t>();
  a.workspace = outputs[3].data_as<int32_t>();
  a.workspace_len = outputs[3].numel();
  return a;
}

Result<std::vector<int32_t>> gptq_permutation(const int32_t* g_idx, int64_t k) {
  const int64_t groups = k / kGroupSize;
  std::vector<int64_t> count(static_cast<size_t>(groups), 0);
  for (int64_t i = 0; i < k; ++i) {
    const int32_t g = g_idx[i];
    if (g < 0 || g >= groups) {
      return Status::invalid_argument(
          fmt::format("gptq_reload g_idx: g_idx[{}] = {} lies outside [0, {})", i, g, groups));
    }
    ++count[static_cast<size_t>(g)];
  }
  for (int64_t g = 0; g < groups; ++g) {
    if (count[static_cast<size_t>(g)] != kGroupSize) {
      return Status::invalid_argument(fmt::format("gptq_reload g_idx: group {} holds {} rows (every group must hold {})",
                                                  g, count[static_cast<size_t>(g)], kGroupSize));
    }
  }
  // Counting sort by group keeps equal groups in increasing k: a stable argsort.
  std::vector<int64_t> next(static_cast<size_t>(groups));
  for (int64_t g = 0; g < groups; ++g) next[static_cast<size_t>(g)] = g * kGroupSize;
  std::vector<int32_t> perm(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) {
    perm[static_cast<size_t>(next[static_cast<size_t>(g_idx[i])]++)] = static_cast<int32_t>(i);
  }
  return perm;
}

}  // namespace ferry::kernels::detail
