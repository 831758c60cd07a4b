// The data-plane interface every transport implements (tcp, shm, cuda_ipc, ucx, nccl).
//
// Shape, after NIXL and c10d: capability queries; memory registered once per buffer; connection
// info exchanged as an opaque blob through the coordinator; asynchronous post returning a handle
// that can be polled, waited on with a deadline, and aborted. A receiver gets each bucket whole, in
// a callback, in memory valid until the callback returns.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/settings.h"
#include "core/status.h"
#include "core/tensor.h"

namespace ferry::transport {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

struct Capabilities {
  bool local = true;    // reaches peers on this node
  bool remote = false;  // reaches peers on other nodes
  bool host_memory = true;
  bool device_memory = false;
  int device = -1;  // device_memory: the CUDA device this instance moves (current when it was created)
  // A connection reaches only peers that share this node's memory (shm): a sender may hand such a
  // peer references to its device memory (direct reads, ipc_share.h) instead of bytes.
  bool same_host_shared_memory = false;
};

// What a transport acts on, fixed when it is created. The caller makes it from its snapshot of the
// settings (transport_options(settings)) and passes it down: no backend reads FERRY_* variables.
struct TransportOptions {
  // Every listener binds this address only (FERRY_LISTEN_HOST); ucx and nccl also limit their
  // libraries to the network interface that holds it.
  std::string listen_host = "127.0.0.1";
  // Bytes per bucket (FERRY_BUCKET_BYTES). Receive buffers and ring slots are sized from it, a
  // sender's connection when ConnectOptions::max_bucket_bytes is 0, and a receiver refuses buckets
  // larger than 4 times it plus 64 MiB from a connection admitted without a limit of its own.
  uint64_t bucket_bytes = uint64_t{64} << 20;
  // Buckets posted and not yet completed per connection (FERRY_BUCKETS_IN_FLIGHT): the slots of
  // shm's and cuda_ipc's rings.
  int64_t buckets_in_flight = 4;
  // FERRY_TIMEOUT_MS: a shm connection that makes no progress for this long fails
  // (DeadlineExceeded).
  std::chrono::milliseconds timeout{30000};
  // The most a tcp connection this instance opens sends, in bytes per second, paced by the kernel
  // (FERRY_TCP_MAX_MBIT); 0: no cap.
  uint64_t tcp_max_rate = 0;

  // The largest bucket a receiver takes from a connection admitted without a limit of its own
  // (Admission::max_bucket_bytes 0); a peer announcing a larger one is refused.
  uint64_t max_received_bucket() const { return bucket_bytes * 4 + (uint64_t{64} << 20); }
};

// TransportOptions from a snapshot of the settings: listen_host, bucket_bytes, buckets_in_flight,
// timeout_ms and tcp_max_mbit.
TransportOptions transport_options(const Settings& settings);
// The same from load_settings() (the environment): for processes' edges only (tools, tests, benches);
// no library calls it.
Result<TransportOptions> transport_options_from_settings();

// Where buckets of a transport with `caps` are: host memory, or the one device it moves (nccl,
// cuda_ipc), on both ends.
inline Device bucket_device(const Capabilities& caps) {
  return caps.host_memory || caps.device < 0 ? Device::cpu() : Device::cuda(caps.device);
}

// Registered memory: a region the transport may move from or into without further setup.
class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
  virtual void* data() const = 0;
  virtual size_t size() const = 0;
  virtual Device device() const = 0;
};

// One asynchronous operation.
class TransferHandle {
 public:
  virtual ~TransferHandle() = default;
  virtual bool is_completed() = 0;
  // Waits until the operation completes or `deadline` passes (DeadlineExceeded); returns its Status.
  virtual Status wait(Deadline deadline) = 0;
  // Cancels the operation if it has not completed; a later wait() returns Aborted. Never blocks.
  virtual void abort() = 0;
};

// A sender's link to one receiver.
class Connection {
 public:
  virtual ~Connection() = default;
  // Posts `size` bytes at `data` (inside a region registered with this transport) as one bucket.
  // The bytes must stay untouched until the handle completes. Device bytes must be written when
  // post() is called (the work that wrote them finished, not merely queued): device transports
  // copy them on their own streams.
  virtual Result<std::unique_ptr<TransferHandle>> post(const MemoryRegion& region, size_t offset, size_t size) = 0;
  // Fails every pending operation with Aborted and closes the link.
  virtual void abort() = 0;
  // Whether the receiver runs on this host (loopback or one of this host's addresses, shared
  // memory, a same-host UCX lane), where moving bytes costs about what comparing them does.
  // False when the transport cannot tell.
  virtual bool same_host() const { return false; }
};

// Most bytes a credential may have; a receiver reads no more than this from an unadmitted peer.
inline constexpr size_t kMaxCredentialBytes = 256;
// How long a new sending connection has to present its credential; one that has not by then is
// closed.
inline constexpr std::chrono::milliseconds kAdmissionDeadline{5000};

// What admission grants a new sending connection.
struct Admission {
  int64_t peer = 0;  // the peer's identity, passed with every bucket of the connection
  // The largest bucket (header and trailer included) this connection may deliver; 0: the
  // transport's default, TransportOptions::max_received_bucket(). A larger bucket is refused
  // (ResourceExhausted, naming both sizes) and closes the connection before any of it reaches the
  // bucket callback.
  uint64_t max_bucket_bytes = 0;
};

