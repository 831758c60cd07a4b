// The conformance cases of admission: every transport takes buckets only from senders whose
// credential its admit callback took, tells the callback who sent each bucket, holds each
// connection to the bucket limit its admission set, and closes peers that present no credential in
// time. Fixture and instantiation: conformance.h and
// conformance_test.cc; the strangers: stranger.h.
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/transport/conformance.h"
#include "tests/transport/stranger.h"
#include "transport/admission.h"

namespace ferry::transport::testing {
namespace {

constexpr uint64_t kStrangerSender = 99;

// A sender with a wrong credential is refused: nothing it posts reaches the callback (nor the
// closed callback: it never was a peer), and the legitimate sender keeps going before and after.
TEST_P(Conformance, StrangerWithAWrongCredentialIsRefused) {
  const std::string blob = listen();
  auto good = connect(*tx_, blob);
  ASSERT_TRUE(good);
  auto src = Source::create(*tx_, 3 * 4096, txd());
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  auto first = post_all(*good, *src, {{0, 4096}}, 1);
  for (auto& p : first) ASSERT_TRUE(p.handle->wait(in(10s)).ok());
  expect_arrived(first);

  auto stranger_tx = create_transport(GetParam().name);
  ASSERT_TRUE(stranger_tx.ok()) << stranger_tx.status().to_string();
  auto stranger = (*stranger_tx)->connect(blob, in(10s), "not-a-credential-of-the-suite");
  if (stranger.ok()) {  // the refusal may also come later, at a post or not at all (tcp)
    auto bad_src = Source::create(**stranger_tx, 4096, txd());
    ASSERT_TRUE(bad_src.ok()) << bad_src.status().to_string();
    bad_src->write(0, 4096, kStrangerSender, 0);
    auto h = (*stranger)->post(bad_src->region(), 0, 4096);
    if (h.ok()) {
      Status st = (*h)->wait(in(10s));
      EXPECT_NE(st.code(), StatusCode::kDeadlineExceeded) << st.to_string();
    }
    stranger->reset();
  } else {
    EXPECT_NE(stranger.status().code(), StatusCode::kDeadlineExceeded) << stranger.status().to_string();
  }

  auto second = post_all(*good, *src, {{4096, 4095}, {8192, 17}}, 1);
  for (auto& p : second) ASSERT_TRUE(p.handle->wait(in(10s)).ok());
  expect_arrived(second, first.size());
  for (const Received& r : inbox_->received()) EXPECT_NE(r.sender, kStrangerSender) << "the stranger's bucket arrived";
  EXPECT_EQ(inbox_->received().size(), first.size() + second.size());
  EXPECT_TRUE(inbox_->closed().empty()) << "a refused stranger reached the closed callback: "
                                        << inbox_->closed()[0].to_string();
  (*stranger_tx)->shutdown();
}

// Every bucket carries the identity admit returned for its connection.
TEST_P(Conformance, BucketsCarryTheAdmittedIdentity) {
  const std::string blob = listen();
  auto tx2 = create_transport(GetParam().name);
  ASSERT_TRUE(tx2.ok()) << tx2.status().to_string();
  // One after the other (nccl: one process drives one sending communicator at a time here).
  for (uint64_t sender : {uint64_t{0}, uint64_t{1}}) {
    Transport& t = sender == 0 ? *tx_ : **tx2;
    auto c = connect(t, blob, sender == 0 ? kCredential : kSecondCredential);
    ASSERT_TRUE(c);
    auto src = Source::create(t, 3 * 4096, txd());
    ASSERT_TRUE(src.ok()) << src.status().to_string();
    auto posted = post_all(*c, *src, {{0, 4096}, {4096, 100}, {8192, 4000}}, sender);
    for (auto& p : posted) ASSERT_TRUE(p.handle->wait(in(10s)).ok());
    ASSERT_TRUE(inbox_->wait_for_count(3 * (sender + 1), in(30s)));
  }
  for (const Received& r : inbox_->received()) {
    ASSERT_LT(r.sender, 2u);
    EXPECT_EQ(r.peer, r.sender == 0 ? kIdentity : kSecondIdentity) << "sender " << r.sender << " seq " << r.seq;
  }
  (*tx2)->shutdown();
}

// Admission sets each connection's own bucket limit, instead of the receiver's default
// (TransportOptions::max_received_bucket(): 64 MiB and a little with small buckets). A connection
// granted 80 MiB delivers a 70 MiB bucket whole; a bucket over its connection's grant (1 MiB: one
// of 2 MiB, travelling in pieces where a transport's slots are smaller, and one just over 1 MiB that
// fits a slot), or over the default where admission granted none, is refused: the connection closes
// with ResourceExhausted naming both sizes, and nothing of the bucket reaches the callback.
TEST_P(Conformance, AdmissionSetsTheConnectionsBucketLimit) {
  auto options = transport_options_from_settings();
  ASSERT_TRUE(options.ok()) << options.status().to_string();
  options->bucket_bytes = 64 << 10;
  create_pair(*options);
  constexpr size_t kMiB = size_t{1} << 20;
  const uint64_t default_limit = options->max_received_bucket();
  ASSERT_LT(default_limit, 70 * kMiB);
  struct Grant {
    std::string credential;
    uint64_t limit;  // 0: none, the default
    size_t bucket;
    bool passes;
  };
  const std::vector<Grant> grants = {{"grant-80MiB", 80 * kMiB, 70 * kMiB, true},
                                     {"grant-1MiB", kMiB, 2 * kMiB, false},
                                     {"grant-1MiB", kMiB, kMiB + 4097, false},
                                     {"grant-default", 0, 70 * kMiB, false}};
  auto blob = rx_->listen(inbox_->callback(), inbox_->closed_callback(),
                          [&grants](std::string_view credential) -> Result<Admission> {
                            for (const Grant& g : grants) {
                              if (credential == g.credential) return Admission{kIdentity, g.limit};
                            }
                            return Status::unauthenticated("not a credential of this test");
                          });
  ASSERT_TRUE(blob.ok()) << blob.status().to_string();
  auto src = Source::create(*tx_, 70 * kMiB, txd());
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  size_t closed = 0;
  for (const Grant& g : grants) {
    SCOPED_TRACE(g.credential + ", a " + std::to_string(g.bucket) + "-byte bucket");
    auto c = connect(*tx_, *blob, g.credential);
    ASSERT_TRUE(c);
    const size_t before = inbox_->received().size();
    auto posted = post_all(*c, *src, {{0, g.bucket}}, 5);
    ASSERT_EQ(posted.size(), 1u);
    const Status sent = posted[0].handle->wait(in(60s));
    if (g.passes) {
      EXPECT_TRUE(sent.ok()) << sent.to_string();
      expect_arrived(posted, before);
      c.reset();
      ASSERT_TRUE(inbox_->wait_for_closed(++closed, in(30s))) << "a clean close was not reported";
      EXPECT_TRUE(inbox_->closed().back().ok()) << inbox_->closed().back().to_string();
      continue;
    }
    // The sender may see the refusal, or the connection closing, or (tcp) nothing: its bytes left.
    EXPECT_NE(sent.code(), StatusCode::kDeadlineExceeded) << sent.to_string();
    ASSERT_TRUE(inbox_->wait_for_closed(++closed, in(30s))) << "the connection was not closed";
    const Status why = inbox_->closed().back();
    EXPECT_EQ(why.code(), StatusCode::kResourceExhausted) << why.to_string();
    const uint64_t limit = g.limit == 0 ? default_limit : g.limit;
    EXPECT_NE(why.message().find(std::to_string(g.bucket)), std::string::npos) << why.to_string();
    EXPECT_NE(why.message().find(std::to_string(limit)), std::string::npos) << why.to_string();
    c.reset();
    EXPECT_EQ(inbox_->received().size(), before) << "a refused bucket reached the callback";
  }
}

// A peer that connects and says nothing, and one that starts a credential and stops (ucx: sends a
// bucket first), are closed by the admission deadline; the legitimate sender is not held up.
TEST_P(Conformance, PeersWithoutACredentialAreClosedByTheDeadline) {
  const std::string blob = listen();
  auto silent = connect_stranger(GetParam().name, blob, Stranger::kSilent);
  ASSERT_TRUE(silent.ok()) << silent.status().to_string();
  auto partial = connect_stranger(GetParam().name, blob, Stranger::kPartial);
  ASSERT_TRUE(partial.ok()) << partial.status().to_string();

  auto good = connect(*tx_, blob);
  ASSERT_TRUE(good);
  auto src = Source::create(*tx_, 4096, txd());
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  auto posted = post_all(*good, *src, {{0, 4096}}, 1);
  for (auto& p : posted) ASSERT_TRUE(p.handle->wait(in(10s)).ok());
  expect_arrived(posted);

  // Some slack past the deadline for a loaded machine (sanitizers, two cores).
  const Deadline by = Clock::now() + kAdmissionDeadline + 10s;
  EXPECT_TRUE((*silent)->closed_by(by)) << "a peer that sent nothing was not closed";
  EXPECT_TRUE((*partial)->closed_by(by)) << "a peer with a partial credential was not closed";
  EXPECT_EQ(inbox_->received().size(), posted.size());
}

// Every socket a transport listens on while it receives and sends is bound to FERRY_LISTEN_HOST:
// none on another interface's address, nor on every address. Regression (ucx): UCX's tcp
// transport listened on each network interface's address beside the loopback one.
TEST_P(Conformance, ListensOnlyOnTheListenHost) {
  auto options = transport_options_from_settings();
  ASSERT_TRUE(options.ok()) << options.status().to_string();
  options->listen_host = "127.0.0.1";
  const auto before = listening_tcp_sockets();
  auto rx = create_transport(GetParam().name, *options);
  ASSERT_TRUE(rx.ok()) << rx.status().to_string();
  auto tx = create_transport(GetParam().name, *options);
  ASSERT_TRUE(tx.ok()) << tx.status().to_string();
  Inbox inbox(rx->get()->capabilities().device_memory);
  auto blob = (*rx)->listen(inbox.callback(), inbox.closed_callback(), suite_admit());
  ASSERT_TRUE(blob.ok()) << blob.status().to_string();
  auto c = connect(**tx, *blob);
  ASSERT_TRUE(c);
  auto src = Source::create(**tx, (size_t{4} << 20) + 4096, txd());  // rendezvous-sized: every lane wired up
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  auto posted = post_all(*c, *src, {{0, 4096}, {4096, size_t{4} << 20}}, 1);
  for (auto& p : posted) ASSERT_TRUE(p.handle->wait(in(30s)).ok());
  ASSERT_TRUE(inbox.wait_for_count(posted.size(), in(30s)));
  for (const auto& [inode, address] : listening_tcp_sockets()) {
    if (before.count(inode) != 0) continue;
    EXPECT_TRUE(address == "127.0.0.1") << GetParam().name << " listens on " << address << " (socket " << inode << ")";
  }
  c.reset();
  (*tx)->shutdown();
  (*rx)->shutdown();
}

// The size of this process's address space (VmSize), in bytes.
uint64_t address_space_bytes() {
  std::ifstream in("/proc/self/status");
  std::string key;
  while (in >> key) {
    if (key == "VmSize:") {
      uint64_t kb = 0;
      in >> kb;
      return kb * 1024;
    }
    in.ignore(1 << 12, '\n');
  }
  return 0;
}

// A raw peer announcing a large first frame is closed at once, and nothing is allocated for it: not
// as a bucket (what the frame would have been before admission existed, under the bucket limit),
// not as a credential (over kMaxCredentialBytes).
TEST(TcpAdmission, LargeFirstFrameIsClosedUnread) {
  auto rx = create_transport("tcp");
  ASSERT_TRUE(rx.ok()) << rx.status().to_string();
  Inbox inbox(false);
  auto blob = (*rx)->listen(inbox.callback(), inbox.closed_callback(), suite_admit());
  ASSERT_TRUE(blob.ok()) << blob.status().to_string();
  constexpr uint64_t kAnnounced = uint64_t{200} << 20;  // under the default bucket limit (4 x 64 MiB + 64 MiB)
  const uint64_t before = address_space_bytes();
  uint8_t bucket_header[8];
  for (int i = 0; i < 8; ++i) bucket_header[i] = static_cast<uint8_t>(kAnnounced >> (8 * i));
  const std::string huge_credential = credential_frame("").substr(0, 4) + std::string("\x00\x00\x80\x0c", 4);
  for (const std::string& first : {std::string(reinterpret_cast<char*>(bucket_header), 8), huge_credential}) {
    const int fd = raw_tcp_socket(*blob);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(send(fd, first.data(), first.size(), MSG_NOSIGNAL), static_cast<ssize_t>(first.size()));
    // Well before the admission deadline: the header alone is enough to refuse.
    EXPECT_TRUE(peer_closed(fd, in(kAdmissionDeadline / 2))) << "a peer announcing a large first frame was not closed";
    close(fd);
  }
  EXPECT_LT(address_space_bytes(), before + kAnnounced / 2) << "memory was reserved for an unadmitted peer's frame";
  EXPECT_TRUE(inbox.received().empty());
  (*rx)->shutdown();
}

// After shutdown() returns, the receiver reports nothing more: the read that shutdown cut short
// ends without a word, so the callbacks may go with the caller's state. Regression: tcp reported
// "receive: Operation canceled" from its I/O thread after shutdown, into an inbox already gone.
TEST(TcpShutdown, NoCloseIsReportedAfterShutdown) {
  auto rx = create_transport("tcp");
  ASSERT_TRUE(rx.ok()) << rx.status().to_string();
  auto tx = create_transport("tcp");
  ASSERT_TRUE(tx.ok()) << tx.status().to_string();
  Inbox inbox(false);
  auto blob = (*rx)->listen(inbox.callback(), inbox.closed_callback(), suite_admit());
  ASSERT_TRUE(blob.ok()) << blob.status().to_string();
  auto src = Source::create(**tx, 4096);
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  src->write(0, 4096, 1, 0);
  std::vector<std::unique_ptr<Connection>> open;  // each keeps its receiver reading
  for (int round = 0; round < 20; ++round) {
    auto c = (*tx)->connect(*blob, in(10s), kCredential);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    open.push_back(std::move(*c));
    auto h = open.back()->post(src->region(), 0, 4096);
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    ASSERT_TRUE((*h)->wait(in(10s)).ok());
    ASSERT_TRUE(inbox.wait_for_count(static_cast<size_t>(round) + 1, in(10s)));
  }
  (*rx)->shutdown();  // 20 receivers, each with a read under way
  const size_t closed = inbox.closed().size();
  // A handler the shutdown left queued runs on the I/O thread soon after; give it the time.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(inbox.closed().size(), closed) << "a close reported after shutdown: " << inbox.closed().back().to_string();
  open.clear();
  (*tx)->shutdown();
}

}  // namespace
}  // namespace ferry::transport::testing
