// The one conformance suite, instantiated for every transport built into this ferry: the cases
// within one process (conformance_process_test.cc has those against child processes). Real
// sockets, real shared memory, real child processes; every wait has a deadline.
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <future>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <unistd.h>

#include "core/buffer.h"
#include "tests/transport/conformance.h"

namespace ferry::transport::testing {

std::vector<TransportCase> built_cases() {
  std::vector<TransportCase> cases;
  for (const auto& f : transport_factories()) {
    const std::string n(f.name);
    if (n == "tcp" || n == "shm") cases.push_back({n, size_t{1} << 30, true, 0});
    else if (n == "ucx" && std::getenv("UCX_TLS") != nullptr) {
      cases.push_back({n, size_t{256} << 20, true, 0});
    }
    else if (n == "ucx") {
      // UCX's tcp, then its shared-memory transports (tcp stays on for the sockaddr connection set-up).
      cases.push_back({n, size_t{256} << 20, true, 0, "ucx_tcp", "tcp"});
      cases.push_back({n, size_t{256} << 20, true, 0, "ucx_shm", "sm,self,tcp"});
    }
    else if (n == "cuda_ipc") {
      // One GPU: both ends on cuda:0 (in one process, and in two through the child cases), as
      // for a trainer and a rollout engine colocated on one GPU. Two GPUs: the ring on cuda:1,
      // the sender on cuda:0, through peer access.
      cases.push_back({n, size_t{1} << 30, true, 1, "cuda_ipc", "", 0, 0, ""});
      cases.push_back({n, size_t{1} << 30, true, 2, "cuda_ipc_2gpu", "", 1, 0, "the cross-GPU cuda_ipc case"});
    } else if (n == "nccl") {
      cases.push_back({n, size_t{256} << 20, true, 2, "nccl", "", 1, 0,
                       "nccl: the two ranks of a communicator cannot share one GPU (NCCL refuses duplicate GPUs)"});
    }
    else cases.push_back({n, size_t{64} << 20, true, 0});
  }
  return cases;
}

namespace {

TEST_P(Conformance, EmptyAndOneByteMessages) {
  const std::string blob = listen();
  auto c = connect(*tx_, blob);
  ASSERT_TRUE(c);
  auto src = Source::create(*tx_, 4096, txd());
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  auto posted = post_all(*c, *src, {{0, 0}, {64, 1}, {128, 0}, {192, 2}}, 1);
  for (auto& p : posted) EXPECT_TRUE(p.handle->wait(in(10s)).ok());
  expect_arrived(posted);
}

// A connection to a receiver on this host says so (tcp and nccl by the control socket's addresses,
// shm and cuda_ipc always, ucx by the receiver's boot id): under FERRY_DELTA=auto such a rank gets
// dense bytes, which cost less there than a compare.
TEST_P(Conformance, AReceiverOnThisHostIsSeenAsSuch) {
  const std::string blob = listen();
  auto c = connect(*tx_, blob);
  ASSERT_TRUE(c);
  EXPECT_TRUE(c->same_host()) << GetParam().name << " took a receiver on this host for one elsewhere";
}

TEST_P(Conformance, UnalignedSizesAndOffsets) {
  const std::string blob = listen();
  auto c = connect(*tx_, blob);
  ASSERT_TRUE(c);
  auto src = Source::create(*tx_, 8 << 20, txd());
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  std::vector<std::pair<size_t, size_t>> items;
  const size_t sizes[] = {3, 17, 4095, 4097, 65537, (1 << 20) + 13, 7};
  size_t off = 1;
  for (size_t s : sizes) {
    items.emplace_back(off, s);
    off += s + 3;
  }
  auto posted = post_all(*c, *src, items, 2);
  for (auto& p : posted) EXPECT_TRUE(p.handle->wait(in(10s)).ok());
  expect_arrived(posted);
}

TEST_P(Conformance, LargeMessage) {
  size_t bytes = GetParam().large_bytes;
  // Sender, receiver and the inbox's check each may hold a copy.
  while (bytes > (size_t{64} << 20) && available_memory_bytes() < 4 * bytes) bytes /= 2;
  auto options = transport_options_from_settings();
  ASSERT_TRUE(options.ok()) << options.status().to_string();
  options->bucket_bytes = bytes;
  create_pair(*options);
  const std::string blob = listen();
  // A 1 GiB shm segment is made and mapped within the connect: under the sanitizers, beside a
  // compile on the same two cores, that once took past 10 s.
  auto c = connect(*tx_, blob, kCredential, 60s);
  ASSERT_TRUE(c);
  auto src = Source::create(*tx_, bytes, txd());
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  auto posted = post_all(*c, *src, {{0, bytes}}, 3);
  ASSERT_EQ(posted.size(), 1u);
  EXPECT_TRUE(posted[0].handle->wait(in(120s)).ok());
  expect_arrived(posted);
}

// The bytes of this process's mappings of shm rings (/dev/shm/ferry-shm-PID-N-r), largest first.
std::vector<uint64_t> ring_mappings() {
  std::vector<uint64_t> out;
  std::ifstream maps("/proc/self/maps");
  const std::string tag = fmt::format("ferry-shm-{}-", getpid());
  for (std::string line; std::getline(maps, line);) {
    const size_t at = line.find(tag);
    if (at == std::string::npos || line.find("-r", at + tag.size()) == std::string::npos) continue;
    uint64_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) == 2) out.push_back(hi - lo);
  }
  std::sort(out.rbegin(), out.rend());
  return out;
}

