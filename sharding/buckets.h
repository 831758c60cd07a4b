// The one rule by which pieces become buckets. The sender follows it as it packs, the planner
// follows it to lay out the plan's buckets for the cost model, so the buckets an update sends are
// the plan's buckets whenever the tensors are sent in plan order (as Trainer::update_weights does).
//
// Per (sender, destination) stream, in the order pieces are sent: a bucket carries at most
// `bucket_bytes` of weight bytes (in its payload, or referenced in a colocated sender's memory) and
// at most kMaxPiecesPerBucket pieces. A piece that does not fit whole fills the open bucket with as
// many whole rows (of its first dimension) as fit, and continues in the next; a single row larger
// than a bucket travels alone. A bucket is sent as soon as it is full: when it reaches its bytes or
// its pieces, or when not even one row of the next piece fits; the last one when the update ends.
// A direct piece (colocated ranks read it in place from the trainer's memory) is never cut: it
// joins the open bucket whole, which is then sent once it references the bucket size. The planner
// cannot know which pieces will go direct (that is decided per rank at run time), so the plan's
// buckets are those of an update that sends bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace ferry::sharding {

struct Plan;

inline constexpr uint64_t kDefaultBucketBytes = uint64_t{64} << 20;
// Pieces per bucket: with this bound a bucket's header fits in a fixed room beside its payload.
inline constexpr size_t kMaxPiecesPerBucket = 2048;

// A piece's rows (its first dimension; 1 for a scalar) and the bytes of one.
struct PieceRows {
  int64_t rows = 0;
  uint64_t row_bytes = 0;
};

// The open bucket of one (sender, destination) stream.
class BucketCutter {
 public:
  explicit BucketCutter(uint64_t bucket_bytes) : bucket_bytes_(bucket_bytes) {}

  // How many of a piece's next `rows_left` rows of `row_bytes` go into the open bucket; 0 when the
  // open bucket must be sent first (then sent(), and ask again). `whole`: a direct piece (a
  // reference to the trainer's memory, with no payload) is never cut, so that the rank's kernels
  // read it in place whole; it joins the open bucket unless that holds its most pieces.
  int64_t fit(int64_t rows_left, uint64_t row_bytes, bool whole = false) const;
  // Records `rows` rows of `row_bytes` placed as one piece; true when the bucket is full now and
  // must be sent.
  bool place(int64_t rows, uint64_t row_bytes);
  // The open bucket was sent (or dropped); the next piece opens a new one.
  void sent() {
    bytes_ = 0;
    pieces_ = 0;
  }
  bool empty() const { return pieces_ == 0; }
  uint64_t bytes() const { return bytes_; }  // placed in the open bucket
  uint64_t bucket_bytes() const { return bucket_bytes_; }

 private:
  uint64_t bucket_bytes_;
  uint64_t bytes_ = 0;
  size_t pieces_ = 0;
};

// One piece's rows [first_row, first_row + rows) inside a bucket.
struct BucketPart {
  int piece = 0;  // index into Plan::pieces
  int64_t first_row = 0;
  int64_t rows = 0;
  uint64_t bytes = 0;
};

// What one bucket carries; the unit a transport moves.
struct Bucket {
  int sender = 0;
  int dst = 0;
  uint64_t bytes = 0;
  std::vector<BucketPart> parts;  // in plan order
};

PieceRows piece_rows(std::span<const int64_t> src_size, uint64_t bytes);
// The source and destination regions of rows [first_row, first_row + rows) of a piece whose whole
// regions are `src` and `dst` (the source's first dimension is destination dimension
// `dst.size.size() - src.size.size()`).
std::pair<Region, Region> part_regions(const Region& src, const Region& dst, int64_t first_row, int64_t rows);

// The plan's pieces, in plan order, cut into buckets of `bucket_bytes` by the rule above; buckets in
// the order they are sent (each when it fills, the open ones at the end).
std::vector<Bucket> cut_buckets(const Plan& plan, uint64_t bucket_bytes);

}  // namespace ferry::sharding
