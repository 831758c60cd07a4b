// Delta updates end to end (FERRY_DELTA): a trainer and a TP replica over real tcp sockets, a
// sequence of updates whose changes go from none to every element, with changes that move a
// per-tensor, per-row and per-block amax, and a rank that restarts between two deltas. After every
// update every storage byte of every rank must equal the reference of a dense update of that
// version, built without ferry's sharding or kernels (scheme_bytes.h).
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "dataplane/bucket.h"
#include "dataplane/bucket_sender.h"
#include "dataplane/delta.h"
#include "tests/common/scoped_env.h"
#include "tests/coordinator/scheme_bytes.h"
#include "tests/coordinator/version_changes.h"
#include "transport/transport.h"

namespace ferry::testutil {
namespace {

struct Case {
  Scheme scheme;
  const char* mode;  // FERRY_DELTA
  const char* zstd = "0";  // FERRY_DELTA_ZSTD
};

void PrintTo(const Case& c, std::ostream* os) { *os << scheme_name(c.scheme) << " " << c.mode << " zstd " << c.zstd; }

class DeltaUpdate : public ::testing::TestWithParam<Case> {};

TEST_P(DeltaUpdate, EveryUpdateMatchesADenseOneByteForByte) {
  const Case tc = GetParam();
  const bool always = std::string(tc.mode) == "always";
  ScopedEnv delta("FERRY_DELTA", tc.mode);
  ScopedEnv zstd("FERRY_DELTA_ZSTD", tc.zstd);
  ScopedEnv transport("FERRY_TRANSPORT", "tcp");
  const Config cfg = kv_above_tp();
  const std::string name(scheme_name(tc.scheme));
  const Layout layout = make_layout(cfg, name);
  Cluster c(cfg.tp, name, cfg.llama);
  Status st = c.start();
  ASSERT_TRUE(st.ok()) << st.to_string();
  scribble(c);
  Checkpoint ck = make_checkpoint(c.manifest(), 100);
  std::mt19937_64 rng(5);

  uint64_t full = 0;  // one dense update's bytes on the wire
  // What each rank got: dense (no base to compute against), or deltas.
  enum class Got { kDense, kDelta };
  const auto update = [&](uint64_t v, const std::string& what, const std::vector<Got>& got) -> coordinator::UpdateReport {
    SCOPED_TRACE(fmt::format("{} FERRY_DELTA={} v{}: {}", name, tc.mode, v, what));
    auto r = c.update(v, ck);
    if (!r.ok()) {
      ADD_FAILURE() << r.status().to_string();
      return {};
    }
    expect_storage(c, expected_storage(cfg, layout, tc.scheme, ck), what);
    EXPECT_EQ(r->delta.size(), 2u);
    for (size_t i = 0; i < got.size() && i < r->delta.size(); ++i) {
      const coordinator::RankDelta& d = r->delta[i];
      if (got[i] == Got::kDense) {
        EXPECT_EQ(d.delta_bytes, 0u) << "rank " << i;
        EXPECT_EQ(d.elements, 0u) << "rank " << i;
        EXPECT_GT(d.dense_bytes, 0u) << "rank " << i;
      } else {
        EXPECT_GT(d.delta_bytes, 0u) << "rank " << i;
        EXPECT_GT(d.elements, 0u) << "rank " << i;
      }
    }
    if (v == 1) full = r->wire_bytes();
    return *r;
  };
  const std::vector<Got> dense(2, Got::kDense), deltas(2, Got::kDelta);

  update(1, "first update: dense", dense);
  auto r = update(2, "nothing changed", deltas);
  for (const auto& d : r.delta) EXPECT_EQ(d.changed, 0u);
  EXPECT_LT(r.wire_bytes() * 50, full) << "an unchanged version costs next to nothing";

  nudge(ck, 0.001, rng);
  r = update(3, "0.1% changed", deltas);
  for (const auto& d : r.delta) {
    EXPECT_GT(d.changed_fraction(), 0.0);
    EXPECT_LT(d.changed_fraction(), 0.01);
    EXPECT_EQ(d.dense_bytes, 0u) << "every piece is smaller as a delta";
  }
  EXPECT_LT(r.wire_bytes() * 10, full);

  nudge(ck, 0.03, rng);
  move_amax(ck, rng);
  r = update(4, "3% changed, amax moved", deltas);
  for (const auto& d : r.delta) {
    // Plain, a delta carries each changed bf16 value whole; as XORs in zstd frames, less than that.
    if (std::string(tc.zstd) != "0") {
      EXPECT_LT(d.delta_bytes, d.changed * 2) << "zstd frames";
    } else {
      EXPECT_GE(d.delta_bytes, d.changed * 2);
    }
  }

  renew(ck, rng);
  // On compares every piece and sends its dense bytes; always sends the (larger) deltas.
  r = update(5, "every element changed", always ? deltas : std::vector<Got>{});
  for (const auto& d : r.delta) {
    EXPECT_GT(d.changed_fraction(), 0.99);
    if (always) {
      EXPECT_GT(d.delta_bytes, d.delta_dense_bytes) << "a delta of everything is larger than the bytes";
    } else {
      EXPECT_EQ(d.delta_bytes, 0u) << "on sends what is smaller: the dense bytes";
    }
  }

  // Rank 1 restarts: it holds no version, so it gets dense bytes while rank 0 gets deltas.
  st = c.restart_rank(1);
  ASSERT_TRUE(st.ok()) << st.to_string();
  nudge(ck, 0.001, rng);
  update(6, "rank 1 restarted", {Got::kDelta, Got::kDense});
  nudge(ck, 0.03, rng);
  update(7, "both hold v6", deltas);
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (Scheme s : kAllSchemes) {
    if (s == Scheme::kGptqInt4) continue;  // quantized reload, not an online scheme
    out.push_back({s, "on"});              // deltas to every rank: this test's ranks are on the trainer's host
    out.push_back({s, "always"});
    out.push_back({s, "on", "3"});  // XORs in zstd frames
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllOnlineSchemes, DeltaUpdate, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string s(scheme_name(info.param.scheme));
                           std::erase(s, '_');
                           return s + "_" + info.param.mode +
                                  (std::string(info.param.zstd) == "0" ? "" : std::string("_zstd"));
                         });

// FERRY_DELTA=off: every update carries every byte, the trainer keeps no copy and the ranks no
// shadow.
TEST(DeltaUpdateOff, EveryUpdateIsDense) {
  ScopedEnv delta("FERRY_DELTA", "off");
  const Config cfg = kv_above_tp();
  Cluster c(cfg.tp, "fp8_block", cfg.llama);
  ASSERT_TRUE(c.start().ok());
  Checkpoint ck = make_checkpoint(c.manifest(), 1);
  for (uint64_t v = 1; v <= 2; ++v) {
    auto r = c.update(v, ck);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->delta_copy_bytes, 0u);
    EXPECT_EQ(r->shadow_bytes, 0u);
    for (const auto& d : r->delta) EXPECT_EQ(d.delta_bytes, 0u);
  }
}

}  // namespace
}  // namespace ferry::testutil

