// FERRY_TCP_MAX_MBIT: a sending tcp connection is paced by the kernel to the cap its transport was
// made with. A cap bounds time from below on any machine (a slow one only takes longer), so the
// test checks that bound, and that the bytes arrive whole. Part of the conformance suite's binary.
#include <gtest/gtest.h>

#include <chrono>
#include <vector>

#include "core/settings.h"
#include "tests/transport/harness.h"

namespace ferry::transport::testing {
namespace {

TEST(TcpPace, TheSettingBecomesTheTransportsRateInBytesPerSecond) {
  Settings s;
  EXPECT_EQ(transport_options(s).tcp_max_rate, 0u);
  s.tcp_max_mbit = 10'000;  // 10 Gbit/s
  EXPECT_EQ(transport_options(s).tcp_max_rate, 1'250'000'000u);
}

TEST(TcpPace, ACappedConnectionSendsNoFasterThanItsCap) {
  TransportOptions rx_options;
  TransportOptions tx_options;
  tx_options.tcp_max_rate = 4'000'000;  // 32 Mbit/s
  auto rx = create_transport("tcp", rx_options);
  auto tx = create_transport("tcp", tx_options);
  ASSERT_TRUE(rx.ok() && tx.ok());
  Inbox inbox(false);
  auto blob = (*rx)->listen(inbox.callback(), inbox.closed_callback(), suite_admit());
  ASSERT_TRUE(blob.ok()) << blob.status().to_string();
  auto c = (*tx)->connect(*blob, in(10s), kCredential);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  constexpr size_t kBucket = size_t{1} << 20, kBuckets = 4;
  auto src = Source::create(**tx, kBucket * kBuckets);
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  std::vector<uint64_t> hashes;
  std::vector<std::unique_ptr<TransferHandle>> handles;
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < kBuckets; ++i) {
    hashes.push_back(src->write(i * kBucket, kBucket, 1, i));
    auto h = (*c)->post(src->region(), i * kBucket, kBucket);
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    handles.push_back(std::move(*h));
  }
  ASSERT_TRUE(inbox.wait_for_count(kBuckets, in(60s)));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (auto& h : handles) EXPECT_TRUE(h->wait(in(10s)).ok());
  const auto got = inbox.received();
  for (size_t i = 0; i < kBuckets; ++i) EXPECT_EQ(got[i].hash, hashes[i]) << "bucket " << i;
  // 4 MiB at 4 MB/s is 1.05 s; the kernel may send a first burst (its initial window) unpaced.
  EXPECT_GE(seconds, 0.6) << "4 MiB crossed a connection capped at 32 Mbit/s in " << seconds << " s";
  (*tx)->shutdown();
  (*rx)->shutdown();
}

}  // namespace
}  // namespace ferry::transport::testing
