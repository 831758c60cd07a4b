// The plan owns the buckets: an update over each transport posts exactly the buckets the planner
// cut for the cost model (the host transports here; cuda_ipc and nccl where GPUs are, run by
// bench/gpu/run.sh), and a trainer and a rank whose FERRY_BUCKET_BYTES differ (two processes)
// complete an update, the rank taking buckets far larger than its own setting would size. Over the
// device transports, an update staged while serving lands the same bytes.
#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <xxhash.h>
#if FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "core/buffer.h"
#include "core/device_copy.h"
#include "sharding/planner.h"
#include "tests/common/scoped_env.h"
#include "tests/common/sibling_binary.h"
#include "tests/coordinator/cluster.h"
#include "tests/coordinator/process.h"
#include "tests/coordinator/version_changes.h"
#include "transport/transport.h"

namespace ferry::testutil {
namespace {

std::vector<std::string> host_transports() {
  std::vector<std::string> out;
  for (const auto& f : transport::transport_factories()) {
    if (f.name == "tcp" || f.name == "shm" || f.name == "ucx") out.emplace_back(f.name);
  }
  return out;
}

// The planner's buckets per rank, for the cluster's manifest and ranks at `bucket_bytes`.
std::vector<uint64_t> planned_buckets(const sharding::LlamaConfig& cfg, int tp, Scheme scheme, uint64_t bucket_bytes,
                                      uint64_t* largest) {
  std::vector<sharding::RankSpec> ranks;
  for (int r = 0; r < tp; ++r) ranks.push_back(*sharding::llama_rank_spec(cfg, r, tp, scheme));
  auto plan = sharding::make_plan(sharding::llama_manifest(cfg), ranks, {sharding::SenderInfo{}},
                                  sharding::PlanOptions{bucket_bytes});
  EXPECT_TRUE(plan.ok()) << plan.status().to_string();
  std::vector<uint64_t> per_rank(static_cast<size_t>(tp), 0);
  *largest = 0;
  for (const auto& b : plan->buckets) {
    ++per_rank[static_cast<size_t>(b.dst)];
    *largest = std::max(*largest, b.bytes);
  }
  return per_rank;
}

// Small buckets cut pieces by rows (the embedding and MLP shards span several); whatever the
// transport, the update posts the plan's buckets to each rank, and the ranks' storage is the same.
TEST(BucketPlan, EveryTransportSendsThePlansBuckets) {
  constexpr uint64_t kBucket = 8 << 10;
  // The storage of the same update in 64 MiB buckets (one per rank, no piece cut), over tcp.
  uint64_t reference = 0;
  {
    ScopedEnv transport("FERRY_TRANSPORT", "tcp");
    Cluster c(2);
    ASSERT_TRUE(c.start().ok());
    ASSERT_TRUE(c.update(1, Checkpoint(c.manifest(), 11)).ok());
    reference = c.rank(1).fingerprint();
  }
  ScopedEnv bytes("FERRY_BUCKET_BYTES", "8K");
  uint64_t largest = 0;
  std::vector<uint64_t> planned = planned_buckets(tiny_llama(), 2, Scheme::kFp8PerTensor, kBucket, &largest);
  std::sort(planned.begin(), planned.end());
  ASSERT_GT(planned.front(), 4u);
  for (const std::string& name : host_transports()) {
    SCOPED_TRACE(name);
    ScopedEnv transport("FERRY_TRANSPORT", name);
    Cluster c(2);
    ASSERT_TRUE(c.start().ok());
    Checkpoint ck(c.manifest(), 11);
    auto r = c.update(1, ck);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    std::vector<uint64_t> sent = r->buckets;
    std::sort(sent.begin(), sent.end());
    EXPECT_EQ(sent, planned) << "the buckets sent are not the plan's";
    EXPECT_EQ(c.rank(1).fingerprint(), reference) << "small buckets changed what landed";
  }
}

// The device transports: the trainer's tensors on its GPU, the ranks' storage on theirs, every piece
// sent as bytes (FERRY_DIRECT=off: a colocated rank would otherwise read them in place, and direct
// pieces are never cut). Each posts the plan's buckets, and what lands is what the same update in
// 64 MiB buckets leaves. nccl needs two GPUs (the two ends of a communicator cannot share one) and
// one rank (one process drives one communicator per end; see the nccl note of
// tests/transport/conformance_test.cc).
struct DeviceCase {
  std::string transport;
  int tp;
  int trainer_gpu;
  int rank_gpu;
  Scheme scheme = Scheme::kFp8PerTensor;
};

std::ostream& operator<<(std::ostream& os, const DeviceCase& c) { return os << c.transport; }

int cuda_devices() {
#if FERRY_HAVE_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
#else
  return 0;
#endif
}

// One replica whose storage is on `rank_gpu`, updated by a trainer sending from `trainer_gpu`.
class DeviceReplica {
 public:
  explicit DeviceReplica(const DeviceCase& c) : c_(c) {}

