// Online quantization: full-precision tensors in, a scheme's storage layout out, written into
// caller-given storage (kernels never allocate their outputs). CPU and CUDA share these entry
// points; the device of the views picks the implementation (all views on one device; CUDA views
// on a build without CUDA give Unavailable).
//
// Definitions (every scheme, CPU and CUDA bit for bit):
//  - Input is f32, bf16 or f16, contiguous, viewed as rows x cols (rows = dim 0; rank >= 3 is a
//    stack of matrices for some schemes, see storage_layout()). bf16/f16 are
//    widened to f32 exactly; all arithmetic below is IEEE f32 (no fused multiply-add).
//  - amax: the largest |x| over the finite values of the group. NaN and +-inf are ignored.
//  - fp8 (all three fp8 schemes): scale = amax / 448 (f32 division); when that is not > 0 (amax
//    is 0, or the quotient underflows) scale = 1. q = e4m3fn(x / scale), the quotient rounded to
//    nearest even; finite overflow and +-inf saturate to +-448; NaN becomes the e4m3fn NaN
//    0x7F (the sign is dropped, as GPU arithmetic drops it). Dequantized value: f32(q) * scale.
//      fp8_per_tensor: one scale per logical shard (shard_rows, or the whole tensor), scale f32[S].
//      fp8_per_channel: one scale per row, f32[rows].
//      fp8_block: one scale per 128x128 block, f32[ceil(rows/128), ceil(cols/128)]; edge blocks
//      may be partial and use only the elements they hold.
//  - int8_per_channel: scale = amax / 127 (f32), 1 when not > 0. q = round_half_even(x / scale)
//    clamped to [-127, 127]; NaN becomes 0, +-inf clamp to +-127. Dequantized: float(q) * scale.
//  - int4_group: groups of 128 consecutive columns of one row; cols % 128 != 0 is InvalidArgument.
//    s = amax / 7 (f32), then rounded to f16 (nearest even). When the f16 scale is 0 it becomes
//    1.0; when it overflows it becomes the largest finite f16 (65504). q = round_half_even(x /
//    f32(scale)) clamped to [-8, 7]; NaN becomes 0. Stored as DType::kI4Packed [rows, cols]: two
//    two's-complement nibbles per byte, column 2k in the low nibble. Scales f16[rows, cols/128].
//  - none: f32(x) converted to the storage dtype, round to nearest even, IEEE overflow to inf,
//    NaN becomes the quiet NaN of the storage dtype with its sign.
//    Same dtype in and out is a plain copy (NaN payloads kept).
//  - gptq_int4 is not an online scheme: see gptq_reload() in kernels/gptq.h. quantize() refuses it.
//
// Engine layouts (EngineLayout, core/scheme.h): the same schemes as vLLM's and SGLang's kernels read
// them, filled with the engines' own arithmetic (docs/engines.md cites each definition). Every
// engine layout holds the same bytes as a ferry layout; only names, shapes, the fused-scale policy
// and the fp8 arithmetic differ. Amax leaves NaN and +-inf out in every layout.
//   vllm fp8_per_tensor (vLLM's online fp8_per_tensor / Fp8LinearMethod, scaled_fp8_quant): one
//     scale for the whole fused parameter, weight_scale f32[1] (f32[E] for stacked experts: one per
//     expert over its merged matrix, quantized expert by expert). scale = amax / 448, with no guard for 0; code =
//     e4m3(clamp(x * (1 / scale), +-448)) by fminf/fmaxf, so NaN (also 0 * inf) codes +448.
//   vllm fp8_per_channel (online fp8_per_channel): weight_scale f32[rows, 1]; scale = max(amax /
//     448, 1 / (448 * 512)); code = e4m3(x / scale).
//   vllm and sglang fp8_block (per_block_cast_to_fp8, the online fp8_per_block and DeepSeek-style
//     checkpoints): weight_scale_inv f32[ceil(rows/128), ceil(cols/128)] ([E, ...] stacked; each
//     logical shard of a stacked matrix a multiple of 128 rows); scale = max(amax, 1e-4) / 448;
//     code = e4m3(x * (1 / scale)).
//   sglang fp8_per_channel (SGLang's online fp8 on sm_89+, per_token_quant_fp8): weight_scale
//     f32[1, rows]; scale = amax / 448; code = e4m3(clamp(x * m)), m = 0 for a zero scale, else
//     1 / scale. sglang fp8_per_tensor only for stacked experts (scaled_fp8_quant per expert,
//     w13_weight_scale f32[E]), with vLLM's arithmetic; SGLang quantizes dense layers per channel.
//   int8_per_channel (both): weight_scale f32[rows, 1] (sglang stacked: [E, rows, 1]), ferry's
//     arithmetic (the engines load int8 checkpoints as they are).
//   none: as ferry. int4_group and gptq_int4: refused (the engines' int4 kernels read Marlin's or
//     Machete's repacked layouts).
//   The weight tensor is the row-major [rows, cols] buffer in every case; vLLM and SGLang keep a
//   transposed view of it as the parameter, which shares these bytes.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/scheme.h"
#include "core/status.h"
#include "core/tensor.h"

