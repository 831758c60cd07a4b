#include "bench/reload_bench.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bench/borrow_buckets.h"
#include "core/parallel.h"
#include "core/region_copy.h"
#include "core/settings.h"
#include "examples/tiny_decoder/model.h"
#include "kernels/gptq.h"
#include "reload/checkpoint_loader.h"

namespace ferry {
namespace {

struct Piece {
  uint32_t param = 0;
  uint32_t input = 0;
  Region dst;
  DType dtype = DType::kBF16;
  std::vector<uint8_t> bytes;
};

// The demo's model (examples/demo/reference.h), TP 1.
tiny::Config demo_shape() {
  tiny::Config c;
  c.hidden = 256;
  c.heads = 8;
  c.kv_heads = 2;
  c.head_dim = 32;
  c.intermediate = 512;
  c.vocab = 1000;
  c.layers = 4;
  return c;
}

double median(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Runs every function once per round, interleaved, so that a change in the machine's load over
// the run weighs on all of them alike; returns each one's median.
Result<std::vector<double>> interleaved_medians(int rounds, const std::vector<std::function<Status()>>& fns) {
  std::vector<std::vector<double>> t(fns.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < fns.size(); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      FERRY_RETURN_IF_ERROR(fns[i]());
      t[i].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  std::vector<double> out;
  for (auto& v : t) out.push_back(median(std::move(v)));
  return out;
}

template <typename F>
Result<double> median_seconds(int runs, F&& fn) {
  std::vector<double> t;
  for (int i = 0; i < runs; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    FERRY_RETURN_IF_ERROR(fn());
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void print(bool json, const std::string& name, uint64_t bytes, double seconds, double base_gbps) {
  const double gbps = static_cast<double>(bytes) / seconds / 1e9;
  if (json) {
    fmt::print(
        "{{\"bench\":\"reload\",\"case\":\"{}\",\"device\":\"cpu\",\"bytes\":{},\"seconds\":{:.9f},\"gbps\":{:.3f},"
        "\"baseline\":\"memcpy\",\"baseline_gbps\":{:.3f},\"ratio\":{:.3f}}}\n",
        name, bytes, seconds, gbps, base_gbps, gbps / base_gbps);
  } else {
    fmt::print("reload {:<26} cpu {:>10} B {:>10.6f} s {:>8.2f} GB/s  memcpy {:>8.2f} GB/s  ratio {:.3f}\n", name,
               bytes, seconds, gbps, base_gbps, gbps / base_gbps);
  }
}

Status bench_scheme(bool json, Scheme linear) {
  const std::string scheme(scheme_name(linear));
  const tiny::Config cfg = demo_shape();
  FERRY_ASSIGN_OR_RETURN(auto spec, tiny::rank_spec(cfg, linear));
  FERRY_ASSIGN_OR_RETURN(auto storage, reload::ModelStorage::allocate(spec, Device::cpu()));
  FERRY_ASSIGN_OR_RETURN(auto engine, reload::ReloadEngine::create(spec, storage));
  FERRY_ASSIGN_OR_RETURN(auto weights, tiny::Weights::random(cfg, spec, 1));
  const reload::Checkpoint& ck = weights.checkpoint();
  // Pieces as buckets deliver them: one per slice (or checkpoint tensor), packed, in plan order.
  std::vector<Piece> pieces;
  uint64_t in_bytes = 0;
  for (uint32_t i = 0; i < spec.params.size(); ++i) {
    const auto& p = spec.params[i];
    const auto inputs = engine->input_layout(i);
    if (inputs.size() == 1) {
      for (const auto& s : p.slices) {
        Piece pc{i, 0, sharding::slice_dst_region(s, p), ck.at(s.source).dtype(), {}};
        pc.bytes.resize(dtype_bytes(pc.dtype, s.src.numel()));
        FERRY_RETURN_IF_ERROR(pack_region(ck.at(s.source), s.src, pc.bytes.data(), pc.bytes.size()));
        pieces.push_back(std::move(pc));
      }
    } else {
      for (uint32_t k = 0; k < inputs.size(); ++k) {
        const TensorView& t = ck.at(reload::storage_name(p.name, inputs[k].suffix));
        Piece pc{i, k, Region::whole(t.shape()), t.dtype(), {}};
        const auto* b = static_cast<const uint8_t*>(t.data());
        pc.bytes.assign(b, b + t.nbytes());
        pieces.push_back(std::move(pc));
      }
    }
  }
  for (const auto& p : pieces) in_bytes += p.bytes.size();
  const uint64_t bytes = in_bytes + storage.bytes();
  constexpr int kRuns = 31;

  uint64_t version = 0;
  // Lent: the rank owns its received buckets and lends them until their layer is processed (the
  // pieces here outlive every update). Copied: the buckets are the transport's, so every piece is
  // taken (staged, or its rows processed into storage) before its layer completes.
  // Borrowed: the buckets are the transport's, valid during their callback: pieces are borrowed
  // and released at the end of every FERRY_BUCKET_BYTES of them.
  enum class Mode { kLent, kCopied, kBorrowed };
  FERRY_ASSIGN_OR_RETURN(const Settings settings, load_settings());
  const uint64_t bucket_bytes = settings.bucket_bytes;
  auto update = [&](Mode mode) -> Status {
    FERRY_RETURN_IF_ERROR(engine->begin(++version));
    sharding::BucketCutter bucket(bucket_bytes);
    for (const auto& p : pieces) {
      if (mode == Mode::kLent) {
        FERRY_RETURN_IF_ERROR(
            engine->lend_piece(p.param, p.input, p.dst, p.dtype, nullptr, p.bytes.data(), p.bytes.size()));
      } else if (mode == Mode::kCopied) {
        FERRY_RETURN_IF_ERROR(
            engine->apply_input_piece(p.param, p.input, p.dst, p.dtype, p.bytes.data(), p.bytes.size()));
      } else {
        FERRY_RETURN_IF_ERROR(bench::borrow_in_buckets(*engine, bucket, [&] {
          return engine->borrow_piece(p.param, p.input, p.dst, p.dtype, p.bytes.data(), p.bytes.size());
        }, p.bytes.size()));
      }
    }
    if (mode == Mode::kBorrowed) FERRY_RETURN_IF_ERROR(engine->release_borrowed());
    return engine->finalize().status();
  };
  // One update of each first: staging pools and page tables are warm in a running rank.
  FERRY_RETURN_IF_ERROR(update(Mode::kLent));
  FERRY_RETURN_IF_ERROR(update(Mode::kCopied));
  FERRY_RETURN_IF_ERROR(update(Mode::kBorrowed));

  // The bare kernels: every parameter's whole input, already assembled, straight into storage.
  std::vector<std::vector<TensorView>> ins, outs;
  std::vector<std::vector<uint8_t>> full;
  for (uint32_t i = 0; i < spec.params.size(); ++i) {
    const auto& p = spec.params[i];
    const auto inputs = engine->input_layout(i);
    std::vector<TensorView> in;
    if (inputs.size() == 1) {
      full.emplace_back(dtype_bytes(p.source_dtype, shape_numel(p.shape)));
      TensorView v(full.back().data(), p.source_dtype, p.shape);
      for (const auto& pc : pieces) {
        if (pc.param == i) FERRY_RETURN_IF_ERROR(unpack_region(v, pc.dst, pc.bytes.data(), pc.bytes.size()));
      }
      in.push_back(v);
    } else {
      for (const auto& t : inputs) in.push_back(ck.at(reload::storage_name(p.name, t.suffix)));
    }
    ins.push_back(in);
    FERRY_ASSIGN_OR_RETURN(auto layout, reload::param_layout(p, DType::kBF16));
    std::vector<TensorView> o;
    for (const auto& t : layout) o.push_back(storage.tensors().at(reload::storage_name(p.name, t.suffix)));
    outs.push_back(o);
  }
  // The same thread count as the engine resolves once (kernels::Exec{} would ask every call).
  kernels::Exec exec;
  exec.threads = static_cast<int>(host_threads());
  auto bare = [&]() -> Status {
    for (size_t i = 0; i < spec.params.size(); ++i) {
      const auto& p = spec.params[i];
      const Scheme s = p.scheme;
      if (s == Scheme::kGptqInt4) {
        FERRY_RETURN_IF_ERROR(kernels::gptq_reload(ins[i][0], ins[i][1], ins[i][2], outs[i], exec));
      } else {
        FERRY_RETURN_IF_ERROR(kernels::quantize(s, ins[i][0], p.shard_rows, outs[i], exec));
      }
    }
    return ok_status();
  };
  FERRY_ASSIGN_OR_RETURN(auto medians, interleaved_medians(kRuns, {[&] { return update(Mode::kLent); },
                                                                   [&] { return update(Mode::kCopied); },
                                                                   [&] { return update(Mode::kBorrowed); }, bare}));
  const double engine_s = medians[0], copied_s = medians[1], borrowed_s = medians[2], bare_s = medians[3];

  std::vector<uint8_t> dst(in_bytes);
  FERRY_ASSIGN_OR_RETURN(double copy_s, median_seconds(kRuns, [&]() -> Status {
    size_t off = 0;
    for (const auto& p : pieces) {
      std::memcpy(dst.data() + off, p.bytes.data(), p.bytes.size());
      off += p.bytes.size();
    }
    return ok_status();
  }));
  const double base_gbps = 2.0 * static_cast<double>(in_bytes) / copy_s / 1e9;
  print(json, scheme, bytes, engine_s, base_gbps);
  print(json, scheme + "/copied", bytes, copied_s, base_gbps);
  print(json, scheme + "/borrowed", bytes, borrowed_s, base_gbps);
  print(json, scheme + "/kernels", bytes, bare_s, base_gbps);
  return ok_status();
}

}  // namespace

int run_reload_bench(bool json, const std::string& device) {
  if (device != "cpu" && device != "all") {
    fmt::print(stderr, "bench reload: device '{}' (cpu or all; CUDA storage is not benchmarked yet)\n", device);
    return 1;
  }
  for (Scheme s : kAllSchemes) {
    const std::string name(scheme_name(s));
    Status st = bench_scheme(json, s);
    if (!st.ok()) {
      fmt::print(stderr, "bench reload {}: {}\n", name, st.to_string());
      return 1;
    }
  }
  return 0;
}

}  // namespace ferry
