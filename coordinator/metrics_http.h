// An opt-in HTTP endpoint (FERRY_METRICS_PORT) serving the coordinator's state as Prometheus text.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "core/accept_loop.h"
#include "core/asio.h"
#include "core/status.h"

namespace ferry::coordinator {

class MetricsServer {
 public:
  // Listens on host:port (0: any) on `io`; `render` runs on the I/O thread for every GET /metrics.
  static Result<std::unique_ptr<MetricsServer>> start(boost::asio::io_context& io, const std::string& host, uint16_t port,
                                                      std::function<std::string()> render);
  ~MetricsServer();
  uint16_t port() const { return port_; }

 private:
  MetricsServer(boost::asio::io_context& io, std::function<std::string()> render);

  boost::asio::ip::tcp::acceptor acceptor_;
  std::function<std::string()> render_;
  std::shared_ptr<AcceptLoop> loop_;
  uint16_t port_ = 0;
};

}  // namespace ferry::coordinator
