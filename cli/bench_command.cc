#include <iostream>

#include "cli/commands.h"

#ifdef FERRY_HAVE_KERNELS_BENCH
#include "bench/kernels_bench.h"
#endif
#ifdef FERRY_HAVE_RELOAD_BENCH
#include "bench/reload_bench.h"
#endif
#ifdef FERRY_HAVE_TRANSPORT_BENCH
#include "bench/transport_bench.h"
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
}

}  // namespace ferry::cli
