#include <iostream>

#include "cli/commands.h"

#ifdef FERRY_HAVE_KERNELS_BENCH
#include "bench/kernels_bench.h"
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
}

}  // namespace ferry::cli
