// ucx: a UCP context and worker per transport instance, driven by one progress thread that makes
// every UCP call on that worker; each lane of a connection to a listener on this host gets a
// context, worker and progress thread of its own (below). Buckets travel as active messages (eager
// or rendezvous, UCX decides). The sending side is in ucx_sender.cc (a connection's lanes) and
// ucx_connection.cc (one endpoint), the receiving side in ucx_receiver.cc, with its admission
// (ucx_admission.cc) and its streams (ucx_stream.cc); this file holds the transport. listen() opens
// a UCP sockaddr listener and returns "ucx://host:port/boot-id/local-port,local-port" (the last for
// this host's senders, below).
//
// Error handling mode, by where the peer is:
// - Another host: peer error handling (UCP_ERR_HANDLING_MODE_PEER). UCX then reports a peer's
//   failure on the endpoint, and abort() is a forced close, which UCX allows only in that mode.
// - The same host (the blob's boot id is ours): none. With peer error handling UCX 1.13 uses only
//   transports that report peer failures, which on one node is its tcp (not its shared-memory
//   transports, nor cma), at about half of what OpenMPI moves through shared memory. Without it,
//   UCX picks shared memory for messages and cma for rendezvous. What that mode gives up, and
//   what stands in for it here:
//   - Forced close. UCX refuses it, and an endpoint may not be closed or freed with requests still
//     on it. So the connection's endpoint lives on a worker of its own (in a UCP context of its
//     own: memory the transport mapped is not passed to it, and UCX registers per operation what
//     shared memory and cma need, which is nothing), and abort(), a failure or the end of a close
//     destroy that worker (Engine::teardown()): every request on it stops there, and only then are
//     the caller's handles completed, so no bucket is reported while UCX may still read its bytes.
//     A kAbortId message goes first (best effort) so the receiver reports Aborted.
//   - A dead peer. The endpoint keeps its sockaddr connection (UCX's tcp connection manager) for
//     its whole life; the kernel closes it when a process dies, UCX fails the endpoint and calls
//     its error handler (UCX 1.13 calls it in any mode once one is installed). The conformance
//     suite's peer-death cases check it over shared memory.
//   - Order between the connection and the data. The connection manager's close overtakes
//     messages still waiting in shared memory, and UCX drops what arrives for an endpoint it
//     closed. A clean close therefore waits for the receiver: the sender says goodbye and keeps its
//     endpoint until the receiver acknowledges it (kByeAckId) or drops the connection; a receiver
//     handles an endpoint's failure only after draining its worker (Engine::after_drain).
//   - Stale messages. The receiver's context turns UCX's indirect ids on (ucx_engine.h), as UCX
//     does for peer mode, so a message for one of its endpoints already closed is dropped.
//   - Two cores. One endpoint moves one bucket at a time through one cma copy on one thread (the
//     receiver's, which reads it: UCX's default get rendezvous), about half of what this host's
//     memory moves. So a same-host connection has lanes (one per host thread, FERRY_THREADS, at most
//     kMaxSameHostLanes): each an endpoint on a context, worker and progress thread of its own, taking buckets in turn.
//     The receiver listens for this host's senders on one listener per lane, each on a context
//     and progress thread of its own, whose ports the blob carries after the boot id, and lane k
//     connects to listener k: each lane's copy runs on a receiving thread of its own, so two
//     buckets are copied at once. UCX's rendezvous scheme is left as it is (its put scheme made
//     UCX 1.13.1 assert in the receiver's worker when a sender died mid-transfer). The
//     transport's listener and context, which senders on other hosts use, are not involved. Every
//     message on a lane carries a LaneHeader (ucx_engine.h): the receivers join the lanes into
//     one stream (shared between their threads under a lock: ucx_stream.h), deliver its
//     buckets in the order posted, report its end once, and answer the goodbyes once every lane
//     has said one. A lane that fails fails the others.
//
// Memory a sender registers is mapped with the transport's context once (ucp_mem_map) and each
// post to another host passes that mapping; the receiver lands rendezvous buckets in pooled
// buffers mapped once and hands them over (ReceivedBucket::owner). The user's UCX_* variables are
// read as they are (ucp_config_read) and never written. Device memory goes through a pinned host
// mirror when this UCX build cannot move CUDA memory itself (checked at run time).
#include "transport/ucx/ucx_transport.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "transport/admission.h"
#include "transport/ucx/ucx_engine.h"
#include "transport/ucx/ucx_receiver.h"
#include "transport/ucx/ucx_regions.h"
#include "transport/ucx/ucx_sender.h"

namespace ferry::transport {
namespace {

using ucx::Engine;

class UcxTransport final : public Transport {
 public:
  UcxTransport(std::shared_ptr<Engine> e, const TransportOptions& options) : options_(options), engine_(std::move(e)) {}
  ~UcxTransport() override {
    shutdown();
    engine_->stop();
  }
  std::string_view name() const override { return "ucx"; }
  Capabilities capabilities() const override { return {true, true, true, false, -1}; }

  Result<std::unique_ptr<MemoryRegion>> register_memory(void* data, size_t size, Device device) override {
    return ucx::register_region(engine_, data, size, device);
  }

