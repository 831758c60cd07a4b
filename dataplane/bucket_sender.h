// The data-sending half of the trainer: connections to every destination rank, a pool of bucket
// buffers per rank, and the pieces of each sent tensor packed into them (or handed over as direct
// reads of the trainer's device memory). The Trainer owns one and drives it per update.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/status.h"
#include "dataplane/piece_pack.h"
#include "transport/transport.h"

namespace ferry {
struct Device;
struct Region;
class TensorView;
}  // namespace ferry
namespace ferry::sharding {
struct Piece;
struct Plan;
struct RankSpec;
struct SourceTensor;
}  // namespace ferry::sharding
namespace ferry::transport {
class Transport;
class IpcExporter;
}  // namespace ferry::transport
namespace ferry::wire {
class Endpoint;
}

namespace ferry::dataplane {

class BucketBuilder;

struct BucketSenderSettings {
  bool verify = false;        // FERRY_VERIFY
  DeltaMode delta = DeltaMode::kOff;
  uint64_t delta_max_bytes = 0;  // FERRY_DELTA_MAX_BYTES: the copies kept for deltas
  int delta_zstd = 0;            // FERRY_DELTA_ZSTD: zstd level for delta pieces (0: off)
  bool delta_copy_on_device = false;  // FERRY_DELTA_COPY=device: a GPU tensor's copy and compare on its GPU
  bool direct = false;        // FERRY_DIRECT allows direct reads
  std::string transport = "auto";  // FERRY_TRANSPORT: the one allowed, or "auto"
  // What the transports it creates are made with; also the sender's deadlines (timeout) and the
  // most buckets in flight per destination (buckets_in_flight).
  transport::TransportOptions transport_options;
};

// The bucket buffer a sender keeps for destination `dst` of `plan`: the plan's bytes for it up to
// the bucket size, at least its largest row, and the header's room.
size_t bucket_capacity(const sharding::Plan& plan, size_t dst);

// For tests: runs on every bucket in host memory after it is sealed and before it is posted, with
// its destination rank, its bytes and their size; it may change the bytes, as a faulty link would,
// or fail the post (the update then fails with that error, as when a link goes down). Process-wide,
// for every BucketSender; an empty function removes it.
using SealedBucketHook = std::function<Status(int replica, int tp_rank, uint8_t* bucket, size_t size)>;
void set_sealed_bucket_hook_for_testing(SealedBucketHook hook);

class BucketSender {
 public:
  // `on_posted` runs after each bucket is posted (the trainer's progress bar).
  BucketSender(BucketSenderSettings settings, std::function<void()> on_posted);
  ~BucketSender();
  BucketSender(const BucketSender&) = delete;
  BucketSender& operator=(const BucketSender&) = delete;

  // Who sends (this trainer's member id, written into every bucket), its data key, and each
  // destination rank's member id: a new data connection presents a credential made from them and
  // its largest bucket (credential.h).
  struct Identity {
    int sender = 0;
    std::string key;
    std::vector<int> receivers;
    int index = 0;  // this sender's index in the plan (its trainer rank): it sends only the pieces given it
    // Per rank, the version whose values it keeps for deltas (Member.delta_base; 0: none): a piece
    // goes to it as a delta only against a copy this sender recorded at that version.
    std::vector<uint64_t> delta_bases;
  };

  // Connects to every rank of `plan` (keeping connections of the last update that are still good)
  // and sizes the bucket pools; then starts counting for update `version`. `ranks` must outlive the
  // update. `endpoints` per rank in its preference order; `storage_devices` per rank.
  Status prepare(uint64_t version, std::shared_ptr<const sharding::Plan> plan, const std::vector<sharding::RankSpec>& ranks,
                 const std::vector<std::vector<wire::Endpoint>>& endpoints,
                 const std::vector<std::string>& storage_devices, Identity identity);
  // Sends the pieces of manifest tensor `source` (`meta`) the plan gives this sender, read from
  // `tensor`, the local tensor backing box `held` of the global one, into buckets cut by the plan's
  // bucket rule (sharding/buckets.h): tensors sent in plan order make the plan's buckets.
  Status send(size_t source, const sharding::SourceTensor& meta, const TensorView& tensor, const Region& held);
  // Posts the open buckets (none once `failure` is set) and waits for every bucket in flight; a
  // destination whose bucket failed reconnects next update. Returns `failure`, else the first error.
  Status finish(Status failure);

  // Manifest tensors of which the plan gave this sender pieces it has not sent this update.
  std::vector<size_t> unsent() const;

  uint64_t bytes() const { return bytes_; }
  uint64_t direct_bytes() const { return direct_bytes_; }
  // What delta encoding did this update, per destination rank in plan order.
  const std::vector<DeltaTally>& delta_tallies() const { return delta_tallies_; }
  uint64_t delta_copy_bytes() const;      // host bytes kept for deltas
  // Bytes this update compared against the kept copies: each part once, however many ranks (of
  // identical replicas) take it.
  uint64_t compared_bytes() const { return scratch_.compared_bytes; }
  // This update's time comparing and encoding deltas, and keeping the copies for the next one.
  double compare_seconds() const { return scratch_.compare_seconds; }
  double copy_seconds() const { return scratch_.copy_seconds; }
  std::vector<uint64_t> buckets() const;  // posted this update, per destination

 private:
  struct Destination;

  Result<transport::Transport*> transport_named(const std::string& name);
  Status connect_dest(Destination& d, size_t i, const std::vector<std::vector<wire::Endpoint>>& endpoints,
                      uint64_t max_bucket, size_t max_in_flight, uint64_t reserve);
  Status connect_all(const std::vector<std::vector<wire::Endpoint>>& endpoints,
                     const std::vector<std::string>& storage_devices);
  Result<BucketBuilder*> open_bucket(Destination& d);
  struct Part {
    BucketBuilder* bucket;
    int64_t rows;
  };
  Result<Part> next_part(Destination& d, int64_t rows_left, uint64_t row_bytes, bool payload);
  Status placed(Destination& d, int64_t rows, uint64_t row_bytes);
  Status flush(Destination& d);
  Status sync_source(Device device);
  Result<bool> send_direct(Destination& d, const sharding::Piece& piece, const Region& dst,
                           const TensorView& tensor);
  // One of this sender's pieces of a tensor, as it lies in the local tensor, where it goes, and the
  // copy a delta to its rank is computed against (null: none).
  struct Route;
  Result<DeltaBases::Base*> compare_boxes(const std::string& name, const TensorView& tensor_in, const Region& held,
                                          const std::vector<Route>& routes, Buffer& host, TensorView& tensor);

  BucketSenderSettings settings_;
  std::function<void()> on_posted_;
  std::vector<std::unique_ptr<transport::Transport>> transports_;
  std::shared_ptr<const sharding::Plan> plan_;
  const std::vector<sharding::RankSpec>* ranks_ = nullptr;
  std::vector<Destination> dests_;
  std::unique_ptr<transport::IpcExporter> exporter_;
  std::set<int> synced_devices_;  // devices synchronized in this update
  bool warned_export_ = false;
  uint64_t version_ = 0;
  Identity identity_;
  uint64_t bytes_ = 0;
  uint64_t direct_bytes_ = 0;
  std::vector<uint32_t> pieces_given_, pieces_sent_;  // per manifest tensor, this update
  std::unique_ptr<DeltaBases> bases_;
  bool keep_bases_ = false;  // some rank of this update takes deltas: copies are kept
  std::vector<DeltaTally> delta_tallies_;
  PackScratch scratch_;
};

}  // namespace ferry::dataplane
