// The planner: from a manifest and every destination rank's spec, the pieces each sender moves to
// each rank, in layer order, with senders balanced by bytes. Deterministic; computed once per
// (manifest, specs) and reused through PlanCache.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "sharding/buckets.h"
#include "sharding/holdings.h"
#include "sharding/model_spec.h"

namespace ferry::sharding {

struct Piece {
  int dst = 0;     // index of the destination rank
  int param = 0;   // parameter index in that rank's spec
  int slice = 0;   // slice index within the parameter
  int source = 0;  // manifest index of the source tensor
  Region src;      // region of the source tensor (inside its slice's, and inside one held box)
  uint64_t bytes = 0;
  int sender = 0;
  int box = 0;     // which held box of the source (holdings.h) the piece lies in
};

struct PlanOptions {
  uint64_t bucket_bytes = kDefaultBucketBytes;  // the trainer's FERRY_BUCKET_BYTES
};

struct Plan {
  std::vector<std::string> layers;            // layer keys in transfer order
  std::vector<int> source_order;              // manifest indices in transfer order
  std::vector<Piece> pieces;                  // grouped by source, in source_order
  std::vector<std::vector<int>> by_source;    // manifest index -> piece indices
  std::vector<uint64_t> bytes_per_sender;
  std::vector<uint64_t> bytes_per_dst;
  uint64_t total_bytes = 0;
  uint64_t key = 0;                           // hash of manifest and specs
  std::vector<Bucket> buckets;                // cut_buckets(): in the order they are sent
  uint64_t bucket_bytes = 0;
  uint64_t max_row_bytes = 0;                 // the largest row of any piece (buckets.h)
};

struct SenderInfo {
  // Tensors this sender holds whole, and boxes of tensors it holds in part (holdings.h); both empty
  // means every tensor of the manifest, whole.
  std::vector<std::string> owns;
  std::vector<Holding> holds;
  bool operator==(const SenderInfo&) const = default;
};

// Where a piece lands in its destination parameter: its slice's destination region, narrowed to
// the part of the slice's source region the piece covers (a piece is cut by the holders' boxes).
Region piece_dst_region(const Piece& piece, const ParamSpec& param);

// Checks the manifest against every rank before anything moves; errors name the tensor, what the
// replica expects and what the trainer sends.
Status check_manifest(const Manifest& manifest, const std::vector<RankSpec>& ranks);

// Sender assignment: largest pieces first, each to the least-loaded sender holding its source
// (ties to the lowest index). Copies of a replicated tensor thus leave from different senders.
Result<Plan> make_plan(const Manifest& manifest, const std::vector<RankSpec>& ranks,
                       const std::vector<SenderInfo>& senders);
Result<Plan> make_plan(const Manifest& manifest, const std::vector<RankSpec>& ranks,
                       const std::vector<SenderInfo>& senders, const PlanOptions& options);

uint64_t plan_key(const Manifest& manifest, const std::vector<RankSpec>& ranks, const std::vector<SenderInfo>& senders);

// Plans keyed by plan_key(); a steady RL loop plans once.
class PlanCache {
 public:
  Result<std::shared_ptr<const Plan>> get(const Manifest& manifest, const std::vector<RankSpec>& ranks,
                                          const std::vector<SenderInfo>& senders);
  Result<std::shared_ptr<const Plan>> get(const Manifest& manifest, const std::vector<RankSpec>& ranks,
                                          const std::vector<SenderInfo>& senders, const PlanOptions& options);
  size_t hits() const { return hits_; }
  size_t misses() const { return misses_; }

 private:
  std::mutex mu_;
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<const Plan>> plans_;  // (plan_key, bucket bytes)
  size_t hits_ = 0;
  size_t misses_ = 0;
};

}  // namespace ferry::sharding
