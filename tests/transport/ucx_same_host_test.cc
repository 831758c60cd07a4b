// ucx between two processes of one host: the endpoints go over UCX's shared-memory transports and
// cma, not its tcp (ucx_transport.cc says how). Part of the conformance suite's binary; built only
// with ucx.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <optional>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "tests/transport/conformance.h"
#include "transport/ucx/ucx_stream.h"
#include "transport/ucx/ucx_transport.h"

namespace ferry::transport::testing {
namespace {

TEST(UcxSameHost, EndpointUsesSharedMemoryAndCma) {
  if (std::getenv("UCX_TLS") != nullptr) GTEST_SKIP() << "UCX_TLS is set: the transports are the user's choice";
  ScopedEnv tls("UCX_TLS", "sm,self,tcp");
  auto rx = create_transport("ucx");
  ASSERT_TRUE(rx.ok()) << rx.status().to_string();
  auto tx = create_transport("ucx");
  ASSERT_TRUE(tx.ok()) << tx.status().to_string();
  auto blob = (*rx)->listen([](const ReceivedBucket&) { return ok_status(); }, [](const Status&) {}, nullptr);
  ASSERT_TRUE(blob.ok()) << blob.status().to_string();
  auto conn = (*tx)->connect(*blob, in(10s), {});
  ASSERT_TRUE(conn.ok()) << conn.status().to_string();
  std::vector<uint8_t> src((size_t{4} << 20) + 3, 7);
  auto region = (*tx)->register_memory(src.data(), src.size(), Device::cpu());
  ASSERT_TRUE(region.ok()) << region.status().to_string();
  auto h = (*conn)->post(**region, 0, src.size());  // a rendezvous: its lanes are wired up by now
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  ASSERT_TRUE((*h)->wait(in(30s)).ok());
  const std::string info = ucx_endpoint_info(**conn);
  ASSERT_FALSE(info.empty());
  const bool shm = info.find("posix/") != std::string::npos || info.find("sysv/") != std::string::npos;
  EXPECT_TRUE(shm) << "no shared-memory lane:\n" << info;
  EXPECT_NE(info.find("cma/"), std::string::npos) << "no cma lane:\n" << info;
  conn->reset();
  (*tx)->shutdown();
  (*rx)->shutdown();
}

// A same-host connection spreads its buckets over two lanes (one per host thread, FERRY_THREADS, at most two), each
// with a progress thread of its own, so two buckets are copied at once; the receiver still gets each bucket whole and
// in the order posted. Fails with one lane.
TEST(UcxSameHost, BucketsGoOverTwoLanesInOrder) {
  if (host_threads() < 2) GTEST_SKIP() << "one host thread (FERRY_THREADS, else the hardware's): one lane";
  auto rx = create_transport("ucx");
  ASSERT_TRUE(rx.ok()) << rx.status().to_string();
  auto tx = create_transport("ucx");
  ASSERT_TRUE(tx.ok()) << tx.status().to_string();
  std::mutex mu;
  std::vector<uint8_t> firsts;  // each bucket's first byte, in delivery order
  auto blob = (*rx)->listen(
      [&](const ReceivedBucket& b) {
        const uint8_t* data = b.data;
        const size_t size = b.size;
        bool whole = true;
        for (size_t i = 0; i < size; i += 4096) whole = whole && data[i] == data[0];
        std::lock_guard<std::mutex> lock(mu);
        firsts.push_back(whole ? data[0] : 0xff);
        return ok_status();
      },
      [](const Status&) {}, nullptr);
  ASSERT_TRUE(blob.ok()) << blob.status().to_string();
  auto conn = (*tx)->connect(*blob, in(10s), {});
  ASSERT_TRUE(conn.ok()) << conn.status().to_string();
  constexpr size_t kBucket = size_t{4} << 20;  // rendezvous
  constexpr int kCount = 8;
  std::vector<uint8_t> src(kBucket * kCount);
  for (int i = 0; i < kCount; ++i) std::fill_n(src.begin() + i * kBucket, kBucket, static_cast<uint8_t>(i + 1));
  auto region = (*tx)->register_memory(src.data(), src.size(), Device::cpu());
  ASSERT_TRUE(region.ok()) << region.status().to_string();
  std::vector<std::unique_ptr<TransferHandle>> handles;
  for (int i = 0; i < kCount; ++i) {
    auto h = (*conn)->post(**region, i * kBucket, kBucket);
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    handles.push_back(std::move(*h));
  }
  for (auto& h : handles) ASSERT_TRUE(h->wait(in(30s)).ok());
  const std::vector<uint64_t> lanes = ucx_lane_bytes(**conn);
  ASSERT_EQ(lanes.size(), 2u);
  for (uint64_t bytes : lanes) EXPECT_EQ(bytes, kBucket * kCount / 2);
  conn->reset();  // a clean close: every bucket is delivered before it returns
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(firsts.size(), static_cast<size_t>(kCount));
  for (int i = 0; i < kCount; ++i) EXPECT_EQ(firsts[i], i + 1) << "bucket " << i;
  (*tx)->shutdown();
  (*rx)->shutdown();
}

// A lane whose hello comes after its stream ended (refused, its other lanes closed: UCX keeps no
// order between endpoints) is refused, not made a new stream whose close would be reported as a
// second end of the same connection.
TEST(UcxStreamTable, ALaneOfAnEndedStreamIsRefused) {
  using ucx::Inbound;
  using ucx::LaneHeader;
  ucx::StreamTable table;
  const auto ep = [](uintptr_t i) { return reinterpret_cast<ucp_ep_h>(i * 64); };
  const LaneHeader h{42, 0, 2, 0};
  auto first = std::make_shared<Inbound>();
  first->peer = 7;
  ASSERT_TRUE(table.join(first, h, ep(1), {}));
  first->closed = true;  // refused
  table.forget(*first, ep(1));
  EXPECT_TRUE(table.streams.empty());
  auto late = std::make_shared<Inbound>();
  late->peer = 7;
  EXPECT_FALSE(table.join(late, h, ep(2), {}));
  EXPECT_TRUE(table.streams.empty());
  // Another connection's stream still starts.
  auto other = std::make_shared<Inbound>();
  other->peer = 7;
  EXPECT_TRUE(table.join(other, LaneHeader{43, 0, 2, 0}, ep(3), {}));
  EXPECT_EQ(table.streams.size(), 1u);
}

}  // namespace
}  // namespace ferry::transport::testing
