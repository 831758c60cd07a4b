#include "coordinator/metrics_http.h"

#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

namespace ferry::coordinator {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using asio::ip::tcp;

constexpr size_t kMaxRequestBytes = 8192;

constexpr std::chrono::seconds kSessionDeadline{5};

// One request, one response, then close: scrapers open a connection per scrape. A session that has
// not been answered within kSessionDeadline is closed (a silent client holds no descriptor, and
// keeps no coordinator from stopping).
struct Session : std::enable_shared_from_this<Session> {
  Session(tcp::socket s, std::function<std::string()> render)
      : socket(std::move(s)), render(std::move(render)), deadline(socket.get_executor()) {
    parser.header_limit(kMaxRequestBytes);
    parser.body_limit(kMaxRequestBytes);
  }
  void start() {
    auto self = shared_from_this();
    deadline.expires_after(kSessionDeadline);
    deadline.async_wait([weak = std::weak_ptr<Session>(self)](beast::error_code ec) {
      auto s = weak.lock();
      if (ec || !s) return;
      beast::error_code e;
      s->socket.close(e);
    });
    http::async_read(socket, buffer, parser, [self](beast::error_code ec, size_t) {
      if (ec) return;
      const auto& req = self->parser.get();
      self->res.version(req.version());
      self->res.keep_alive(false);
      if (req.method() == http::verb::get && req.target() == "/metrics") {
        self->res.result(http::status::ok);
        self->res.set(http::field::content_type, "text/plain; version=0.0.4");
        self->res.body() = self->render();
      } else {
        self->res.result(http::status::not_found);
        self->res.body() = "only GET /metrics is served\n";
      }
      self->res.prepare_payload();
      http::async_write(self->socket, self->res, [self](beast::error_code, size_t) {
        beast::error_code e;
        self->socket.shutdown(tcp::socket::shutdown_both, e);
        self->deadline.cancel();
      });
    });
  }
  tcp::socket socket;
  std::function<std::string()> render;
  asio::steady_timer deadline;
  beast::flat_buffer buffer;
  http::request_parser<http::string_body> parser;
  http::response<http::string_body> res;
};

}  // namespace

MetricsServer::MetricsServer(asio::io_context& io, std::function<std::string()> render)
    : acceptor_(io), render_(std::move(render)) {}

MetricsServer::~MetricsServer() {
  if (loop_) loop_->stop();
  beast::error_code ec;
  acceptor_.close(ec);
}

Result<std::unique_ptr<MetricsServer>> MetricsServer::start(asio::io_context& io, const std::string& host, uint16_t port,
                                                            std::function<std::string()> render) {
  std::unique_ptr<MetricsServer> s(new MetricsServer(io, std::move(render)));
  beast::error_code ec;
  auto addr = asio::ip::make_address(host, ec);
  if (ec) return Status::invalid_argument("metrics address '" + host + "' is not an IP address");
  tcp::endpoint ep(addr, port);
  s->acceptor_.open(ep.protocol(), ec);
  if (!ec) s->acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) s->acceptor_.bind(ep, ec);
  if (!ec) s->acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return Status::unavailable(fmt::format("metrics endpoint cannot listen on {}:{}: {}", host, port, ec.message()));
  s->port_ = s->acceptor_.local_endpoint().port();
  s->loop_ = accept_forever(
      s->acceptor_, [render = s->render_](tcp::socket socket) { std::make_shared<Session>(std::move(socket), render)->start(); },
      fmt::format("metrics endpoint {}:{}", host, s->port_));
  return s;
}

}  // namespace ferry::coordinator