namespace ferry::testutil {
namespace {

// Every host transport carries deltas, staged or not: a dense first update, then 0.1% and 3%
// changes, storage checked against the reference after each.
class DeltaTransport : public ::testing::TestWithParam<std::string> {};

TEST_P(DeltaTransport, DeltasAndStagingMatchTheReference) {
  ScopedEnv transport("FERRY_TRANSPORT", GetParam());
  ScopedEnv delta("FERRY_DELTA", "on");
  const Config cfg = kv_below_tp();
  const Layout layout = make_layout(cfg, "fp8_per_tensor");
  Cluster c(cfg.tp, "fp8_per_tensor", cfg.llama);
  Status st = c.start();
  ASSERT_TRUE(st.ok()) << st.to_string();
  Checkpoint ck = make_checkpoint(c.manifest(), 9);
  std::mt19937_64 rng(11);
  for (uint64_t v = 1; v <= 4; ++v) {
    if (v > 1) nudge(ck, v == 3 ? 0.03 : 0.001, rng);
    coordinator::UpdateOptions o;
    o.stage = v >= 3;
    ASSERT_TRUE(c.trainer().start_weight_update(v, c.manifest(), o).ok());
    coordinator::MapSource src(ck.views);
    ASSERT_TRUE(c.trainer().update_weights(src).ok());
    auto r = c.trainer().finish_weight_update();
    ASSERT_TRUE(r.ok()) << GetParam() << " v" << v << ": " << r.status().to_string();
    EXPECT_EQ(r->staged, v >= 3);
    uint64_t delta = 0;
    for (const auto& d : r->delta) delta += d.delta_bytes;
    if (v == 1) {
      EXPECT_EQ(delta, 0u);
    } else {
      EXPECT_GT(delta, 0u) << GetParam() << " v" << v;
    }
    expect_storage(c, expected_storage(cfg, layout, Scheme::kFp8PerTensor, ck), fmt::format("{} v{}", GetParam(), v));
  }
}

// Identical replicas take the same parts against the same copy: the trainer compares each part
// once and sends its encoding to every rank that takes it (UpdateReport::compared_bytes counts the
// compares, each rank's `elements` what it took). Three replicas cost the compares of one, take
// three times its elements, and every replica lands the reference's bytes.
TEST(DeltaReplicas, EachPartIsComparedOnceForEveryReplica) {
  ScopedEnv transport("FERRY_TRANSPORT", "tcp");
  ScopedEnv delta("FERRY_DELTA", "on");
  const Config cfg = kv_below_tp();
  const Layout layout = make_layout(cfg, "fp8_per_channel");
  struct Counts {
    uint64_t compared = 0, taken = 0, deltas = 0;
  };
  auto run = [&](int replicas) {
    std::vector<Counts> out;
    Cluster c(cfg.tp, "fp8_per_channel", cfg.llama, replicas);
    EXPECT_TRUE(c.start().ok());
    Checkpoint ck = make_checkpoint(c.manifest(), 13);
    std::mt19937_64 rng(17);
    for (uint64_t v = 1; v <= 3; ++v) {
      if (v > 1) nudge(ck, 0.02, rng);
      auto r = c.update(v, ck);
      EXPECT_TRUE(r.ok()) << replicas << " replicas, v" << v << ": " << r.status().to_string();
      if (!r.ok()) return out;
      Counts n{r->compared_bytes, 0, 0};
      for (const auto& d : r->delta) {
        n.taken += d.elements;
        n.deltas += d.delta_bytes;
      }
      out.push_back(n);
      const auto want = expected_storage(cfg, layout, Scheme::kFp8PerChannel, ck);
      for (int replica = 0; replica < replicas; ++replica) {
        expect_storage(c, want, fmt::format("{} replicas, v{}, replica {}", replicas, v, replica), replica);
      }
    }
    return out;
  };
  const std::vector<Counts> one = run(1), three = run(3);
  ASSERT_EQ(one.size(), 3u);
  ASSERT_EQ(three.size(), 3u);
  EXPECT_EQ(one[0].compared, 0u) << "the first update has nothing to compare against";
  for (size_t v = 1; v < 3; ++v) {
    EXPECT_GT(one[v].deltas, 0u);
    EXPECT_GT(one[v].compared, 0u);
    EXPECT_EQ(three[v].compared, one[v].compared) << "v" << v + 1 << ": parts compared again for other replicas";
    EXPECT_EQ(three[v].taken, 3 * one[v].taken) << "v" << v + 1;
    EXPECT_EQ(three[v].deltas, 3 * one[v].deltas) << "v" << v + 1;
  }
}

// A runs piece says where its values begin (PieceHeader.values_at), so that a rank can hand a
// device payload's encoding to its GPU without reading the pairs on the host: in every bucket sent,
// every runs piece without flags gives the place the codec's own parse finds, and no other piece
// gives one.
TEST(DeltaWire, RunsPiecesSayWhereTheirValuesBegin) {
  ScopedEnv transport("FERRY_TRANSPORT", "tcp");
  ScopedEnv delta("FERRY_DELTA", "on");
  const Config cfg = kv_below_tp();
  Cluster c(cfg.tp, "fp8_per_channel", cfg.llama);
  ASSERT_TRUE(c.start().ok());
  Checkpoint ck = make_checkpoint(c.manifest(), 13);
  std::mt19937_64 rng(17);
  std::mutex mu;
  size_t runs_pieces = 0;
  std::vector<std::string> wrong;
  dataplane::set_sealed_bucket_hook_for_testing([&](int, int, uint8_t* data, size_t size) {
    wire::BucketHeader h;
    if (!dataplane::decode_bucket(data, size, &h).ok()) return ok_status();
    const uint8_t* payload = data;  // pieces lie from the bucket's start
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& p : h.pieces()) {
      if (p.encoding() != static_cast<uint32_t>(dataplane::DeltaEncoding::kRuns)) {
        if (p.values_at() != 0)
          wrong.push_back(
              fmt::format("piece of param {} encoding {} says values at {}", p.param(), p.encoding(), p.values_at()));
        continue;
      }
      auto dt = parse_dtype(p.dtype());
      if (!dt.ok()) continue;
      const size_t elem = std::max<size_t>(dtype_bits(*dt) / 8, 1);
      dataplane::DeltaRuns runs;
      const uint8_t* enc = payload + p.offset();
      if (!dataplane::delta_runs(p.encoding(), enc, p.encoded_bytes(), p.bytes() / elem, elem, runs).ok()) continue;
      ++runs_pieces;
      if (p.values_at() != static_cast<uint64_t>(runs.values - enc)) {
        wrong.push_back(fmt::format("param {}: values at {}, said {}", p.param(), runs.values - enc, p.values_at()));
      }
    }
    return ok_status();
  });
  for (uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) nudge(ck, v == 2 ? 0.001 : 0.03, rng);
    auto r = c.update(v, ck);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
  }
  dataplane::set_sealed_bucket_hook_for_testing({});
  EXPECT_GT(runs_pieces, 0u) << "no runs piece was sent: the test proves nothing";
  EXPECT_TRUE(wrong.empty()) << wrong.front();
}

