// ucx's sending side: a connection as the caller holds it, its buckets going to its lanes in turn
// (one endpoint to another host; one per host thread to a receiver on this host, each on an engine of its
// own: ucx_connection.h), and the close of a connection's lanes. ucx_transport.cc says why same-host
// lanes look the way they do.
#include "transport/ucx/ucx_sender.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "core/parallel.h"
#include "transport/ucx/ucx_connection.h"
#include "transport/ucx/ucx_engine.h"

namespace ferry::transport::ucx {
namespace {

// Closes every lane of a connection: all say goodbye, then each waits for its answer (until
// `deadline`), then each private engine is torn down.
void close_lanes(const std::vector<std::shared_ptr<UcxConnection>>& lanes, Deadline deadline) {
  std::vector<std::shared_ptr<CompletionState>> closing;
  for (const auto& lane : lanes) closing.push_back(lane->begin_close());
  for (const auto& done : closing) done->wait(deadline).ignore_error();
  for (const auto& lane : lanes) lane->finish_close();
}

// The caller's handle: closing it says goodbye and closes the endpoints. Buckets go to the lanes in
// turn (one lane unless the receiver is on this host).
class OwnedUcxConnection final : public Connection {
 public:
  OwnedUcxConnection(std::vector<std::shared_ptr<UcxConnection>> lanes, bool same_host)
      : lanes_(std::move(lanes)), same_host_(same_host) {}
  ~OwnedUcxConnection() override { close_lanes(lanes_, Clock::now() + std::chrono::seconds(10)); }
  Result<std::unique_ptr<TransferHandle>> post(const MemoryRegion& r, size_t o, size_t s) override {
    return lanes_[next_lane_.fetch_add(1, std::memory_order_relaxed) % lanes_.size()]->post(r, o, s);
  }
  void abort() override {
    for (const auto& lane : lanes_) lane->abort();
  }
  bool same_host() const override { return same_host_; }
  std::string describe() { return lanes_.front()->describe(); }
  std::vector<uint64_t> lane_bytes() const {
    std::vector<uint64_t> out;
    for (const auto& lane : lanes_) out.push_back(lane->bytes_sent());
    return out;
  }

 private:
  std::vector<std::shared_ptr<UcxConnection>> lanes_;
  const bool same_host_;
  std::atomic<uint64_t> next_lane_{0};
};

}  // namespace

uint32_t same_host_lanes() { return static_cast<uint32_t>(std::clamp<size_t>(host_threads(), 1, kMaxSameHostLanes)); }

Result<std::unique_ptr<Connection>> connect_sender(const std::shared_ptr<Engine>& shared, const std::string& host,
                                                   uint16_t port, const std::vector<uint16_t>& local_ports,
                                                   bool same_host, std::string_view credential, Deadline deadline) {
  std::vector<std::shared_ptr<UcxConnection>> lanes;
  if (same_host) {  // lanes, each on a worker of its own, torn down to stop its requests (ucx_transport.cc)
    // The id: a random part per process (a pid comes back when a container's trainer restarts, and
    // receivers remember the ids of streams that ended) and a counter.
    static std::atomic<uint32_t> streams{0};
    static const uint64_t process = static_cast<uint64_t>(std::random_device{}()) << 32;
    auto group = std::make_shared<LaneGroup>();
    group->stream = process | (streams.fetch_add(1) + 1);
    const uint32_t n = local_ports.size() >= 2 ? std::min<uint32_t>(same_host_lanes(), local_ports.size()) : 1;
    for (uint32_t i = 0; i < n; ++i) {
      auto engine = std::make_shared<Engine>();
      FERRY_RETURN_IF_ERROR(engine->init(shared->listen_host(), /*indirect_ids=*/false));
      lanes.push_back(std::make_shared<UcxConnection>(std::move(engine), true, group));
      group->lanes.push_back(lanes.back());
    }
  } else {
    lanes.push_back(std::make_shared<UcxConnection>(shared, false));
  }
  Status st;
  for (size_t i = 0; i < lanes.size(); ++i) {
    const uint16_t to = same_host && local_ports.size() >= 2 ? local_ports[i] : port;
    st = lanes[i]->open(host, to, credential, deadline);
    if (!st.ok()) break;
  }
  if (!st.ok() && same_host) close_lanes(lanes, Clock::now());
  FERRY_RETURN_IF_ERROR(st);
  return std::unique_ptr<Connection>(std::make_unique<OwnedUcxConnection>(std::move(lanes), same_host));
}

std::string describe_connection(Connection& c) {
  auto* owned = dynamic_cast<OwnedUcxConnection*>(&c);
  return owned != nullptr ? owned->describe() : std::string();
}

std::vector<uint64_t> lane_bytes(Connection& c) {
  auto* owned = dynamic_cast<OwnedUcxConnection*>(&c);
  return owned != nullptr ? owned->lane_bytes() : std::vector<uint64_t>();
}

}  // namespace ferry::transport::ucx
