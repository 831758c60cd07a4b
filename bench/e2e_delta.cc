#include "bench/e2e_delta.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "bench/e2e_links.h"
#include "bench/e2e_probe.h"
#include "core/settings.h"
#include "coordinator/trainer.h"
#include "core/float_convert.h"
#include "sharding/llama.h"

namespace ferry {
namespace {

using e2e::Child;

// The spacing of bf16 values at `f` (8 significant bits).
float ulp(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const int e = static_cast<int>((u >> 23) & 0xff);
  return std::ldexp(1.0f, std::max(e, 1) - 127 - 7);
}

// A uniform value in [-1, 1) from a 64-bit hash of `x`.
float unit(uint64_t x) {
  x ^= x >> 33, x *= 0xff51afd7ed558ccdull, x ^= x >> 33, x *= 0xc4ceb9fe1a85ec53ull, x ^= x >> 33;
  return static_cast<float>(static_cast<double>(x >> 11) * 0x1.0p-52 - 1.0);
}

// fp32 master weights under Adam, and the bf16 the trainer sends after each step.
class AdamTrajectory {
 public:
  // Weights of a model some way into training: bf16 values ~ N(0, 0.02), each with an fp32 master
  // somewhere within its rounding interval (not on the bf16 grid, where a fresh cast puts it).
  explicit AdamTrajectory(const sharding::Manifest& m) {
    uint64_t k = 0;
    for (const auto& t : m) {
      Tensor& s = tensors_.emplace_back();
      const size_t n = static_cast<size_t>(shape_numel(t.shape));
      s.bf16.resize(n);
      s.w.resize(n);
      for (size_t i = 0; i < n; ++i, ++k) {
        const float u1 = 0.5f * (unit(k * 3 + 1) + 1.0f) + 1e-7f, u2 = unit(k * 3 + 2);
        const float w = 0.02f * std::sqrt(-2.0f * std::log(u1)) * std::cos(3.14159265f * u2);
        s.bf16[i] = f32_to_bf16(w);
        const float on_grid = bf16_to_f32(s.bf16[i]);
        s.w[i] = on_grid + 0.499f * unit(k * 3 + 3) * ulp(on_grid);
      }
      s.m.assign(n, 0.0f);
      s.v.assign(n, 0.0f);
    }
  }

  // One step: gradient = half a fixed direction per element plus noise, lr 1e-6.
  void step() {
    constexpr float kLr = 1e-6f, kB1 = 0.9f, kB2 = 0.999f, kEps = 1e-8f;
    ++t_;
    const float c1 = 1.0f - std::pow(kB1, static_cast<float>(t_)), c2 = 1.0f - std::pow(kB2, static_cast<float>(t_));
    uint64_t seed = 0;
    for (Tensor& s : tensors_) {
      ++seed;
      for (size_t i = 0; i < s.w.size(); ++i) {
        const uint64_t id = (seed << 40) ^ i;
        const float g = 0.5f * unit(id) + unit(id ^ (static_cast<uint64_t>(t_) << 56) ^ 0x5bd1e995ull);
        s.m[i] = kB1 * s.m[i] + (1 - kB1) * g;
        s.v[i] = kB2 * s.v[i] + (1 - kB2) * g * g;
        s.w[i] -= kLr * (s.m[i] / c1) / (std::sqrt(s.v[i] / c2) + kEps);
        s.bf16[i] = f32_to_bf16(s.w[i]);
      }
    }
  }

  std::vector<std::vector<uint16_t>> snapshot() const {
    std::vector<std::vector<uint16_t>> out;
    for (const Tensor& s : tensors_) out.push_back(s.bf16);
    return out;
  }

