// Online quantization: full-precision tensors in, a scheme's storage layout out, written into
// caller-given storage (kernels never allocate their outputs). CPU and CUDA share these entry
// points; the device of the views picks the implementation.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace ferry::kernels {

enum class Scheme : uint8_t {
  kNone,            // dtype conversion and copy (bf16 / f16 / f32 storage)
  kFp8PerTensor,    // e4m3fn, one f32 scale per logical shard of a fused parameter
  kFp8PerChannel,   // e4m3fn, one f32 scale per output row
  kFp8Block,        // e4m3fn, one f32 scale per 128x128 block
  kInt8PerChannel,  // symmetric int8, one f32 scale per output row
  kInt4Group,       // packed symmetric int4, one f16 scale per group of 128 input columns
  kGptqInt4,        // quantized reload of a GPTQ act-order checkpoint
};

std::string_view scheme_name(Scheme scheme);
Result<Scheme> parse_scheme(std::string_view name);

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
Result<std::vector<StorageTensor>> storage_layout(Scheme scheme, const Shape& shape, std::span<const int64_t> shard_rows,
                                                  DType none_dtype = DType::kBF16);

// Where a kernel runs. On CUDA, `stream` is a cudaStream_t; on the CPU, `threads` bounds the workers
// (0: all cores).
struct Exec {
  void* stream = nullptr;
  int threads = 0;
};

// Quantizes `input` (f32, bf16 or f16; contiguous; rows x cols) into `outputs`, which follow
// storage_layout() in order. All views on one device.
Status quantize(Scheme scheme, const TensorView& input, std::span<const int64_t> shard_rows,
                std::span<const TensorView> outputs, const Exec& exec = {});

// The inverse, to f32 (tests and reference GEMMs).
Status dequantize(Scheme scheme, std::span<const TensorView> storage, std::span<const int64_t> shard_rows,
                  const TensorView& output_f32, const Exec& exec = {});

}  // namespace ferry::kernels
