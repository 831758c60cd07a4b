// Engine layouts: the storage of each scheme as vLLM's and SGLang's kernels read it, and the fp8
// arithmetic those engines quantize with (kernels/quantize.h; sources cited in docs/engines.md).
// Every engine layout but one is a ferry layout's bytes under other names and shapes, so the kernels
// are ferry's, given the engine's rule and shards. The exception is int4_group, which both engines
// read repacked for Marlin (kernels/marlin_layout.h), quantized straight into that order.
#include <fmt/format.h>

#include <string>

#include "kernels/gptq.h"
#include "kernels/internal.h"
#include "kernels/marlin_layout.h"
#include "kernels/quantize.h"

namespace ferry::kernels {
namespace detail {
namespace {

// vLLM scaled_fp8_quant (csrc/quantization/w8a8/fp8/common.cuh): scale = amax / 448, then
// fmaxf(-448, fminf(x * (1 / scale), 448)), converted with satfinite round-to-nearest.
constexpr ops::Fp8Rule kScaledFp8Quant{0.0f, 0.0f, false, true, false, 0x7E};
// vLLM online fp8_per_channel (_fp8_channel_scale, _fp8_quant_per_channel): true division by a scale
// clamped to at least 1 / (448 * 512).
constexpr ops::Fp8Rule kVllmPerChannel{0.0f, 1.0f / (448.0f * 512.0f), false, false, false, 0x7F};
// per_block_cast_to_fp8 (DeepGEMM's, used by vLLM): amax clamped to 1e-4, codes of x * (1 / scale).
constexpr ops::Fp8Rule kPerBlockCast{1e-4f, 0.0f, false, true, false, 0x7F};
// SGLang per_token_quant_fp8: a zero row's scale multiplies by 0.
constexpr ops::Fp8Rule kSglangPerToken{0.0f, 0.0f, false, true, true, 0x7E};

// int4_group as both engines' W4A16 kernels read it (compressed-tensors CompressedTensorsWNA16, then
// MarlinLinearKernel): weight_packed repacked by gptq_marlin_repack, weight_scale permuted by
// marlin_permute_scales, in the activations' dtype.
// What Marlin's kernels take: outputs (a stacked weight's dim 1) in tiles of 64, inputs of 128, and
// scales in the activations' dtype.
template <typename Refuse>
Status check_marlin_shape(const Shape& shape, DType model, const Refuse& refuse) {
  if (shape.size() < 2) return refuse("Marlin needs a weight of rank >= 2");
  const Geometry g = geometry(Scheme::kInt4Group, shape);
  if (g.rows <= 0 || g.cols <= 0 || g.rows % marlin::kMinN != 0 || g.cols % marlin::kMinK != 0) {
    return refuse(fmt::format(
        "Marlin needs the rank's outputs ({}) a positive multiple of {} and its inputs ({}) a positive multiple of {}",
        g.rows, marlin::kMinN, g.cols, marlin::kMinK));
  }
  if (model != DType::kBF16 && model != DType::kF16) {
    return refuse(fmt::format("Marlin keeps its scales in the activations' dtype, bf16 or f16, and the model's is {}",
                              dtype_name(model)));
  }
  return ok_status();
}

template <typename Refuse>
Result<EngineFormat> marlin_format(const Shape& shape, DType model, const Refuse& refuse) {
  FERRY_RETURN_IF_ERROR(check_marlin_shape(shape, model, refuse));
  const Geometry g = geometry(Scheme::kInt4Group, shape);
  const bool stacked = shape.size() >= 3;
  Shape w{g.cols / marlin::kTile, 2 * g.rows}, s{g.cols / kGroupSize, g.rows};
  if (stacked) {
    w.insert(w.begin(), g.batch);
    s.insert(s.begin(), g.batch);
  }
  EngineFormat f;
  f.tensors = {{"weight_packed", DType::kI32, std::move(w), false}, {"weight_scale", model, std::move(s), false}};
  f.marlin = true;
  return f;
}

}  // namespace

Result<EngineFormat> engine_format(Scheme scheme, EngineLayout layout, const Shape& shape,
                                   std::span<const int64_t> shard_rows, DType none_dtype) {
  EngineFormat f;
  f.shard_rows.assign(shard_rows.begin(), shard_rows.end());
  if (layout == EngineLayout::kFerry) {
    FERRY_ASSIGN_OR_RETURN(f.tensors, storage_layout(scheme, shape, shard_rows, none_dtype));
    return f;
  }
  const std::string_view engine = engine_layout_name(layout);
  const bool vllm = layout == EngineLayout::kVllm;
  auto refuse = [&](std::string_view why) {
    return Status::invalid_argument(
        fmt::format("{} layout: {} of shape {}: {}", engine, scheme_name(scheme), shape_to_string(shape), why));
  };
  if (shape.empty()) return refuse("a weight needs rank >= 1");
  const bool stacked = shape.size() >= 3;
  // The ferry layout with these shards holds the bytes; below, the engine's names and shapes.
  switch (scheme) {
    case Scheme::kNone: break;
    case Scheme::kFp8PerTensor:
      if (!vllm && !stacked) {
        return refuse(
            "SGLang quantizes dense layers online per channel (Fp8LinearMethod on sm_89 and later): use "
            "fp8_per_channel");
      }
      // One scale for the whole fused parameter, or one per stacked expert over its merged matrix
      // (quantize() takes the experts one by one then).
      f.shard_rows.clear();
      f.fp8 = kScaledFp8Quant;
      if (stacked) {
        f.tensors = {{"weight", DType::kF8E4M3FN, shape, false}, {"weight_scale", DType::kF32, {shape[0]}, false}};
        f.per_matrix = true;
        return f;
      }
      break;
    case Scheme::kFp8PerChannel:
      if (stacked) return refuse("fused experts are not defined for this scheme in this layout");
      f.fp8 = vllm ? kVllmPerChannel : kSglangPerToken;
      break;
    case Scheme::kFp8Block:
      if (stacked) {
        for (int64_t r : shard_rows) {
          if (r % kFp8BlockSize != 0) {
            return refuse(fmt::format("each logical shard of a stacked expert must be a multiple of {} rows, one is {}",
                                      kFp8BlockSize, r));
          }
        }
      }
      f.fp8 = kPerBlockCast;
      break;
    case Scheme::kInt8PerChannel:
      if (stacked && vllm) return refuse("fused experts are not defined for this scheme in this layout");
      break;
    case Scheme::kInt4Group:
      // Both engines permute fused experts' w13 scales with size_k = the repacked weight's width
      // (w13_weight_packed.shape[2], 2N, after replace_parameter: compressed_tensors_moe.py), so as
      // for several groups even where the input is one group of 128, where ferry writes Marlin's
      // single-group permutation.
      if (stacked && !shard_rows.empty() && shape.back() == kGroupSize) {
        return refuse(
            "fused experts whose input is one group of 128 get their scales permuted as for several groups "
            "(size_k = w13_weight_packed.shape[2]), which ferry does not write");
      }
      return marlin_format(shape, none_dtype, refuse);
    case Scheme::kGptqInt4: {
      FERRY_RETURN_IF_ERROR(check_marlin_shape(shape, none_dtype, refuse));
      FERRY_ASSIGN_OR_RETURN(f.tensors, gptq_marlin_layout(shape, none_dtype));
      f.shard_rows.clear();
      f.marlin = true;
      return f;
    }
  }
  FERRY_ASSIGN_OR_RETURN(f.tensors, storage_layout(scheme, shape, f.shard_rows, none_dtype));
  const Geometry g = geometry(scheme, shape);
  switch (scheme) {
    case Scheme::kFp8PerChannel:
      f.tensors[1].shape = vllm ? Shape{g.rows, 1} : Shape{1, g.rows};
      break;
    case Scheme::kFp8Block:
      f.tensors[1].suffix = "weight_scale_inv";
      break;
    case Scheme::kInt8PerChannel:
      f.tensors[1].shape = stacked ? Shape{g.batch, g.rows, 1} : Shape{g.rows, 1};
      break;
    default: break;
  }
  return f;
}

}  // namespace detail

Result<std::vector<StorageTensor>> storage_layout(Scheme scheme, EngineLayout layout, const Shape& shape,
                                                  std::span<const int64_t> shard_rows, DType none_dtype) {
  FERRY_ASSIGN_OR_RETURN(detail::EngineFormat f, detail::engine_format(scheme, layout, shape, shard_rows, none_dtype));
  return std::move(f.tensors);
}

}  // namespace ferry::kernels
