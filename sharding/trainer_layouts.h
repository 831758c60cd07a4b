// The holdings of common sharded trainers: which box of every manifest tensor one trainer rank
// holds under FSDP2, HSDP, pipeline stages and expert parallelism, as `SenderInfo` for `make_plan`
// and `resolve_holdings`. Every layout of every rank count tiles the manifest exactly. A rank that
// holds nothing of a layout still declares a (zero-size) box, so it never reads as "everything".
#pragma once

#include <cstdint>
#include <utility>

#include "sharding/planner.h"

namespace ferry::sharding {

// The rows [from, to) FSDP2's Shard(0) gives rank `rank` of `ranks` along a dimension of `n`, as
// torch.chunk cuts: chunks of ceil(n / ranks) rows, the last one shorter and any after it empty.
std::pair<int64_t, int64_t> shard_rows(int64_t n, int rank, int ranks);

// FSDP2: rank `rank` of `ranks` holds shard_rows of dimension 0 of every tensor (a 0-d tensor
// whole on rank 0).
SenderInfo fsdp_holdings(const Manifest& manifest, int rank, int ranks);

// HSDP: `ranks` = replicas x `shard_group`; rank r holds FSDP shard r % shard_group of
// `shard_group`, so every shard is replicated on ranks / shard_group holders (torch's (replicate,
// shard) mesh, shard dimension innermost).
SenderInfo hsdp_holdings(const Manifest& manifest, int rank, int ranks, int shard_group);

// Pipeline stages: the decoder layers split evenly by index (stage s holds layers
// [L * s / stages, L * (s + 1) / stages) whole, L the manifest's layer count); stage 0 also holds
// the embedding, the last stage every other tensor outside the layers (final norm, lm_head).
SenderInfo pipeline_holdings(const Manifest& manifest, int stage, int stages);

// Expert parallelism over `ep_size` ranks: routed expert e (a name with ".experts.<e>.", or row e
// of a stacked experts tensor, stacked_experts_of()) is held by EP rank r when e is in
// [E * r / ep_size, E * (r + 1) / ep_size), E the manifest's expert count: contiguous blocks of E / ep_size, as Megatron-Core and torchtitan place experts (they
// require ep_size to divide E; otherwise the blocks differ by one expert, and none is empty while
// E >= ep_size, unlike torch.chunk's rule). Every other tensor (attention, dense and shared-expert
// MLPs, router, embedding, head) is Shard(0) over the same ranks, as FSDP2 shards the non-expert
// parameters of an EP trainer (torchtitan's dp_shard x ep mesh), so every rank sends a share of
// them and none funnels them alone.
SenderInfo expert_holdings(const Manifest& manifest, int ep_rank, int ep_size);

// The routed expert index of a tensor name ("...mlp.experts.7.down_proj.weight" -> 7), or -1.
int expert_index_of(const std::string& name);
// The experts a tensor holds stacked (stack_experts(): "...experts.gate_up_proj" or
// "...experts.down_proj", [experts, rows, cols]), or 0.
int64_t stacked_experts_of(const SourceTensor& t);

}  // namespace ferry::sharding
