#include "sharding/buckets.h"

#include <algorithm>
#include <map>
#include <utility>

#include "sharding/planner.h"

namespace ferry::sharding {

int64_t BucketCutter::fit(int64_t rows_left, uint64_t row_bytes, bool whole) const {
  if (rows_left <= 0) return 0;
  if (pieces_ >= kMaxPiecesPerBucket || bytes_ >= bucket_bytes_) return 0;
  if (row_bytes == 0 || whole) return rows_left;
  const uint64_t n = std::min<uint64_t>(static_cast<uint64_t>(rows_left), (bucket_bytes_ - bytes_) / row_bytes);
  if (n == 0 && empty()) return 1;  // a row larger than a bucket travels alone
  return static_cast<int64_t>(n);
}

bool BucketCutter::place(int64_t rows, uint64_t row_bytes) {
  bytes_ += static_cast<uint64_t>(rows) * row_bytes;
  ++pieces_;
  return bytes_ >= bucket_bytes_ || pieces_ >= kMaxPiecesPerBucket;
}

PieceRows piece_rows(const std::vector<int64_t>& src_size, uint64_t bytes) {
  const int64_t rows = src_size.empty() ? 1 : src_size[0];
  return PieceRows{rows, rows > 0 ? bytes / static_cast<uint64_t>(rows) : 0};
}

std::pair<Region, Region> part_regions(const Region& src_full, const Region& dst_full, int64_t first_row,
                                      int64_t rows) {
  Region src = src_full;
  Region dst = dst_full;
  if (!src.size.empty()) {
    const size_t k = dst.size.size() - src.size.size();
    src.offset[0] += first_row;
    src.size[0] = rows;
    dst.offset[k] += first_row;
    dst.size[k] = rows;
  }
  return {src, dst};
}

std::vector<Bucket> cut_buckets(const Plan& plan, uint64_t bucket_bytes) {
  struct Stream {
    BucketCutter cutter;
    Bucket open;
  };
  std::vector<Bucket> buckets;
  std::map<std::pair<int, int>, Stream> streams;  // (sender, dst)
  auto send = [&buckets](Stream& s) {
    buckets.push_back(std::move(s.open));
    s.open = Bucket{buckets.back().sender, buckets.back().dst, 0, {}};
    s.cutter.sent();
  };
  for (size_t i = 0; i < plan.pieces.size(); ++i) {
    const Piece& pc = plan.pieces[i];
    const auto key = std::make_pair(pc.sender, pc.dst);
    auto it = streams.find(key);
    if (it == streams.end()) {
      it = streams.emplace(key, Stream{BucketCutter(bucket_bytes), Bucket{pc.sender, pc.dst, 0, {}}}).first;
    }
    Stream& s = it->second;
    const PieceRows pr = piece_rows(pc.src.size, pc.bytes);
    int64_t row = 0;
    while (row < pr.rows) {
      const int64_t n = s.cutter.fit(pr.rows - row, pr.row_bytes);
      if (n == 0) {
        send(s);
        continue;
      }
      const uint64_t bytes = static_cast<uint64_t>(n) * pr.row_bytes;
      s.open.parts.push_back(BucketPart{static_cast<int>(i), row, n, bytes});
      s.open.bytes += bytes;
      row += n;
      if (s.cutter.place(n, pr.row_bytes)) send(s);
    }
  }
  for (auto& [key, s] : streams) {
    if (!s.cutter.empty()) buckets.push_back(std::move(s.open));
  }
  return buckets;
}

}  // namespace ferry::sharding
