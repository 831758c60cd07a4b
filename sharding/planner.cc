#include "sharding/planner.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <unordered_map>

#include <xxhash.h>

#include "sharding/spec_check.h"

namespace ferry::sharding {
namespace {

// XXH3 over the inputs, gathered into chunks first: the digest of a stream does not depend on how
// it is cut, and a plan of millions of slices would otherwise make tens of millions of calls.
class Hasher {
 public:
  Hasher() : st_(XXH3_createState()), buf_(kChunk) { XXH3_64bits_reset(st_); }
  ~Hasher() { XXH3_freeState(st_); }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  void add(const void* p, size_t n) {
    if (used_ + n > kChunk) flush();
    if (n > kChunk) {
      XXH3_64bits_update(st_, p, n);
      return;
    }
    std::memcpy(buf_.data() + used_, p, n);
    used_ += n;
  }
  void add(const std::string& s) {
    add_int(static_cast<int64_t>(s.size()));
    add(s.data(), s.size());
  }
  void add_int(int64_t v) { add(&v, sizeof(v)); }
  void add_shape(const Shape& s) {
    add_int(static_cast<int64_t>(s.size()));
    for (int64_t d : s) add_int(d);
  }
  uint64_t digest() {
    flush();
    return XXH3_64bits_digest(st_);
  }