  Status start() {
    FERRY_RETURN_IF_ERROR(set_current_device(Device::cuda(c_.trainer_gpu)));
    FERRY_ASSIGN_OR_RETURN(trainer_, coordinator::Trainer::create({}));
    // Device transports move memory of the device current when they are made: the storage's.
    FERRY_RETURN_IF_ERROR(set_current_device(Device::cuda(c_.rank_gpu)));
    for (int r = 0; r < c_.tp; ++r) {
      FERRY_ASSIGN_OR_RETURN(auto spec, sharding::llama_rank_spec(tiny_llama(), r, c_.tp, c_.scheme));
      FERRY_ASSIGN_OR_RETURN(auto storage, reload::ModelStorage::allocate(spec, Device::cuda(c_.rank_gpu)));
      storage_.push_back(std::make_unique<reload::ModelStorage>(std::move(storage)));
      coordinator::RolloutOptions o;
      o.coordinator = trainer_->coordinator_address();
      o.spec = spec;
      o.storage = storage_.back().get();
      o.pause = [this](const coordinator::PauseRequest&) {
        ++pauses_;
        return ok_status();
      };
      o.resume = [](uint64_t) { return ok_status(); };
      FERRY_ASSIGN_OR_RETURN(auto w, coordinator::RolloutWorker::create(std::move(o)));
      workers_.push_back(std::move(w));
    }
    FERRY_RETURN_IF_ERROR(set_current_device(Device::cuda(c_.trainer_gpu)));
    return trainer_->wait_for_ranks(c_.tp, 10'000);
  }

  // The checkpoint's tensors copied to the trainer's GPU; the update posts them all.
  Result<coordinator::UpdateReport> update(uint64_t version, const Checkpoint& ck, bool stage = false) {
    std::map<std::string, TensorView> views;
    std::vector<Buffer> held;
    const Device gpu = Device::cuda(c_.trainer_gpu);
    for (const auto& [name, v] : ck.views) {
      FERRY_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(std::max<size_t>(v.nbytes(), 1), gpu));
      FERRY_RETURN_IF_ERROR(copy_bytes(b.data(), gpu, v.data(), Device::cpu(), v.nbytes()));
      views.emplace(name, TensorView(b.data(), v.dtype(), v.shape(), gpu));
      held.push_back(std::move(b));
    }
    coordinator::UpdateOptions o;
    o.stage = stage;
    FERRY_RETURN_IF_ERROR(trainer_->start_weight_update(version, sharding::llama_manifest(tiny_llama()), o));
    coordinator::MapSource src(views);
    FERRY_RETURN_IF_ERROR(trainer_->update_weights(src));
    return trainer_->finish_weight_update();
  }
  int pauses() const { return pauses_.load(); }

  // XXH3 over every rank's storage, read back to the host.
  Result<uint64_t> fingerprint() const {
    uint64_t h = 0;
    for (const auto& s : storage_) {
      for (const auto& [name, v] : s->tensors()) {
        std::vector<uint8_t> host(v.nbytes());
        FERRY_RETURN_IF_ERROR(copy_bytes(host.data(), Device::cpu(), v.data(), v.device(), v.nbytes()));
        h = XXH3_64bits_withSeed(host.data(), host.size(), h);
      }
    }
    return h;
  }

