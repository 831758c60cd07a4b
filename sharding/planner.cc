#include "sharding/planner.h"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <unordered_map>

#include <fmt/format.h>
#include <xxhash.h>


namespace ferry::sharding {
namespace {

std::string describe(const SourceTensor& t) { return fmt::format("{}{}", dtype_name(t.dtype), shape_to_string(t.shape)); }

class Hasher {
 public:
  Hasher() : st_(XXH3_createState()) { XXH3_64bits_reset(st_); }
  ~Hasher() { XXH3_freeState(st_); }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  void add(const void* p, size_t n) { XXH3_64bits_update(st_, p, n); }
  void add(const std::string& s) {
    add_int(static_cast<int64_t>(s.size()));
    add(s.data(), s.size());
  }
  void add_int(int64_t v) { add(&v, sizeof(v)); }
  void add_shape(const Shape& s) {
    add_int(static_cast<int64_t>(s.size()));
    for (int64_t d : s) add_int(d);
  }
  uint64_t digest() { return XXH3_64bits_digest(st_); }

 private:
  XXH3_state_t* st_;
};

}  // namespace

Status check_manifest(const Manifest& manifest, const std::vector<RankSpec>& ranks) {
  std::unordered_map<std::string, const SourceTensor*> sent;
  for (const auto& t : manifest) {
    if (!sent.emplace(t.name, &t).second) return Status::invalid_argument("trainer sends " + t.name + " twice");
  }
  std::set<std::string> expected;
  for (const RankSpec& r : ranks) {
    for (const SourceTensor& e : r.expects) {
      expected.insert(e.name);
      auto it = sent.find(e.name);
      if (it == sent.end()) {
        return Status::invalid_argument(fmt::format("tensor {}: replica {} rank {} expects {}, trainer sends nothing",
                                                    e.name, r.replica, r.tp_rank, describe(e)));
      }
      if (it->second->dtype != e.dtype || it->second->shape != e.shape) {
        return Status::invalid_argument(fmt::format("tensor {}: replica {} rank {} expects {}, trainer sends {}", e.name,
                                                    r.replica, r.tp_rank, describe(e), describe(*it->second)));
      }
    }
    FERRY_RETURN_IF_ERROR(validate_rank_spec(r, r.expects));
  }
  for (const auto& t : manifest) {
    if (!expected.count(t.name)) {
      return Status::invalid_argument(
          fmt::format("tensor {}: trainer sends {}, but no replica has a tensor of that name", t.name, describe(t)));
    }
  }
  return ok_status();
}

uint64_t plan_key(const Manifest& manifest, const std::vector<RankSpec>& ranks, const std::vector<SenderInfo>& senders) {
  Hasher h;
  for (const auto& t : manifest) {
    h.add(t.name);
    h.add_int(static_cast<int64_t>(t.dtype));
    h.add_shape(t.shape);
  }
  for (const RankSpec& r : ranks) {
    h.add_int(r.replica);
    h.add_int(r.tp_rank);
    h.add_int(r.tp_size);
    h.add_int(r.ep_size);
    for (const ParamSpec& p : r.params) {
      h.add(p.name);
      h.add(p.layer);
      h.add_shape(p.shape);
      h.add_int(static_cast<int64_t>(p.source_dtype));
      h.add(std::string(scheme_name(p.scheme)));
      h.add_shape(p.shard_rows);
      for (const SourceSlice& s : p.slices) {
        h.add(s.source);
        h.add_shape(s.src.offset);
        h.add_shape(s.src.size);
        h.add_shape(s.dst_offset);
      }
    }
  }
  for (const SenderInfo& s : senders) {
    h.add_int(static_cast<int64_t>(s.owns.size()));
    for (const auto& n : s.owns) h.add(n);
    h.add_int(static_cast<int64_t>(s.holds.size()));
    for (const Holding& x : s.holds) {
      h.add(x.name);
      h.add_shape(x.region.offset);
      h.add_shape(x.region.size);
    }
  }
  return h.digest();
}

Result<Plan> make_plan(const Manifest& manifest, const std::vector<RankSpec>& ranks,
                       const std::vector<SenderInfo>& senders) {
  return make_plan(manifest, ranks, senders, PlanOptions{});
}

Result<Plan> make_plan(const Manifest& manifest, const std::vector<RankSpec>& ranks,
                       const std::vector<SenderInfo>& senders, const PlanOptions& options) {
  if (senders.empty()) return Status::invalid_argument("a plan needs at least one sender");
  const uint64_t bucket_bytes = options.bucket_bytes;
  if (bucket_bytes == 0) return Status::invalid_argument("a plan's bucket size must be positive");
  FERRY_RETURN_IF_ERROR(check_manifest(manifest, ranks));
  std::unordered_map<std::string, int> index;
  for (size_t i = 0; i < manifest.size(); ++i) index[manifest[i].name] = static_cast<int>(i);
  // Who holds which box of each source; the boxes tile every source exactly.
  FERRY_ASSIGN_OR_RETURN(const auto held, resolve_holdings(manifest, senders));

  Plan plan;
  plan.key = plan_key(manifest, ranks, senders);
  plan.bucket_bytes = bucket_bytes;
  // Transfer order: decoder layers in index order, with the tensors outside the stack placed where
  // an engine meets them (embeddings first, final norm and lm_head last); stable within a layer.
  plan.source_order.resize(manifest.size());
  std::iota(plan.source_order.begin(), plan.source_order.end(), 0);
  auto rank_of = [&](int i) {
    const std::string& n = manifest[static_cast<size_t>(i)].name;
    const int li = layer_index_of(n);
    if (li >= 0) return static_cast<int64_t>(li) + 1;
    return n.starts_with("model.embed_tokens") ? int64_t{0} : std::numeric_limits<int64_t>::max();
  };
  std::stable_sort(plan.source_order.begin(), plan.source_order.end(),
                   [&](int a, int b) { return rank_of(a) < rank_of(b); });
  for (int i : plan.source_order) {
    const std::string layer = layer_of(manifest[static_cast<size_t>(i)].name);
    if (plan.layers.empty() || plan.layers.back() != layer) plan.layers.push_back(layer);
  }

  // Pieces, grouped by source.
  std::vector<std::vector<Piece>> per_source(manifest.size());
  for (size_t d = 0; d < ranks.size(); ++d) {
    const auto& params = ranks[d].params;
    for (size_t p = 0; p < params.size(); ++p) {
      for (size_t s = 0; s < params[p].slices.size(); ++s) {
        const SourceSlice& sl = params[p].slices[s];
        const int src = index.at(sl.source);
        // One piece per held box the slice meets (one, for a trainer holding tensors whole).
        const auto& boxes = held.boxes[static_cast<size_t>(src)];
        for (size_t k = 0; k < boxes.size(); ++k) {
          auto part = boxes.size() == 1 ? std::optional<Region>(sl.src) : intersect(sl.src, boxes[k].region);
          if (!part) continue;
          Piece pc;
          pc.dst = static_cast<int>(d);
          pc.param = static_cast<int>(p);
          pc.slice = static_cast<int>(s);
          pc.source = src;
          pc.box = static_cast<int>(k);
          pc.src = std::move(*part);
          pc.bytes = dtype_bytes(manifest[static_cast<size_t>(src)].dtype, pc.src.numel());
          per_source[static_cast<size_t>(src)].push_back(std::move(pc));
        }
      }
    }
  }
  plan.bytes_per_dst.assign(ranks.size(), 0);
  plan.by_source.resize(manifest.size());
  for (int src : plan.source_order) {
    for (Piece& pc : per_source[static_cast<size_t>(src)]) {
      plan.bytes_per_dst[static_cast<size_t>(pc.dst)] += pc.bytes;
      plan.total_bytes += pc.bytes;
      plan.by_source[static_cast<size_t>(src)].push_back(static_cast<int>(plan.pieces.size()));
      plan.pieces.push_back(std::move(pc));
    }
  }

  // Balance senders, largest pieces first (LPT): the heaviest sender ends within one piece of the
  // ideal split, and the copies of a replicated piece go to different senders in turn.
  std::vector<int> by_size(plan.pieces.size());
  std::iota(by_size.begin(), by_size.end(), 0);
  std::stable_sort(by_size.begin(), by_size.end(), [&](int a, int b) {
    return plan.pieces[static_cast<size_t>(a)].bytes > plan.pieces[static_cast<size_t>(b)].bytes;
  });
  plan.bytes_per_sender.assign(senders.size(), 0);
  for (int i : by_size) {
    Piece& pc = plan.pieces[static_cast<size_t>(i)];
    const auto& cands = held.holders(static_cast<size_t>(pc.source), static_cast<size_t>(pc.box));
    int best = cands.front();
    for (int c : cands) {
      if (plan.bytes_per_sender[static_cast<size_t>(c)] < plan.bytes_per_sender[static_cast<size_t>(best)]) best = c;
    }
    pc.sender = best;
    plan.bytes_per_sender[static_cast<size_t>(best)] += pc.bytes;
  }
  for (const Piece& pc : plan.pieces) plan.max_row_bytes = std::max(plan.max_row_bytes, piece_rows(pc.src.size, pc.bytes).row_bytes);
  plan.buckets = cut_buckets(plan, bucket_bytes);
  return plan;
}

Region piece_dst_region(const Piece& piece, const ParamSpec& param) {
  const SourceSlice& slice = param.slices[static_cast<size_t>(piece.slice)];
  Region dst = slice_dst_region(slice, param);
  // Source dimension i is destination dimension i + k (a destination may have leading dimensions,
  // such as experts, that its source slices do not).
  const size_t k = dst.size.size() - slice.src.size.size();
  for (size_t i = 0; i < piece.src.size.size(); ++i) {
    dst.offset[i + k] += piece.src.offset[i] - slice.src.offset[i];
    dst.size[i + k] = piece.src.size[i];
  }
  return dst;
}

Result<std::shared_ptr<const Plan>> PlanCache::get(const Manifest& manifest, const std::vector<RankSpec>& ranks,
                                                   const std::vector<SenderInfo>& senders) {
  return get(manifest, ranks, senders, PlanOptions{});
}

Result<std::shared_ptr<const Plan>> PlanCache::get(const Manifest& manifest, const std::vector<RankSpec>& ranks,
                                                   const std::vector<SenderInfo>& senders, const PlanOptions& options) {
  const auto key = std::make_pair(plan_key(manifest, ranks, senders), options.bucket_bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(key);
    if (it != plans_.end()) {
      ++hits_;
      return it->second;
    }
  }
  FERRY_ASSIGN_OR_RETURN(Plan plan, make_plan(manifest, ranks, senders, options));
  auto shared = std::make_shared<const Plan>(std::move(plan));
  std::lock_guard<std::mutex> lock(mu_);
  ++misses_;
  plans_[key] = shared;
  return std::shared_ptr<const Plan>(shared);
}

}  // namespace ferry::sharding