// Decides whether a new sending connection may deliver buckets, from the credential its sender
// presented at connect. Returns what the connection is admitted as (its peer identity and bucket
// limit) or an error, which closes the connection before one byte of a bucket is read or allocated
// for. Never runs at the same time as another callback of the same transport.
using AdmitCallback = std::function<Result<Admission>(std::string_view credential)>;

// One received bucket: `size` bytes at `data`, from the peer whose identity admission returned.
struct ReceivedBucket {
  const uint8_t* data = nullptr;
  size_t size = 0;
  int64_t peer = 0;
  // Where the bytes are: host memory, or for a transport that moves device memory only (cuda_ipc,
  // nccl) the receiver's CUDA device (bucket_device() of its capabilities).
  Device device = Device::cpu();
  // The owner of the bytes when the transport hands them over, else null. A receiver that holds a
  // copy of it keeps the bytes valid past the callback (the transport reads the next bucket into
  // another buffer), so it can read them in place later instead of copying them now. The holder may
  // drop it on any thread, at any time, even after the transport is shut down and destroyed. tcp
  // hands every bucket over; ucx the buckets it receives into its own buffers (rendezvous ones, and
  // eager ones queued behind a rendezvous) but not eager ones delivered in place from UCX's buffer;
  // shm the buckets larger than a ring slot (assembled) but not those it delivers in place from a
  // slot; cuda_ipc and nccl none (their bytes are device memory in a ring or a buffer the transport
  // reuses, which the rank keeps by copying).
  std::shared_ptr<const void> owner;
};

// Called once per received bucket; the bytes stay valid until it returns. A non-OK Status closes
// the sending connection. One transport never runs two callbacks at once. The bytes are where
// `bucket.device` says: host memory unless capabilities().device_memory is set and host_memory is
// not (cuda_ipc, nccl), then device memory on the receiver's device.
using BucketCallback = std::function<Status(const ReceivedBucket& bucket)>;

// Called when an admitted sending peer's connection ends (OK for a clean close). A peer refused at
// admission never reaches it (nor the bucket callback): the transport logs the refusal once.
using PeerClosedCallback = std::function<void(const Status& why)>;

// How a sender connects. Converts from a credential alone.
struct ConnectOptions {
  ConnectOptions() = default;
  ConnectOptions(std::string_view c, uint64_t max_bucket = 0) : credential(c), max_bucket_bytes(max_bucket) {}
  ConnectOptions(const std::string& c, uint64_t max_bucket = 0) : credential(c), max_bucket_bytes(max_bucket) {}
  ConnectOptions(const char* c, uint64_t max_bucket = 0) : credential(c), max_bucket_bytes(max_bucket) {}

  std::string_view credential;  // presented first on the connection; must outlive connect()
  // The largest bucket (header and trailer included) the connection will post; 0: the transport's
  // TransportOptions::bucket_bytes and room for headers. A transport that reserves memory per connection (shm's ring) sizes it so:
  // a bucket larger than that still travels, in pieces.
  uint64_t max_bucket_bytes = 0;
  // What such a transport reserves per bucket in flight, when less than max_bucket_bytes: a
  // connection expected to carry small buckets (references to the sender's memory, colocated direct
  // reads) reserves little, and a larger bucket travels in pieces. 0: max_bucket_bytes.
  uint64_t reserve_bytes = 0;
  // The most buckets the connection will have in flight at once; 0: FERRY_BUCKETS_IN_FLIGHT.
  uint32_t max_in_flight = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string_view name() const = 0;
  virtual Capabilities capabilities() const = 0;

  virtual Result<std::unique_ptr<MemoryRegion>> register_memory(void* data, size_t size, Device device) = 0;

  // Receiver side: starts accepting buckets; returns the connection blob senders connect with.
  // Every new sending connection first presents a credential (within kAdmissionDeadline) that
  // `admit` judges; `admit` empty: every peer is admitted with identity 0 and the default bucket
  // limit. Every listener binds TransportOptions::listen_host only.
  virtual Result<std::string> listen(BucketCallback on_bucket, PeerClosedCallback on_closed, AdmitCallback admit) = 0;
  // Sender side: `options.credential` (at most kMaxCredentialBytes) is presented first on the new
  // connection.
  virtual Result<std::unique_ptr<Connection>> connect(const std::string& blob, Deadline deadline,
                                                      const ConnectOptions& options) = 0;
  // Stops listening and closes every connection.
  virtual void shutdown() = 0;
};

// Transport factories, in priority order (the first that can reach a peer wins).
struct TransportFactory {
  std::string_view name;
  std::function<Result<std::unique_ptr<Transport>>(const TransportOptions& options)> create;
  // Taken by "auto". Off for transports whose receivers get device memory in the callback or that
  // need a communicator set up by the coordinator: they are used only when named.
  bool automatic = true;
};

const std::vector<TransportFactory>& transport_factories();
// Creates the transport `name` names, or for "auto" the first in priority order that can be created
// on this machine.
Result<std::unique_ptr<Transport>> create_transport(std::string_view name, const TransportOptions& options);
// The same with transport_options_from_settings(): for tools and tests that take their options from
// the environment.
Result<std::unique_ptr<Transport>> create_transport(std::string_view name);

}  // namespace ferry::transport
