// A rank that borrows pieces from host buckets it does not keep, as the benches model it: a piece is
// borrowed into the open bucket (cut by the bucket rule, sharding/buckets.h) and a bucket's pieces
// are released when it is done.
#pragma once

#include <cstddef>

#include "core/status.h"
#include "reload/engine.h"
#include "sharding/buckets.h"

namespace ferry::bench {

template <class Borrow>
Status borrow_in_buckets(reload::ReloadEngine& engine, sharding::BucketCutter& bucket, Borrow borrow, size_t bytes) {
  if (bucket.fit(1, bytes) == 0) {
    FERRY_RETURN_IF_ERROR(engine.release_borrowed());
    bucket.sent();
  }
  FERRY_RETURN_IF_ERROR(borrow());
  if (bucket.place(1, bytes)) {
    FERRY_RETURN_IF_ERROR(engine.release_borrowed());
    bucket.sent();
  }
  return ok_status();
}

}  // namespace ferry::bench
