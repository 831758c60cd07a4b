// ferry-demo: a trainer (with the embedded coordinator) and one replica of TP ranks, as separate
// processes on 127.0.0.1. Three updates of a small Llama-shaped model whose weights change each
// time; every rank's storage is checked bit-exact against an independent reference.
//
//   ferry-demo [--updates 3] [--tp 2] [--dump-dir DIR]
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "core/device_copy.h"
#include "core/log.h"
#include "core/rank_devices.h"
#include "core/safetensors.h"
#include "core/settings.h"
#include "coordinator/rollout_worker.h"
#include "coordinator/trainer.h"
#include "examples/demo/llama_config.h"
#include "examples/demo/reference.h"
#include "reload/model_storage.h"
#include "reload/processing.h"
#include "sharding/llama.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using ferry::Status;

std::string rank_file(const std::string& dir, uint64_t version, int rank) {
  return fmt::format("{}/v{}/rank{}.safetensors", dir, version, rank);
}

int run_rollout(const std::string& coordinator, int rank, int tp, const std::string& dir, ferry::Device device) {
  ferry::set_log_identity(fmt::format("rank {}", rank));
  const demo::Model m;
  auto spec = ferry::sharding::llama_rank_spec(demo::llama_config(m), rank, tp, ferry::Scheme::kFp8PerTensor);
  if (!spec.ok()) return std::cerr << spec.status().to_string() << "\n", 1;
  // Device transports (nccl, cuda_ipc) move memory of the current device: the storage's.
  if (auto st = ferry::set_current_device(device); !st.ok()) return std::cerr << st.to_string() << "\n", 1;
  auto storage = ferry::reload::ModelStorage::allocate(*spec, device);
  if (!storage.ok()) return std::cerr << storage.status().to_string() << "\n", 1;
  ferry::coordinator::RolloutOptions o;
  o.coordinator = coordinator;
  o.spec = *spec;
  o.storage = &*storage;
  // After every update the rank writes what its kernels would read, for the trainer to check.
  o.resume = [&](uint64_t version) -> Status {
    std::error_code ec;
    fs::create_directories(fmt::format("{}/v{}", dir, version), ec);
    std::vector<std::pair<std::string, ferry::TensorView>> tensors;
    std::vector<ferry::Buffer> host;  // device storage is read back first
    for (const auto& [name, t] : storage->tensors()) {
      if (t.device().is_cpu()) {
        tensors.emplace_back(name, t);
        continue;
      }
      FERRY_ASSIGN_OR_RETURN(ferry::Buffer b, ferry::Buffer::allocate(std::max<size_t>(t.nbytes(), 1)));
      FERRY_RETURN_IF_ERROR(ferry::reload::copy_bytes(b.data(), ferry::Device::cpu(), t.data(), t.device(), t.nbytes()));
      tensors.emplace_back(name, ferry::TensorView(b.data(), t.dtype(), t.shape()));
      host.push_back(std::move(b));
    }
    return ferry::write_safetensors(rank_file(dir, version, rank), tensors);
  };
  auto worker = ferry::coordinator::RolloutWorker::create(std::move(o));
  if (!worker.ok()) return std::cerr << "rank " << rank << ": " << worker.status().to_string() << "\n", 1;
  // Serve until the trainer ends the job; a lost coordinator is an error that says where it left us.
  ferry::Status end;
  while ((end = (*worker)->wait_closed(60'000)).code() == ferry::StatusCode::kDeadlineExceeded) {
  }
  if (!end.ok()) return std::cerr << "rank " << rank << ": " << end.to_string() << "\n", 4;
  return 0;
}

// A child process whose exit can be awaited with a deadline.
struct Child {
  pid_t pid = -1;
  int pidfd = -1;
};

ferry::Result<Child> spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  Child c;
  if (posix_spawn(&c.pid, "/proc/self/exe", nullptr, nullptr, argv.data(), environ) != 0) {
    return Status::unavailable(std::string("posix_spawn: ") + std::strerror(errno));
  }
  c.pidfd = static_cast<int>(syscall(SYS_pidfd_open, c.pid, 0));
  return c;
}

// Waits for the child's exit until `ms`; kills it past the deadline. Returns its exit status.
int reap(Child& c, int ms) {
  if (c.pidfd >= 0) {
    pollfd p{c.pidfd, POLLIN, 0};
    if (poll(&p, 1, ms) == 0) kill(c.pid, SIGKILL);
    close(c.pidfd);
  }
  int status = 0;
  waitpid(c.pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

struct Check {
  bool ok = true;
  std::string first_error;
};

Check verify(const demo::Model& m, const demo::Checkpoint& ck, const std::string& dir, uint64_t version, int tp) {
  Check c;
  for (int r = 0; r < tp && c.ok; ++r) {
    auto expected = demo::expected_storage(m, ck, r, tp);
    auto file = ferry::SafetensorsReader::open(rank_file(dir, version, r));
    if (!file.ok()) return {false, file.status().to_string()};
    if (file->names().size() != expected.size()) {
      return {false, fmt::format("rank {} holds {} tensors; the reference has {}", r, file->names().size(), expected.size())};
    }
    for (const auto& [name, bytes] : expected) {
      auto t = file->tensor(name);
      if (!t.ok()) return {false, t.status().to_string()};
      if (t->nbytes() != bytes.size() || std::memcmp(t->data(), bytes.data(), bytes.size()) != 0) {
        return {false, fmt::format("rank {} tensor {} differs from the reference", r, name)};
      }
    }
  }
  return c;
}

int run_trainer(int updates, int tp, std::string dir, ferry::Device device, const std::vector<ferry::Device>& rank_devices) {
  ferry::set_log_identity("trainer");
  const bool keep = !dir.empty();
  if (!keep) {
    char tmpl[] = "/tmp/ferry-demo-XXXXXX";
    if (!mkdtemp(tmpl)) return std::cerr << "mkdtemp failed\n", 1;
    dir = tmpl;
  }
  if (auto st = ferry::set_current_device(device); !st.ok()) return std::cerr << st.to_string() << "\n", 1;
  auto trainer = ferry::coordinator::Trainer::create({});
  if (!trainer.ok()) return std::cerr << trainer.status().to_string() << "\n", 1;
  std::vector<Child> children;
  for (int r = 0; r < tp; ++r) {
    auto c = spawn({"ferry-demo", "--role", "rollout", "--coordinator", (*trainer)->coordinator_address(), "--tp-rank",
                    std::to_string(r), "--tp", std::to_string(tp), "--dump-dir", dir, "--device", rank_devices[static_cast<size_t>(r)].to_string()});
    if (!c.ok()) return std::cerr << c.status().to_string() << "\n", 1;
    children.push_back(*c);
  }
  const int64_t timeout = ferry::load_settings().value().timeout_ms;
  int rc = 0;
  Status st = (*trainer)->wait_for_ranks(tp, timeout);
  const demo::Model m;
  const auto manifest = ferry::sharding::llama_manifest(demo::llama_config(m));
  std::map<std::string, ferry::Buffer> on_device;  // a GPU trainer's weights: allocated once, rewritten per step
  for (int v = 1; v <= updates && st.ok(); ++v) {
    const demo::Checkpoint ck = demo::make_checkpoint(m, static_cast<uint64_t>(v));
    std::map<std::string, ferry::TensorView> views;
    for (const auto& [name, t] : ck) {
      ferry::TensorView host(const_cast<uint16_t*>(t.bf16.data()), ferry::DType::kBF16, t.shape);
      if (device.is_cpu()) {
        views.emplace(name, host);
        continue;
      }
      auto& b = on_device[name];
      if (b.data() == nullptr) {
        auto nb = ferry::Buffer::allocate(host.nbytes(), device);
        if (!nb.ok()) return std::cerr << nb.status().to_string() << "\n", 1;
        b = std::move(*nb);
      }
      st = ferry::reload::copy_bytes(b.data(), device, host.data(), ferry::Device::cpu(), host.nbytes());
      views.emplace(name, ferry::TensorView(b.data(), ferry::DType::kBF16, t.shape, device));
    }
    if (!st.ok()) break;
    ferry::coordinator::MapSource source(views);
    st = (*trainer)->start_weight_update(static_cast<uint64_t>(v), manifest);
    if (st.ok()) st = (*trainer)->update_weights(source);
    if (!st.ok()) break;
    auto report = (*trainer)->finish_weight_update();
    if (!report.ok()) {
      st = report.status();
      break;
    }
    const Check check = verify(m, ck, dir, static_cast<uint64_t>(v), tp);
    std::cout << fmt::format("update v{}: ok ranks={} bytes={} direct={} seconds={:.4f} gbps={:.2f} moved={}/{} {}", v,
                             report->ranks, report->bytes, report->direct_bytes, report->seconds, report->gbps(),
                             report->moved, report->registered, check.ok ? "verified" : "MISMATCH")
              << std::endl;
    if (!check.ok) {
      std::cerr << check.first_error << "\n";
      rc = 1;
      break;
    }
  }
  if (!st.ok()) {
    std::cerr << "ferry-demo: " << st.to_string() << "\n";
    rc = 1;
  }
  trainer->reset();  // closes the coordinator; the ranks exit
  for (auto& c : children) {
    const int crc = reap(c, static_cast<int>(timeout));
    if (crc != 0) {
      std::cerr << "ferry-demo: a rollout rank exited with " << crc << "\n";
      rc = 1;
    }
  }
  if (!keep) fs::remove_all(dir);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ferry-demo: three verified weight updates from a trainer into a TP replica"};
  std::string role = "trainer", coordinator, dump_dir;
  int updates = 3, tp = 2, tp_rank = 0;
  app.add_option("--role", role, "trainer (default) or rollout")->check(CLI::IsMember({"trainer", "rollout"}));
  app.add_option("--updates", updates, "number of updates")->check(CLI::Range(1, 1000));
  app.add_option("--tp", tp, "tensor-parallel ranks of the replica")->check(CLI::IsMember({1, 2, 4, 8}));
  app.add_option("--dump-dir", dump_dir, "write every rank's registered tensors to DIR/vN/rankR.safetensors");
  app.add_option("--coordinator", coordinator, "rollout role: coordinator address");
  app.add_option("--tp-rank", tp_rank, "rollout role: this rank");
  std::string device_name = "cpu", rank_device_name;
  app.add_option("--device", device_name,
                 "where the trainer's weights and the ranks' storage live: cpu, or cuda:N (colocated on one GPU node: "
                 "the ranks read the trainer's tensors in place)");
  app.add_option("--rank-device", rank_device_name,
                 "where the ranks' storage lives, when not on --device: cuda:N for every rank, or one per rank "
                 "(cuda:1,cuda:2: a GPU each), reached over FERRY_TRANSPORT=nccl or cuda_ipc");
  CLI11_PARSE(app, argc, argv);
  if (auto st = ferry::load_settings().status(); !st.ok()) return std::cerr << st.to_string() << "\n", 2;
  auto device = ferry::parse_device(device_name);
  if (!device.ok()) return std::cerr << "--device: " << device.status().message() << "\n", 2;
  if (role == "rollout") return run_rollout(coordinator, tp_rank, tp, dump_dir, *device);
  auto rank_devices = ferry::parse_rank_devices(rank_device_name.empty() ? device->to_string() : rank_device_name, tp);
  if (!rank_devices.ok()) return std::cerr << "--rank-device: " << rank_devices.status().message() << "\n", 2;
  return run_trainer(updates, tp, dump_dir, *device, *rank_devices);
}
