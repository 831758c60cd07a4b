// A ucx stranger: a UCP endpoint to a ucx listener that says no hello (kSilent) or sends a bucket
// first (kPartial). It sees the receiver's close as its endpoint failing.
#include <arpa/inet.h>
#include <netinet/in.h>

#include <condition_variable>
#include <mutex>

#include "tests/transport/stranger.h"
#include "transport/ucx/ucx_engine.h"

namespace ferry::transport::testing {
namespace {

class UcxStranger final : public StrangerPeer {
 public:
  ~UcxStranger() override {
    if (engine_) {
      engine_->call(
                 [this](std::shared_ptr<CompletionState> done) {
                   if (ep_ != nullptr) engine_->close_ep(std::exchange(ep_, nullptr), true);
                   done->complete(ok_status());
                 },
                 Clock::now() + std::chrono::seconds(10))
          .ignore_error();
      engine_->stop();
    }
  }

  Status open(const std::string& host, uint16_t port, Stranger kind) {
    engine_ = std::make_shared<ucx::Engine>();
    FERRY_ASSIGN_OR_RETURN(TransportOptions options, transport_options_from_settings());
    FERRY_RETURN_IF_ERROR(engine_->init(options.listen_host));
    return engine_->call(
        [this, host, port, kind](std::shared_ptr<CompletionState> done) {
          sockaddr_in sa{};
          sa.sin_family = AF_INET;
          sa.sin_port = htons(port);
          inet_pton(AF_INET, host.c_str(), &sa.sin_addr);
          ucp_ep_params_t p{};
          p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                         UCP_EP_PARAM_FIELD_ERR_HANDLER;
          p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
          p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
          p.sockaddr.addrlen = sizeof sa;
          p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
          p.err_handler.cb = &UcxStranger::on_error;
          p.err_handler.arg = this;
          const ucs_status_t st = ucp_ep_create(engine_->worker(), &p, &ep_);
          if (st != UCS_OK) return done->complete(ucx::ucs_error("stranger endpoint", st));
          if (kind == Stranger::kPartial) {
            static const char bucket[64] = {};
            ucp_request_param_t rp{};
            rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
            rp.flags = UCP_AM_SEND_FLAG_REPLY;
            ucs_status_ptr_t r = ucp_am_send_nbx(ep_, ucx::kDataId, nullptr, 0, bucket, sizeof bucket, &rp);
            if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
          }
          done->complete(ok_status());
        },
        Clock::now() + std::chrono::seconds(10));
  }

  bool closed_by(Deadline deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_until(lock, deadline, [&] { return failed_; });
  }

 private:
  static void on_error(void* arg, ucp_ep_h, ucs_status_t) {
    auto* self = static_cast<UcxStranger*>(arg);
    std::lock_guard<std::mutex> lock(self->mu_);
    self->failed_ = true;
    self->cv_.notify_all();
  }

  std::shared_ptr<ucx::Engine> engine_;
  ucp_ep_h ep_ = nullptr;  // the progress thread's
  std::mutex mu_;
  std::condition_variable cv_;
  bool failed_ = false;
};

}  // namespace

Result<std::unique_ptr<StrangerPeer>> connect_ucx_stranger(const std::string& blob, Stranger kind) {
  // "ucx://host:port/..."
  const std::string rest = blob.substr(std::string("ucx://").size());
  const std::string address = rest.substr(0, rest.find('/'));
  const size_t colon = address.rfind(':');
  if (!blob.starts_with("ucx://") || colon == std::string::npos) return Status::invalid_argument("not a ucx blob: " + blob);
  auto s = std::make_unique<UcxStranger>();
  FERRY_RETURN_IF_ERROR(s->open(address.substr(0, colon), static_cast<uint16_t>(std::stoi(address.substr(colon + 1))), kind));
  return std::unique_ptr<StrangerPeer>(std::move(s));
}

}  // namespace ferry::transport::testing
