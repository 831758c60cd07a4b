// ferry under mpirun: the first --trainers ranks are trainers, the rest replicas of --tp ranks.
// MPI bootstraps the job (it hands every rank the coordinator's address); ferry moves the weights.
//
//   mpirun -np 3 ferry-mpi-example --tp 2 --updates 3
#define OMPI_SKIP_MPICXX 1  // the C API only
#include <mpi.h>

#include <cstring>
#include <iostream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "core/log.h"
#include "coordinator/rollout_worker.h"
#include "coordinator/trainer.h"
#include "examples/demo/llama_config.h"
#include "examples/demo/reference.h"
#include "reload/model_storage.h"
#include "sharding/llama.h"

namespace {

constexpr int kAddressBytes = 256;

// Trainer rank 0: embeds the coordinator, runs the updates. Returns the number of failures.
int run_trainer(int ranks, int updates) {
  const demo::Model m;
  auto trainer = ferry::coordinator::Trainer::create({});
  char address[kAddressBytes] = {};
  if (trainer.ok()) std::snprintf(address, sizeof address, "%s", (*trainer)->coordinator_address().c_str());
  MPI_Bcast(address, kAddressBytes, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (!trainer.ok()) return std::cerr << trainer.status().to_string() << "\n", 1;
  if (auto st = (*trainer)->wait_for_ranks(ranks, 30'000); !st.ok()) return std::cerr << st.to_string() << "\n", 1;
  const auto manifest = ferry::sharding::llama_manifest(demo::llama_config(m));
  int failures = 0;
  for (int v = 1; v <= updates; ++v) {
    const demo::Checkpoint ck = demo::make_checkpoint(m, static_cast<uint64_t>(v));
    std::map<std::string, ferry::TensorView> views;
    for (const auto& [name, t] : ck) {
      views.emplace(name, ferry::TensorView(const_cast<uint16_t*>(t.bf16.data()), ferry::DType::kBF16, t.shape));
    }
    ferry::coordinator::MapSource source(views);
    ferry::Status st = (*trainer)->start_weight_update(static_cast<uint64_t>(v), manifest);
    if (st.ok()) st = (*trainer)->update_weights(source);
    auto report = st.ok() ? (*trainer)->finish_weight_update() : ferry::Result<ferry::coordinator::UpdateReport>(st);
    if (!report.ok()) {
      std::cerr << "update v" << v << ": " << report.status().to_string() << "\n";
      ++failures;
      continue;
    }
    std::cout << fmt::format("update v{}: ok ranks={} bytes={} seconds={:.4f} moved={}/{}", v, report->ranks,
                             report->bytes, report->seconds, report->moved, report->registered)
              << std::endl;
  }
  return failures;
}

// A rollout rank: serves updates and checks its storage against the reference after each one.
int run_rollout(int tp_rank, int tp, int* mismatches) {
  ferry::set_log_identity(fmt::format("rank {}", tp_rank));
  char address[kAddressBytes] = {};
  MPI_Bcast(address, kAddressBytes, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (address[0] == '\0') return 1;
  const demo::Model m;
  auto spec = ferry::sharding::llama_rank_spec(demo::llama_config(m), tp_rank, tp, "fp8_per_tensor");
  if (!spec.ok()) return std::cerr << spec.status().to_string() << "\n", 1;
  auto storage = ferry::reload::ModelStorage::allocate(*spec, ferry::Device::cpu());
  if (!storage.ok()) return std::cerr << storage.status().to_string() << "\n", 1;
  ferry::coordinator::RolloutOptions o;
  o.coordinator = address;
  o.spec = *spec;
  o.storage = &*storage;
  o.resume = [&](uint64_t version) {
    const auto expected = demo::expected_storage(m, demo::make_checkpoint(m, version), tp_rank, tp);
    for (const auto& [name, bytes] : expected) {
      auto t = storage->get(name);
      if (!t.ok() || t->nbytes() != bytes.size() || std::memcmp(t->data(), bytes.data(), bytes.size()) != 0) {
        ++*mismatches;
        std::cerr << fmt::format("rank {}: {} differs from the reference at v{}\n", tp_rank, name, version);
      }
    }
    return ferry::ok_status();
  };
  auto worker = ferry::coordinator::RolloutWorker::create(std::move(o));
  if (!worker.ok()) return std::cerr << worker.status().to_string() << "\n", 1;
  MPI_Barrier(MPI_COMM_WORLD);  // the trainer reaches it after its last update
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
  int trainers = 1, tp = 2, updates = 3;
  app.add_option("--trainers", trainers, "ranks that train (the first one embeds the coordinator)")->check(CLI::IsMember({1}));
  app.add_option("--tp", tp, "tensor-parallel size of each replica")->check(CLI::IsMember({1, 2, 4, 8}));
  app.add_option("--updates", updates, "number of updates")->check(CLI::Range(1, 100));
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
  if (rank == 0) {
    failures = run_trainer(rollout_ranks, updates);
    MPI_Barrier(MPI_COMM_WORLD);
  } else {
    failures = run_rollout(rank - trainers, tp, &mismatches);
  }
  int bad = failures + mismatches, total = 0;
  MPI_Reduce(&bad, &total, 1, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
  if (rank == 0) std::cout << (total == 0 ? fmt::format("all {} updates verified on every rank", updates) : "FAILED") << std::endl;
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
