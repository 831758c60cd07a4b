// The expectation side of the storage-bytes tests (scheme_bytes_test.cc, verify_test.cc): model
// configurations, a checkpoint with the schemes' corner cases, and every rank's storage bytes as
// they must be after an update, built without ferry's sharding or kernels: each rank's
// full-precision parameter from the test-side layout oracle (tests/sharding/oracle.h, vLLM's TP
// layout), quantized by the test-side reference quantizer (tests/kernels/ref_quantize.h).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/scheme.h"
#include "sharding/llama.h"
#include "tests/coordinator/cluster.h"

namespace ferry::testutil {

// Dimensions every online scheme accepts on every rank: each linear's per-rank columns (hidden
// size, heads * head_dim / tp, intermediate / tp) a multiple of 128 (int4 groups, fp8 blocks).
struct Config {
  std::string name;
  sharding::LlamaConfig llama;
  int tp = 1;
};

// Where every element of one checkpoint tensor lands, from the oracle: the places of element e are
// dest[start[e]] .. dest[start[e + 1]).
struct Dest {
  int32_t rank;
  int32_t param;  // index in the rank's parameters
  int64_t flat;   // element of the rank's parameter
};
struct Places {
  std::vector<uint32_t> start;
  std::vector<Dest> dest;
};

// The ranks' parameter lists (names, shapes, shard rows: what the storage is registered from) and
// where every checkpoint element lands in them.
struct Layout {
  std::vector<sharding::RankSpec> specs;
  std::shared_ptr<const std::map<std::string, Places>> places;  // by checkpoint name
};

using Bytes = std::vector<uint8_t>;
using RankBytes = std::map<std::string, Bytes>;  // storage tensor name -> bytes

Config config(std::string name, int tp, int64_t hidden, int64_t kv_heads, int64_t head_dim, int64_t intermediate);
// TP 2 with more KV heads than ranks (two per rank); the vocabulary of 300 pads each rank's shard
// to 192 rows, the last rank's 42 of them padding.
Config kv_above_tp();
// TP 4 with two KV heads: each KV head is replicated on two ranks. Vocabulary shards of 128 rows:
// rank 2 holds 44 real rows and rank 3 none at all (all padding).
Config kv_below_tp();
// Large enough that each rank's update is several small buckets (each rank takes about 2.5 MB).
Config several_buckets();

// The seeded checkpoint of cluster.h with values that make the schemes' corner cases matter.
Checkpoint make_checkpoint(const sharding::Manifest& m, uint64_t seed);
Layout make_layout(const Config& c, const std::string& scheme);
bool is_linear(const std::string& param);
std::string scale_name(const std::string& param);

// Every storage tensor of every rank, expected after `ck` lands under `scheme`.
std::vector<RankBytes> expected_storage(const Config& c, const Layout& l, Scheme scheme, const Checkpoint& ck);
RankBytes storage_bytes(const Rank& rank);
// "" when `got` holds exactly the tensors of `want` with the same bytes; else the differences.
std::string compare(const RankBytes& want, const RankBytes& got);
// Bytes that differ between two tensors of the same size.
size_t differing(const Bytes& a, const Bytes& b);
// Fills every storage tensor of every rank with garbage, so that an update must write each byte.
void scribble(Cluster& c);
void expect_storage(Cluster& c, const std::vector<RankBytes>& want, const std::string& what, int replica = 0);

}  // namespace ferry::testutil
