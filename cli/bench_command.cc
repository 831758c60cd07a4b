#include <iostream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/scheme.h"

#ifdef FERRY_HAVE_KERNELS_BENCH
#include "bench/kernels_bench.h"
#endif
#ifdef FERRY_HAVE_RELOAD_BENCH
#include "bench/reload_bench.h"
#endif
#ifdef FERRY_HAVE_TRANSPORT_BENCH
#include "bench/transport_bench.h"
#endif
#ifdef FERRY_HAVE_E2E_BENCH
#include "bench/e2e_bench.h"
#include "bench/e2e_trainers.h"
#endif

namespace ferry::cli {

void add_bench_command(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "benchmarks, each beside a baseline measured in the same run");
  bench->require_subcommand(1);
  auto* kernels = bench->add_subcommand("kernels", "quantization kernels beside a plain copy of their input");
  static bool json = false;
  static std::string device = "all";
  static size_t rows = 4096, cols = 4096;
  kernels->add_flag("--json", json, "one JSON object per line");
  kernels->add_option("--device", device, "cpu, cuda or all")->check(CLI::IsMember({"cpu", "cuda", "all"}));
  kernels->add_option("--rows", rows, "rows of the benchmark tensor");
  kernels->add_option("--cols", cols, "columns of the benchmark tensor");
  kernels->callback([] {
#ifdef FERRY_HAVE_KERNELS_BENCH
    const int rc = run_kernels_bench(json, device, rows, cols);
    if (rc) throw CLI::RuntimeError(rc);
#else
    std::cerr << "this ferry was built without the kernels benchmark\n";
    throw CLI::RuntimeError(1);
#endif
  });

  auto* reload = bench->add_subcommand("reload", "a whole-model update into registered storage, per scheme");
  static bool reload_json = false;
  static std::string reload_device = "cpu";
  reload->add_flag("--json", reload_json, "one JSON object per line");
  reload->add_option("--device", reload_device, "cpu or all");
  reload->callback([] {
#ifdef FERRY_HAVE_RELOAD_BENCH
    const int rc = run_reload_bench(reload_json, reload_device);
    if (rc) throw CLI::RuntimeError(rc);
#else
    std::cerr << "this ferry was built without the reload benchmark\n";
    throw CLI::RuntimeError(1);
#endif
  });