// A connection that reserves less than its largest bucket (a colocated rank's connection, which
// carries references) still delivers buckets larger than the reserve, whole; shm then maps a ring
// of the reserve's size, not of the largest bucket's (the ring of a colocated first update was
// 256 MiB, written and mapped by both ends).
TEST_P(Conformance, BucketsLargerThanTheReserveArriveWhole) {
  const std::string blob = listen();
  ConnectOptions o(kCredential, uint64_t{64} << 20);
  o.reserve_bytes = uint64_t{1} << 20;
  auto c = tx_->connect(blob, in(10s), o);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto src = Source::create(*tx_, 12 << 20, txd());
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  auto posted = post_all(**c, *src, {{0, 100}, {4096, (5 << 20) + 7}, {6 << 20, 3 << 20}, {10 << 20, 1}}, 5);
  for (auto& p : posted) EXPECT_TRUE(p.handle->wait(in(30s)).ok());
  expect_arrived(posted);
  if (GetParam().name == "shm") {
    const auto rings = ring_mappings();
    ASSERT_FALSE(rings.empty()) << "no shm ring mapped by this process";
    EXPECT_LT(rings.front(), uint64_t{32} << 20) << "the ring was sized for the largest bucket, not the reserve";
    // Without a reserve the ring holds the largest bucket (the control: the check above can fail).
    auto whole = tx_->connect(blob, in(10s), ConnectOptions(kCredential, uint64_t{64} << 20));
    ASSERT_TRUE(whole.ok()) << whole.status().to_string();
    EXPECT_GE(ring_mappings().front(), uint64_t{64} << 20);
  }
}

TEST_P(Conformance, ManyBucketsInFlight) {
  const std::string blob = listen();
  auto c = connect(*tx_, blob);
  ASSERT_TRUE(c);
  constexpr size_t kCount = 200;
  constexpr size_t kStride = 72 << 10;
  auto src = Source::create(*tx_, kCount * kStride, txd());
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  std::vector<std::pair<size_t, size_t>> items;
  for (size_t i = 0; i < kCount; ++i) items.emplace_back(i * kStride, (64 << 10) + i * 37);
  auto posted = post_all(*c, *src, items, 4);
  ASSERT_EQ(posted.size(), kCount);
  for (auto& p : posted) EXPECT_TRUE(p.handle->wait(in(30s)).ok());
  expect_arrived(posted);
}

TEST_P(Conformance, CompletionsPolledOutOfOrder) {
  const std::string blob = listen();
  auto c = connect(*tx_, blob);
  ASSERT_TRUE(c);
  constexpr size_t kCount = 32;
  constexpr size_t kStride = 1 << 20;
  auto src = Source::create(*tx_, kCount * kStride, txd());
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  std::vector<std::pair<size_t, size_t>> items;
  for (size_t i = 0; i < kCount; ++i) items.emplace_back(i * kStride, kStride - i);
  auto posted = post_all(*c, *src, items, 5);
  ASSERT_EQ(posted.size(), kCount);
  std::vector<size_t> order(kCount);
  for (size_t i = 0; i < kCount; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937(42));
  // Poll in a scrambled order; then wait newest first.
  const Deadline end = in(30s);
  size_t done = 0;
  while (done < kCount && Clock::now() < end) {
    done = 0;
    for (size_t i : order) done += posted[i].handle->is_completed() ? 1 : 0;
    std::this_thread::yield();
  }
  EXPECT_EQ(done, kCount);
  for (size_t i = kCount; i-- > 0;) EXPECT_TRUE(posted[i].handle->wait(in(10s)).ok()) << i;
  expect_arrived(posted);
}

