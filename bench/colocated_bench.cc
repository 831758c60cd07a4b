// ferry-bench-colocated: the colocated update on one GPU. A trainer process holds a Llama-3-8B
// shaped model in bf16 on cuda:N (one cudaMalloc per tensor, as PyTorch's allocator gives large
// tensors); a rollout process on the same GPU (TP 1) holds quantized storage. Each update changes
// every weight, then times start_weight_update .. finish_weight_update returning; the median over
// --updates after warm-up is printed beside the floor measured in the same run: the update's bytes
// read plus bytes written over the device-to-device copy bandwidth.
//
//   ferry-bench-colocated [--scheme fp8_per_channel] [--layers 32] [--updates 10] [--device cuda:0] [--json]
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <random>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "core/buffer.h"
#include "core/float_convert.h"
#include "core/log.h"
#include "core/settings.h"
#include "coordinator/rollout_worker.h"
#include "coordinator/trainer.h"
#include "reload/model_storage.h"
#include "sharding/llama.h"

#if FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

extern char** environ;

namespace {

using ferry::Status;

ferry::sharding::LlamaConfig llama3_8b(int layers) {
  ferry::sharding::LlamaConfig c;
  c.hidden_size = 4096;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.intermediate_size = 14336;
  c.vocab_size = 128256;
  c.num_layers = layers;
  c.tie_word_embeddings = false;
  return c;
}

int run_rank(const std::string& coordinator, const std::string& scheme, int layers, int device) {
  ferry::set_log_identity("rollout");
  auto spec = ferry::sharding::llama_rank_spec(llama3_8b(layers), 0, 1, scheme);
  if (!spec.ok()) return std::cerr << spec.status().to_string() << "\n", 1;
  auto storage = ferry::reload::ModelStorage::allocate(*spec, ferry::Device::cuda(device));
  if (!storage.ok()) return std::cerr << storage.status().to_string() << "\n", 1;
  ferry::coordinator::RolloutOptions o;
  o.coordinator = coordinator;
  o.spec = *spec;
  o.storage = &*storage;
  auto worker = ferry::coordinator::RolloutWorker::create(std::move(o));
  if (!worker.ok()) return std::cerr << worker.status().to_string() << "\n", 1;
  while (!(*worker)->wait_closed(60'000).ok()) {
  }
  return 0;
}

#if FERRY_HAVE_CUDA

#define CHECK_CUDA(expr)                                                                     \
  do {                                                                                       \
    const cudaError_t e_ = (expr);                                                           \
    if (e_ != cudaSuccess) return Status::internal(fmt::format("{}: {}", #expr, cudaGetErrorString(e_))); \
  } while (0)

// Device-to-device copy bandwidth (bytes read plus bytes written per second), median of 9.
ferry::Result<double> copy_bandwidth(int device) {
  const size_t n = size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaSetDevice(device));
  CHECK_CUDA(cudaMalloc(&a, n));
  CHECK_CUDA(cudaMalloc(&b, n));
  CHECK_CUDA(cudaMemset(a, 1, n));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<double> s;
  for (int i = 0; i < 10; ++i) {
    cudaEventRecord(e0);
    cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    if (i > 0) s.push_back(ms / 1e3);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  std::sort(s.begin(), s.end());
  return 2.0 * static_cast<double>(n) / s[s.size() / 2];
}

struct Weights {
  std::vector<ferry::Buffer> buffers;
  std::map<std::string, ferry::TensorView> views;
  ferry::Buffer pool;  // random bf16 values the weights are cut from
  uint64_t params = 0;
};

// Every tensor of the manifest on `device`, each its own allocation.
ferry::Result<Weights> allocate_weights(const ferry::sharding::Manifest& manifest, ferry::Device device) {
  Weights w;
  const size_t pool_elems = size_t{256} << 20;  // 512 MiB of bf16
  std::vector<uint16_t> host(pool_elems);
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  for (auto& v : host) v = ferry::f32_to_bf16(dist(rng));
  FERRY_ASSIGN_OR_RETURN(w.pool, ferry::Buffer::allocate(pool_elems * 2, device));
  CHECK_CUDA(cudaMemcpy(w.pool.data(), host.data(), pool_elems * 2, cudaMemcpyHostToDevice));
  for (const auto& t : manifest) {
    const size_t bytes = ferry::dtype_bytes(t.dtype, ferry::shape_numel(t.shape));
    FERRY_ASSIGN_OR_RETURN(ferry::Buffer b, ferry::Buffer::allocate(bytes, device));
    w.views.emplace(t.name, ferry::TensorView(b.data(), t.dtype, t.shape, device));
    w.params += static_cast<uint64_t>(ferry::shape_numel(t.shape));
    w.buffers.push_back(std::move(b));
  }
  return w;
}

// New values for every weight: a slice of the pool that shifts with `step`.
Status change_weights(Weights& w, uint64_t step) {
  const size_t pool = w.pool.size();
  size_t at = (step * 2654435761ull) % (pool / 2) & ~size_t{255};
  for (auto& [name, v] : w.views) {
    size_t done = 0;
    const size_t n = v.nbytes();
    while (done < n) {
      const size_t len = std::min(n - done, pool - at);
      CHECK_CUDA(cudaMemcpyAsync(static_cast<char*>(v.data()) + done, w.pool.data_as<char>() + at, len,
                                 cudaMemcpyDeviceToDevice));
      done += len;
      at = (at + len + 4096) % (pool / 2);
    }
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  return ferry::ok_status();
}

#endif

int run_trainer(const std::string& scheme, int layers, int updates, int device, bool json) {
#if !FERRY_HAVE_CUDA
  (void)scheme, (void)layers, (void)updates, (void)device, (void)json;
  std::cerr << "ferry-bench-colocated needs a CUDA build\n";
  return 1;
#else
  ferry::set_log_identity("trainer");
  const auto cfg = llama3_8b(layers);
  const auto manifest = ferry::sharding::llama_manifest(cfg);
  auto spec = ferry::sharding::llama_rank_spec(cfg, 0, 1, scheme);
  if (!spec.ok()) return std::cerr << spec.status().to_string() << "\n", 1;
  uint64_t storage_bytes = 0;
  for (const auto& p : spec->params) {
    auto layout = ferry::reload::param_layout(p, ferry::DType::kBF16);
    if (!layout.ok()) return std::cerr << layout.status().to_string() << "\n", 1;
    for (const auto& t : *layout) storage_bytes += ferry::dtype_bytes(t.dtype, ferry::shape_numel(t.shape));
  }
  auto bw = copy_bandwidth(device);
  if (!bw.ok()) return std::cerr << bw.status().to_string() << "\n", 1;
  auto weights = allocate_weights(manifest, ferry::Device::cuda(device));
  if (!weights.ok()) return std::cerr << weights.status().to_string() << "\n", 1;

  auto trainer = ferry::coordinator::Trainer::create({});
  if (!trainer.ok()) return std::cerr << trainer.status().to_string() << "\n", 1;
  std::vector<std::string> args = {"ferry-bench-colocated", "--role", "rollout", "--coordinator",
                                   (*trainer)->coordinator_address(), "--scheme", scheme, "--layers",
                                   std::to_string(layers), "--device", fmt::format("cuda:{}", device)};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), environ) != 0) {
    return std::cerr << "posix_spawn failed\n", 1;
  }
  const int64_t timeout = ferry::setting_int("FERRY_TIMEOUT_MS").value();
  Status st = (*trainer)->wait_for_ranks(1, timeout);
  std::vector<ferry::coordinator::UpdateReport> reports;
  const int warmup = 2;
  for (int v = 1; v <= warmup + updates && st.ok(); ++v) {
    st = change_weights(*weights, static_cast<uint64_t>(v));
    if (!st.ok()) break;
    ferry::coordinator::MapSource source(weights->views);
    st = (*trainer)->start_weight_update(static_cast<uint64_t>(v), manifest);
    if (st.ok()) st = (*trainer)->update_weights(source);
    if (!st.ok()) break;
    auto r = (*trainer)->finish_weight_update();
    if (!r.ok()) {
      st = r.status();
      break;
    }
    if (r->moved != 0) st = Status::internal(fmt::format("update v{}: census moved {}/{}", v, r->moved, r->registered));
    if (v > warmup) reports.push_back(*r);
    std::cerr << fmt::format("update v{}: {:.2f} ms (transfer {:.2f}, process {:.2f}) direct {}/{} bytes\n", v,
                             r->seconds * 1e3, r->transfer_seconds * 1e3, r->process_seconds * 1e3, r->direct_bytes,
                             r->bytes);
  }
  trainer->reset();
  int status = 0;
  waitpid(pid, &status, 0);
  if (!st.ok()) return std::cerr << "ferry-bench-colocated: " << st.to_string() << "\n", 1;
  auto median = [&](auto field) {
    std::vector<double> v;
    for (const auto& r : reports) v.push_back(field(r));
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double seconds = median([](const auto& r) { return r.seconds; });
  const double moved_bytes = 2.0 * static_cast<double>(weights->params) + static_cast<double>(storage_bytes);
  const double floor = moved_bytes / *bw;
  const auto& last = reports.back();
  if (json) {
    fmt::print("{{\"bench\":\"colocated\",\"case\":\"ferry/{}\",\"device\":\"cuda\",\"params\":{},\"layers\":{},"
               "\"bytes\":{:.0f},\"direct_bytes\":{},\"seconds\":{:.6f},\"updates\":{},\"pause_seconds\":{:.6f},"
               "\"ranks_pause_seconds\":{:.6f},"
               "\"transfer_seconds\":{:.6f},\"process_seconds\":{:.6f},\"resume_seconds\":{:.6f},"
               "\"copy_gbps\":{:.1f},\"floor_seconds\":{:.6f},\"ratio_to_floor\":{:.3f}}}\n",
               scheme, weights->params, layers, moved_bytes, last.direct_bytes, seconds, reports.size(),
               median([](const auto& r) { return r.pause_seconds; }),
               median([](const auto& r) { return r.ranks_pause_seconds; }),
               median([](const auto& r) { return r.transfer_seconds; }),
               median([](const auto& r) { return r.process_seconds; }),
               median([](const auto& r) { return r.resume_seconds; }), *bw / 1e9, floor, seconds / floor);
  } else {
    fmt::print("colocated {} {} params: {:.2f} ms per update (median of {}), floor {:.2f} ms at {:.0f} GB/s copy, "
               "ratio {:.2f}\n",
               scheme, weights->params, seconds * 1e3, reports.size(), floor * 1e3, *bw / 1e9, seconds / floor);
  }
  return 0;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ferry-bench-colocated: a colocated update of a Llama-3-8B shaped model beside its memory floor"};
  std::string role = "trainer", coordinator, scheme = "fp8_per_channel", device_name = "cuda:0";
  int layers = 32, updates = 10;
  bool json = false;
  app.add_option("--role", role, "trainer (default) or rollout")->check(CLI::IsMember({"trainer", "rollout"}));
  app.add_option("--coordinator", coordinator, "rollout role: coordinator address");
  app.add_option("--scheme", scheme, "the rollout's linear-layer scheme");
  app.add_option("--layers", layers, "decoder layers (32 for Llama-3-8B)")->check(CLI::Range(1, 128));
  app.add_option("--updates", updates, "timed updates after two warm-up updates")->check(CLI::Range(1, 1000));
  app.add_option("--device", device_name, "cuda:N");
  app.add_flag("--json", json, "one JSON line");
  CLI11_PARSE(app, argc, argv);
  if (auto st = ferry::validate_settings(); !st.ok()) return std::cerr << st.to_string() << "\n", 2;
  if (!device_name.starts_with("cuda:") || device_name.size() < 6 ||
      device_name.find_first_not_of("0123456789", 5) != std::string::npos) {
    return std::cerr << "--device " << device_name << ": expected cuda:N\n", 2;
  }
  const int device = std::stoi(device_name.substr(5));
  if (role == "rollout") return run_rank(coordinator, scheme, layers, device);
  return run_trainer(scheme, layers, updates, device, json);
}
