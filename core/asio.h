// Boost.Asio, with the standard headers its 1.74 release forgets under C++20.
#pragma once

#include <utility>

#include <boost/asio.hpp>