TEST_P(Conformance, AbortThenReconnect) {
  const std::string blob = listen();
  auto c = connect(*tx_, blob);
  ASSERT_TRUE(c);
  constexpr size_t kBucket = 32 << 20;
  constexpr size_t kCount = 10;
  auto src = Source::create(*tx_, kBucket * kCount, txd());
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  inbox_->close_gate();  // the receiver stalls in its first callback: the rest back up
  std::vector<std::pair<size_t, size_t>> items;
  for (size_t i = 0; i < kCount; ++i) items.emplace_back(i * kBucket, kBucket);
  auto posted = post_all(*c, *src, items, 8);
  ASSERT_EQ(posted.size(), kCount);
  // Aborting one pending transfer never blocks, and its wait says Aborted.
  const auto t0 = Clock::now();
  posted.back().handle->abort();
  Status st = posted.back().handle->wait(in(10s));
  EXPECT_EQ(st.code(), StatusCode::kAborted) << st.to_string();
  EXPECT_LT(Clock::now() - t0, 5s);
  c->abort();
  for (auto& p : posted) {
    Status s = p.handle->wait(in(10s));
    EXPECT_NE(s.code(), StatusCode::kDeadlineExceeded) << s.to_string();
  }
  // A post on an aborted connection fails, at post or at wait.
  auto late = c->post(src->region(), 0, 16);
  if (late.ok()) {
    EXPECT_FALSE((*late)->wait(in(10s)).ok());
  }
  inbox_->open_gate();
  EXPECT_TRUE(inbox_->wait_for_closed(1, in(20s))) << "receiver was not told of the aborted connection";
  c.reset();

  auto again = connect(*tx_, blob);
  ASSERT_TRUE(again);
  const size_t before = inbox_->received().size();
  auto fresh = post_all(*again, *src, {{0, (1 << 20) + 5}}, 9);
  ASSERT_EQ(fresh.size(), 1u);
  EXPECT_TRUE(fresh[0].handle->wait(in(10s)).ok());
  expect_arrived(fresh, before);
}

// Both senders and the receiver in this process. Not for nccl: that makes four communicators on two
// GPUs in one process driven concurrently from three threads, which NCCL does not support (its
// operations on several communicators of one process must be ordered by the caller, or they can
// deadlock; here they hang in about one run of two). Two sender processes into one receiver, the
// deployment's shape, run for nccl in TwoSenderProcessesOneReceiver.
TEST_P(Conformance, TwoSendersOneReceiver) {
  if (GetParam().name == "nccl") GTEST_SKIP() << "nccl: one process driving four communicators at once (see above)";
  const std::string blob = listen();
  auto tx2_or = create_transport(GetParam().name);
  ASSERT_TRUE(tx2_or.ok()) << tx2_or.status().to_string();
  std::unique_ptr<Transport> tx2 = std::move(*tx2_or);
  constexpr size_t kCount = 40;
  constexpr size_t kBucket = 256 << 10;
  constexpr size_t kInFlight = 4;
  std::vector<uint64_t> hashes[2];
  auto run = [&](Transport& t, uint64_t sender) {
    auto c = t.connect(blob, in(10s), kCredential);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    auto src = Source::create(t, kBucket * kInFlight, txd());
    ASSERT_TRUE(src.ok()) << src.status().to_string();
    std::deque<std::unique_ptr<TransferHandle>> pending;
    for (size_t i = 0; i < kCount; ++i) {
      if (pending.size() == kInFlight) {
        ASSERT_TRUE(pending.front()->wait(in(30s)).ok());
        pending.pop_front();
      }
      const size_t off = (i % kInFlight) * kBucket;
      hashes[sender].push_back(src->write(off, kBucket - sender - i, sender, i));
      auto h = (*c)->post(src->region(), off, kBucket - sender - i);
      ASSERT_TRUE(h.ok()) << h.status().to_string();
      pending.push_back(std::move(*h));
    }
    for (auto& h : pending) ASSERT_TRUE(h->wait(in(30s)).ok());
  };
  std::thread a([&] { run(*tx_, 0); });
  std::thread b([&] { run(*tx2, 1); });
  a.join();
  b.join();
  ASSERT_TRUE(inbox_->wait_for_count(2 * kCount, in(60s)));
  uint64_t next[2] = {0, 0};
  for (const Received& r : inbox_->received()) {
    ASSERT_LT(r.sender, 2u);
    ASSERT_EQ(r.seq, next[r.sender]) << "sender " << r.sender << " out of order";
    EXPECT_EQ(r.hash, hashes[r.sender][r.seq]);
    ++next[r.sender];
  }
  EXPECT_EQ(next[0], kCount);
  EXPECT_EQ(next[1], kCount);
  tx2->shutdown();
}