  auto* transport = bench->add_subcommand("transport", "one transport moving buckets, beside same-run baselines");
  static bool transport_json = false;
  static std::string transport_name = "tcp";
  static size_t transport_bytes = 256u << 20;
  static int transport_iters = 10;
  transport->add_flag("--json", transport_json, "one JSON object per line");
  transport->add_option("--transport", transport_name, "tcp, shm, ucx, cuda_ipc or nccl");
  transport->add_option("--bytes", transport_bytes, "bytes per bucket");
  transport->add_option("--iters", transport_iters, "buckets to move");
  transport->callback([] {
#ifdef FERRY_HAVE_TRANSPORT_BENCH
    const int rc = run_transport_bench(transport_name, transport_bytes, transport_iters, transport_json);
    if (rc) throw CLI::RuntimeError(rc);
#else
    std::cerr << "this ferry was built without the transport benchmark\n";
    throw CLI::RuntimeError(1);
#endif
  });

#ifdef FERRY_HAVE_E2E_BENCH
  auto* e2e = bench->add_subcommand("e2e", "whole updates across processes, beside the cost model's prediction");
  static E2eOptions e2e_options;
  e2e->add_flag("--json", e2e_options.json, "one JSON object per line");
  e2e->add_option("--transport", e2e_options.transport, "tcp, shm, ucx, or all")
      ->check(CLI::IsMember({"tcp", "shm", "ucx", "all"}))
      ->capture_default_str();
  std::vector<std::string> online;
  for (Scheme s : kAllSchemes) {
    if (scheme_is_online(s)) online.emplace_back(scheme_name(s));
  }
  e2e->add_option("--scheme", e2e_options.scheme, "quantization of the rollout's linear layers (online schemes)")
      ->check(CLI::IsMember(online))
      ->capture_default_str();
  e2e->add_option("--updates", e2e_options.updates, "timed rounds (links, then an update) after a warm-up round")
      ->capture_default_str();
  e2e->add_option("--tp", e2e_options.tp, "rank processes of the replica")->capture_default_str();
  e2e->add_option("--bucket-bytes", e2e_options.bucket_bytes, "bytes per bucket (default FERRY_BUCKET_BYTES)");
  e2e->add_flag("--delta", e2e_options.delta,
                "delta updates (changes from Adam steps at lr 1e-6) beside dense ones, each with and without "
                "staging while serving, on a 117M-parameter model");
  e2e->add_option("--model", e2e_options.model,
                  "demo (5.49 MB of bf16) or delta (117M parameters, 234 MB); --delta always uses delta")
      ->check(CLI::IsMember({"demo", "delta"}))
      ->capture_default_str();
  e2e->add_option("--trainers", e2e_options.trainers,
                  "sharded trainers of these sizes (e.g. 1,2,4), each beside gather-then-send from as many processes")
      ->delimiter(',')
      ->check(CLI::Range(1, 64));
  e2e->callback([] {
    const int rc = run_e2e_bench(e2e_options);
    if (rc) throw CLI::RuntimeError(rc);
  });
  // The bench's trainer processes for --trainers: this binary, re-run.
  auto* e2e_trainer = bench->add_subcommand("e2e-trainer", "")->group("");
  static int trainer_port = 0, trainer_rank = 0, trainer_count = 1, trainer_updates = 1;
  static std::string trainer_coordinator, trainer_mode, trainer_model = "demo";
  static uint64_t trainer_first = 1;
  e2e_trainer->add_option("--probe-port", trainer_port)->required();
  e2e_trainer->add_option("--coordinator", trainer_coordinator)->required();
  e2e_trainer->add_option("--trainer-rank", trainer_rank)->required();
  e2e_trainer->add_option("--trainers", trainer_count)->required();
  e2e_trainer->add_option("--mode", trainer_mode)->required()->check(CLI::IsMember({"sharded", "gather"}));
  e2e_trainer->add_option("--updates", trainer_updates)->required();
  e2e_trainer->add_option("--first-version", trainer_first)->required();
  e2e_trainer->add_option("--model", trainer_model);
  e2e_trainer->callback([] {
    const int rc = run_e2e_trainer(static_cast<uint16_t>(trainer_port), trainer_coordinator, trainer_rank,
                                   trainer_count, trainer_mode, trainer_updates, trainer_first, trainer_model);
    if (rc) throw CLI::RuntimeError(rc);
  });
  // The bench's rank processes: this binary, re-run by `ferry bench e2e`.
  auto* e2e_rank = bench->add_subcommand("e2e-rank", "")->group("");
  static int rank_port = 0, rank_index = 0, rank_tp = 1;
  static std::string rank_coordinator, rank_scheme, rank_transport, rank_model = "demo";
  e2e_rank->add_option("--probe-port", rank_port)->required();
  e2e_rank->add_option("--coordinator", rank_coordinator)->required();
  e2e_rank->add_option("--tp-rank", rank_index)->required();
  e2e_rank->add_option("--tp", rank_tp)->required();
  e2e_rank->add_option("--scheme", rank_scheme)->required();
  e2e_rank->add_option("--transport", rank_transport)->required();
  e2e_rank->add_option("--model", rank_model);
  e2e_rank->callback([] {
    const int rc =
        run_e2e_rank(static_cast<uint16_t>(rank_port), rank_coordinator, rank_index, rank_tp, rank_scheme,
                     rank_transport, rank_model);
    if (rc) throw CLI::RuntimeError(rc);
  });
#endif
}

}  // namespace ferry::cli
