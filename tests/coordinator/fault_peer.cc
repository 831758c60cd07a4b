// A member process for fault tests: a rollout rank, or a trainer that stops itself mid-transfer so
// the test can kill it at a known point. Faults are injected into real processes on real sockets.
//
//   ferry-fault-peer rollout COORDINATOR TP_RANK TP [wide]   (wide: wide_llama(), else tiny_llama())
//   ferry-fault-peer trainer COORDINATOR VERSION STOP_AFTER_TENSORS
//   ferry-fault-peer coordinator ADDRESS_FILE MAX_FILES     a coordinator alone, under RLIMIT_NOFILE
//   ferry-fault-peer embedded ADDRESS_FILE TP STOP_AFTER    a trainer embedding the coordinator: v1
//                                                          whole, then v2 stopped mid-transfer
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

#include "coordinator/coordinator.h"
#include "tests/coordinator/cluster.h"

using namespace ferry;

int main(int argc, char** argv) {
  const bool wide = argc == 6 && std::string(argv[1]) == "rollout" && std::string(argv[5]) == "wide";
  if (argc != 5 && !wide && !(argc == 4 && std::string(argv[1]) == "coordinator")) {
    std::cerr << "usage: ferry-fault-peer rollout|trainer|coordinator|embedded A B C\n";
    return 2;
  }
  const std::string role = argv[1], address = argv[2];
  const auto cfg = wide ? testutil::wide_llama() : testutil::tiny_llama();
  if (role == "rollout") {
    const int rank = std::atoi(argv[3]), tp = std::atoi(argv[4]);
    auto spec = sharding::llama_rank_spec(cfg, rank, tp, ferry::Scheme::kFp8PerTensor);
    if (!spec.ok()) return std::cerr << spec.status().to_string() << "\n", 1;
    auto storage = reload::ModelStorage::allocate(*spec, Device::cpu());
    if (!storage.ok()) return std::cerr << storage.status().to_string() << "\n", 1;
    coordinator::RolloutOptions o;
    o.coordinator = address;
    o.spec = *spec;
    o.storage = &*storage;
    auto worker = coordinator::RolloutWorker::create(std::move(o));
    if (!worker.ok()) return std::cerr << worker.status().to_string() << "\n", 3;
    Status end;
    while ((end = (*worker)->wait_closed(60'000)).code() == StatusCode::kDeadlineExceeded) {
    }
    if (!end.ok()) return std::cerr << end.to_string() << "\n", 4;
    return 0;
  }
  const auto publish = [](const std::string& file, const std::string& address) {
    std::ofstream(file + ".tmp") << address;
    std::rename((file + ".tmp").c_str(), file.c_str());  // readers see the whole address or none
  };
  if (role == "coordinator") {
    const rlimit lim{std::strtoul(argv[3], nullptr, 10), std::strtoul(argv[3], nullptr, 10)};
    if (setrlimit(RLIMIT_NOFILE, &lim) != 0) return std::cerr << "setrlimit failed\n", 1;
    auto coord = coordinator::Coordinator::start({});
    if (!coord.ok()) return std::cerr << coord.status().to_string() << "\n", 3;
    publish(argv[2], (*coord)->address());
    while (true) pause();  // until the test kills it
  }
  if (role == "embedded") {
    const int tp = std::atoi(argv[3]), stop_after = std::atoi(argv[4]);
    auto trainer = coordinator::Trainer::create({});
    if (!trainer.ok()) return std::cerr << trainer.status().to_string() << "\n", 3;
    publish(argv[2], (*trainer)->coordinator_address());
    if (!(*trainer)->wait_for_ranks(tp, 30'000).ok()) return 1;
    const auto manifest = sharding::llama_manifest(cfg);
    for (uint64_t v = 1; v <= 2; ++v) {
      testutil::Checkpoint ck(manifest, v);
      if (!(*trainer)->start_weight_update(v, manifest).ok()) return 1;
      int sent = 0;
      for (const auto& t : manifest) {
        if (v == 2 && sent++ == stop_after) raise(SIGSTOP);  // the test kills the process here
        if (!(*trainer)->send(t.name, ck.views.at(t.name)).ok()) return 1;
      }
      if (!(*trainer)->finish_weight_update().ok()) return 1;
    }
    return 0;
  }
  if (role == "trainer") {
    const uint64_t version = std::strtoull(argv[3], nullptr, 10);
    const int stop_after = std::atoi(argv[4]);
    coordinator::TrainerOptions o;
    o.coordinator = address;
    auto trainer = coordinator::Trainer::create(o);
    if (!trainer.ok()) return std::cerr << trainer.status().to_string() << "\n", 3;
    const auto manifest = sharding::llama_manifest(cfg);
    testutil::Checkpoint ck(manifest, version);
    if (Status st = (*trainer)->start_weight_update(version, manifest); !st.ok()) {
      return std::cerr << st.to_string() << "\n", 1;
    }
    int sent = 0;
    for (const auto& t : manifest) {
      if (sent++ == stop_after) raise(SIGSTOP);  // the test kills the process here
      if (Status st = (*trainer)->send(t.name, ck.views.at(t.name)); !st.ok()) return 1;
    }
    return (*trainer)->finish_weight_update().ok() ? 0 : 1;
  }
  return 2;
}
