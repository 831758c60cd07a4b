#include "transport/ucx/ucx_admission.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <string_view>

#include <fmt/format.h>

#include "transport/admission.h"
#include "transport/ucx/ucx_engine.h"
#include "transport/ucx/ucx_stream.h"

namespace ferry::transport::ucx {

std::string client_address(ucp_conn_request_h req) {
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  if (ucp_conn_request_query(req, &attr) != UCS_OK || attr.client_address.ss_family != AF_INET) {
    return "an unknown address";
  }
  const auto* a = reinterpret_cast<const sockaddr_in*>(&attr.client_address);
  char text[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &a->sin_addr, text, sizeof text);
  return fmt::format("{}:{}", text, ntohs(a->sin_port));
}

void Gate::add(ucp_ep_h ep, std::string who) {
  const uint64_t ticket = ++tickets_;
  waiting_[ep] = Waiting{ticket, std::move(who), false};
  engine_->at(Clock::now() + kAdmissionDeadline, [weak = weak_from_this(), ep, ticket] {
    auto gate = weak.lock();
    if (!gate) return;
    auto it = gate->waiting_.find(ep);
    if (it == gate->waiting_.end() || it->second.ticket != ticket) return;  // admitted, closed, or another endpoint
    gate->refuse(ep, fmt::format("no credential within {} ms", kAdmissionDeadline.count()));
  });
}

std::optional<Admission> Gate::hello(ucp_ep_h ep, const void* data, size_t length, bool rendezvous) {
  auto it = waiting_.find(ep);
  if (it == waiting_.end() || it->second.refused) return std::nullopt;
  if (rendezvous || length > kMaxCredentialBytes) {
    refuse(ep, fmt::format("a {}-byte credential", length));
    return std::nullopt;
  }
  auto granted = admit_peer(admit_, std::string_view(static_cast<const char*>(data), length), "ucx", it->second.who,
                            default_max_bucket_);
  if (!granted.ok()) {  // admit_peer() logged why
    it->second.refused = true;
    notify(ep, kRefuseId, granted.status().message());
    return std::nullopt;
  }
  waiting_.erase(it);
  return *granted;
}

bool Gate::holds(ucp_ep_h ep) {
  auto it = waiting_.find(ep);
  if (it == waiting_.end()) return false;
  if (!it->second.refused) refuse(ep, "sent before presenting a credential");
  return true;
}

bool Gate::failed(ucp_ep_h ep) {
  if (waiting_.erase(ep) == 0) return false;
  // On the engine's own thread: it is there when this runs.
  engine_->after_drain([engine = engine_.get(), ep] { engine->close_ep(ep, true); });
  return true;
}

void Gate::close_all() {
  for (auto& [ep, w] : waiting_) engine_->close_ep(ep, true);
  waiting_.clear();
}

void Gate::refuse(ucp_ep_h ep, const std::string& why) {
  auto it = waiting_.find(ep);
  if (it == waiting_.end()) return;
  if (!it->second.refused) log_unadmitted("ucx", it->second.who, why);
  waiting_.erase(it);
  // Once no table lock is held (TableLock says why), still on this thread.
  TableLock::later([engine = engine_.get(), ep] { engine->close_ep(ep, true); });
}

}  // namespace ferry::transport::ucx
