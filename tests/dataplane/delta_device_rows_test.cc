// The rows a delta writes in, marked on the device as it writes them (dataplane/delta_device.h
// RowMarks), against a plain loop written here. Skips without a device.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "dataplane/delta.h"
#include "dataplane/delta_device.h"
#include "tests/dataplane/delta_device_util.h"

namespace ferry::dataplane {
namespace {

using device_testing::Bytes;
using device_testing::changed_at;
using device_testing::on_device;
using device_testing::random_bytes;
using device_testing::to_host;

// The rows a delta writes in are marked as it is written, whichever way it reaches the device (a
// bitmap or runs encoding from the host, a runs encoding in device memory): exactly the rows of
// `per_row` elements that hold a changed element, at rows shorter and longer than a bitmap byte's 8
// elements and not aligned to it, changes at the first and last element; a mark already set on a
// row the delta does not touch stays.
TEST(DeltaOnDevice, TheRowsADeltaWritesInAreMarked) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(23);
  const size_t n = 50'021;
  for (size_t elem : {1, 2, 4, 8}) {
    const Bytes old = random_bytes(n * elem, rng);
    for (const uint64_t per_row : {uint64_t{1}, uint64_t{5}, uint64_t{8}, uint64_t{100}, uint64_t{4096}}) {
      for (double rate : {0.0, 0.0005, 0.03, 0.5}) {
        Bytes now = changed_at(old, n, elem, rate, rng);
        if (rate > 0) {
          now[0] ^= 1;
          now[(n - 1) * elem] ^= 1;
        }
        const size_t rows = (n + per_row - 1) / per_row;
        // The middle row keeps its old values; a mark set on it before stays.
        const size_t kept = rows / 2;
        const size_t kept_end = std::min<size_t>((kept + 1) * per_row, n);
        std::copy(old.begin() + static_cast<std::ptrdiff_t>(kept * per_row * elem),
                  old.begin() + static_cast<std::ptrdiff_t>(kept_end * elem),
                  now.begin() + static_cast<std::ptrdiff_t>(kept * per_row * elem));
        std::vector<uint8_t> want(rows, 0);
        for (size_t e = 0; e < n; ++e) {
          if (std::memcmp(old.data() + e * elem, now.data() + e * elem, elem) != 0) want[e / per_row] = 1;
        }
        ASSERT_EQ(want[kept], 0);
        want[kept] = 1;
        for (const bool prefer_delta : {true, false}) {  // runs, and a bitmap where it is smaller
          Bytes enc;
          const DeltaChoice c = encode_delta(old.data(), now.data(), n, elem, prefer_delta, enc);
          if (c.encoding == DeltaEncoding::kDense) continue;
          const auto field = static_cast<uint32_t>(c.encoding);
          const std::string what =
              fmt::format("elem {} per_row {} rate {} {}", elem, per_row, rate, encoding_name(c.encoding));
          Buffer d = on_device(old), upload;
          std::vector<uint8_t> marks(rows, 0);
          marks[kept] = 1;
          const RowMarks marked{per_row, marks.data()};
          ASSERT_TRUE(
              apply_delta_on_device(field, enc.data(), enc.size(), d.data(), Device::cuda(0), n, elem, upload, &marked)
                  .ok())
              << what;
          EXPECT_TRUE(to_host(d, old.size()) == now) << what;
          EXPECT_TRUE(marks == want) << what;
          if (c.encoding != DeltaEncoding::kRuns) continue;
          Buffer payload = on_device(enc), e = on_device(old);
          std::fill(marks.begin(), marks.end(), 0);
          marks[kept] = 1;
          ASSERT_TRUE(apply_device_runs(field, payload.data_as<uint8_t>(), enc.size(), enc.size() - c.changed * elem,
                                        e.data(), Device::cuda(0), n, elem, upload, &marked)
                          .ok())
              << what << " in device memory";
          EXPECT_TRUE(to_host(e, old.size()) == now) << what << " in device memory";
          EXPECT_TRUE(marks == want) << what << " in device memory";
        }
      }
    }
  }
}

}  // namespace
}  // namespace ferry::dataplane
