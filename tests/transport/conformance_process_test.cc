// The conformance cases against child processes (a peer that dies, a stream from another process,
// two sender processes), and the child's side of them. Fixture and instantiation:
// conformance.h and conformance_test.cc.
#include <deque>
#include <set>

#include "tests/transport/conformance.h"

namespace ferry::transport::testing {
namespace {

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

// The child side of the peer-death cases; skipped unless a parent started this binary for it.
TEST(ConformanceChild, Run) {
  if (std::getenv("FERRY_CONFORMANCE_ROLE") == nullptr) GTEST_SKIP() << "runs only as a child of the suite";
  Status st = run_child_role();
  EXPECT_TRUE(st.ok()) << st.to_string();
}

}  // namespace
}  // namespace ferry::transport::testing
