#include "bench/e2e_setup.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

#include <fmt/format.h>

#include "core/work_pool.h"
#include "examples/demo/llama_config.h"
#include "sharding/llama.h"

namespace ferry::e2e {

namespace {

uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

void fill_bf16(std::span<uint16_t> out, uint64_t seed) {
  // Chunks of their own xorshift state, on the work pool: a bench's ranks and trainers make a
  // model's worth of new values for every update, which one thread took longer to make than the
  // update took to move and process.
  constexpr size_t kChunk = size_t{1} << 17;
  const size_t chunks = (out.size() + kChunk - 1) / kChunk;
  run_pieces(chunks, [&](size_t c) {
    uint64_t x = splitmix64(seed ^ splitmix64(c)) | 1;  // xorshift's state is never 0
    const size_t end = std::min(out.size(), (c + 1) * kChunk);
    for (size_t i = c * kChunk; i < end; i += 4) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      // Four values of 16 bits each: sign, exponent 119..122, mantissa.
      for (size_t k = 0; k < 4 && i + k < end; ++k) {
        const auto b = static_cast<uint16_t>(x >> (16 * k));
        out[i + k] = static_cast<uint16_t>((b & 0x8000u) | ((119u + ((b >> 7) & 3u)) << 7) | (b & 0x7fu));
      }
    }
  });
}

Weights::Weights(const sharding::Manifest& m, uint64_t version) {
  const uint64_t seed = 0x9e3779b97f4a7c15ull * (version + 1);
  for (const auto& t : m) {
    auto& v = data.emplace_back(static_cast<size_t>(shape_numel(t.shape)));
    fill_bf16(v, splitmix64(seed + data.size()));
    views.emplace_back(v.data(), DType::kBF16, t.shape);
    by_name.emplace(t.name, views.back());
  }
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Result<std::vector<sharding::RankSpec>> demo_rank_specs(const sharding::LlamaConfig& cfg, int tp,
                                                        const std::string& scheme) {
  FERRY_ASSIGN_OR_RETURN(const Scheme linear, parse_scheme(scheme));
  std::vector<sharding::RankSpec> specs;
  for (int r = 0; r < tp; ++r) {
    FERRY_ASSIGN_OR_RETURN(auto spec, sharding::llama_rank_spec(cfg, r, tp, linear));
    specs.push_back(std::move(spec));
  }
  return specs;
}

Result<sharding::LlamaConfig> model_config(const std::string& model) {
  if (model == "demo") return demo::llama_config(demo::Model{});
  if (model != "delta") return Status::invalid_argument(fmt::format("bench model '{}': expected demo or delta", model));
  sharding::LlamaConfig c;
  c.hidden_size = 1024;
  c.num_heads = 8;
  c.num_kv_heads = 8;
  c.intermediate_size = 2816;
  c.vocab_size = 32000;
  c.num_layers = 4;
  return c;
}

Result<std::vector<ProbeSocket>> start_ranks(ProbeListener& listener, std::vector<Child>& children,
                                             const std::string& coordinator, int tp, const std::string& scheme,
                                             const std::string& transport, int64_t timeout_ms,
                                             const std::string& model) {
  children.resize(static_cast<size_t>(tp));
  for (int r = 0; r < tp; ++r) {
    FERRY_RETURN_IF_ERROR(children[static_cast<size_t>(r)].spawn(
        {"ferry", "bench", "e2e-rank", "--probe-port", std::to_string(listener.port()), "--coordinator", coordinator,
         "--tp-rank", std::to_string(r), "--tp", std::to_string(tp), "--scheme", scheme, "--transport", transport,
         "--model", model}));
  }
  std::vector<ProbeSocket> ranks(static_cast<size_t>(tp));
  for (int i = 0; i < tp; ++i) {
    FERRY_ASSIGN_OR_RETURN(auto s, listener.accept(Clock::now() + std::chrono::milliseconds(timeout_ms)));
    FERRY_ASSIGN_OR_RETURN(std::string hello, s.recv(Clock::now() + std::chrono::milliseconds(timeout_ms)));
    std::string_view rest;
    if (command_of(hello, &rest) != "hello") return Status::internal("bench rank did not say hello");
    const int r = std::atoi(std::string(rest).c_str());
    if (r < 0 || r >= tp || ranks[static_cast<size_t>(r)].ok()) return Status::internal("bench rank with a bad index");
    ranks[static_cast<size_t>(r)] = std::move(s);
  }
  return ranks;
}

}  // namespace ferry::e2e
