// Public entry points: validate, then hand raw arguments to the CPU or CUDA back end.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>

#include "kernels/gemm.h"
#include "kernels/gptq.h"
#include "kernels/internal.h"
#include "kernels/quantize.h"

namespace ferry::kernels {

Status quantize(Scheme scheme, const TensorView& input, std::span<const int64_t> shard_rows,
                std::span<const TensorView> outputs, const Exec& exec) {
  return quantize(scheme, EngineLayout::kFerry, input, shard_rows, outputs, exec);
}

namespace {

std::atomic<uint64_t> g_quantize_runs{0};

Status run_quantize(const detail::QuantArgs& args, Device device, const Exec& exec) {
  g_quantize_runs.fetch_add(1, std::memory_order_relaxed);
  if (device.is_cuda()) return detail::cuda::quantize(args, exec.stream);
  return detail::cpu::quantize(args, exec.threads);
}

// An engine layout's stacked matrices with one scale each (EngineFormat::per_matrix): matrix by
// matrix, each as the layout's 2-D parameter.
Status quantize_per_matrix(Scheme scheme, EngineLayout layout, const detail::EngineFormat& f, const TensorView& input,
                           std::span<const TensorView> outputs, const Exec& exec) {
  FERRY_RETURN_IF_ERROR(detail::check_storage(
      fmt::format("quantize {} output ({} layout)", scheme_name(scheme), engine_layout_name(layout)), f.tensors,
      outputs, input.device()));
  if (!input.is_contiguous() || (input.numel() > 0 && input.empty())) {
    return Status::invalid_argument(fmt::format("quantize input: {} must be contiguous", input.describe()));
  }
  const int64_t batch = input.dim(0);
  const Shape matrix{input.dim(1), batch && input.dim(1) ? input.numel() / batch / input.dim(1) : 0};
  const int64_t per = shape_numel(matrix);
  const size_t in_bytes = dtype_bytes(input.dtype(), per), out_bytes = dtype_bytes(outputs[0].dtype(), per);
  for (int64_t e = 0; e < batch; ++e) {
    const TensorView in(static_cast<char*>(input.data()) + e * in_bytes, input.dtype(), matrix, input.device());
    const TensorView views[] = {
        TensorView(static_cast<char*>(outputs[0].data()) + e * out_bytes, outputs[0].dtype(), matrix, input.device()),
        TensorView(outputs[1].data_as<float>() + e, DType::kF32, {1}, input.device())};
    // Each matrix as ferry's per-tensor layout of one shard (the same bytes), by the engine's rule.
    FERRY_ASSIGN_OR_RETURN(detail::QuantArgs args, detail::check_quantize(scheme, in, {}, views));
    args.fp8 = f.fp8;
    FERRY_RETURN_IF_ERROR(run_quantize(args, input.device(), exec));
  }
  return ok_status();
}

}  // namespace

Status quantize(Scheme scheme, EngineLayout layout, const TensorView& input, std::span<const int64_t> shard_rows,
                std::span<const TensorView> outputs, const Exec& exec) {
  if (layout == EngineLayout::kFerry || outputs.empty()) {
    FERRY_ASSIGN_OR_RETURN(auto args, detail::check_quantize(scheme, input, shard_rows, outputs));
    return run_quantize(args, input.device(), exec);
  }
  if (scheme == Scheme::kGptqInt4) {
    return Status::invalid_argument("quantize: gptq_int4 is a quantized reload; call gptq_reload()");
  }
  if (scheme == Scheme::kInt4Group) return quantize_marlin_rows(layout, input.shape(), input, 0, outputs, exec);
  // The model's dtype, which engine_format() takes: the weight's under none.
  FERRY_ASSIGN_OR_RETURN(auto f, detail::engine_format(scheme, layout, input.shape(), shard_rows, outputs[0].dtype()));
  if (f.per_matrix) return quantize_per_matrix(scheme, layout, f, input, outputs, exec);
  FERRY_ASSIGN_OR_RETURN(auto args, detail::check_quantize(scheme, layout, f, input, outputs));
  return run_quantize(args, input.device(), exec);
}

Status quantize_marlin_rows(EngineLayout layout, const Shape& whole, const TensorView& input, int64_t row0,
                            std::span<const TensorView> outputs, const Exec& exec) {
  if (outputs.size() != 2) {
    return Status::invalid_argument(
        fmt::format("quantize int4_group ({} layout): {} output tensors given where Marlin's layout has 2 "
                    "(weight_packed, weight_scale)",
                    engine_layout_name(layout), outputs.size()));
  }
  FERRY_ASSIGN_OR_RETURN(auto f, detail::engine_format(Scheme::kInt4Group, layout, whole, {}, outputs[1].dtype()));
  if (!f.marlin) {
    return Status::invalid_argument(
        fmt::format("quantize_marlin_rows: the {} layout of int4_group is not Marlin's", engine_layout_name(layout)));
  }
  FERRY_ASSIGN_OR_RETURN(const detail::MarlinArgs m, detail::check_marlin(f, layout, whole, input, row0, outputs));
  if (m.batch == 0 || m.n == 0) return ok_status();  // an empty run
  g_quantize_runs.fetch_add(1, std::memory_order_relaxed);
  if (input.device().is_cuda()) return detail::cuda::marlin_quantize(m, exec.stream);
  return detail::cpu::marlin_quantize(m, exec.threads);
}

Result<int64_t> quantize_rows_keeping_scales(Scheme scheme, EngineLayout layout, const TensorView& input,
                                             std::span<const int64_t> shard_rows,
                                             std::span<const std::pair<int64_t, int64_t>> rows,
                                             std::span<const TensorView> outputs, const Exec& exec) {
  if (scheme != Scheme::kFp8PerTensor || !input.device().is_cpu() || input.rank() != 2 || outputs.size() != 2) {
    return 0;
  }
  detail::QuantArgs args;
  if (layout == EngineLayout::kFerry) {
    FERRY_ASSIGN_OR_RETURN(args, detail::check_quantize(scheme, input, shard_rows, outputs));
  } else {
    FERRY_ASSIGN_OR_RETURN(auto f,
                           detail::engine_format(scheme, layout, input.shape(), shard_rows, outputs[0].dtype()));
    if (f.per_matrix) return 0;
    FERRY_ASSIGN_OR_RETURN(args, detail::check_quantize(scheme, layout, f, input, outputs));
  }
  int64_t last = 0;
  for (const auto& [r0, r1] : rows) {
    if (r0 < last || r1 <= r0 || r1 > args.rows) {
      return Status::invalid_argument(
          fmt::format("quantize rows: [{}, {}) of {} rows, after row {}", r0, r1, args.rows, last));
    }
    last = r1;
  }
  g_quantize_runs.fetch_add(1, std::memory_order_relaxed);
  return detail::cpu::fp8_per_tensor_rows(args, rows, exec.threads);
}

uint64_t quantize_runs() { return g_quantize_runs.load(std::memory_order_relaxed); }

Status dequantize(Scheme scheme, std::span<const TensorView> storage, std::span<const int64_t> shard_rows,
                  const TensorView& output_f32, const Exec& exec) {
  if (output_f32.rank() < 1) return Status::invalid_argument("dequantize output: rank 0 (expected rows x cols)");
  FERRY_RETURN_IF_ERROR(expect_tensor(output_f32, "dequantize output", DType::kF32, output_f32.shape()));
  FERRY_ASSIGN_OR_RETURN(auto w,
                         detail::check_weight(scheme, storage, shard_rows, output_f32.shape(), output_f32.device()));
  if (output_f32.device().is_cuda()) return detail::cuda::dequantize(w, output_f32.data_as<float>(), exec.stream);
  return detail::cpu::dequantize(w, output_f32.data_as<float>(), exec.threads);
}

Status gptq_reload(const TensorView& qweight, const TensorView& scales, const TensorView& g_idx,
                   std::span<const TensorView> outputs, const Exec& exec) {
  return gptq_reload(EngineLayout::kFerry, qweight, scales, g_idx, outputs, exec);
}

Status gptq_reload(EngineLayout layout, const TensorView& qweight, const TensorView& scales, const TensorView& g_idx,
                   std::span<const TensorView> outputs, const Exec& exec) {
  FERRY_ASSIGN_OR_RETURN(auto args, detail::check_gptq(layout, qweight, scales, g_idx, outputs));
  if (qweight.device().is_cuda()) return detail::cuda::gptq_reload(args, exec.stream);
  return detail::cpu::gptq_reload(args, exec.threads);
}

Status gemm_async(Scheme scheme, const TensorView& x, std::span<const TensorView> weight,
                  std::span<const int64_t> shard_rows, const TensorView& y, const Exec& exec) {
  if (x.rank() != 2 || (x.dtype() != DType::kF32 && x.dtype() != DType::kBF16) || !x.is_contiguous()) {
    return Status::invalid_argument(fmt::format("gemm x: {} (expected contiguous f32 or bf16 [M, K])", x.describe()));
  }
  if (y.rank() != 2 || y.dim(0) != x.dim(0)) {
    return Status::invalid_argument(
        fmt::format("gemm y: {} (expected f32 [M, N] with M = {})", y.describe(), x.dim(0)));
  }
  FERRY_RETURN_IF_ERROR(expect_tensor(y, "gemm y", DType::kF32, y.shape()));
  if (y.device() != x.device()) return Status::invalid_argument("gemm: x and y lie on different devices");
  if (x.numel() > 0 && x.empty()) return Status::invalid_argument("gemm x: null data");
  FERRY_ASSIGN_OR_RETURN(auto w, detail::check_weight(scheme, weight, shard_rows, {y.dim(1), x.dim(1)}, x.device()));
  if (w.rows != w.matrix_rows) {
    return Status::invalid_argument(fmt::format("gemm: {} weight of {} stacked matrices (a GEMM takes one [N, K])",
                                                scheme_name(scheme), w.rows / std::max<int64_t>(w.matrix_rows, 1)));
  }
  detail::GemmArgs a;
  a.w = std::move(w);
  a.x = x.data();
  a.x_dtype = x.dtype();
  a.m = x.dim(0);
  a.y = y.data_as<float>();
  if (x.device().is_cuda()) return detail::cuda::gemm(a, exec.stream);
  return detail::cpu::gemm(a, exec.threads);
}

Status gemm_check(Scheme scheme, std::span<const TensorView> weight, const Exec& exec) {
  if (scheme != Scheme::kGptqInt4) return ok_status();
  if (weight.size() != 4) {
    return Status::invalid_argument(fmt::format("gemm_check: gptq_int4 storage has 4 tensors, {} given", weight.size()));
  }
  const TensorView& ws = weight[3];
  if (ws.dtype() != DType::kI32 || ws.rank() != 1 || ws.numel() < 2 || !ws.is_contiguous() || ws.empty()) {
    return Status::invalid_argument(
        fmt::format("gemm_check workspace: {} (expected i32[ceil(N/64) + 1])", ws.describe()));
  }
  if (!ws.device().is_cuda()) return ok_status();  // the CPU GEMM takes no turns
  return detail::cuda::gemm_check(ws.data_as<const int32_t>(), ws.numel(), exec.stream);
}

Status gemm(Scheme scheme, const TensorView& x, std::span<const TensorView> weight, std::span<const int64_t> shard_rows,
            const TensorView& y, const Exec& exec) {
  FERRY_RETURN_IF_ERROR(gemm_async(scheme, x, weight, shard_rows, y, exec));
  if (!x.device().is_cuda()) return ok_status();
  // gemm_check waits for the stream; the other schemes need the wait to report launch errors.
  if (scheme == Scheme::kGptqInt4) return gemm_check(scheme, weight, exec);
  return detail::cuda::gemm_check(nullptr, 0, exec.stream);
}

}  // namespace ferry::kernels
