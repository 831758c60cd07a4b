// Sharded trainers for the tests: which box of each checkpoint tensor each trainer rank holds, as
// FSDP2, HSDP and pipeline stages lay them out, and that rank's local tensors cut from a checkpoint.
#pragma once

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "sharding/planner.h"
#include "sharding/trainer_layouts.h"
#include "tests/coordinator/scheme_bytes.h"

namespace ferry::testutil {

// TP 2 with a vocabulary of 301 rows: four FSDP2 shards of the embedding and lm_head are uneven
// (76, 76, 76, 73 rows).
inline Config sharded_config(int tp) {
  Config c = config(fmt::format("Tp{}Vocab301", tp), tp, 128, 4, 32, 256);
  c.llama.vocab_size = 301;
  return c;
}

// The checkpoint of version `v`: unrelated values per version, or (`small_steps`, as an RL step at
// a small learning rate) one base checkpoint with about 0.1% of its elements moved by one unit in
// the last place, a different 0.1% each version.
inline Checkpoint version_checkpoint(const sharding::Manifest& m, uint64_t v, bool small_steps) {
  if (!small_steps) return make_checkpoint(m, 100 + v);
  Checkpoint ck = make_checkpoint(m, 101);
  for (auto& [name, data] : ck.data) {
    for (size_t i = v % 997; i < data.size(); i += 997) data[i] ^= 1;
  }
  return ck;
}

// A trainer rank's holdings of `m` under `layout` (sharding/trainer_layouts.h):
//   fsdp      Shard(0) over all ranks;
//   hsdp      Shard(0) over pairs, replicated across them (rank r holds shard r % 2 of 2);
//   pipeline  the layers split over the ranks as stages (stage 0 also the embedding, the last the
//             norm and head);
//   gap       fsdp, but the last rank does not hold the last row of lm_head;
//   overlap   fsdp, but rank 1's box of the embedding starts one row into rank 0's.
inline sharding::SenderInfo holdings_for(const std::string& layout, const sharding::Manifest& m, int rank, int ranks) {
  if (layout == "pipeline") return sharding::pipeline_holdings(m, rank, ranks);
  if (layout == "hsdp") return sharding::hsdp_holdings(m, rank, ranks, 2);
  sharding::SenderInfo out = sharding::fsdp_holdings(m, rank, ranks);
  for (auto& h : out.holds) {
    if (layout == "gap" && rank == ranks - 1 && h.name == "lm_head.weight") h.region.size[0] -= 1;
    if (layout == "overlap" && rank == 1 && h.name == "model.embed_tokens.weight") {
      h.region.offset[0] -= 1;
      h.region.size[0] += 1;
    }
  }
  return out;
}

// The local tensors of a trainer rank: each held box's rows copied out of the checkpoint.
struct LocalShards {
  std::map<std::string, std::vector<uint16_t>> data;
  std::map<std::string, TensorView> views;

  LocalShards(const sharding::Manifest& m, const Checkpoint& ck, const sharding::SenderInfo& h) {
    for (const auto& name : h.owns) views.emplace(name, ck.views.at(name));
    for (const auto& box : h.holds) {
      const auto& src = ck.data.at(box.name);
      const auto& t = *std::find_if(m.begin(), m.end(), [&](const auto& x) { return x.name == box.name; });
      const int64_t row = shape_numel(t.shape) / std::max<int64_t>(t.shape[0], 1);
      auto& v = data[box.name];
      v.assign(src.begin() + box.region.offset[0] * row, src.begin() + (box.region.offset[0] + box.region.size[0]) * row);
      views.emplace(box.name, TensorView(v.data(), DType::kBF16, box.region.size));
    }
  }
};

}  // namespace ferry::testutil
