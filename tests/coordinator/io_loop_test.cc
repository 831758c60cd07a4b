// The control plane's waits: run_io() (an I/O thread that polls for FERRY_IO_SPIN_US after each
// handler) and Mailbox::wait() (which polls as long before it sleeps) still run every handler, end
// when stopped or out of work, and keep their deadlines.
#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace ferry::coordinator
