// ferry under mpirun: the first --trainers ranks are trainer ranks, the rest replicas of --tp ranks.
// MPI bootstraps the job (it hands every rank the coordinator's address); ferry moves the weights.
// Several trainer ranks form one sharded trainer: each holds FSDP2-style Shard(0) rows of every
// tensor (chunks of ceil(rows / trainers)) and sends only those, straight to the rollout ranks.
//
//   mpirun -np 3 ferry-mpi-example --tp 2 --updates 3
//   mpirun -np 6 ferry-mpi-example --trainers 4 --tp 2 --updates 3           # 4 sharded trainer ranks
//   mpirun -np 3 -x FERRY_TRANSPORT=nccl ferry-mpi-example --tp 2 --gpus 2   # trainer on GPU 0, ranks on GPU 1
#define OMPI_SKIP_MPICXX 1  // the C API only
#include <mpi.h>

#include <cstring>
#include <future>
#include <map>
#include <vector>
#include <iostream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "core/device_copy.h"
#include "core/log.h"
#include "coordinator/rollout_worker.h"
#include "coordinator/trainer.h"
#include "examples/demo/llama_config.h"
#include "examples/demo/reference.h"
#include "reload/model_storage.h"
#include "sharding/llama.h"
#include "sharding/trainer_layouts.h"

