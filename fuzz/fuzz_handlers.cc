// The coordinator's message handling without sockets: arbitrary bytes become a conversation of up to
// kSlots connections with one coordinator, fed through the real frame decoder into the real
// CoordinatorCore (the admission the coordinator makes: challenge, hello, a rank's registration,
// the frame cap before authentication, the bound on pending connections) and through it the real
// UpdateMachine with its member and replica tables.
//
// Input: one byte of options (bit 0: every deadline passes as soon as it is armed; bit 1: a token
// is required), then records. A record is one byte `op`, slot = op % kSlots: with bit 7 set the
// slot's connection closes (bit 6 too: the reaper runs instead, an hour later); with only bit 6 set
// the slot's connection opens and stays silent; otherwise one frame from the slot follows (opening
// its connection first if needed).
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include <google/protobuf/stubs/logging.h>

#include "core/asio.h"
#include "core/log.h"
#include "coordinator/channel.h"
#include "coordinator/coordinator_core.h"
#include "coordinator/frame.h"

namespace {

using namespace ferry;
using namespace ferry::coordinator;

constexpr int kSlots = 8;
constexpr uint64_t kMaxFrame = 1 << 20;

CoreOptions options(bool deadlines_pass, bool token) {
  CoreOptions o;
  o.timeout_ms = deadlines_pass ? 0 : 3'600'000;
  o.token = token ? "fuzz-token" : "";
  o.max_frame = kMaxFrame;
  o.max_pending = 4;  // small, so that eviction is reached
  o.nonce = [] { return Result<std::string>(std::string(32, 'n')); };
  return o;
}

class Conversation {
 public:
  Conversation(bool deadlines_pass, bool token)
      : core_(io_, options(deadlines_pass, token)), deadlines_pass_(deadlines_pass) {}

  ~Conversation() {
    core_.stop("fuzz ended");
    for (int slot = 0; slot < kSlots; ++slot) close(slot, Status::unavailable("coordinator stopped"));
    run();
  }

  void close(int slot, const Status& why) {
    auto c = std::move(channels_[slot]);
    if (c) core_.on_closed(c, why);
  }

  void reap() { core_.reap(std::chrono::steady_clock::now() + std::chrono::hours(1)); }

  void open(int slot) {
    auto& c = channels_[slot];
    if (c) return;
    c = std::make_shared<Channel>(boost::asio::ip::tcp::socket(io_), kPreAuthFrameBytes);
    if (!core_.on_connect(c).ok()) std::abort();
  }

  // A frame from `slot`: decoded with the channel's current cap, as Channel::read_header does.
  bool on_frame(int slot, std::string_view& rest) {
    open(slot);
    auto& c = channels_[slot];
    wire::Envelope env;
    auto used = decode_frame(rest, c->max_frame(), "fuzz", &env);
    if (!used.ok()) {
      close(slot, used.status());
      return false;
    }
    rest.remove_prefix(*used);
    core_.on_message(c, env);
    return true;
  }

  // Runs what the last record queued. Deadlines of an hour never pass here; deadlines of 0 ms are
  // waited for in every phase that arms one, so that the outcome does not depend on timing.
  void run() {
    io_.restart();  // a poll that found no work stopped the context
    io_.poll();
    for (int i = 0; deadlines_pass_ && i < 100 && waits_on_deadline(); ++i) {
      io_.run_one_for(std::chrono::seconds(1));
    }
    // A channel the core closed reads nothing more; its closed callback reaches the core.
    for (int slot = 0; slot < kSlots; ++slot) {
      if (channels_[slot] && channels_[slot]->is_closed()) close(slot, Status::unavailable("closed"));
    }
  }

 private:
  bool waits_on_deadline() const {
    const std::string phase = core_.status().phase();
    return phase != "idle" && phase != "transferring";
  }

  boost::asio::io_context io_;  // declared first: outlives the channels and the machine's timer
  CoordinatorCore core_;
  bool deadlines_pass_;
  std::shared_ptr<Channel> channels_[kSlots];
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ferry::logger().set_level(spdlog::level::off);
  google::protobuf::SetLogHandler(nullptr);  // every non-UTF-8 string field would log a line
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Conversation c((data[0] & 1) != 0, (data[0] & 2) != 0);
  std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  while (!rest.empty()) {
    const auto op = static_cast<uint8_t>(rest[0]);
    rest.remove_prefix(1);
    const int slot = op % kSlots;
    if (op & 0x80) {
      if (op & 0x40) {
        c.reap();
      } else {
        c.close(slot, Status::unavailable("peer closed"));
      }
    } else if (op & 0x40) {
      c.open(slot);
    } else if (!c.on_frame(slot, rest)) {
      break;
    }
    c.run();
  }
  return 0;
}
