#include "tests/sharding/update_fixture.h"

#include <algorithm>
#include <cstring>
#include <random>

#include <fmt/format.h>

namespace ferry::sharding::fixture {
namespace {

float value(std::mt19937& rng) { return static_cast<float>(static_cast<int>(rng() % 255) - 127) / 64.0f; }

uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

std::string with_changes(std::string_view config, const nlohmann::json& changes) {
  nlohmann::json j = nlohmann::json::parse(config);
  j.merge_patch(changes);
  return j.dump();
}

const SourceTensor* find_source(const Manifest& m, const std::string& name) {
  auto it = std::find_if(m.begin(), m.end(), [&](const SourceTensor& t) { return t.name == name; });
  return it == m.end() ? nullptr : &*it;
}

const ParamSpec* find_param(const RankSpec& r, const std::string& name) {
  auto it = std::find_if(r.params.begin(), r.params.end(), [&](const ParamSpec& p) { return p.name == name; });
  return it == r.params.end() ? nullptr : &*it;
}

float element(const TensorView& t, int64_t i) {
  uint32_t u = 0;
  if (t.dtype() == DType::kF32) {
    std::memcpy(&u, static_cast<const char*>(t.data()) + 4 * i, 4);
  } else {
    uint16_t b;
    std::memcpy(&b, static_cast<const char*>(t.data()) + 2 * i, 2);
    u = uint32_t{b} << 16;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

int64_t box_index(const Shape& shape, const Region& r, int64_t k) {
  int64_t flat = 0, stride = 1;
  for (int d = r.rank() - 1; d >= 0; --d) {
    flat += (r.offset[static_cast<size_t>(d)] + k % r.size[static_cast<size_t>(d)]) * stride;
    k /= r.size[static_cast<size_t>(d)];
    stride *= shape[static_cast<size_t>(d)];
  }
  return flat;
}

Weights::Weights(const Manifest& m, uint32_t seed) {
  std::mt19937 rng(seed);
  for (const auto& t : m) {
    auto& b = bytes[t.name];
    const int64_t n = shape_numel(t.shape);
    b.resize(dtype_bytes(t.dtype, n));
    for (int64_t i = 0; i < n; ++i) {
      const float f = value(rng);
      if (t.dtype == DType::kF32) {
        std::memcpy(b.data() + 4 * i, &f, 4);
      } else {
        const uint16_t h = bf16_bits(f);
        std::memcpy(b.data() + 2 * i, &h, 2);
      }
    }
    views.emplace(t.name, TensorView(b.data(), t.dtype, t.shape));
  }
}

Status Replica::start(const ModelDesc& model, int tp, int ep, Scheme scheme, EngineLayout layout) {
  FERRY_ASSIGN_OR_RETURN(trainer, coordinator::Trainer::create({}));
  FERRY_ASSIGN_OR_RETURN(specs, model_rank_specs(model, 1, tp, ep, scheme));
  for (auto& spec : specs) spec.layout = layout;
  for (const auto& spec : specs) {
    FERRY_ASSIGN_OR_RETURN(auto s, reload::ModelStorage::allocate(spec, Device::cpu()));
    storage.push_back(std::make_unique<reload::ModelStorage>(std::move(s)));
    coordinator::RolloutOptions o;
    o.coordinator = trainer->coordinator_address();
    o.spec = spec;
    o.storage = storage.back().get();
    o.pause = [](const coordinator::PauseRequest&) { return ok_status(); };
    o.resume = [](uint64_t) { return ok_status(); };
    FERRY_ASSIGN_OR_RETURN(auto w, coordinator::RolloutWorker::create(std::move(o)));
    workers.push_back(std::move(w));
  }
  return trainer->wait_for_ranks(tp, 10'000);
}

Result<coordinator::UpdateReport> Replica::update(uint64_t version, const Manifest& manifest, const Weights& w) {
  FERRY_RETURN_IF_ERROR(trainer->start_weight_update(version, manifest));
  coordinator::MapSource src(w.views);
  FERRY_RETURN_IF_ERROR(trainer->update_weights(src));
  return trainer->finish_weight_update();
}

std::string check_storage(const Replica& r, const Weights& w) {
  for (size_t i = 0; i < r.specs.size(); ++i) {
    for (const auto& p : r.specs[i].params) {
      auto stored = r.storage[i]->get(p.name);
      if (!stored.ok()) return stored.status().to_string();
      for (const auto& s : p.slices) {
        const TensorView& src = w.views.at(s.source);
        const Region dst = slice_dst_region(s, p);
        for (int64_t k = 0; k < s.src.numel(); ++k) {
          const float want = element(src, box_index(src.shape(), s.src, k));
          const float got = element(*stored, box_index(p.shape, dst, k));
          if (want != got) {
            return fmt::format("rank {} {} element {} of {} {}: {} != {}", i, p.name, k, s.source, s.src.to_string(),
                               got, want);
          }
        }
      }
    }
  }
  return "";
}

}  // namespace ferry::sharding::fixture
