// BucketSender's state per destination rank, shared by its two halves: bucket_sender.cc (the
// connections, bucket buffers and buckets in flight) and bucket_sender_pieces.cc (a tensor's pieces
// into those buckets: read in place, compared for deltas, packed). Private to the data plane's send
// end.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dataplane/bucket.h"
#include "dataplane/bucket_sender.h"
#include "sharding/buckets.h"
#include "transport/transport.h"

namespace ferry::dataplane {

// One destination rank: its connection, a pool of bucket buffers, and the buckets in flight.
struct BucketSender::Destination {
  std::string endpoint;  // the blob connected to
  transport::Transport* transport = nullptr;
  std::unique_ptr<transport::Connection> conn;
  std::vector<std::unique_ptr<BucketBuilder>> pool;
  std::vector<std::unique_ptr<transport::MemoryRegion>> regions;
  std::deque<std::pair<std::unique_ptr<transport::TransferHandle>, size_t>> in_flight;
  std::vector<size_t> free;
  int open = -1;                                                 // builder being filled
  sharding::BucketCutter cutter{sharding::kDefaultBucketBytes};  // the open bucket, by the bucket rule
  uint64_t buckets = 0;
  uint64_t seq = 0;
  bool direct = false;                   // reads this trainer's device tensors in place
  Device bucket_device = Device::cpu();  // where the buckets are (a device transport's device)
  std::set<uint64_t> announced;          // shared allocations this connection was told of
  uint64_t connected_for = 0;            // the largest bucket the connection was opened for
  size_t connected_in_flight = 0;        // and the most buckets in flight it was opened for
  uint64_t reserved = 0;                 // and what it reserves per bucket, when less (0: connected_for)
  bool carried_bytes = false;            // payload went over a connection that reserved less
  uint64_t delta_base = 0;               // the version the rank keeps for deltas (0: none)
  bool deltas = false;                   // takes deltas this update (FERRY_DELTA and its link)
  bool open_compared = false;            // the open bucket holds parts compared for deltas
};

}  // namespace ferry::dataplane
