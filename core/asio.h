// Boost.Asio, with the standard headers its 1.74 release forgets under C++20.
#pragma once

#include <chrono>
#include <cstddef>
#include <thread>
#include <utility>

#include <boost/asio.hpp>

#include "core/settings.h"

namespace ferry {

// Asio's transfer_all moves at most 64 KiB per read or write system call: a large message then costs
// thousands of calls and reactor rounds. This completion condition moves up to 16 MiB per call.
inline std::size_t transfer_all_large(const boost::system::error_code& ec, std::size_t /*transferred*/) {
  return ec ? 0 : std::size_t{16} << 20;
}

// Runs `io` until it is stopped or out of work, like io_context::run(), except that after each
// handler the thread keeps polling for io_spin() before it blocks again: a control message is
// mostly answered within that time (a pause, its ack, the reply), and a sleeping thread takes an
// epoll wake-up, tens to hundreds of microseconds, for each message of such a round trip.
inline void run_io(boost::asio::io_context& io) {
  const auto spin = io_spin();
  while (io.run_one() > 0) {
    auto until = std::chrono::steady_clock::now() + spin;
    while (!io.stopped() && std::chrono::steady_clock::now() < until) {
      if (io.poll() > 0) {
        until = std::chrono::steady_clock::now() + spin;
      } else {
        std::this_thread::yield();
      }
    }
    if (io.stopped()) break;
  }
}

}  // namespace ferry
