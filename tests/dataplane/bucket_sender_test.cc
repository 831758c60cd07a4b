// BucketSender refuses what it cannot send correctly, before it connects to anyone; and never
// computes a delta against a copy a failed send changed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "dataplane/bucket.h"
#include "dataplane/bucket_sender.h"
#include "proto/ferry.pb.h"
#include "sharding/llama.h"
#include "sharding/planner.h"
#include "transport/transport.h"

namespace ferry::dataplane {
namespace {

// One layer of a 64-wide Llama with a vocabulary of `vocab`.
sharding::LlamaConfig tiny_llama(int vocab) {
  sharding::LlamaConfig c;
  c.hidden_size = 64;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.intermediate_size = 128;
  c.vocab_size = vocab;
  c.num_layers = 1;
  return c;
}

// Each trainer rank sends the pieces the plan gives its index: an index the plan does not have would
// send nothing and leave the ranks waiting, so it is refused before any connection.
TEST(BucketSender, RefusesASenderIndexOutsideThePlan) {
  const sharding::LlamaConfig c = tiny_llama(100);
  const std::vector<sharding::RankSpec> ranks = {*sharding::llama_rank_spec(c, 0, 1, Scheme::kNone)};
  auto plan = sharding::make_plan(sharding::llama_manifest(c), ranks, std::vector<sharding::SenderInfo>(2),
                                  sharding::PlanOptions{4096});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  BucketSender sender(BucketSenderSettings{}, [] {});
  const Status st = sender.prepare(1, std::make_shared<const sharding::Plan>(std::move(*plan)), ranks, {{}}, {"cpu"},
                                   BucketSender::Identity{0, "", {}, 2, {}});
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
  EXPECT_THAT(st.message(), ::testing::HasSubstr("sender 2 of a plan of 2 senders"));
}

// A tensor's kept copy that the compare brought up to date has no version until the tensor's last
// part is placed: a send that fails in between leaves a copy no delta is computed against, whatever
// version a rank says it holds, so that tensor goes to it dense next time while the tensors whose
// copies still hold that version go as deltas. (Through a coordinator a rank of a failed update
// holds no base at all; this is the sender's own guard.) Real tcp to a listener that records what
// each bucket carries.
TEST(BucketSender, ACopyAFailedSendBroughtUpToDateIsNoDeltaBase) {
  const sharding::LlamaConfig c = tiny_llama(512);
  const sharding::Manifest manifest = sharding::llama_manifest(c);
  const std::vector<sharding::RankSpec> ranks = {*sharding::llama_rank_spec(c, 0, 1, Scheme::kNone)};
  // Buckets of a few KiB: the first tensor (the embedding, 64 KiB) spans several.
  auto made = sharding::make_plan(manifest, ranks, std::vector<sharding::SenderInfo>(1), sharding::PlanOptions{8192});
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  const auto plan = std::make_shared<const sharding::Plan>(std::move(*made));
  const size_t first = static_cast<size_t>(plan->source_order.front());
  std::set<uint32_t> first_params;
  for (int pi : plan->by_source[first])
    first_params.insert(static_cast<uint32_t>(plan->pieces[static_cast<size_t>(pi)].param));

  // What each update's buckets carried: per parameter, whether any piece of it was a delta.
  struct Seen {
    std::mutex mu;
    std::map<uint64_t, std::map<uint32_t, bool>> delta;  // version -> param -> any delta piece
  } seen;
  auto rx = transport::create_transport("tcp", transport::TransportOptions{});
  ASSERT_TRUE(rx.ok()) << rx.status().to_string();
  auto blob = (*rx)->listen(
      [&](const transport::ReceivedBucket& b) {
        wire::BucketHeader h;
        FERRY_RETURN_IF_ERROR(decode_bucket(b.data, b.size, &h));
        std::lock_guard<std::mutex> lock(seen.mu);
        for (const auto& p : h.pieces()) seen.delta[h.version()][p.param()] |= p.encoding() != 0;
        return ok_status();
      },
      [](const Status&) {},
      [](std::string_view) -> Result<transport::Admission> {
        return transport::Admission{1, 0};
      });
  ASSERT_TRUE(blob.ok()) << blob.status().to_string();
  wire::Endpoint e;
  e.set_transport("tcp");
  e.set_blob(*blob);

  // Version v of every tensor: bf16 bits from a seed, a tenth of them changed from one version to
  // the next.
  std::vector<std::vector<uint16_t>> values(manifest.size());
  std::mt19937_64 rng(7);
  for (size_t i = 0; i < manifest.size(); ++i) {
    values[i].resize(static_cast<size_t>(shape_numel(manifest[i].shape)));
    for (auto& x : values[i]) x = static_cast<uint16_t>(rng());
  }
  const auto step = [&] {
    for (auto& t : values) {
      for (auto& x : t) {
        if (rng() % 10 == 0) x ^= 1;
      }
    }
  };
  BucketSenderSettings settings;
  settings.delta = DeltaMode::kOn;
  settings.delta_max_bytes = uint64_t{1} << 30;
  settings.transport = "tcp";
  BucketSender sender(settings, [] {});
  const auto update = [&](uint64_t version, uint64_t base) -> Status {
    FERRY_RETURN_IF_ERROR(
        sender.prepare(version, plan, ranks, {{e}}, {"cpu"}, BucketSender::Identity{0, "a data key", {1}, 0, {base}}));
    Status st;
    for (const int i : plan->source_order) {
      const auto& t = manifest[static_cast<size_t>(i)];
      st = sender.send(static_cast<size_t>(i), t, TensorView(values[static_cast<size_t>(i)].data(), t.dtype, t.shape),
                       Region::whole(t.shape));
      if (!st.ok()) break;
    }
    return sender.finish(st);
  };
  ASSERT_TRUE(update(1, 0).ok());
  step();
  // v2 against v1: the first tensor's copy is brought up to date by its compare, and the post of its
  // first bucket fails.
  int posts = 0;
  set_sealed_bucket_hook_for_testing([&](int, int, uint8_t*, size_t) {
    return ++posts == 1 ? Status::unavailable("the link went down") : ok_status();
  });
  const Status failed = update(2, 1);
  set_sealed_bucket_hook_for_testing({});
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.to_string().find("the link went down"), std::string::npos) << failed.to_string();
  step();
  // v3, to a rank that says it holds v1: the first tensor dense, the others (their copies hold v1)
  // as deltas.
  ASSERT_TRUE(update(3, 1).ok());
  std::lock_guard<std::mutex> lock(seen.mu);
  const auto& v3 = seen.delta[3];
  ASSERT_FALSE(v3.empty()) << "nothing of v3 arrived";
  bool others = false;
  for (const auto& [param, delta] : v3) {
    if (first_params.contains(param)) {
      EXPECT_FALSE(delta) << "parameter #" << param << " went as a delta against a copy a failed send changed";
    } else {
      others = others || delta;
    }
  }
  EXPECT_TRUE(others) << "no other tensor went as a delta: the test proves nothing";
}

}  // namespace
}  // namespace ferry::dataplane