// Rolling updates with deltas: two replicas take versions at different times, so each rank's base
// is its own. Every replica must hold exactly the version it was last given, whatever the trainer
// sent to the other one in between (a delta against the wrong base would leave a mix of versions).
TEST(DeltaRolling, EachReplicaGetsTheChangesFromItsOwnVersion) {
  ScopedEnv delta("FERRY_DELTA", "on");
  const Config cfg = kv_below_tp();
  const Layout layout = make_layout(cfg, "fp8_per_tensor");
  Cluster c(cfg.tp, "fp8_per_tensor", cfg.llama, /*replicas=*/2);
  Status st = c.start();
  ASSERT_TRUE(st.ok()) << st.to_string();
  std::mt19937_64 rng(21);
  Checkpoint ck = make_checkpoint(c.manifest(), 5);
  std::map<uint64_t, std::vector<RankBytes>> want;  // each version's storage, from the reference
  // (version, replicas it goes to (empty: every replica), whether deltas travel). v3 goes dense to
  // replica 1, which holds v1 while the trainer's copy is v2; at v4 replica 1 holds v3, the copy.
  struct Step {
    uint64_t v;
    std::vector<int> replicas;
    bool deltas;
  };
  const std::vector<Step> steps = {{1, {}, false}, {2, {0}, true}, {3, {1}, false}, {4, {}, true}, {5, {0}, true}};
  uint64_t held[2] = {0, 0};
  for (const auto& [v, replicas, deltas] : steps) {
    if (v > 1) nudge(ck, 0.002, rng);
    want[v] = expected_storage(cfg, layout, Scheme::kFp8PerTensor, ck);
    coordinator::UpdateOptions o;
    o.replicas = replicas;
    ASSERT_TRUE(c.trainer().start_weight_update(v, c.manifest(), o).ok());
    coordinator::MapSource src(ck.views);
    ASSERT_TRUE(c.trainer().update_weights(src).ok());
    auto r = c.trainer().finish_weight_update();
    ASSERT_TRUE(r.ok()) << "v" << v << ": " << r.status().to_string();
    uint64_t delta = 0;
    for (const auto& d : r->delta) delta += d.delta_bytes;
    EXPECT_EQ(delta > 0, deltas) << "v" << v << ": " << delta << " delta bytes";
    for (int rep = 0; rep < 2; ++rep) {
      if (replicas.empty() || replicas[0] == rep) held[rep] = v;
      expect_storage(c, want[held[rep]], fmt::format("after v{}: replica {} at v{}", v, rep, held[rep]), rep);
      EXPECT_EQ(c.rank(rep * cfg.tp).worker->weight_version(), held[rep]);
    }
  }
}