 private:
  struct Tensor {
    std::vector<float> w, m, v;
    std::vector<uint16_t> bf16;
  };
  std::vector<Tensor> tensors_;
  int t_ = 0;
};

struct CaseFigures {
  std::vector<double> wire, seconds, window, apply, start, transfer, finish, compare, copy;
  uint64_t changed = 0, elements = 0;
  bool staged = true;
};

Status run_one(const E2eOptions& o, const std::string& transport, bool delta, bool stage, int zstd,
               const sharding::Manifest& manifest, const std::vector<std::vector<std::vector<uint16_t>>>& versions,
               CaseFigures* out) {
  setenv("FERRY_TRANSPORT", transport.c_str(), 1);
  // "on": the bench's ranks share the trainer's host (its slow links are a shaped loopback), where
  // the default "auto" would send dense.
  setenv("FERRY_DELTA", delta ? "on" : "off", 1);
  setenv("FERRY_DELTA_ZSTD", std::to_string(zstd).c_str(), 1);
  FERRY_ASSIGN_OR_RETURN(Settings settings, load_settings());
  coordinator::TrainerOptions to;
  to.settings = settings;
  FERRY_ASSIGN_OR_RETURN(auto trainer, coordinator::Trainer::create(to));
  e2e::ProbeListener listener;
  FERRY_RETURN_IF_ERROR(listener.open());
  std::vector<Child> children;
  FERRY_ASSIGN_OR_RETURN(auto ranks, e2e::start_ranks(listener, children, trainer->coordinator_address(), o.tp,
                                                      o.scheme, transport, settings.timeout_ms, "delta"));
  for (auto& r : ranks) FERRY_RETURN_IF_ERROR(r.send("done"));  // no link probes: they serve updates only
  FERRY_RETURN_IF_ERROR(trainer->wait_for_ranks(o.tp, settings.timeout_ms));
  for (size_t v = 0; v < versions.size(); ++v) {
    std::map<std::string, TensorView> views;
    for (size_t i = 0; i < manifest.size(); ++i) {
      views.emplace(manifest[i].name, TensorView(const_cast<uint16_t*>(versions[v][i].data()), DType::kBF16,
                                                 manifest[i].shape));
    }
    coordinator::UpdateOptions uo;
    uo.stage = stage;
    FERRY_RETURN_IF_ERROR(trainer->start_weight_update(v + 1, manifest, uo));
    coordinator::MapSource source(std::move(views));
    FERRY_RETURN_IF_ERROR(trainer->update_weights(source));
    FERRY_ASSIGN_OR_RETURN(auto r, trainer->finish_weight_update());
    if (v == 0) continue;  // the first update is dense whatever the setting: nothing to compare to
    out->wire.push_back(static_cast<double>(r.wire_bytes()));
    out->seconds.push_back(r.seconds);
    out->window.push_back(r.pause_window_seconds);
    // The apply: staged, from a replica's Apply to its ranks' finalize; else the ranks' processing.
    out->apply.push_back(r.staged ? r.apply_seconds : r.process_seconds);
    // The update's three phases: the start (the pause, the plan, connections), the sending, and the
    // finish (the ranks' last buckets, their finalize, the resume).
    out->start.push_back(r.pause_seconds + r.plan_seconds);
    out->transfer.push_back(r.transfer_seconds);
    out->finish.push_back(r.seconds - r.pause_seconds - r.plan_seconds - r.transfer_seconds);
    out->compare.push_back(r.compare_seconds);
    out->copy.push_back(r.copy_seconds);
    out->staged = out->staged && r.staged;
    for (const auto& d : r.delta) {
      out->changed += d.changed;
      out->elements += d.elements;
    }
  }
  trainer.reset();  // closes the coordinator: the ranks leave and exit
  for (auto& c : children) {
    if (const int rc = c.reap(static_cast<int>(settings.timeout_ms)); rc != 0) {
      return Status::internal(fmt::format("a bench rank exited with {}", rc));
    }
  }
  return ok_status();
}

std::string figures_json(const CaseFigures& f) {
  return fmt::format(
      "{{\"wire_bytes\":{:.0f},\"seconds\":{:.6f},\"pause_window\":{:.6f},\"apply\":{:.6f},\"staged\":{},"
      "\"start\":{:.6f},\"sending\":{:.6f},\"finish\":{:.6f},\"compare\":{:.6f},\"copy\":{:.6f}}}",
      e2e::median(f.wire), e2e::median(f.seconds), e2e::median(f.window), e2e::median(f.apply),
      f.staged ? "true" : "false", e2e::median(f.start), e2e::median(f.transfer), e2e::median(f.finish),
      e2e::median(f.compare), e2e::median(f.copy));
}

}  // namespace

Status run_delta_case(const E2eOptions& o, const std::string& transport) {
  FERRY_ASSIGN_OR_RETURN(const sharding::LlamaConfig cfg, e2e::model_config("delta"));
  const sharding::Manifest manifest = sharding::llama_manifest(cfg);
  uint64_t bytes = 0;
  for (const auto& t : manifest) bytes += static_cast<uint64_t>(shape_numel(t.shape)) * 2;
  // The versions the trainer sends: the initial weights, then one Adam step each.
  std::vector<std::vector<std::vector<uint16_t>>> versions;
  AdamTrajectory adam(manifest);
  versions.push_back(adam.snapshot());
  for (int i = 0; i < o.updates; ++i) {
    adam.step();
    versions.push_back(adam.snapshot());
  }
  // The last case: deltas as XORs in zstd frames (FERRY_DELTA_ZSTD=1).
  const char* names[] = {"dense", "delta", "dense_staged", "delta_staged", "delta_zstd"};
  constexpr int kCases = 5;
  CaseFigures f[kCases];
  for (int k = 0; k < kCases; ++k) {
    const bool delta = k % 2 == 1 || k == 4, stage = k == 2 || k == 3;
    FERRY_RETURN_IF_ERROR(
        run_one(o, transport, delta, stage, k == 4 ? 1 : 0, manifest, versions, &f[k]).with_context(names[k]));
  }
  const double changed = f[1].elements ? static_cast<double>(f[1].changed) / static_cast<double>(f[1].elements) : 0;
  const double wire_ratio = e2e::median(f[1].wire) > 0 ? e2e::median(f[0].wire) / e2e::median(f[1].wire) : 0;
  const double speedup = e2e::median(f[1].seconds) > 0 ? e2e::median(f[0].seconds) / e2e::median(f[1].seconds) : 0;
  const double zstd_wire_ratio = e2e::median(f[4].wire) > 0 ? e2e::median(f[0].wire) / e2e::median(f[4].wire) : 0;
  const double zstd_speedup = e2e::median(f[4].seconds) > 0 ? e2e::median(f[0].seconds) / e2e::median(f[4].seconds) : 0;
  const double window_over_apply =
      e2e::median(f[3].apply) > 0 ? e2e::median(f[3].window) / e2e::median(f[3].apply) : 0;
  const std::string name = transport + "/" + o.scheme;
  if (o.json) {
    fmt::print(
        "{{\"bench\":\"e2e-delta\",\"case\":\"{}\",\"tp\":{},\"updates\":{},\"bytes\":{},\"changed_fraction\":{:.6f},"
        "\"dense\":{},\"delta\":{},\"dense_staged\":{},\"delta_staged\":{},\"delta_zstd\":{},"
        "\"wire_ratio\":{:.2f},\"speedup\":{:.2f},\"zstd_wire_ratio\":{:.2f},\"zstd_speedup\":{:.2f},"
        "\"window_over_apply\":{:.2f}}}\n",
        name, o.tp, o.updates, bytes, changed, figures_json(f[0]), figures_json(f[1]), figures_json(f[2]),
        figures_json(f[3]), figures_json(f[4]), wire_ratio, speedup, zstd_wire_ratio, zstd_speedup, window_over_apply);
  } else {
    fmt::print("e2e-delta {:<20} tp {} {} B, {:.3f}% of elements changed per Adam step (lr 1e-6)\n", name, o.tp, bytes,
               100 * changed);
    for (int k = 0; k < kCases; ++k) {
      fmt::print(
          "    {:<13} wire {:>11.0f} B  update {:.4f} s (start {:.4f}, sending {:.4f}: compare {:.4f}, copy {:.4f}; "
          "finish {:.4f})  not serving {:.4f} s  apply {:.4f} s{}\n",
          names[k], e2e::median(f[k].wire), e2e::median(f[k].seconds), e2e::median(f[k].start),
          e2e::median(f[k].transfer), e2e::median(f[k].compare), e2e::median(f[k].copy), e2e::median(f[k].finish),
          e2e::median(f[k].window), e2e::median(f[k].apply),
          (k == 2 || k == 3) && !f[k].staged ? "  (fell back to pause first)" : "");
    }
    fmt::print(
        "    delta vs dense: {:.1f}x fewer bytes, {:.2f}x faster; with zstd {:.1f}x fewer, {:.2f}x faster; "
        "staged delta: not serving {:.2f}x its apply\n",
        wire_ratio, speedup, zstd_wire_ratio, zstd_speedup, window_over_apply);
  }
  std::fflush(stdout);
  return ok_status();
}

}  // namespace ferry
