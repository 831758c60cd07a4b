// One trainer rank of a sharded trainer, as its own process, for the sharded-trainer tests:
//   ferry-trainer-rank OUT COORDINATOR RANK RANKS LAYOUT TP FIRST LAST [DIE_VERSION DIE_AFTER]
// joins COORDINATOR as trainer rank RANK of RANKS, holds its LAYOUT box of every tensor of
// sharded_config(TP)'s checkpoint (sharded.h), and sends versions FIRST..LAST, each from the
// checkpoint seeded 100 + version, appending "v<N> ok" or "v<N> error: <status>" to OUT. With
// DIE_VERSION, it exits abruptly after sending DIE_AFTER tensors of that version.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <span>
#include <string>

#include <fmt/format.h>

#include "coordinator/trainer.h"
#include "sharding/source_layout.h"
#include "tests/common/megatron_shards.h"
#include "tests/coordinator/sharded.h"

int main(int argc, char** argv) {
  using namespace ferry;
  if (argc != 9 && argc != 11) {
    std::fprintf(stderr, "usage: %s OUT COORDINATOR RANK RANKS LAYOUT TP FIRST LAST [DIE_VERSION DIE_AFTER]\n", argv[0]);
    return 2;
  }
  const std::string out_path = argv[1];
  const int rank = std::atoi(argv[3]), ranks = std::atoi(argv[4]), tp = std::atoi(argv[6]);
  const std::string layout = argv[5];
  const uint64_t first = std::strtoull(argv[7], nullptr, 10), last = std::strtoull(argv[8], nullptr, 10);
  const uint64_t die_version = argc == 11 ? std::strtoull(argv[9], nullptr, 10) : 0;
  const int die_after = argc == 11 ? std::atoi(argv[10]) : 0;
  auto say = [&](const std::string& line) {
    FILE* f = std::fopen(out_path.c_str(), "a");
    if (f == nullptr) std::exit(3);
    std::fprintf(f, "%s\n", line.c_str());
    std::fclose(f);
  };

  const testutil::Config cfg = testutil::sharded_config(tp);
  const sharding::Manifest manifest = sharding::llama_manifest(cfg.llama);
  coordinator::TrainerOptions o;
  o.coordinator = argv[2];
  o.trainer_rank = rank;
  o.trainer_ranks = ranks;
  auto trainer = coordinator::Trainer::create(o);
  if (!trainer.ok()) {
    say("join error: " + trainer.status().to_string());
    return 1;
  }
  coordinator::UpdateOptions u;
  if (layout == "megatron") {
    auto source = sharding::megatron_layout(cfg.llama, rank, ranks);
    if (!source.ok()) {
      say("layout error: " + source.status().to_string());
      return 1;
    }
    u.source_layout = std::move(*source);
  } else {
    u.holdings = testutil::holdings_for(layout, manifest, rank, ranks);
  }
  int failures = 0;
  for (uint64_t v = first; v <= last; ++v) {
    // FERRY_TEST_SMALL_STEPS (the test's, not ferry's): versions a small step apart, for deltas.
    const testutil::Checkpoint ck =
        testutil::version_checkpoint(manifest, v, std::getenv("FERRY_TEST_SMALL_STEPS") != nullptr);
    // Megatron's fused local tensors, or the boxes of the checkpoint tensors themselves.
    std::map<std::string, TensorView> views;
    std::optional<testutil::MegatronShards> fused;
    std::optional<testutil::LocalShards> shards;
    if (layout == "megatron") {
      const auto source = [&ck](const std::string& name) { return std::span<const uint16_t>(ck.data.at(name)); };
      views = fused.emplace(cfg.llama, source, sharding::MegatronRank{ranks, rank}).views;
    } else {
      views = shards.emplace(manifest, ck, u.holdings).views;
    }
    if (layout == "forget" && rank == 1) views.erase("model.norm.weight");  // a rank that forgets one tensor
    auto report = [&]() -> Result<coordinator::UpdateReport> {
      // "wrongshape": the last trainer rank declares lm_head one row longer than the others do.
      sharding::Manifest declared = manifest;
      if (layout == "wrongshape" && rank == ranks - 1) declared.back().shape[0] += 1;
      FERRY_RETURN_IF_ERROR((*trainer)->start_weight_update(v, declared, u));
      Status sent;
      if (v == die_version || layout == "forget") {  // tensor by tensor, as a user calling send()
        int n = 0;
        for (const auto& [name, view] : views) {
          if (v == die_version && n++ == die_after) _exit(9);
          if (sent = (*trainer)->send(name, view); !sent.ok()) break;
        }
      } else {
        coordinator::MapSource source(views);
        sent = (*trainer)->update_weights(source);
      }
      auto finished = (*trainer)->finish_weight_update();
      if (!sent.ok()) return sent;
      return finished;
    }();
    if (report.ok()) {
      uint64_t delta = 0;
      for (const auto& d : report->delta) delta += d.delta_bytes;
      say(fmt::format("v{} ok bytes={} direct={} allocated={} delta={}", v, report->bytes, report->direct_bytes,
                      report->allocated_staging_bytes, delta));
    } else {
      say(fmt::format("v{} error: {}", v, report.status().to_string()));
      ++failures;
    }
  }
  return failures == 0 ? 0 : 1;
}