 private:
  static constexpr size_t kChunk = size_t{1} << 16;
  void flush() {
    if (used_ > 0) XXH3_64bits_update(st_, buf_.data(), used_);
    used_ = 0;
  }
  XXH3_state_t* st_;
  std::vector<unsigned char> buf_;
  size_t used_ = 0;
};

// Each source's place in the transfer order: decoder layers in index order, with the tensors
// outside the stack placed where an engine meets them (embeddings first, final norm and lm_head
// last).
std::vector<int64_t> layer_keys(const Manifest& manifest) {
  std::vector<int64_t> key(manifest.size());
  for (size_t i = 0; i < manifest.size(); ++i) {
    const std::string& n = manifest[i].name;
    const int li = layer_index_of(n);
    key[i] = li >= 0                                ? static_cast<int64_t>(li) + 1
             : n.starts_with("model.embed_tokens") ? int64_t{0}
                                                   : std::numeric_limits<int64_t>::max();
  }
  return key;
}

// Transfer order: sources by layer key, stable within a layer.
std::vector<int> transfer_order(const std::vector<int64_t>& keys) {
  std::vector<int> order(keys.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return keys[static_cast<size_t>(a)] < keys[static_cast<size_t>(b)]; });
  return order;
}

// The digest of one rank's parameters: names, shapes, schemes and every slice.
uint64_t params_digest(const std::vector<ParamSpec>& params) {
  Hasher h;
  for (const ParamSpec& p : params) {
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
  return h.digest();
}

// Ranks laid out alike: the first rank whose parameters each rank shares (RankSpec's copies share
// them; an identical replica's ranks do), so the walk below indexes each distinct layout once.
std::vector<size_t> layout_classes(const std::vector<RankSpec>& ranks) {
  std::unordered_map<const void*, size_t> first;
  std::vector<size_t> cls(ranks.size());
  for (size_t d = 0; d < ranks.size(); ++d) cls[d] = first.try_emplace(ranks[d].params.identity(), d).first->second;
  return cls;
}

// One layout's slices by source: those of source i are (param, slice) pairs entries[at[i], at[i + 1]),
// in the rank's order (parameter after parameter), with the pieces they make (one per held box they
// meet) counted.
struct SlicesBySource {
  std::vector<uint32_t> at;
  std::vector<std::pair<uint32_t, uint32_t>> entries;
  size_t pieces = 0;
};

size_t boxes_met(const Region& slice, const std::vector<HeldBox>& boxes) {
  if (boxes.size() == 1) return 1;  // a source held whole: the one box
  size_t n = 0;
  for (const auto& b : boxes) n += slice.overlaps(b.region) ? 1 : 0;
  return n;
}

SlicesBySource slices_by_source(const RankSpec& rank, const int* sources, size_t num_sources, const Holdings& held) {
  SlicesBySource out;
  out.at.assign(num_sources + 1, 0);
  const int* next = sources;
  for (const ParamSpec& p : rank.params) {
    for (size_t s = 0; s < p.slices.size(); ++s) ++out.at[static_cast<size_t>(*next++) + 1];
  }
  for (size_t i = 0; i < num_sources; ++i) out.at[i + 1] += out.at[i];
  out.entries.resize(out.at.back());
  std::vector<uint32_t> fill(out.at.begin(), out.at.end() - 1);
  next = sources;
  for (size_t p = 0; p < rank.params.size(); ++p) {
    const auto& slices = rank.params[p].slices;
    for (size_t s = 0; s < slices.size(); ++s) {
      const auto src = static_cast<size_t>(*next++);
      out.entries[fill[src]++] = {static_cast<uint32_t>(p), static_cast<uint32_t>(s)};
      out.pieces += boxes_met(slices[s].src, held.boxes[src]);
    }
  }
  return out;
}

// The pieces, grouped by source in transfer order (in each, rank after rank, a rank's in its
// parameter order), with their sums: one per held box each slice meets (one, for a trainer holding
// tensors whole). Written in that order, each once.
void place_pieces(const Manifest& manifest, const std::vector<RankSpec>& ranks, const Holdings& held,
                  const std::vector<int>& slice_sources, Plan& plan) {
  const std::vector<size_t> cls = layout_classes(ranks);
  std::vector<SlicesBySource> layouts(ranks.size());
  const int* sources = slice_sources.data();
  size_t total = 0;
  for (size_t d = 0; d < ranks.size(); ++d) {
    size_t n = 0;
    for (const ParamSpec& p : ranks[d].params) n += p.slices.size();
    if (cls[d] == d) layouts[d] = slices_by_source(ranks[d], sources, manifest.size(), held);
    total += layouts[cls[d]].pieces;
    sources += n;
  }
  plan.pieces.reserve(total);
  plan.by_source.resize(manifest.size());
  plan.bytes_per_dst.assign(ranks.size(), 0);
  for (int src : plan.source_order) {
    const auto i = static_cast<size_t>(src);
    const auto& boxes = held.boxes[i];
    const size_t first = plan.pieces.size();
    for (size_t d = 0; d < ranks.size(); ++d) {
      const SlicesBySource& l = layouts[cls[d]];
      const auto& params = ranks[d].params;
      for (uint32_t e = l.at[i]; e < l.at[i + 1]; ++e) {
        const auto [p, s] = l.entries[e];
        const Region& whole = params[p].slices[s].src;
        for (size_t k = 0; k < boxes.size(); ++k) {
          if (boxes.size() > 1 && !whole.overlaps(boxes[k].region)) continue;
          Piece& pc = plan.pieces.emplace_back();
          pc.dst = static_cast<int>(d);
          pc.param = static_cast<int>(p);
          pc.slice = static_cast<int>(s);
          pc.source = src;
          pc.box = static_cast<int>(k);
          pc.src = boxes.size() == 1 ? whole : *intersect(whole, boxes[k].region);
          pc.bytes = dtype_bytes(manifest[i].dtype, pc.src.numel());
          plan.bytes_per_dst[d] += pc.bytes;
          plan.total_bytes += pc.bytes;
          plan.max_row_bytes = std::max(plan.max_row_bytes, piece_rows(pc.src.size, pc.bytes).row_bytes);
        }
      }
    }
    auto& mine = plan.by_source[i];
    mine.resize(plan.pieces.size() - first);
    std::iota(mine.begin(), mine.end(), static_cast<int>(first));
  }
}

// Piece indices by bytes, largest first, ties in plan order (a stable sort), in time linear in
// pieces: a counting sort over the distinct sizes, which are few (pieces of one shape repeat).
std::vector<int> largest_first(const std::vector<Piece>& pieces) {
  std::unordered_map<uint64_t, uint32_t> group_of;
  std::vector<uint64_t> sizes;
  std::vector<uint32_t> group(pieces.size());
  uint64_t last = 0;
  uint32_t last_group = std::numeric_limits<uint32_t>::max();
  for (size_t i = 0; i < pieces.size(); ++i) {
    const uint64_t b = pieces[i].bytes;
    if (last_group == std::numeric_limits<uint32_t>::max() || b != last) {
      auto [it, added] = group_of.try_emplace(b, static_cast<uint32_t>(sizes.size()));
      if (added) sizes.push_back(b);
      last = b;
      last_group = it->second;
    }
    group[i] = last_group;
  }
  std::vector<uint32_t> by_size(sizes.size());
  std::iota(by_size.begin(), by_size.end(), 0u);
  std::sort(by_size.begin(), by_size.end(), [&](uint32_t a, uint32_t b) { return sizes[a] > sizes[b]; });
  std::vector<size_t> start(sizes.size() + 1, 0);
  for (uint32_t g : group) ++start[g + 1];
  std::vector<size_t> at(sizes.size());
  size_t total = 0;
  for (uint32_t g : by_size) {
    at[g] = total;
    total += start[g + 1];
  }
  std::vector<int> order(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) order[at[group[i]]++] = static_cast<int>(i);
  return order;
}

// The least-loaded of a fixed set of senders (ties to the lowest index), kept in a tournament tree
// as their loads grow: the answer in O(1), an update in O(log senders).
class LeastLoaded {
 public:
  LeastLoaded(const std::vector<int>& members, const std::vector<uint64_t>& load) : load_(load) {
    while (leaves_ < members.size()) leaves_ *= 2;
    tree_.assign(2 * leaves_, -1);
    for (size_t i = 0; i < members.size(); ++i) {
      tree_[leaves_ + i] = members[i];
      if (static_cast<size_t>(members[i]) >= leaf_of_.size()) leaf_of_.resize(static_cast<size_t>(members[i]) + 1, 0);
      leaf_of_[static_cast<size_t>(members[i])] = leaves_ + i;
    }
    for (size_t n = leaves_ - 1; n >= 1; --n) tree_[n] = better(tree_[2 * n], tree_[2 * n + 1]);
  }
  int best() const { return tree_[1]; }
  // Sender s's load changed; s need not be a member.
  void update(int s) {
    if (static_cast<size_t>(s) >= leaf_of_.size() || leaf_of_[static_cast<size_t>(s)] == 0) return;
    for (size_t n = leaf_of_[static_cast<size_t>(s)] / 2; n >= 1; n /= 2) tree_[n] = better(tree_[2 * n], tree_[2 * n + 1]);
  }

 private:
  int better(int a, int b) const {
    if (a < 0 || b < 0) return a < 0 ? b : a;
    const uint64_t la = load_[static_cast<size_t>(a)], lb = load_[static_cast<size_t>(b)];
    return lb < la || (lb == la && b < a) ? b : a;
  }
  const std::vector<uint64_t>& load_;
  size_t leaves_ = 1;
  std::vector<int> tree_;        // node n's winner; leaves from leaves_
  std::vector<size_t> leaf_of_;  // sender -> its leaf (0: not a member)
};

// Balance senders, largest pieces first (LPT): the heaviest sender ends within one piece of the
// ideal split, and the copies of a replicated piece go to different senders in turn. Each piece
// goes to the least-loaded holder of its box, ties to the lowest index.
void assign_senders(const Holdings& held, size_t num_senders, Plan& plan) {
  plan.bytes_per_sender.assign(num_senders, 0);
  auto& load = plan.bytes_per_sender;
  LeastLoaded everyone(held.everyone, load);
  for (int i : largest_first(plan.pieces)) {
    Piece& pc = plan.pieces[static_cast<size_t>(i)];
    const auto& box = held.boxes[static_cast<size_t>(pc.source)][static_cast<size_t>(pc.box)];
    int best = 0;
    if (box.holders.empty()) {
      best = everyone.best();
    } else {
      best = box.holders.front();
      for (int c : box.holders) {
        if (load[static_cast<size_t>(c)] < load[static_cast<size_t>(best)]) best = c;
      }
    }
    pc.sender = best;
    load[static_cast<size_t>(best)] += pc.bytes;
    everyone.update(best);
  }
}

}  // namespace

Status check_manifest(const Manifest& manifest, const std::vector<RankSpec>& ranks) {
  return check_and_resolve(manifest, ranks, NameIndex(manifest), nullptr);
}

uint64_t plan_key(const Manifest& manifest, const std::vector<RankSpec>& ranks, const std::vector<SenderInfo>& senders) {
  Hasher h;
  for (const auto& t : manifest) {
    h.add(t.name);
    h.add_int(static_cast<int64_t>(t.dtype));
    h.add_shape(t.shape);
  }
  // Each rank's parameters enter as their own digest, computed once for the ranks that share them
  // (identical replicas): the key is the same whether or not specs share, and hashing a plan of 16
  // replicas reads one replica's parameters. (Every vector without a buffer is empty: one digest.)
  std::unordered_map<const void*, uint64_t> digests;
  for (const RankSpec& r : ranks) {
    h.add_int(r.replica);
    h.add_int(r.tp_rank);
    h.add_int(r.tp_size);
    h.add_int(r.ep_size);
    auto [it, added] = digests.try_emplace(r.params.identity(), 0);
    if (added) it->second = params_digest(r.params);
    h.add_int(static_cast<int64_t>(it->second));
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
  std::vector<int> slice_sources;  // manifest index of every slice, rank after rank
  FERRY_RETURN_IF_ERROR(check_and_resolve(manifest, ranks, NameIndex(manifest), &slice_sources));
  // Who holds which box of each source; the boxes tile every source exactly.
  FERRY_ASSIGN_OR_RETURN(const auto held, resolve_holdings(manifest, senders));

  Plan plan;
  plan.key = plan_key(manifest, ranks, senders);
  plan.bucket_bytes = bucket_bytes;
  const std::vector<int64_t> keys = layer_keys(manifest);
  plan.source_order = transfer_order(keys);
  for (int i : plan.source_order) {
    std::string layer = layer_of(manifest[static_cast<size_t>(i)].name);
    if (plan.layers.empty() || plan.layers.back() != layer) plan.layers.push_back(std::move(layer));
  }
  place_pieces(manifest, ranks, held, slice_sources, plan);
  assign_senders(held, senders.size(), plan);
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