namespace ferry::kernels {

// One tensor of a scheme's storage, registered with the layer. `suffix` replaces ".weight" in the
// parameter name ("weight", "weight_scale", ...). Runtime tensors are read by kernels but are not
// written from checkpoint data directly (permutations, workspaces).
struct StorageTensor {
  std::string suffix;
  DType dtype;
  Shape shape;
  bool runtime = false;
};

// The storage a parameter of full-precision `shape` (rows x cols) needs under `scheme`.
// `shard_rows` splits the rows into logical shards (q, k, v of a fused qkv); empty means one shard.
// `none_dtype` is the storage dtype for Scheme::kNone. Fails with InvalidArgument when the shape
// breaks the scheme's grouping (e.g. int4_group with cols not a multiple of 128).
//   none:             weight none_dtype[shape]
//   fp8_per_tensor:   weight f8_e4m3fn[shape], weight_scale f32[S] (S = shards, 1 when none given)
//   fp8_per_channel:  weight f8_e4m3fn[shape], weight_scale f32[rows]
//   fp8_block:        weight f8_e4m3fn[shape], weight_scale f32[ceil(rows/128), ceil(cols/128)]
//   int8_per_channel: weight i8[shape], weight_scale f32[rows]
//   int4_group:       weight i4x2[rows, cols], weight_scale f16[rows, cols/128]
//   gptq_int4:        see gptq_storage_layout() in kernels/gptq.h (shape is [N, K] = [out, in]).
// Rank >= 3 under none, fp8_per_channel, int8_per_channel, int4_group and fp8_block: [E, rows, cols...]
// is E stacked matrices (fused expert weights), each quantized on its own, and the scales carry E
// in front: f32[E, rows], f16[E, rows, cols/128], f32[E, ceil(rows/128), ceil(cols/128)]; the int4
// weight is i4x2[E, rows, cols]; shard_rows, when given, split the rows of one matrix. Under
// fp8_per_tensor a shape of rank > 2 is viewed as dim 0 x the rest. The weight keeps the shape.
Result<std::vector<StorageTensor>> storage_layout(Scheme scheme, const Shape& shape, std::span<const int64_t> shard_rows,
                                                  DType none_dtype = DType::kBF16);

// The storage of `scheme` as engine `layout` names and shapes it; kFerry is the overload above.
// Refuses, naming the engine and the reason, a scheme the engine's layout does not define here.
Result<std::vector<StorageTensor>> storage_layout(Scheme scheme, EngineLayout layout, const Shape& shape,
                                                  std::span<const int64_t> shard_rows,
                                                  DType none_dtype = DType::kBF16);

// Where a kernel runs. On CUDA, `stream` is a cudaStream_t; on the CPU, `threads` bounds the workers
// (0: host_threads(): FERRY_THREADS, else the hardware's).
struct Exec {
  void* stream = nullptr;
  int threads = 0;
};

// Quantizes `input` (f32, bf16 or f16; contiguous; rows x cols) into `outputs`, which follow
// storage_layout() in order. All views on one device. `shard_rows` must sum to rows when given
// (only fp8_per_tensor uses it). On CUDA the work is enqueued on exec.stream and not waited for.
Status quantize(Scheme scheme, const TensorView& input, std::span<const int64_t> shard_rows,
                std::span<const TensorView> outputs, const Exec& exec = {});

// quantize() into an engine layout's storage (storage_layout(scheme, layout, ...)), with its arithmetic.
Status quantize(Scheme scheme, EngineLayout layout, const TensorView& input, std::span<const int64_t> shard_rows,
                std::span<const TensorView> outputs, const Exec& exec = {});

// int4_group in an engine layout (Marlin's repack, which vLLM and SGLang read): rows
// [row0, row0 + input.dim(0)) of a parameter of shape `whole`, into the whole parameter's storage
// `outputs`. A 2-D weight's rows are its outputs, in runs of whole 64-output chunks (Marlin's
// tile; the weight's own rows are a multiple of 64); a stacked weight's rows are its matrices.
Status quantize_marlin_rows(EngineLayout layout, const Shape& whole, const TensorView& input, int64_t row0,
                            std::span<const TensorView> outputs, const Exec& exec = {});

// For a change to rows `rows` (sorted, disjoint, in [0, rows of input)) of a parameter whose other
// rows are as they were when `outputs` was quantized from them: writes what quantize() of the
// whole `input` would, touching only what it would change, and returns the rows whose codes it
// wrote. fp8_per_tensor on the CPU: in a shard whose scale comes out bit for bit as `outputs`
// holds it, the codes of the changed rows with that scale; any other shard whole (scale and codes).
// 0, with nothing written, for any other scheme or device (the caller quantizes whole).
Result<int64_t> quantize_rows_keeping_scales(Scheme scheme, EngineLayout layout, const TensorView& input,
                                             std::span<const int64_t> shard_rows,
                                             std::span<const std::pair<int64_t, int64_t>> rows,
                                             std::span<const TensorView> outputs, const Exec& exec = {});

// Calls into a device's (or the CPU's) quantize dispatcher this process has made so far, failed ones
// included: one per quantize() call, one per matrix for an engine layout's stacked per-tensor
// experts. On CUDA most are one kernel launch; fp8_per_tensor below the fused kernel's size launches
// a memset and two or three kernels (per shard on the generic path), and `none` into the input's
// own dtype is a copy, not a kernel.
uint64_t quantize_runs();

// The inverse, to f32 (tests and reference GEMMs). `output_f32` is f32 [rows, cols] in the
// parameter's logical (checkpoint) order; for gptq_int4 that is [N, K] with the act-order
// permutation undone.
Status dequantize(Scheme scheme, std::span<const TensorView> storage, std::span<const int64_t> shard_rows,
                  const TensorView& output_f32, const Exec& exec = {});

}  // namespace ferry::kernels
