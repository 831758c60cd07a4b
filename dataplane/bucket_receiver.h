// The receiving half of a rank's data plane: who may send (admission of data connections), and what
// a bucket does once it arrives: decoded and checked (header, checksum under FERRY_VERIFY, the
// sender its connection proved, the open update), then its pieces handed to the reload engine:
// lent from a kept device payload or a bucket the transport handed over, read in place from a
// colocated sender's device memory (direct pieces), or borrowed for the call when nothing keeps the
// bytes. The RolloutWorker owns one and drives it from its transports' callbacks.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "core/buffer.h"
#include "core/status.h"
#include "core/tensor.h"
#include "dataplane/device_bucket.h"
#include "proto/ferry.pb.h"
#include "transport/transport.h"

namespace ferry::reload {
class ReloadEngine;
struct PieceBytes;
}
namespace ferry::transport {
class IpcImporter;
}

namespace ferry::dataplane {

class BucketReceiver {
 public:
  // `engine` writes the rank's storage on `storage_device`; `verify`: every bucket must carry a
  // checksum (FERRY_VERIFY), checked on decode.
  BucketReceiver(reload::ReloadEngine& engine, Device storage_device, bool verify);
  ~BucketReceiver();

  // This rank's member id, once it joined: credentials are made out to it.
  void set_receiver(int member_id);
  // The senders of the update opening now and their data keys (the Pause): only they are admitted,
  // and only their buckets are taken. Thread-safe.
  void set_senders(std::map<int, std::string> keys);
  // A transport's AdmitCallback: the sender's member id and the largest bucket it announced for the
  // connection (credential.h), or Unauthenticated. Thread-safe.
  Result<transport::Admission> admit(std::string_view credential);

  // A bucket after decoding: its header, or why it is refused.
  struct Decoded {
    wire::BucketHeader header;
    Status status;
  };
  // Decodes and checks `bucket` (in memory of `where`) apart from the engine: header and pieces'
  // bounds, checksum, and that its sender is the one its connection proved.
  Decoded decode(const transport::ReceivedBucket& bucket, Device where) const;
  // Hands a decoded bucket's pieces to the engine, for update `open_update`; the caller holds the
  // engine's lock. False when the bucket belongs to an earlier (aborted) update and was dropped;
  // else true, with `*status` saying whether its pieces were taken.
  bool take(const Decoded& d, const transport::ReceivedBucket& bucket, Device where, uint64_t open_update,
            Status* status);

 private:
  Status announce(const wire::IpcAllocation& a);
  Status take_delta(const wire::PieceHeader& p, const Region& dst, DType dtype, const uint8_t* payload,
                    Device payload_device);
  Result<reload::PieceBytes> direct_bytes(uint64_t nonce, const wire::PieceHeader& p);

  reload::ReloadEngine& engine_;
  Device device_;
  bool verify_;
  std::unique_ptr<transport::IpcImporter> importer_;  // device storage: colocated senders' memory
  PayloadPool payloads_;                              // device buckets' payloads, kept for the engine
  Buffer delta_upload_;  // deltas into a device shadow, on their way there (delta_device.h); take() is called under
                         // its caller's lock (RolloutWorker's), one bucket at a time

  mutable std::mutex senders_mu_;
  int receiver_ = 0;
  std::map<int, std::string> senders_;  // member id -> data key, of the current update's senders
};

}  // namespace ferry::dataplane
