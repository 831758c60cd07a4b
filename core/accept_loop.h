// An accept loop that survives its errors. A listener that stops at the first failed accept() is
// gone for good after a burst of connections exhausts the process's descriptors (EMFILE), so every
// listener of ferry accepts through this: an error is logged once per kind and retried after a
// short back-off (descriptors free up as connections close); only closing the acceptor ends it.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <set>
#include <string>

#include "core/asio.h"
#include "core/log.h"

namespace ferry {

// A running accept loop. stop() (on the acceptor's executor, or once it no longer runs) ends it
// without touching the acceptor again: call it before destroying an acceptor that may still have a
// back-off pending. Closing the acceptor also ends the loop.
class AcceptLoop {
 public:
  virtual ~AcceptLoop() = default;
  virtual void stop() = 0;
};

// Accepts on `acceptor` until it is closed (operation_aborted) or the returned loop is stopped,
// handing every socket to `on_accept`, on the acceptor's executor. `what` names the listener in the
// log. Without stop(), the acceptor must outlive the loop's pending operations (close it, then let
// its executor run them out, or stop the executor).
inline std::shared_ptr<AcceptLoop> accept_forever(boost::asio::ip::tcp::acceptor& acceptor,
                           std::function<void(boost::asio::ip::tcp::socket)> on_accept, std::string what) {
  struct Loop final : AcceptLoop, std::enable_shared_from_this<Loop> {
    boost::asio::ip::tcp::acceptor& acceptor;
    std::function<void(boost::asio::ip::tcp::socket)> on_accept;
    std::string what;
    boost::asio::steady_timer backoff;
    std::set<int> logged;  // error values already logged
    std::chrono::milliseconds delay{1};
    bool stopped = false;

    Loop(boost::asio::ip::tcp::acceptor& a, std::function<void(boost::asio::ip::tcp::socket)> f, std::string w)
        : acceptor(a), on_accept(std::move(f)), what(std::move(w)), backoff(a.get_executor()) {}

    void next() {
      acceptor.async_accept([self = shared_from_this()](boost::system::error_code ec, boost::asio::ip::tcp::socket s) {
        if (self->stopped || ec == boost::asio::error::operation_aborted || !self->acceptor.is_open()) return;
        if (ec) return self->retry(ec);
        self->delay = std::chrono::milliseconds(1);
        self->on_accept(std::move(s));
        self->next();
      });
    }

    // EMFILE, ENFILE, ENOBUFS, ENOMEM, ECONNABORTED, ...: wait, then accept again. The delay doubles
    // up to 100 ms while the error persists, so a listener out of descriptors does not spin.
    void retry(const boost::system::error_code& ec) {
      if (logged.insert(ec.value()).second) {
        FERRY_LOG_WARN("{}: accept failed ({}); retrying with back-off, connections wait in the backlog", what,
                       ec.message());
      }
      backoff.expires_after(delay);
      delay = std::min(delay * 2, std::chrono::milliseconds(100));
      backoff.async_wait([self = shared_from_this()](boost::system::error_code e) {
        if (e || self->stopped || !self->acceptor.is_open()) return;
        self->next();
      });
    }

    void stop() override {
      stopped = true;
      backoff.cancel();
    }
  };
  auto loop = std::make_shared<Loop>(acceptor, std::move(on_accept), std::move(what));
  loop->next();
  return loop;
}

}  // namespace ferry