// A sender connects while another has buckets in flight to the same receiver; both streams
// arrive whole and in order. Regression (nccl): the receiver set up the newcomer's communicator on
// the thread that posts receives, so the first sender's sends (kernels waiting for those receives)
// and the newcomer's NCCL init (CUDA calls that wait for them) deadlocked until the connect deadline.
TEST_P(Conformance, SenderJoinsWhileAnotherStreams) {
  const std::string blob = listen();
  auto tx2_or = create_transport(GetParam().name);
  ASSERT_TRUE(tx2_or.ok()) << tx2_or.status().to_string();
  std::unique_ptr<Transport> tx2 = std::move(*tx2_or);
  constexpr size_t kCount = 8;
  constexpr size_t kBucket = 256 << 10;
  std::vector<std::pair<size_t, size_t>> items;
  for (size_t i = 0; i < kCount; ++i) items.emplace_back(i * kBucket, kBucket - i);
  auto a = connect(*tx_, blob);
  ASSERT_TRUE(a);
  auto src_a = Source::create(*tx_, kBucket * kCount, txd());
  ASSERT_TRUE(src_a.ok()) << src_a.status().to_string();
  auto first = post_all(*a, *src_a, items, 0);  // not waited on: in flight while the second joins
  ASSERT_EQ(first.size(), kCount);
  auto b = connect(*tx2, blob);
  ASSERT_TRUE(b) << "a second sender could not join while the first streamed";
  auto src_b = Source::create(*tx2, kBucket * kCount, txd());
  ASSERT_TRUE(src_b.ok()) << src_b.status().to_string();
  auto second = post_all(*b, *src_b, items, 1);
  ASSERT_EQ(second.size(), kCount);
  for (auto& p : first) EXPECT_TRUE(p.handle->wait(in(30s)).ok());
  for (auto& p : second) EXPECT_TRUE(p.handle->wait(in(30s)).ok());
  ASSERT_TRUE(inbox_->wait_for_count(2 * kCount, in(60s))) << "received " << inbox_->received().size() << " of "
                                                           << 2 * kCount;
  uint64_t next[2] = {0, 0};
  for (const Received& r : inbox_->received()) {
    ASSERT_LT(r.sender, 2u);
    ASSERT_LT(r.seq, kCount);
    ASSERT_EQ(r.seq, next[r.sender]) << "sender " << r.sender << " out of order";
    EXPECT_EQ(r.hash, (r.sender == 0 ? first : second)[r.seq].hash);
    ++next[r.sender];
  }
  a.reset();
  b.reset();
  tx2->shutdown();
}

// A sender may finish and close while the receiver still holds buckets it has not handed over (a
// cuda_ipc sender's handles complete once its copies land in the receiver's ring). That close is
// clean: every bucket still arrives and the receiver reports OK. Regression (cuda_ipc): the
// receiver wrote a slot-free to the closed socket, failed with "Broken pipe", reported that as the
// close and dropped the buckets still waiting (which also starved TwoSendersOneReceiver).
TEST_P(Conformance, CloseWithBucketsUndelivered) {
  const std::string blob = listen();
  auto c = connect(*tx_, blob);
  ASSERT_TRUE(c);
  auto src = Source::create(*tx_, 2 * 4096, txd());
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  inbox_->close_gate();  // the receiver holds the first bucket in its callback
  // Two buckets: a cuda_ipc ring has at least two slots, so both land without a slot-free.
  auto posted = post_all(*c, *src, {{0, 4096}, {4096, 4095}}, 12);
  ASSERT_EQ(posted.size(), 2u);
  // Where completing or closing needs the receiver's progress, the closer waits for the gate;
  // where it does not (cuda_ipc), it closes while both buckets are still undelivered.
  auto closer = std::async(std::launch::async, [&] {
    for (auto& p : posted) EXPECT_TRUE(p.handle->wait(in(30s)).ok());
    c.reset();
  });
  (void)closer.wait_for(5s);
  inbox_->open_gate();
  closer.wait();
  expect_arrived(posted);
  EXPECT_TRUE(inbox_->wait_for_closed(1, in(20s))) << "the receiver was not told of the clean close";
  if (!inbox_->closed().empty()) {
    EXPECT_TRUE(inbox_->closed()[0].ok()) << inbox_->closed()[0].to_string();
  }
}

TEST_P(Conformance, MalformedBlobFails) {
  auto c = tx_->connect("not-a-blob", in(5s), kCredential);
  EXPECT_FALSE(c.ok());
}

INSTANTIATE_TEST_SUITE_P(AllTransports, Conformance, ::testing::ValuesIn(built_cases()),
                         [](const ::testing::TestParamInfo<TransportCase>& info) {
                           return info.param.label.empty() ? info.param.name : info.param.label;
                         });

}  // namespace
}  // namespace ferry::transport::testing
