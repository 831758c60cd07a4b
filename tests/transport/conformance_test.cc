// The one conformance suite, instantiated for every transport built into this ferry. Real sockets,
// real shared memory, real child processes; every wait has a deadline.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <future>
#include <random>
#include <set>
#include <thread>

#include "core/buffer.h"
#include "tests/transport/harness.h"
#include "transport/transport.h"

namespace ferry::transport::testing {
namespace {

struct TransportCase {
  std::string name;
  size_t large_bytes;   // the "large message" case; 1 GiB where it is cheap
  bool cross_process;   // peer-death cases run against a child process
  int devices_needed;   // GPUs both ends need (0: none)
  std::string label = {};    // test name suffix when it differs from name
  std::string ucx_tls = {};  // UCX_TLS for this case, unless the user set one
  int rx_device = 0;         // CUDA device of the receiving transport (device transports)
  int tx_device = 0;         // and of the sending ones
  std::string why_devices = {};  // said when a case skips for want of GPUs
};

// NVLink multicast stays off in this test process (and its children) unless the user chose.
const bool kNvlsOff = [] {
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  return true;
}();

void PrintTo(const TransportCase& c, std::ostream* os) { *os << (c.label.empty() ? c.name : c.label); }

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

// Sets an environment variable for one test and puts the old value back after it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) setenv(name_, old_->c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

struct Posted {
  std::unique_ptr<TransferHandle> handle;
  size_t size;
  uint64_t hash;
};

class Conformance : public ::testing::TestWithParam<TransportCase> {
 protected:
  void SetUp() override {
    const TransportCase& c = GetParam();
    (void)kNvlsOff;
    if (c.devices_needed > 0 && !cuda_device_available()) GTEST_SKIP() << "no CUDA device here";
    if (c.devices_needed > 0 && cuda_device_count() < c.devices_needed) {
      GTEST_SKIP() << c.why_devices << ": needs " << c.devices_needed << " CUDA devices, this machine shows "
                   << cuda_device_count();
    }
    if (!GetParam().ucx_tls.empty() && std::getenv("UCX_TLS") == nullptr) tls_.emplace("UCX_TLS", GetParam().ucx_tls);
    // Device transports take the device current at creation: the receiver's, then the sender's
    // (left current, so transports the test body creates send from it too).
    if (c.devices_needed > 0) {
      ASSERT_TRUE(use_device(c.rx_device));
    }
    auto rx = create_transport(GetParam().name);
    // A built host transport must work here; only device transports may find no device.
    if (!rx.ok() && GetParam().devices_needed > 0) GTEST_SKIP() << GetParam().name << ": " << rx.status().to_string();
    ASSERT_TRUE(rx.ok()) << rx.status().to_string();
    rx_ = std::move(*rx);
    if (c.devices_needed > 0) {
      ASSERT_TRUE(use_device(c.tx_device));
    }
    auto tx = create_transport(GetParam().name);
    ASSERT_TRUE(tx.ok()) << tx.status().to_string();
    tx_ = std::move(*tx);
    inbox_ = std::make_unique<Inbox>(rx_->capabilities().device_memory);
  }

  void TearDown() override {
    if (inbox_) inbox_->open_gate();
    if (tx_) tx_->shutdown();
    if (rx_) rx_->shutdown();
    tx_.reset();
    rx_.reset();
    tls_.reset();
  }

  int txd() const { return GetParam().tx_device; }

  std::string listen() {
    auto blob = rx_->listen(inbox_->callback(), inbox_->closed_callback());
    EXPECT_TRUE(blob.ok()) << blob.status().to_string();
    return blob.ok() ? *blob : std::string();
  }