std::vector<std::string> host_transports() {
  std::vector<std::string> out;
  for (const auto& f : transport::transport_factories()) {
    if (f.name == "tcp" || f.name == "shm" || f.name == "ucx") out.emplace_back(f.name);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(HostTransports, DeltaTransport, ::testing::ValuesIn(host_transports()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// FERRY_DELTA=auto, the default: every rank is on the trainer's host (loopback tcp, shm, a ucx
// lane on this host), where comparing costs about what moving the bytes does. Every update goes
// dense, the trainer keeps no copy and the ranks no shadow, while FERRY_DELTA=on over the same link
// sends deltas.
class DeltaAuto : public ::testing::TestWithParam<std::string> {};

TEST_P(DeltaAuto, RanksOnThisHostGetDenseBytesAndNoCopyIsKept) {
  ScopedEnv transport("FERRY_TRANSPORT", GetParam());
  for (const char* mode : {"auto", "on"}) {
    SCOPED_TRACE(mode);
    ScopedEnv delta("FERRY_DELTA", mode);
    const bool on = std::string(mode) == "on";
    const Config cfg = kv_below_tp();
    const Layout layout = make_layout(cfg, "fp8_per_channel");
    Cluster c(cfg.tp, "fp8_per_channel", cfg.llama);
    Status st = c.start();
    ASSERT_TRUE(st.ok()) << st.to_string();
    Checkpoint ck = make_checkpoint(c.manifest(), 17);
    std::mt19937_64 rng(3);
    for (uint64_t v = 1; v <= 3; ++v) {
      if (v > 1) nudge(ck, 0.001, rng);
      auto r = c.update(v, ck);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      uint64_t delta = 0, dense = 0;
      for (const auto& d : r->delta) delta += d.delta_bytes, dense += d.dense_bytes;
      if (on) {
        EXPECT_GT(r->delta_copy_bytes, 0u) << "v" << v;
        EXPECT_GT(r->shadow_bytes, 0u) << "v" << v;
        if (v > 1) {
          EXPECT_GT(delta, 0u) << "v" << v;
        }
      } else {
        EXPECT_EQ(r->delta_copy_bytes, 0u) << "v" << v << ": no copy kept for ranks on this host";
        EXPECT_EQ(r->shadow_bytes, 0u) << "v" << v << ": the ranks keep no shadow for a sender that sends none";
        EXPECT_EQ(delta, 0u) << "v" << v;
        EXPECT_GT(dense, 0u) << "v" << v;
      }
      expect_storage(c, expected_storage(cfg, layout, Scheme::kFp8PerChannel, ck), fmt::format("{} v{}", mode, v));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(HostTransports, DeltaAuto, ::testing::ValuesIn(host_transports()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace ferry::testutil

namespace ferry::testutil {
namespace {

// FERRY_ROLLBACK=host with deltas: an update that fails after deltas landed on some layers is
// rolled back to the version before it, byte for byte; the ranks' shadows took those deltas, so
// the next update goes to them dense (and lands exactly).
TEST(DeltaRollback, AnAbortedDeltaUpdateRestoresThePreviousVersionAndTheNextGoesDense) {
  ScopedEnv transport("FERRY_TRANSPORT", "tcp");
  ScopedEnv delta("FERRY_DELTA", "on");
  ScopedEnv rollback("FERRY_ROLLBACK", "host");
  const Config cfg = kv_above_tp();
  const Layout layout = make_layout(cfg, "int4_group");
  Cluster c(cfg.tp, "int4_group", cfg.llama);
  ASSERT_TRUE(c.start().ok());
  Checkpoint ck = make_checkpoint(c.manifest(), 3);
  std::mt19937_64 rng(4);
  ASSERT_TRUE(c.update(1, ck).ok());
  nudge(ck, 0.01, rng);
  auto r = c.update(2, ck);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const auto v2 = expected_storage(cfg, layout, Scheme::kInt4Group, ck);
  expect_storage(c, v2, "v2");

  // v3: every tensor but the last goes out as deltas (whole layers land), then the trainer aborts.
  nudge(ck, 0.01, rng);
  ASSERT_TRUE(c.trainer().start_weight_update(3, c.manifest()).ok());
  const auto m = c.manifest();
  for (size_t i = 0; i + 1 < m.size(); ++i) ASSERT_TRUE(c.trainer().send(m[i].name, ck.views.at(m[i].name)).ok());
  ASSERT_TRUE(c.trainer().abort_weight_update("the step diverged").ok());
  // The ranks restore v2 and resume on it.
  for (int i = 0; i < c.tp(); ++i) {
    ASSERT_TRUE(c.rank(i).worker->wait_serving(10'000).ok());
    EXPECT_EQ(c.rank(i).worker->weight_version(), 2u);
  }
  expect_storage(c, v2, "v2 after v3 was rolled back");

  nudge(ck, 0.01, rng);
  r = c.update(4, ck);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  for (const auto& d : r->delta) EXPECT_EQ(d.delta_bytes, 0u) << "a rolled-back rank gets dense bytes";
  expect_storage(c, expected_storage(cfg, layout, Scheme::kInt4Group, ck), "v4");
  nudge(ck, 0.01, rng);
  r = c.update(5, ck);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  for (const auto& d : r->delta) EXPECT_GT(d.delta_bytes, 0u) << "and deltas again after";
  expect_storage(c, expected_storage(cfg, layout, Scheme::kInt4Group, ck), "v5");
}

}  // namespace
}  // namespace ferry::testutil