  // The transport's listener, for senders on other hosts, and one per lane for this host's
  // senders, each on a context and progress thread of its own (top of this file). The local ones
  // share their streams and receive buffers (ucx::make_stream_table()). Their callbacks take turns.
  Result<std::string> listen(BucketCallback on_bucket, PeerClosedCallback on_closed, AdmitCallback admit) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (receiver_) return Status::failed_precondition("ucx: listen() was already called on this transport");
    const std::string& host = options_.listen_host;
    const uint64_t default_max_bucket = options_.max_received_bucket();
    auto turn = std::make_shared<std::mutex>();
    BucketCallback bucket_cb = [turn, cb = std::move(on_bucket)](const ReceivedBucket& b) {
      std::lock_guard<std::mutex> l(*turn);
      return cb(b);
    };
    AdmitCallback admit_cb;
    if (admit) {
      admit_cb = [turn, cb = std::move(admit)](std::string_view credential) {
        std::lock_guard<std::mutex> l(*turn);
        return cb(credential);
      };
    }
    PeerClosedCallback closed_cb = [turn, cb = std::move(on_closed)](const Status& why) {
      std::lock_guard<std::mutex> l(*turn);
      if (cb) cb(why);
    };
    ucx::Listening main;
    FERRY_ASSIGN_OR_RETURN(receiver_,
                           ucx::start_receiver(engine_, host, default_max_bucket, bucket_cb, closed_cb, admit_cb, &main));
    const std::string blob = main.blob;
    if (ucx::host_identity().empty() || ucx::same_host_lanes() < 2) return blob;
    std::string ports;
    auto table = ucx::make_stream_table();  // the lanes of one connection reach different listeners
    for (uint32_t i = 0; i < ucx::same_host_lanes(); ++i) {
      auto local = std::make_shared<Engine>();
      ucx::Listening where;
      Status st = local->init(host, /*indirect_ids=*/true);
      if (st.ok()) {
        auto r = ucx::start_receiver(local, host, default_max_bucket, bucket_cb, closed_cb, admit_cb, &where, table);
        if (r.ok()) {
          local_receivers_.push_back(*r);
          local_engines_.push_back(local);
        } else {
          st = r.status();
        }
      }
      if (!st.ok()) {
        local->stop();
        break;
      }
      if (!ports.empty()) ports += ",";
      ports += std::to_string(where.port);
    }
    if (local_receivers_.size() < 2) {  // this host's senders then use the transport's listener, with one lane
      for (auto& r : local_receivers_) ucx::stop_receiver(r);
      local_receivers_.clear();
      for (auto& e : local_engines_) e->stop();
      local_engines_.clear();
      return blob;
    }
    return blob + "/" + ports;
  }

  // "ucx://host:port/boot-id[/local-port,local-port]"; without the boot id (or with another one)
  // the peer counts as on another host, and the endpoint keeps peer error handling. A sender on
  // this host connects lane k to local port k (one lane to the transport's port if there are none).
  Result<std::unique_ptr<Connection>> connect(const std::string& blob, Deadline deadline,
                                              const ConnectOptions& options) override {
    const std::string_view credential = options.credential;
    FERRY_RETURN_IF_ERROR(check_credential(credential).with_context("ucx connect"));
    constexpr std::string_view kScheme = "ucx://";
    if (!blob.starts_with(kScheme)) return Status::invalid_argument("ucx: malformed endpoint '" + blob + "'");
    std::string address = blob.substr(kScheme.size());
    std::string boot;
    std::vector<uint16_t> local_ports;
    if (const size_t slash = address.find('/'); slash != std::string::npos) {
      boot = address.substr(slash + 1);
      address.resize(slash);
      if (const size_t second = boot.find('/'); second != std::string::npos) {
        std::string list = boot.substr(second + 1);
        boot.resize(second);
        size_t at = 0;
        while (at <= list.size()) {
          const int p = std::atoi(list.c_str() + at);
          if (p <= 0 || p > 65535) return Status::invalid_argument("ucx: malformed port in '" + blob + "'");
          local_ports.push_back(static_cast<uint16_t>(p));
          const size_t comma = list.find(',', at);
          if (comma == std::string::npos) break;
          at = comma + 1;
        }
      }
    }
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos || colon == 0) return Status::invalid_argument("ucx: malformed endpoint '" + blob + "'");
    const int port = std::atoi(address.c_str() + colon + 1);
    if (port <= 0 || port > 65535) return Status::invalid_argument("ucx: malformed port in '" + blob + "'");
    const bool same_host = !boot.empty() && boot == ucx::host_identity();
    auto conn = ucx::connect_sender(engine_, address.substr(0, colon), static_cast<uint16_t>(port), local_ports,
                                    same_host, credential, deadline);
    if (!conn.ok()) return conn.status().with_context("ucx connect to " + blob);
    return conn;
  }

  void shutdown() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (receiver_) ucx::stop_receiver(receiver_);
    receiver_.reset();
    for (auto& r : local_receivers_) ucx::stop_receiver(r);
    local_receivers_.clear();
    for (auto& e : local_engines_) e->stop();
    local_engines_.clear();
  }

 private:
  const TransportOptions options_;
  std::shared_ptr<Engine> engine_;
  std::mutex mu_;
  std::shared_ptr<ucx::Receiver> receiver_;
  std::vector<std::shared_ptr<Engine>> local_engines_;  // this host's senders' listeners, one per lane
  std::vector<std::shared_ptr<ucx::Receiver>> local_receivers_;
};

}  // namespace

std::string ucx_endpoint_info(Connection& c) { return ucx::describe_connection(c); }

std::vector<uint64_t> ucx_lane_bytes(Connection& c) { return ucx::lane_bytes(c); }

Result<std::unique_ptr<Transport>> create_ucx_transport(const TransportOptions& options) {
  auto engine = std::make_shared<ucx::Engine>();
  FERRY_RETURN_IF_ERROR(engine->init(options.listen_host));
  return std::unique_ptr<Transport>(std::make_unique<UcxTransport>(std::move(engine), options));
}

}  // namespace ferry::transport