namespace {

constexpr int kAddressBytes = 256;

// With --gpus N the trainer's weights live on cuda:0 and rollout rank r's storage on
// cuda:(1 + r % (N - 1)) (cuda:0 when N is 1); otherwise everything is in host memory.
ferry::Device trainer_device(int gpus) { return gpus > 0 ? ferry::Device::cuda(0) : ferry::Device::cpu(); }
ferry::Device rank_device(int gpus, int tp_rank) {
  if (gpus <= 0) return ferry::Device::cpu();
  return ferry::Device::cuda(gpus == 1 ? 0 : 1 + tp_rank % (gpus - 1));
}

// Trainer rank `me` of `trainers` (the first embeds the coordinator): runs the updates, sending its
// Shard(0) rows of every tensor. Returns the number of failures.
int run_trainer(int me, int trainers, MPI_Comm trainer_comm, int ranks, int updates, ferry::Device device) {
  const demo::Model m;
  ferry::set_log_identity(fmt::format("trainer {}", me));
  ferry::Status placed = ferry::set_current_device(device);
  char address[kAddressBytes] = {};
  ferry::Result<std::unique_ptr<ferry::coordinator::Trainer>> trainer = placed;
  ferry::coordinator::TrainerOptions o;
  o.trainer_rank = me;
  o.trainer_ranks = trainers;
  if (me == 0 && placed.ok()) {
    trainer = ferry::coordinator::Trainer::create(o);
    if (trainer.ok()) std::snprintf(address, sizeof address, "%s", (*trainer)->coordinator_address().c_str());
  }
  MPI_Bcast(address, kAddressBytes, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (me > 0 && placed.ok() && address[0] != '\0') {
    o.coordinator = address;
    trainer = ferry::coordinator::Trainer::create(o);
  }
  if (!trainer.ok()) return std::cerr << trainer.status().to_string() << "\n", 1;
  if (me == 0) {
    if (auto st = (*trainer)->wait_for_ranks(ranks, 30'000); !st.ok()) return std::cerr << st.to_string() << "\n", 1;
  }
  MPI_Barrier(trainer_comm);  // every trainer rank starts once the replica is there
  const auto manifest = ferry::sharding::llama_manifest(demo::llama_config(m));
  ferry::coordinator::UpdateOptions options;
  // The only trainer rank of one holds every tensor whole.
  if (trainers > 1) options.holdings = ferry::sharding::fsdp_holdings(manifest, me, trainers);
  int failures = 0;
  std::map<std::string, ferry::Buffer> on_device;  // a GPU trainer's weights, rewritten each step
  for (int v = 1; v <= updates; ++v) {
    const demo::Checkpoint ck = demo::make_checkpoint(m, static_cast<uint64_t>(v));
    std::map<std::string, ferry::TensorView> views;
    ferry::Status st;
    for (const auto& [name, t] : ck) {
      // This trainer rank's rows of the tensor (all of them for a trainer of one rank).
      const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
      const auto [from, to] = ferry::sharding::shard_rows(rows, me, trainers);
      const size_t row = t.bf16.size() / static_cast<size_t>(std::max<int64_t>(rows, 1));
      ferry::Shape local = t.shape;
      if (!local.empty()) local[0] = to - from;
      ferry::TensorView host(const_cast<uint16_t*>(t.bf16.data()) + static_cast<size_t>(from) * row,
                             ferry::DType::kBF16, local);
      if (device.is_cpu() || !st.ok()) {
        views.emplace(name, host);
        continue;
      }
      auto& b = on_device[name];
      if (b.data() == nullptr) {
        auto nb = ferry::Buffer::allocate(host.nbytes(), device);
        if (!nb.ok()) return std::cerr << nb.status().to_string() << "\n", failures + 1;
        b = std::move(*nb);
      }
      st = ferry::copy_bytes(b.data(), device, host.data(), ferry::Device::cpu(), host.nbytes());
      views.emplace(name, ferry::TensorView(b.data(), ferry::DType::kBF16, local, device));
    }
    ferry::coordinator::MapSource source(views);
    if (st.ok()) st = (*trainer)->start_weight_update(static_cast<uint64_t>(v), manifest, options);
    if (st.ok()) st = (*trainer)->update_weights(source);
    auto report = st.ok() ? (*trainer)->finish_weight_update() : ferry::Result<ferry::coordinator::UpdateReport>(st);
    if (!report.ok()) {
      std::cerr << "update v" << v << ": " << report.status().to_string() << "\n";
      ++failures;
      continue;
    }
    if (me != 0) continue;  // one line per update
    std::cout << fmt::format("update v{}: ok trainer_ranks={} ranks={} bytes={} seconds={:.4f} transfer={:.4f} gbps={:.2f} "
                             "moved={}/{}",
                             v, trainers, report->ranks, report->bytes, report->seconds, report->transfer_seconds,
                             report->gbps(), report->moved, report->registered)
              << std::endl;
  }
  return failures;
}

// A rollout rank: serves updates and checks its storage against the reference after each one.
int run_rollout(int tp_rank, int tp, ferry::Device device, int* mismatches) {
  ferry::set_log_identity(fmt::format("rank {}", tp_rank));
  char address[kAddressBytes] = {};
  MPI_Bcast(address, kAddressBytes, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (address[0] == '\0') return 1;
  const demo::Model m;
  auto spec = ferry::sharding::llama_rank_spec(demo::llama_config(m), tp_rank, tp, ferry::Scheme::kFp8PerTensor);
  if (!spec.ok()) return std::cerr << spec.status().to_string() << "\n", 1;
  // Device transports (nccl, cuda_ipc) move memory of the current device: the storage's.
  if (auto st = ferry::set_current_device(device); !st.ok()) return std::cerr << st.to_string() << "\n", 1;
  auto storage = ferry::reload::ModelStorage::allocate(*spec, device);
  if (!storage.ok()) return std::cerr << storage.status().to_string() << "\n", 1;
  ferry::coordinator::RolloutOptions o;
  o.coordinator = address;
  o.spec = *spec;
  o.storage = &*storage;
  // The reference of the next version is computed while the trainer trains, so that checking the
  // storage in resume() (which the update waits for) is only a comparison.
  using Expected = std::map<std::string, std::vector<uint8_t>>;
  auto reference = [&m, tp_rank, tp](uint64_t v) { return demo::expected_storage(m, demo::make_checkpoint(m, v), tp_rank, tp); };
  std::future<Expected> next = std::async(std::launch::async, reference, 1);
  uint64_t next_version = 1;
  o.resume = [&](uint64_t version) {
    const Expected expected = version == next_version ? next.get() : reference(version);
    next_version = version + 1;
    next = std::async(std::launch::async, reference, next_version);
    for (const auto& [name, bytes] : expected) {
      auto t = storage->get(name);
      std::vector<uint8_t> held;  // the storage's bytes, read back from the device
      if (t.ok() && t->nbytes() == bytes.size()) {
        held.resize(bytes.size());
        FERRY_RETURN_IF_ERROR(ferry::copy_bytes(held.data(), ferry::Device::cpu(), t->data(), t->device(), held.size()));
      }
      if (!t.ok() || t->nbytes() != bytes.size() || std::memcmp(held.data(), bytes.data(), bytes.size()) != 0) {
        ++*mismatches;
        std::cerr << fmt::format("rank {}: {} differs from the reference at v{}\n", tp_rank, name, version);
      }
    }
    return ferry::ok_status();
  };
  auto worker = ferry::coordinator::RolloutWorker::create(std::move(o));
  if (!worker.ok()) return std::cerr << worker.status().to_string() << "\n", 1;
  MPI_Barrier(MPI_COMM_WORLD);  // the trainer reaches it after its last update
  worker->reset();                // no resume() after this point
  if (next.valid()) next.wait();  // the unused reference of the version after the last
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  CLI::App app{"ferry-mpi-example: a trainer and TP replicas launched by mpirun"};
  int trainers = 1, tp = 2, updates = 3, gpus = 0;
  app.add_option("--trainers", trainers,
                 "ranks that train, each holding Shard(0) rows of every tensor (the first embeds the coordinator)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--tp", tp, "tensor-parallel size of each replica")->check(CLI::IsMember({1, 2, 4, 8}));
  app.add_option("--updates", updates, "number of updates")->check(CLI::Range(1, 100));
  app.add_option("--gpus", gpus,
                 "GPUs of this node to use (0: host memory): the trainer's weights on cuda:0, rank r's storage on "
                 "cuda:(1 + r % (N-1)); with FERRY_TRANSPORT=nccl the weights move over NCCL")
      ->check(CLI::Range(0, 64));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    MPI_Finalize();
    return rc;
  }
  const int rollout_ranks = size - trainers;
  if (rollout_ranks <= 0 || rollout_ranks % tp != 0) {
    if (rank == 0) std::cerr << fmt::format("{} ranks: need {} trainer(s) plus a multiple of --tp {}\n", size, trainers, tp);
    MPI_Finalize();
    return 2;
  }
  if (rollout_ranks != tp && rank == 0) {
    std::cerr << "this example runs one replica; use -np " << trainers + tp << "\n";
    MPI_Finalize();
    return 2;
  }
  int failures = 0, mismatches = 0;
  MPI_Comm trainer_comm;
  MPI_Comm_split(MPI_COMM_WORLD, rank < trainers ? 0 : 1, rank, &trainer_comm);
  if (rank < trainers) {
    failures = run_trainer(rank, trainers, trainer_comm, rollout_ranks, updates, trainer_device(gpus));
    MPI_Barrier(MPI_COMM_WORLD);
  } else {
    failures = run_rollout(rank - trainers, tp, rank_device(gpus, rank - trainers), &mismatches);
  }
  int bad = failures + mismatches, total = 0;
  MPI_Reduce(&bad, &total, 1, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
  if (rank == 0) std::cout << (total == 0 ? fmt::format("all {} updates verified on every rank", updates) : "FAILED") << std::endl;
  MPI_Comm_free(&trainer_comm);
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
