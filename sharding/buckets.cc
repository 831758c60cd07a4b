#include "sharding/buckets.h"

#include <algorithm>
#include <numeric>
#include <unordered_map>
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

PieceRows piece_rows(std::span<const int64_t> src_size, uint64_t bytes) {
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
  std::vector<Stream> streams;
  // Each (sender, destination) pair's stream: a table over the pairs when they are few enough,
  // else a hash map.
  int64_t senders = 0, dsts = 0;
  bool negative = false;
  for (const Piece& pc : plan.pieces) {
    senders = std::max<int64_t>(senders, int64_t{pc.sender} + 1);
    dsts = std::max<int64_t>(dsts, int64_t{pc.dst} + 1);
    negative |= pc.sender < 0 || pc.dst < 0;
  }
  const bool table = !negative && senders * dsts <= (int64_t{1} << 22);
  std::vector<int> table_index(table ? static_cast<size_t>(senders * dsts) : 0, -1);
  std::unordered_map<uint64_t, int> map_index;
  auto stream_of = [&](int sender, int dst) -> Stream& {
    int& slot = table ? table_index[static_cast<size_t>(int64_t{sender} * dsts + dst)]
                      : map_index.try_emplace(uint64_t{static_cast<uint32_t>(sender)} << 32 | static_cast<uint32_t>(dst), -1)
                            .first->second;
    if (slot < 0) {
      slot = static_cast<int>(streams.size());
      streams.push_back(Stream{BucketCutter(bucket_bytes), Bucket{sender, dst, 0, {}}});
    }
    return streams[static_cast<size_t>(slot)];
  };
  // A stream gathers its open bucket's parts in storage it keeps, and a sent bucket takes a copy
  // of exactly its size: no growing vector per bucket.
  auto send = [&buckets](Stream& s) {
    buckets.push_back(Bucket{s.open.sender, s.open.dst, s.open.bytes, {s.open.parts.begin(), s.open.parts.end()}});
    s.open.bytes = 0;
    s.open.parts.clear();
    s.cutter.sent();
  };
  for (size_t i = 0; i < plan.pieces.size(); ++i) {
    const Piece& pc = plan.pieces[i];
    Stream& s = stream_of(pc.sender, pc.dst);
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
  // The open buckets last, by (sender, destination).
  std::vector<size_t> order(streams.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::make_pair(streams[a].open.sender, streams[a].open.dst) < std::make_pair(streams[b].open.sender, streams[b].open.dst);
  });
  for (size_t k : order) {
    if (!streams[k].cutter.empty()) send(streams[k]);
  }
  return buckets;
}

}  // namespace ferry::sharding
