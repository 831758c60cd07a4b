// Boost.Asio, with the standard headers its 1.74 release forgets under C++20.
#pragma once

#include <cstddef>
#include <utility>

#include <boost/asio.hpp>

namespace ferry {

// Asio's transfer_all moves at most 64 KiB per read or write system call: a large message then costs
// thousands of calls and reactor rounds. This completion condition moves up to 16 MiB per call.
inline std::size_t transfer_all_large(const boost::system::error_code& ec, std::size_t /*transferred*/) {
  return ec ? 0 : std::size_t{16} << 20;
}

}  // namespace ferry
