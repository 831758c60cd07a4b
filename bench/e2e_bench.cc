#include "bench/e2e_bench.h"


#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "bench/e2e_links.h"
#include "bench/e2e_probe.h"
#include "bench/e2e_delta.h"
#include "bench/e2e_trainers.h"
#include "core/settings.h"
#include "coordinator/trainer.h"
#include "sharding/cost_model.h"
#include "sharding/llama.h"
#include "sharding/planner.h"
#include "transport/transport.h"

namespace ferry {
namespace {

using e2e::Clock;
using e2e::Child;
using namespace std::chrono_literals;

struct Measured {
  double seconds = 0, pause = 0, plan = 0, transfer = 0, process = 0, resume = 0, other = 0;
  uint64_t bytes = 0;
  uint64_t trainer_rss = 0, rank_rss = 0;  // resident bytes after the updates (ranks: the largest)
};

// Resident bytes of process `pid` (0: this one), from /proc; 0 when unreadable.
uint64_t resident_bytes(pid_t pid) {
  FILE* f = std::fopen(pid > 0 ? fmt::format("/proc/{}/status", pid).c_str() : "/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  uint64_t kb = 0;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "VmRSS: %lu kB", &kb) == 1) break;
  }
  std::fclose(f);
  return kb * 1024;
}

struct Samples {
  std::vector<double> s, pa, pl, tr, pr, re, ot;
};

Status one_update(coordinator::Trainer& trainer, const sharding::Manifest& manifest, uint64_t version, Samples* out,
                  Measured* m) {
  e2e::Weights w(manifest, version);
  coordinator::MapSource source(w.by_name);
  FERRY_RETURN_IF_ERROR(trainer.start_weight_update(version, manifest));
  FERRY_RETURN_IF_ERROR(trainer.update_weights(source));
  FERRY_ASSIGN_OR_RETURN(auto r, trainer.finish_weight_update());
  if (r.moved != 0) return Status::internal(fmt::format("update v{} moved {} registered tensors", version, r.moved));
  if (out == nullptr) return ok_status();
  m->bytes = r.bytes;
  out->s.push_back(r.seconds);
  out->pa.push_back(r.pause_seconds);
  out->pl.push_back(r.plan_seconds);
  out->tr.push_back(r.transfer_seconds);
  out->pr.push_back(r.process_seconds);
  out->re.push_back(r.resume_seconds);
  out->ot.push_back(r.seconds - r.pause_seconds - r.plan_seconds - r.transfer_seconds - r.resume_seconds);
  return ok_status();
}

void print(const E2eOptions& o, const std::string& transport, const sharding::Plan& plan, const Measured& m,
           const sharding::CostReport& c, const e2e::Links& l) {
  const std::string name = transport + "/" + o.scheme + (o.model == "demo" ? "" : "/" + o.model);
  const double ratio = m.seconds > 0 ? c.predicted_seconds / m.seconds : 0;
  if (o.json) {
    fmt::print(
        "{{\"bench\":\"e2e\",\"case\":\"{}\",\"device\":\"cpu\",\"tp\":{},\"updates\":{},\"bytes\":{},\"buckets\":{},"
        "\"seconds\":{:.9f},\"predicted_seconds\":{:.9f},\"ratio\":{:.3f},"
        "\"measured\":{{\"pause\":{:.9f},\"plan\":{:.9f},\"transfer\":{:.9f},\"process\":{:.9f},\"resume\":{:.9f},"
        "\"other\":{:.9f}}},"
        "\"predicted\":{},\"links\":{},\"memory\":{{\"trainer_rss_bytes\":{},\"rank_rss_bytes\":{}}}}}\n",
        name, o.tp, o.updates, m.bytes, plan.buckets.size(), m.seconds, c.predicted_seconds, ratio, m.pause, m.plan,
        m.transfer, m.process, m.resume, m.other, e2e::predicted_json(c), e2e::links_json(l), m.trainer_rss,
        m.rank_rss);
  } else {
    fmt::print("e2e {:<22} tp {} {:>9} B {:>3} buckets  measured {:.6f} s  predicted {:.6f} s  ratio {:.2f}\n", name,
               o.tp, m.bytes, plan.buckets.size(), m.seconds, c.predicted_seconds, ratio);
    fmt::print("    measured:  pause {:.6f} plan {:.6f} transfer {:.6f} resume {:.6f} other {:.6f} (process {:.6f})\n",
               m.pause, m.plan, m.transfer, m.resume, m.other, m.process);
    fmt::print("    predicted: control {:.6f} + pipeline {:.6f} [{}: fill {:.6f} busy {:.6f} drain {:.6f}]"
               " (pack {:.6f}, process {:.6f}, host {:.6f})\n",
               c.control_seconds, c.pipeline_seconds, c.critical, c.fill_seconds, c.busy_seconds, c.drain_seconds,
               c.pack_seconds, c.process_seconds, c.host_seconds);
    fmt::print("    links:     round trip {:.6f} s, {} {:.2f} GB/s + {:.6f} s per bucket,"
               " pack {:.2f} GB/s, process {:.2f} GB/s per rank\n",
               l.round_trip_seconds, transport, l.host_bytes_per_second / 1e9,
               l.seconds_per_bucket, l.pack_bytes_per_second / 1e9, l.process_bytes_per_second / 1e9);
    fmt::print("    memory:    trainer {:.1f} MB, largest rank {:.1f} MB resident after the updates\n",
               static_cast<double>(m.trainer_rss) / 1e6, static_cast<double>(m.rank_rss) / 1e6);
  }
  std::fflush(stdout);
}

Status run_case(const E2eOptions& o, const std::string& transport) {
  setenv("FERRY_TRANSPORT", transport.c_str(), 1);  // the trainer and the ranks (inherited) use only it
  FERRY_ASSIGN_OR_RETURN(const Settings settings, load_settings());
  FERRY_ASSIGN_OR_RETURN(const sharding::LlamaConfig cfg, e2e::model_config(o.model));
  const sharding::Manifest manifest = sharding::llama_manifest(cfg);
  FERRY_ASSIGN_OR_RETURN(const std::vector<sharding::RankSpec> specs, e2e::demo_rank_specs(cfg, o.tp, o.scheme));
  FERRY_RETURN_IF_ERROR(sharding::check_manifest(manifest, specs));  // a scheme the demo model cannot take fails here
  const transport::TransportOptions topts = transport::transport_options(settings);
  const uint64_t bucket_bytes = topts.bucket_bytes;
  const int64_t in_flight = topts.buckets_in_flight;
  const int64_t timeout_ms = settings.timeout_ms;
  // The plan the trainer makes: the same manifest, ranks, one sender holding everything, bucket size.
  FERRY_ASSIGN_OR_RETURN(sharding::Plan plan,
                         sharding::make_plan(manifest, specs, {sharding::SenderInfo{}}, sharding::PlanOptions{bucket_bytes}));

  FERRY_ASSIGN_OR_RETURN(auto trainer, coordinator::Trainer::create({}));
  e2e::ProbeListener listener;
  FERRY_RETURN_IF_ERROR(listener.open());
  std::vector<Child> children;
  FERRY_ASSIGN_OR_RETURN(auto ranks, e2e::start_ranks(listener, children, trainer->coordinator_address(), o.tp, o.scheme,
                                                      transport, timeout_ms, o.model));
  FERRY_RETURN_IF_ERROR(trainer->wait_for_ranks(o.tp, timeout_ms));

  // Rounds of link measurements, each followed by one update; the first round warms up.
  FERRY_ASSIGN_OR_RETURN(auto probe,
                         e2e::LinkProbe::open(ranks, transport, plan, specs, manifest, static_cast<int>(in_flight),
                                              e2e::pack_deltas(settings)));
  Samples samples;
  Measured m;
  for (int v = 1; v <= o.updates + 1; ++v) {
    FERRY_RETURN_IF_ERROR(probe->round(v > 1));
    FERRY_RETURN_IF_ERROR(one_update(*trainer, manifest, static_cast<uint64_t>(v), v > 1 ? &samples : nullptr, &m));
  }
  const e2e::Links links = probe->links();
  probe.reset();
  // The footprint of this transport's update path, while its connections are still open.
  m.trainer_rss = resident_bytes(0);
  for (const auto& c : children) m.rank_rss = std::max(m.rank_rss, resident_bytes(c.pid()));
  for (auto& r : ranks) FERRY_RETURN_IF_ERROR(r.send("done"));
  m.seconds = e2e::median(samples.s);
  m.pause = e2e::median(samples.pa);
  m.plan = e2e::median(samples.pl);
  m.transfer = e2e::median(samples.tr);
  m.process = e2e::median(samples.pr);
  m.resume = e2e::median(samples.re);
  m.other = e2e::median(samples.ot);

  sharding::Topology topo;
  sharding::CostOptions co;
  e2e::cost_inputs(links, &topo, &co);
  FERRY_ASSIGN_OR_RETURN(auto cost, sharding::estimate_cost(plan, specs, 1, topo, co));
  print(o, transport, plan, m, cost, links);

  trainer.reset();  // closes the coordinator: the ranks leave and exit
  for (auto& c : children) {
    if (const int rc = c.reap(static_cast<int>(timeout_ms)); rc != 0) {
      return Status::internal(fmt::format("a bench rank exited with {}", rc));
    }
  }
  return ok_status();
}

}  // namespace

int run_e2e_bench(const E2eOptions& o) {
  if (o.updates < 1 || o.tp < 1) {
    fmt::print(stderr, "bench e2e: --updates and --tp must be positive\n");
    return 1;
  }
  if (o.scheme == "gptq_int4") {
    fmt::print(stderr, "bench e2e: the trainer sends full-precision weights; gptq_int4 takes a pre-quantized checkpoint\n");
    return 1;
  }
  if (!o.bucket_bytes.empty()) setenv("FERRY_BUCKET_BYTES", o.bucket_bytes.c_str(), 1);
  std::vector<std::string> names;
  if (o.transport == "all") {
    for (const char* t : {"tcp", "shm", "ucx"}) {
      for (const auto& f : transport::transport_factories()) {
        if (f.name == t) names.emplace_back(t);
      }
    }
  } else {
    names.push_back(o.transport);
  }
  for (const auto& t : names) {
    Status st;
    for (int n : o.trainers) {
      if (st.ok()) st = run_trainers_case(o, t, n);
    }
    if (o.delta) {
      st = run_delta_case(o, t);
    } else if (o.trainers.empty()) {
      st = run_case(o, t);
    }
    if (!st.ok()) {
      fmt::print(stderr, "bench e2e {}: {}\n", t, st.to_string());
      return 1;
    }
  }
  return 0;
}

}  // namespace ferry
