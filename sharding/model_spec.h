// What a rollout rank holds and what the trainer sends, in checkpoint names.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/cow_vector.h"
#include "core/dtype.h"
#include "core/scheme.h"
#include "core/status.h"
#include "core/tensor.h"

namespace ferry::sharding {

// One tensor of the manifest: what the trainer will send, in checkpoint format.
struct SourceTensor {
  std::string name;  // model.layers.3.self_attn.q_proj.weight
  DType dtype = DType::kBF16;
  Shape shape;
  bool operator==(const SourceTensor&) const = default;
};

using Manifest = std::vector<SourceTensor>;

// A region of a source tensor that lands at `dst_offset` inside a destination parameter.
// The region and its landing box have the same extent; a 1-D or 2-D source may land in a
// destination of higher rank by leading unit dimensions.
struct SourceSlice {
  std::string source;
  Region src;
  Dims dst_offset;
  bool operator==(const SourceSlice&) const = default;
};

// One parameter of one rank, in full precision after fusion and sharding. Its processing (scheme)
// turns it into the registered storage.
struct ParamSpec {
  std::string name;   // engine name, fused: model.layers.0.self_attn.qkv_proj.weight
  std::string layer;  // the layer it belongs to: model.layers.0, model.embed_tokens, model.norm, lm_head
  Shape shape;        // full-precision shape on this rank
  DType source_dtype = DType::kBF16;
  Scheme scheme = Scheme::kNone;    // processing into storage (core/scheme.h, kernels/quantize.h)
  std::vector<int64_t> shard_rows;  // logical shards of a fused parameter (q, k, v); empty: one
  std::vector<SourceSlice> slices;  // where every element comes from; disjoint
  bool operator==(const ParamSpec&) const = default;
};

// One rank of one replica.
struct RankSpec {
  int replica = 0;
  int tp_rank = 0;
  int tp_size = 1;
  int ep_size = 1;   // expert-parallel groups inside the replica's tp_size ranks (1: experts TP-sharded)
  // Whose kernels read this rank's storage (kernels/quantize.h "Engine layouts"): the names, shapes
  // and arithmetic of every quantized parameter. Local to the rank: the plan does not depend on it.
  EngineLayout layout = EngineLayout::kFerry;
  // Every source tensor this rank's model takes, with its full shape, and the rank's parameters.
  // Copies of a spec share both until one is written (core/cow_vector.h): the ranks of identical
  // replicas hold them once, and the planner treats ranks that share them as laid out alike.
  CowVector<SourceTensor> expects;
  CowVector<ParamSpec> params;
};

// Makes `spec` share `other`'s tensors and parameters where they are equal (compared in full), as
// if copied from it: ranks of identical replicas that were built apart (received over the wire)
// then plan as fast as copies. True when both are shared.
bool share_layout(RankSpec& spec, const RankSpec& other);
// share_layout() with the first of `others` at the same TP rank, TP size and expert groups whose
// tensors and parameters equal `spec`'s (the same rank of another identical replica); true when
// `spec` then shares them.
bool share_with_alike(RankSpec& spec, std::span<const RankSpec* const> others);

// Destination box of a slice inside its parameter.
Region slice_dst_region(const SourceSlice& slice, const ParamSpec& param);

// Checks a rank's parameters: slices inside their source and destination, disjoint, extents agree.
Status validate_rank_spec(const RankSpec& spec, const Manifest& manifest);

// The layer key of a checkpoint or engine name: "model.layers.N" for per-layer tensors, otherwise the
// name without its last component ("model.embed_tokens.weight" -> "model.embed_tokens").
std::string layer_of(const std::string& name);
// The decoder layer index of a name, or -1 for tensors outside the decoder stack.
int layer_index_of(const std::string& name);

}  // namespace ferry::sharding
