// The coordinator: membership, the per-update state machine, the pause barrier, and the release of
// every rank of a replica together at the new version. Runs on its own I/O thread; embedded in
// trainer rank 0 by default, or alone as `ferry coordinator`.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/settings.h"
#include "core/status.h"

namespace ferry::coordinator {

struct CoordinatorOptions {
  std::string host;   // empty: settings' listen_host (FERRY_LISTEN_HOST)
  uint16_t port = 0;  // 0: any free port
  // Prometheus text on http://host:PORT/metrics. Unset: settings' metrics_port (FERRY_METRICS_PORT;
  // 0 there: off); set: on that port (0: any free port).
  std::optional<uint16_t> metrics_port;
  // Frame limit, timeout, token, listen host, metrics port. Unset: load_settings() (the environment).
  std::optional<Settings> settings;
};

struct MemberInfo {
  int id = 0;
  std::string role;
  std::string peer;
  int replica = -1;
  int tp_rank = -1;
  uint64_t version = 0;
  std::string state;
};

class Coordinator {
 public:
  static Result<std::unique_ptr<Coordinator>> start(const CoordinatorOptions& options);
  virtual ~Coordinator() = default;

  // "host:port" that members join.
  virtual std::string address() const = 0;
  virtual int rollout_ranks() const = 0;
  virtual std::vector<MemberInfo> members() const = 0;
  // Waits until `n` rollout ranks have joined (DeadlineExceeded past `timeout_ms`).
  virtual Status wait_for_ranks(int n, int64_t timeout_ms) = 0;
  // The port /metrics is served on, or 0 when the endpoint is off.
  virtual uint16_t metrics_port() const = 0;
  virtual void stop() = 0;
};

}  // namespace ferry::coordinator
