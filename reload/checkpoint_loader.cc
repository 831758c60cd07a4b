#include "reload/checkpoint_loader.h"

#include <algorithm>
#include <cstring>
#include <random>

#include <fmt/format.h>

#include "core/region_copy.h"
#include "reload/processing.h"

namespace ferry::reload {
namespace {

struct Piece {
  uint32_t param = 0;
  uint32_t input = 0;
  TensorView src;
  Region src_region;
  Region dst;
};

// Splits `src` (and its landing box `dst`, of the same extent up to leading unit dims) by rows.
void chunk(const Piece& p, int64_t rows, std::vector<Piece>& out) {
  const int64_t total = p.src_region.size.empty() ? 1 : p.src_region.size[0];
  if (rows <= 0 || rows >= total) return out.push_back(p);
  // The dst dim that holds the src's first dim: the dst may have extra leading unit dims.
  const size_t dd = p.dst.size.size() - p.src_region.size.size();
  for (int64_t r = 0; r < total; r += rows) {
    Piece c = p;
    const int64_t n = std::min(rows, total - r);
    c.src_region.offset[0] += r;
    c.src_region.size[0] = n;
    c.dst.offset[dd] += r;
    c.dst.size[dd] = n;
    out.push_back(c);
  }
}

}  // namespace

Result<EngineReport> load_checkpoint(ReloadEngine& engine, const Checkpoint& checkpoint, uint64_t version,
                                     const LoadOptions& options) {
  const sharding::RankSpec& spec = engine.spec();
  std::vector<std::string> layer_order;
  std::map<std::string, std::vector<Piece>> by_layer;
  for (uint32_t i = 0; i < spec.params.size(); ++i) {
    const sharding::ParamSpec& p = spec.params[i];
    if (!by_layer.count(p.layer)) layer_order.push_back(p.layer);
    auto& pieces = by_layer[p.layer];
    const auto inputs = engine.input_layout(i);
    if (inputs.size() == 1) {
      for (const auto& s : p.slices) {
        auto it = checkpoint.find(s.source);
        if (it == checkpoint.end()) return Status::not_found(fmt::format("checkpoint lacks {}", s.source));
        chunk(Piece{i, 0, it->second, s.src, sharding::slice_dst_region(s, p)}, options.chunk_rows, pieces);
      }
    } else {
      for (uint32_t k = 0; k < inputs.size(); ++k) {
        const std::string name = storage_name(p.name, inputs[k].suffix);
        auto it = checkpoint.find(name);
        if (it == checkpoint.end()) return Status::not_found(fmt::format("checkpoint lacks {}", name));
        const Region whole = Region::whole(inputs[k].shape);
        chunk(Piece{i, k, it->second, whole, whole}, options.chunk_rows, pieces);
      }
    }
  }
  if (options.reverse_layers) std::reverse(layer_order.begin(), layer_order.end());
  std::vector<Piece> order;
  for (const auto& l : layer_order) {
    auto& pieces = by_layer[l];
    if (options.shuffle_seed) std::shuffle(pieces.begin(), pieces.end(), std::mt19937_64(options.shuffle_seed));
    order.insert(order.end(), pieces.begin(), pieces.end());
  }
  if (options.interleave_layers) {
    order.clear();
    for (size_t k = 0;; ++k) {
      bool any = false;
      for (const auto& l : layer_order) {
        if (k < by_layer[l].size()) order.push_back(by_layer[l][k]), any = true;
      }
      if (!any) break;
    }
  }
  FERRY_RETURN_IF_ERROR(engine.begin(version, options.senders, options.stage));
  if (options.after_begin) options.after_begin(engine);
  std::vector<uint8_t> buf;
  std::vector<uint8_t> bucket(options.borrow_bucket_bytes);
  size_t filled = 0;
  // Ends the bucket's borrows and spoils its bytes: whatever the engine read later would show.
  auto next_bucket = [&]() -> Status {
    Status st = engine.release_borrowed();
    std::memset(bucket.data(), 0xff, filled);
    filled = 0;
    return st;
  };
  for (const Piece& p : order) {
    const DType dt = p.src.dtype();
    buf.resize(dtype_bytes(dt, p.src_region.numel()));
    Status st = pack_region(p.src, p.src_region, buf.data(), buf.size());
    if (st.ok() && options.borrow_bucket_bytes > 0) {
      if (filled + buf.size() > bucket.size()) st = next_bucket();
      if (st.ok() && buf.size() > bucket.size()) bucket.resize(buf.size());
      if (st.ok()) {
        uint8_t* at = bucket.data() + filled;
        std::memcpy(at, buf.data(), buf.size());
        filled += buf.size();
        st = engine.borrow_piece(p.param, p.input, p.dst, dt, at, buf.size());
      }
    } else if (st.ok() && options.lend_from.is_cuda()) {
      auto dev = Buffer::allocate(std::max<size_t>(buf.size(), 1), options.lend_from);
      st = dev.status();
      if (st.ok()) st = copy_bytes(dev->data(), options.lend_from, buf.data(), Device::cpu(), buf.size());
      if (st.ok()) {
        auto owner = std::make_shared<Buffer>(std::move(*dev));
        const void* data = owner->data();
        st = engine.lend_piece(p.param, p.input, p.dst, dt, std::move(owner), data, buf.size(), options.lend_from);
      }
    } else if (st.ok() && options.lend) {
      auto owner = std::make_shared<std::vector<uint8_t>>(buf);
      const void* data = owner->data();
      st = engine.lend_piece(p.param, p.input, p.dst, dt, std::move(owner), data, buf.size());
    } else if (st.ok()) {
      st = engine.apply_input_piece(p.param, p.input, p.dst, dt, buf.data(), buf.size());
    }
    if (!st.ok()) {
      engine.abort();
      return st;
    }
  }
  if (options.borrow_bucket_bytes > 0) {
    if (Status st = next_bucket(); !st.ok()) {
      engine.abort();
      return st;
    }
  }
  if (options.stage && options.before_apply) options.before_apply(engine);
  if (options.stage) FERRY_RETURN_IF_ERROR(engine.apply_staged());
  return engine.finalize();
}

}  // namespace ferry::reload
