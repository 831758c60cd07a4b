// The control plane's channel and waits: frames sent from several threads at once (each written
// from its caller's thread when nothing is queued) arrive whole and in each thread's order; run_io() (an I/O thread that polls for FERRY_IO_SPIN_US after each
// handler) and Mailbox::wait() (which polls as long before it sleeps) still run every handler, end
// when stopped or out of work, and keep their deadlines.
#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "coordinator/channel.h"
#include "coordinator/mailbox.h"
#include "core/asio.h"

namespace ferry::coordinator {
namespace {

using Clock = std::chrono::steady_clock;
namespace asio = boost::asio;

TEST(IoLoop, RunsEveryHandlerAndEndsWhenStoppedWhileSpinning) {
  ASSERT_GT(io_spin().count(), 0) << "the default spins; this test is about ending while it does";
  asio::io_context io;
  auto guard = asio::make_work_guard(io);
  std::atomic<int> ran{0};
  auto done = std::async(std::launch::async, [&] { run_io(io); });
  for (int i = 0; i < 1000; ++i) asio::post(io, [&] { ran.fetch_add(1); });
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (ran.load() < 1000 && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(ran.load(), 1000);
  // Stopped right after a handler, inside the spin window.
  asio::post(io, [&] { ran.fetch_add(1); });
  io.stop();
  ASSERT_EQ(done.wait_for(std::chrono::seconds(5)), std::future_status::ready) << "run_io did not end after stop()";
}

TEST(IoLoop, EndsWhenOutOfWork) {
  asio::io_context io;
  auto guard = asio::make_work_guard(io);
  std::atomic<int> ran{0};
  auto done = std::async(std::launch::async, [&] { run_io(io); });
  asio::post(io, [&] { ran.fetch_add(1); });
  guard.reset();
  ASSERT_EQ(done.wait_for(std::chrono::seconds(5)), std::future_status::ready) << "run_io did not end without work";
  EXPECT_EQ(ran.load(), 1);
}

TEST(MailboxWait, TakesAReplyPushedLaterAndKeepsItsDeadline) {
  Mailbox box;
  auto pusher = std::async(std::launch::async, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));  // past the spin: the waiter sleeps
    wire::Envelope other;
    other.mutable_pause_ack()->set_version(3);
    box.push(other);
    wire::Envelope e;
    e.mutable_finish_reply()->set_version(7);
    box.push(e);
  });
  auto r = box.wait(wire::Envelope::kFinishReply, Clock::now() + std::chrono::seconds(10), "finish reply");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->finish_reply().version(), 7u);
  pusher.get();

  const auto t0 = Clock::now();
  auto none = box.wait(wire::Envelope::kStartReply, t0 + std::chrono::milliseconds(50), "start reply");
  EXPECT_EQ(none.status().code(), StatusCode::kDeadlineExceeded) << none.status().to_string();
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(50));
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  // The other envelope is still there for whoever waits for it.
  auto ack = box.wait(wire::Envelope::kPauseAck, Clock::now(), "pause ack");
  ASSERT_TRUE(ack.ok()) << ack.status().to_string();
  EXPECT_EQ(ack->pause_ack().version(), 3u);
}


// Large frames from four threads and from the I/O thread at once: the socket takes part of a frame
// and the rest is queued; no other frame may be written in between, and each sender's frames keep
// their order.
TEST(Channel, ConcurrentSendersKeepFramesWholeAndInOrder) {
  asio::io_context io;
  auto guard = asio::make_work_guard(io);
  asio::ip::tcp::acceptor acceptor(io, {asio::ip::make_address("127.0.0.1"), 0});
  asio::ip::tcp::socket a(io), b(io);
  a.connect(acceptor.local_endpoint());
  acceptor.accept(b);
  auto tx = std::make_shared<Channel>(std::move(a), 64 << 20);
  auto rx = std::make_shared<Channel>(std::move(b), 64 << 20);
  constexpr int kSenders = 5, kFrames = 120;
  constexpr size_t kBytes = 300 << 10;
  std::mutex mu;
  std::map<int, int> next;  // sender -> next sequence number expected
  int received = 0;
  std::string error;
  std::promise<void> all;
  rx->start(
      [&](const std::shared_ptr<Channel>&, wire::Envelope& e) {
        std::lock_guard<std::mutex> lock(mu);
        const auto& h = e.hello();
        const int sender = h.pid() / 1000, seq = h.pid() % 1000;
        const std::string want(kBytes, static_cast<char>(sender * 50 + seq % 50));
        if (h.auth() != want && error.empty()) error = "frame of sender " + std::to_string(sender) + " is corrupt";
        if (seq != next[sender] && error.empty()) error = "sender " + std::to_string(sender) + " out of order";
        next[sender] = seq + 1;
        if (++received == kSenders * kFrames) all.set_value();
      },
      [&](const std::shared_ptr<Channel>&, const Status& why) {
        std::lock_guard<std::mutex> lock(mu);
        if (error.empty()) error = "receiver closed: " + why.to_string();
      });
  tx->start([](const std::shared_ptr<Channel>&, wire::Envelope&) {}, [](const std::shared_ptr<Channel>&, const Status&) {});
  auto done = std::async(std::launch::async, [&] { run_io(io); });
  auto frame = [](int sender, int seq) {
    wire::Envelope e;
    auto* h = e.mutable_hello();
    h->set_pid(sender * 1000 + seq);
    h->set_auth(std::string(kBytes, static_cast<char>(sender * 50 + seq % 50)));
    return e;
  };
  std::vector<std::thread> senders;
  for (int t = 0; t < kSenders - 1; ++t) {
    senders.emplace_back([&, t] {
      for (int i = 0; i < kFrames; ++i) tx->send(frame(t, i));
    });
  }
  // The last sender sends from the I/O thread, as handlers do.
  for (int i = 0; i < kFrames; ++i) asio::post(io, [&, i] { tx->send(frame(kSenders - 1, i)); });
  for (auto& t : senders) t.join();
  const bool arrived = all.get_future().wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_TRUE(error.empty()) << error;
    EXPECT_TRUE(arrived) << received << " of " << kSenders * kFrames << " frames arrived";
  }
  tx->close(ok_status());
  rx->close(ok_status());
  io.stop();
  done.wait();
}

}  // namespace
}  // namespace ferry::coordinator
