// Shared by the reload tests: engines over the tiny decoder's spec, snapshots of registered
// identities and storage bytes.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/device_copy.h"
#include "examples/tiny_decoder/model.h"
#include "reload/engine.h"
#include "reload/model_storage.h"

namespace ferry::reload::testing {

#define ASSERT_OK(expr)                              \
  do {                                               \
    const ::ferry::Status st_ = (expr);              \
    ASSERT_TRUE(st_.ok()) << st_.to_string();        \
  } while (0)

// A rank with storage and an engine over the tiny decoder's spec.
struct Rank {
  sharding::RankSpec spec;
  ModelStorage storage;
  std::unique_ptr<ReloadEngine> engine;
};

inline std::unique_ptr<Rank> make_rank(const tiny::Config& cfg, Scheme scheme, EngineOptions o = {},
                                       EngineLayout layout = EngineLayout::kFerry, Device device = Device::cpu()) {
  auto spec = tiny::rank_spec(cfg, scheme);
  EXPECT_TRUE(spec.ok()) << spec.status().to_string();
  spec->layout = layout;
  auto storage = ModelStorage::allocate(*spec, device);
  EXPECT_TRUE(storage.ok()) << storage.status().to_string();
  auto r = std::make_unique<Rank>(Rank{*spec, std::move(*storage), nullptr});
  auto e = ReloadEngine::create(r->spec, r->storage, std::move(o));
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  r->engine = std::move(*e);
  return r;
}

// data pointer and size of every live tensor, by name.
inline std::map<std::string, std::pair<const void*, size_t>> identities(const ModelStorage& s) {
  std::map<std::string, std::pair<const void*, size_t>> out;
  for (const auto& [name, v] : s.tensors()) out[name] = {v.data(), v.nbytes()};
  return out;
}

// A tensor's bytes, from host or device memory.
inline std::vector<uint8_t> bytes_of(const TensorView& v) {
  if (!v.device().is_cpu()) {
    std::vector<uint8_t> out(v.nbytes());
    const Status st = copy_bytes(out.data(), Device::cpu(), v.data(), v.device(), out.size());
    EXPECT_TRUE(st.ok()) << st.to_string();
    return out;
  }
  const auto* p = static_cast<const uint8_t*>(v.data());
  return {p, p + v.nbytes()};
}

inline std::map<std::string, std::vector<uint8_t>> contents(const ModelStorage& s) {
  std::map<std::string, std::vector<uint8_t>> out;
  for (const auto& [name, v] : s.tensors()) out[name] = bytes_of(v);
  return out;
}

}  // namespace ferry::reload::testing
