// Quantization schemes: the one list of their names and the constants of their layouts. kernels/
// implements them, sharding/ checks shapes against them and sizes the wire, reload/ picks a
// processing kernel by them; proto messages, the CLI and Python carry the names, parsed here.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/dtype.h"
#include "core/status.h"

namespace ferry {

enum class Scheme : uint8_t {
  kNone,            // dtype conversion and copy (bf16 / f16 / f32 storage)
  kFp8PerTensor,    // e4m3fn, one f32 scale per logical shard of a fused parameter
  kFp8PerChannel,   // e4m3fn, one f32 scale per output row
  kFp8Block,        // e4m3fn, one f32 scale per kFp8BlockSize x kFp8BlockSize block
  kInt8PerChannel,  // symmetric int8, one f32 scale per output row
  kInt4Group,       // packed symmetric int4, one f16 scale per kGroupSize input columns
  kGptqInt4,        // quantized reload of a GPTQ act-order checkpoint, kGroupSize rows of K per group
};

inline constexpr Scheme kAllSchemes[] = {Scheme::kNone,           Scheme::kFp8PerTensor, Scheme::kFp8PerChannel,
                                         Scheme::kFp8Block,       Scheme::kInt8PerChannel, Scheme::kInt4Group,
                                         Scheme::kGptqInt4};

inline constexpr int64_t kFp8BlockSize = 128;  // fp8_block: rows and columns per scale block
inline constexpr int64_t kGroupSize = 128;     // int4_group and gptq_int4: input columns per scale group

// "none", "fp8_per_tensor", "fp8_per_channel", "fp8_block", "int8_per_channel", "int4_group",
// "gptq_int4".
std::string_view scheme_name(Scheme scheme);
Result<Scheme> parse_scheme(std::string_view name);

// Whose kernels read the storage: the layout of every scheme's tensors (names, shapes, fused-scale
// policy) and the arithmetic that fills them. kernels/quantize.h defines each; docs/engines.md cites
// the engines' source for the vLLM and SGLang ones.
enum class EngineLayout : uint8_t {
  kFerry,   // ferry's own kernels (kernels/quantize.h)
  kVllm,    // vLLM's online quantization methods and the parameters its kernels read
  kSglang,  // SGLang's
};

inline constexpr EngineLayout kAllEngineLayouts[] = {EngineLayout::kFerry, EngineLayout::kVllm, EngineLayout::kSglang};

// "ferry", "vllm", "sglang".
std::string_view engine_layout_name(EngineLayout layout);
Result<EngineLayout> parse_engine_layout(std::string_view name);

// False for gptq_int4, which takes a pre-quantized checkpoint instead of full-precision tensors.
bool scheme_is_online(Scheme scheme);
// Input columns per scale group (kGroupSize for int4_group and gptq_int4), 0 when the scheme has no
// column groups: a shard's columns must be a multiple of it.
int64_t scheme_group_columns(Scheme scheme);
// Bits per element of the scheme's main storage tensor (the source's for none), for wire estimates.
int scheme_weight_bits(Scheme scheme, DType source_dtype);

}  // namespace ferry