 private:
  DeviceCase c_;
  std::atomic<int> pauses_{0};
  std::unique_ptr<coordinator::Trainer> trainer_;
  std::vector<std::unique_ptr<reload::ModelStorage>> storage_;
  std::vector<std::unique_ptr<coordinator::RolloutWorker>> workers_;
};

// Why `c` cannot run here, or "".
std::string device_case_skip(const DeviceCase& c) {
  bool built = false;
  for (const auto& f : transport::transport_factories()) built = built || f.name == c.transport;
  if (!built) return c.transport + " is not built here (needs CUDA" + (c.transport == "nccl" ? " and NCCL)" : ")");
  const int need = std::max(c.trainer_gpu, c.rank_gpu) + 1;
  const int have = cuda_devices();
  if (have < need) {
    return fmt::format(
        "{}: the case needs {} CUDA device(s), this machine has {} (bench/gpu/run.sh runs it on a GPU "
        "machine)",
        c.transport, need, have);
  }
  return "";
}

class BucketPlanOnDevice : public ::testing::TestWithParam<DeviceCase> {};

TEST_P(BucketPlanOnDevice, SendsThePlansBuckets) {
  const DeviceCase& c = GetParam();
  if (const std::string why = device_case_skip(c); !why.empty()) GTEST_SKIP() << why;
  ScopedEnv transport("FERRY_TRANSPORT", c.transport);
  ScopedEnv direct("FERRY_DIRECT", "off");
  Checkpoint ck(sharding::llama_manifest(tiny_llama()), 11);
  uint64_t reference = 0;
  {
    DeviceReplica whole(c);
    Status st = whole.start();
    ASSERT_TRUE(st.ok()) << st.to_string();
    auto r = whole.update(1, ck);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    auto f = whole.fingerprint();
    ASSERT_TRUE(f.ok()) << f.status().to_string();
    reference = *f;
  }
  constexpr uint64_t kBucket = 8 << 10;
  ScopedEnv bytes("FERRY_BUCKET_BYTES", "8K");
  uint64_t largest = 0;
  std::vector<uint64_t> planned = planned_buckets(tiny_llama(), c.tp, Scheme::kFp8PerTensor, kBucket, &largest);
  std::sort(planned.begin(), planned.end());
  ASSERT_GT(planned.front(), 4u);
  DeviceReplica small(c);
  Status st = small.start();
  ASSERT_TRUE(st.ok()) << st.to_string();
  auto r = small.update(1, ck);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  std::vector<uint64_t> sent = r->buckets;
  std::sort(sent.begin(), sent.end());
  EXPECT_EQ(sent, planned) << "the buckets sent are not the plan's";
  auto f = small.fingerprint();
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(*f, reference) << "small buckets changed what landed";
}

// Staged while serving over a device transport: the ranks take the whole update into staging (device
// buckets, as the transport delivers them), pause once each only after every byte arrived, and
// storage then holds exactly what a pause-first update of the same version leaves.
TEST_P(BucketPlanOnDevice, AStagedUpdateLandsWhatAPauseFirstOneDoes) {
  const DeviceCase& c = GetParam();
  if (const std::string why = device_case_skip(c); !why.empty()) GTEST_SKIP() << why;
  ScopedEnv transport("FERRY_TRANSPORT", c.transport);
  ScopedEnv direct("FERRY_DIRECT", "off");
  const Checkpoint v1(sharding::llama_manifest(tiny_llama()), 21), v2(sharding::llama_manifest(tiny_llama()), 22);
  uint64_t reference = 0;
  {
    DeviceReplica first(c);
    ASSERT_TRUE(first.start().ok());
    ASSERT_TRUE(first.update(1, v1).ok());
    auto r = first.update(2, v2);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_FALSE(r->staged);
    auto f = first.fingerprint();
    ASSERT_TRUE(f.ok());
    reference = *f;
  }
  DeviceReplica staged(c);
  ASSERT_TRUE(staged.start().ok());
  ASSERT_TRUE(staged.update(1, v1).ok());
  auto before = staged.fingerprint();
  ASSERT_TRUE(before.ok());
  EXPECT_NE(*before, reference) << "the two versions land different bytes";
  const int pauses = staged.pauses();
  auto r = staged.update(2, v2, /*stage=*/true);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE(r->staged) << "the update fell back to pause first";
  EXPECT_EQ(staged.pauses(), pauses + c.tp) << "each rank pauses once, to apply";
  EXPECT_LT(r->pause_window_seconds, r->seconds);
  auto f = staged.fingerprint();
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(*f, reference) << "a staged update landed other bytes than a pause-first one";
}

INSTANTIATE_TEST_SUITE_P(DeviceTransports, BucketPlanOnDevice,
                         ::testing::Values(DeviceCase{"cuda_ipc", 2, 0, 0}, DeviceCase{"nccl", 1, 0, 1}),
                         [](const ::testing::TestParamInfo<DeviceCase>& i) { return i.param.transport; });

// Deltas compared and applied on the GPU, over tcp and the device transports (whose device buckets
// carry the encodings): the trainer keeps its copies on its device and
// compares there (FERRY_DELTA_COPY=device), the ranks keep their shadows on theirs and a kernel
// writes each delta's changes there (FERRY_DELTA_SHADOW=device). Versions with no change, 0.1%,
// 3% with amaxes that move, and every element changed each land exactly what a dense update of the
// same version leaves on a second replica (FERRY_DELTA=off), in every online scheme; the changes
// travel as deltas, the ranks' columns of row-parallel weights among them (packed on the device
// before the compare), and each end reports its device copies. Two schemes run with FERRY_DELTA_ZSTD
// (XOR values, in zstd frames where a frame saves an eighth).
class DeltaOnDevice : public ::testing::TestWithParam<DeviceCase> {};

TEST_P(DeltaOnDevice, ComparedAndAppliedOnTheGpuTheyLandWhatDenseUpdatesDo) {
  ScopedEnv transport("FERRY_TRANSPORT", GetParam().transport);
  ScopedEnv direct("FERRY_DIRECT", "off");
  // (int4_group groups 128 input columns: the tiny model's row-parallel shards at TP 2 have 64.)
  for (const Scheme scheme :
       {Scheme::kFp8PerChannel, Scheme::kFp8PerTensor, Scheme::kFp8Block, Scheme::kInt8PerChannel, Scheme::kNone}) {
    DeviceCase c = GetParam();
    c.scheme = scheme;
    if (const std::string why = device_case_skip(c); !why.empty()) GTEST_SKIP() << why;
    SCOPED_TRACE(scheme_name(scheme));
    DeviceReplica dense(c), delta(c);
    {
      ScopedEnv off("FERRY_DELTA", "off");
      const Status st = dense.start();
      ASSERT_TRUE(st.ok()) << st.to_string();
    }
    {
      ScopedEnv on("FERRY_DELTA", "on");  // this test's ranks share the trainer's host
      ScopedEnv copy("FERRY_DELTA_COPY", "device");
      ScopedEnv shadow("FERRY_DELTA_SHADOW", "device");
      // XOR values, compressed on the host where that pays, for two of the schemes.
      ScopedEnv zstd("FERRY_DELTA_ZSTD", scheme == Scheme::kFp8Block || scheme == Scheme::kNone ? "1" : "0");
      const Status st = delta.start();
      ASSERT_TRUE(st.ok()) << st.to_string();
    }
    Checkpoint ck(sharding::llama_manifest(tiny_llama()), 41);
    std::mt19937_64 rng(43);
    for (uint64_t v = 1; v <= 5; ++v) {
      const char* what[] = {
          "", "first: dense", "nothing changed", "0.1% changed", "3% changed, amax moved", "every element changed"};
      SCOPED_TRACE(what[v]);
      if (v == 3) nudge(ck, 0.001, rng);
      if (v == 4) {
        nudge(ck, 0.03, rng);
        move_amax(ck, rng);
      }
      if (v == 5) renew(ck, rng);
      auto want = dense.update(v, ck);
      ASSERT_TRUE(want.ok()) << want.status().to_string();
      auto got = delta.update(v, ck);
      ASSERT_TRUE(got.ok()) << got.status().to_string();
      auto a = dense.fingerprint(), b = delta.fingerprint();
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_EQ(*b, *a) << "a device delta landed other bytes than a dense update";
      ASSERT_EQ(got->delta.size(), 2u);
      for (const coordinator::RankDelta& d : got->delta) {
        if (v == 1) {
          EXPECT_EQ(d.delta_bytes, 0u);
        } else if (v < 5) {
          EXPECT_GT(d.delta_bytes, 0u) << "compared on the device, sent as a delta";
          if (v < 4) {
            EXPECT_EQ(d.dense_bytes, 0u) << "every piece is smaller as a delta";
          }
          if (v == 2) {
            EXPECT_EQ(d.changed, 0u);
          }
        } else {
          EXPECT_GT(d.changed_fraction(), 0.99);
          EXPECT_EQ(d.delta_bytes, 0u) << "a change of everything goes dense";
        }
      }
      EXPECT_GT(got->delta_copy_bytes, 0u);
      EXPECT_GT(got->shadow_bytes, 0u);
    }
  }
}

// Under auto, ranks on the trainer's host get dense bytes over a device transport too, even with
// the compare on the GPU: the trainer keeps no copy and the ranks no shadow.
TEST_P(DeltaOnDevice, AutoSendsDenseBytesToRanksOnThisHost) {
  DeviceCase c = GetParam();
  if (c.transport == "tcp") GTEST_SKIP() << "tcp: DeltaAuto (delta_update_test.cc) covers it";
  if (const std::string why = device_case_skip(c); !why.empty()) GTEST_SKIP() << why;
  ScopedEnv transport("FERRY_TRANSPORT", c.transport);
  ScopedEnv direct("FERRY_DIRECT", "off");
  ScopedEnv copy("FERRY_DELTA_COPY", "device");
  ScopedEnv shadow("FERRY_DELTA_SHADOW", "device");
  DeviceReplica replica(c);
  ASSERT_TRUE(replica.start().ok());
  Checkpoint ck(sharding::llama_manifest(tiny_llama()), 51);
  std::mt19937_64 rng(53);
  for (uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) nudge(ck, 0.03, rng);
    auto r = replica.update(v, ck);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    for (const coordinator::RankDelta& d : r->delta) EXPECT_EQ(d.delta_bytes, 0u) << "update v" << v;
    EXPECT_EQ(r->delta_copy_bytes, 0u);
    EXPECT_EQ(r->shadow_bytes, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, DeltaOnDevice,
                         ::testing::Values(DeviceCase{"tcp", 2, 0, 0}, DeviceCase{"cuda_ipc", 2, 0, 0},
                                           DeviceCase{"nccl", 1, 0, 1}),
                         [](const ::testing::TestParamInfo<DeviceCase>& i) { return i.param.transport; });

// The rank's transports are made with FERRY_BUCKET_BYTES=4K, which alone would let them take
// buckets of 64 MiB and a little; the trainer cuts 96 MiB ones from a model whose embedding alone
// is larger than that. Each connection announces the largest bucket it will send, so the update
// completes over every transport.
TEST(BucketPlan, ATrainerAndARankWithDifferentBucketSizesCompleteAnUpdate) {
  ScopedEnv timeout("FERRY_TIMEOUT_MS", "20000");
  uint64_t largest = 0;
  planned_buckets(wide_llama(), 1, Scheme::kFp8PerTensor, uint64_t{96} << 20, &largest);
  ASSERT_GT(largest, (uint64_t{64} << 20) + 4 * 4096) << "the test needs a bucket beyond the rank's own limit";
  Checkpoint ck(sharding::llama_manifest(wide_llama()), 5);
  for (const std::string& name : host_transports()) {
    SCOPED_TRACE(name);
    ScopedEnv transport("FERRY_TRANSPORT", name);
    std::unique_ptr<coordinator::Trainer> trainer;
    {
      ScopedEnv big("FERRY_BUCKET_BYTES", "96M");
      auto t = coordinator::Trainer::create({});
      ASSERT_TRUE(t.ok()) << t.status().to_string();
      trainer = std::move(*t);
    }
    std::unique_ptr<Child> rank;
    {
      ScopedEnv small("FERRY_BUCKET_BYTES", "4K");
      rank = std::make_unique<Child>(std::vector<std::string>{sibling_binary(FERRY_FAULT_PEER), "rollout",
                                                              trainer->coordinator_address(), "0", "1", "wide"});
    }
    ASSERT_TRUE(trainer->wait_for_ranks(1, 30'000).ok());
    ASSERT_TRUE(trainer->start_weight_update(1, sharding::llama_manifest(wide_llama())).ok());
    coordinator::MapSource src(ck.views);
    Status sent = trainer->update_weights(src);
    auto r = trainer->finish_weight_update();
    ASSERT_TRUE(sent.ok()) << sent.to_string();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->ranks, 1);
    trainer.reset();
    EXPECT_EQ(rank->wait_exit(30'000), 0) << "the rank did not end cleanly";
  }
}

}  // namespace
}  // namespace ferry::testutil