  std::unique_ptr<Connection> connect(Transport& t, const std::string& blob) {
    auto c = t.connect(blob, in(10s));
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // Posts one payload per (offset, size) from `src`, all before waiting on any.
  std::vector<Posted> post_all(Connection& c, Source& src, const std::vector<std::pair<size_t, size_t>>& items,
                               uint64_t sender) {
    std::vector<Posted> out;
    for (size_t i = 0; i < items.size(); ++i) {
      const auto [off, size] = items[i];
      const uint64_t h = src.write(off, size, sender, i);
      auto h_or = c.post(src.region(), off, size);
      EXPECT_TRUE(h_or.ok()) << h_or.status().to_string();
      if (!h_or.ok()) break;
      out.push_back({std::move(*h_or), size, h});
    }
    return out;
  }

  // Every posted payload arrived, whole and in order, after `first` earlier buckets.
  void expect_arrived(const std::vector<Posted>& posted, size_t first = 0) {
    ASSERT_TRUE(inbox_->wait_for_count(first + posted.size(), in(60s)))
        << "received " << inbox_->received().size() << " of " << first + posted.size();
    const auto got = inbox_->received();
    for (size_t i = 0; i < posted.size(); ++i) {
      EXPECT_EQ(got[first + i].size, posted[i].size) << "bucket " << i;
      EXPECT_EQ(got[first + i].hash, posted[i].hash) << "bucket " << i;
    }
  }

  std::optional<ScopedEnv> tls_;
  std::unique_ptr<Transport> rx_, tx_;
  std::unique_ptr<Inbox> inbox_;
};

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
  ScopedEnv bucket("FERRY_BUCKET_BYTES", std::to_string(bytes));
  const std::string blob = listen();
  auto c = connect(*tx_, blob);
  ASSERT_TRUE(c);
  auto src = Source::create(*tx_, bytes, txd());
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  auto posted = post_all(*c, *src, {{0, bytes}}, 3);
  ASSERT_EQ(posted.size(), 1u);
  EXPECT_TRUE(posted[0].handle->wait(in(120s)).ok());
  expect_arrived(posted);
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

TEST_P(Conformance, ReceiverDiesMidTransfer) {
  if (!GetParam().cross_process) GTEST_SKIP() << "needs a second process";
  auto child = Child::spawn("receiver", GetParam().name, "", GetParam().rx_device);
  ASSERT_TRUE(child.ok()) << child.status().to_string();
  auto line = (*child)->read_line(in(30s));
  ASSERT_TRUE(line && line->starts_with("blob ")) << "child did not report its blob";
  auto c = connect(*tx_, line->substr(5));
  ASSERT_TRUE(c);
  constexpr size_t kBucket = 16 << 20;
  constexpr size_t kSlots = 4;
  auto src = Source::create(*tx_, kBucket * kSlots, txd());
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  std::deque<std::unique_ptr<TransferHandle>> pending;
  for (size_t k = 0; k < kSlots; ++k) {
    src->write(k * kBucket, kBucket, 6, k);
    auto h = c->post(src->region(), k * kBucket, kBucket);
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    pending.push_back(std::move(*h));
  }
  ASSERT_EQ((*child)->read_line(in(30s)), std::optional<std::string>("bucket"));
  (*child)->kill_now();
  // The sender learns of the death as an error, well before the deadline.
  const Deadline end = in(20s);
  Status failure;
  for (size_t seq = kSlots; failure.ok() && Clock::now() < end; ++seq) {
    Status st = pending.front()->wait(end);
    pending.pop_front();
    if (!st.ok()) {
      failure = st;
      break;
    }
    auto h = c->post(src->region(), (seq % kSlots) * kBucket, kBucket);
    if (!h.ok()) {
      failure = h.status();
      break;
    }
    pending.push_back(std::move(*h));
  }
  EXPECT_FALSE(failure.ok());
  EXPECT_NE(failure.code(), StatusCode::kDeadlineExceeded) << failure.to_string();
  EXPECT_LT(Clock::now(), end);
}

TEST_P(Conformance, SenderDiesMidTransfer) {
  if (!GetParam().cross_process) GTEST_SKIP() << "needs a second process";
  const std::string blob = listen();
  auto child = Child::spawn("sender", GetParam().name, blob, GetParam().tx_device);
  ASSERT_TRUE(child.ok()) << child.status().to_string();
  ASSERT_TRUE(inbox_->wait_for_count(2, in(30s))) << "no bucket from the child";
  (*child)->kill_now();
  EXPECT_TRUE(inbox_->wait_for_closed(1, in(20s))) << "the receiver never noticed its sender died";
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
    auto c = t.connect(blob, in(10s));
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

// A child process streams stream_schedule() into this one: for cuda_ipc this is the real IPC path
// (cudaIpcOpenMemHandle, interprocess events), which two ends in one process never take.
TEST_P(Conformance, CrossProcessStream) {
  if (!GetParam().cross_process) GTEST_SKIP() << "needs a second process";
  const std::string blob = listen();
  auto child = Child::spawn("stream_sender", GetParam().name, blob, GetParam().tx_device);
  ASSERT_TRUE(child.ok()) << child.status().to_string();
  const auto schedule = stream_schedule();
  const bool all = inbox_->wait_for_count(schedule.size(), in(120s));
  const auto line = (*child)->read_line(in(all ? 30s : 1s));
  ASSERT_TRUE(all) << "received " << inbox_->received().size() << " of " << schedule.size()
                   << " buckets; the child said: " << line.value_or("(nothing: see its output above)");
  const auto got = inbox_->received();
  for (size_t i = 0; i < schedule.size(); ++i) {
    std::vector<uint8_t> expect(schedule[i].second);
    fill_payload(expect.data(), expect.size(), kStreamSender, i);
    EXPECT_EQ(got[i].size, schedule[i].second) << "bucket " << i;
    EXPECT_EQ(got[i].hash, hash_bytes(expect.data(), expect.size())) << "bucket " << i << " of " << got[i].size << " bytes";
  }
  EXPECT_EQ(line, std::optional<std::string>("done"));
  EXPECT_TRUE(inbox_->wait_for_closed(1, in(20s))) << "the receiver was not told of the clean close";
  if (!inbox_->closed().empty()) {
    EXPECT_TRUE(inbox_->closed()[0].ok()) << inbox_->closed()[0].to_string();
  }
}

// Two sender processes stream into one receiver at once, as the processes of two trainer GPUs
// feeding one rank: every bucket of both arrives whole, each sender's in order. (Both children
// write the same payloads, so the received sequence must split into two ordered copies.)
TEST_P(Conformance, TwoSenderProcessesOneReceiver) {
  if (!GetParam().cross_process) GTEST_SKIP() << "needs child processes";
  const std::string blob = listen();
  auto a = Child::spawn("stream_sender", GetParam().name, blob, GetParam().tx_device);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  auto b = Child::spawn("stream_sender", GetParam().name, blob, GetParam().tx_device);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  const auto schedule = stream_schedule();
  const bool all = inbox_->wait_for_count(2 * schedule.size(), in(120s));
  const auto said_a = (*a)->read_line(in(all ? 30s : 1s));
  const auto said_b = (*b)->read_line(in(all ? 30s : 1s));
  ASSERT_TRUE(all) << "received " << inbox_->received().size() << " of " << 2 * schedule.size()
                   << " buckets; the children said: " << said_a.value_or("(nothing)") << ", "
                   << said_b.value_or("(nothing)");
  EXPECT_EQ(said_a, std::optional<std::string>("done"));
  EXPECT_EQ(said_b, std::optional<std::string>("done"));
  std::multiset<std::pair<size_t, uint64_t>> expected, got;
  for (size_t i = 0; i < schedule.size(); ++i) {
    std::vector<uint8_t> payload(schedule[i].second);
    fill_payload(payload.data(), payload.size(), kStreamSender, i);
    expected.insert({payload.size(), hash_bytes(payload.data(), payload.size())});
    expected.insert({payload.size(), hash_bytes(payload.data(), payload.size())});
  }
  uint64_t next[2] = {0, 0};  // the next sequence number of each copy
  for (const Received& r : inbox_->received()) {
    got.insert({r.size, r.hash});
    if (r.seq == ~0ull) continue;  // too short to carry a header
    while (next[0] < schedule.size() && schedule[next[0]].second < 16) ++next[0];
    while (next[1] < schedule.size() && schedule[next[1]].second < 16) ++next[1];
    if (r.seq == next[0]) {
      ++next[0];
    } else if (r.seq == next[1]) {
      ++next[1];
    } else {
      ADD_FAILURE() << "bucket " << r.seq << " arrived out of order (expected " << next[0] << " or " << next[1] << ")";
    }
  }
  EXPECT_TRUE(got == expected) << "the buckets received are not two copies of the stream";
}

TEST_P(Conformance, MalformedBlobFails) {
  auto c = tx_->connect("not-a-blob", in(5s));
  EXPECT_FALSE(c.ok());
}

INSTANTIATE_TEST_SUITE_P(AllTransports, Conformance, ::testing::ValuesIn(built_cases()),
                         [](const ::testing::TestParamInfo<TransportCase>& info) {
                           return info.param.label.empty() ? info.param.name : info.param.label;
                         });

// The child side of the peer-death cases; skipped unless a parent started this binary for it.
TEST(ConformanceChild, Run) {
  if (std::getenv("FERRY_CONFORMANCE_ROLE") == nullptr) GTEST_SKIP() << "runs only as a child of the suite";
  Status st = run_child_role();
  EXPECT_TRUE(st.ok()) << st.to_string();
}

}  // namespace
}  // namespace ferry::transport::testing
