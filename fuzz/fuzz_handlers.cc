// The coordinator's message handling without sockets: arbitrary bytes become a conversation of up to
// kSlots members with one coordinator, fed through the real frame decoder, the hello checks the
// coordinator makes (protocol version, token, role, the rank spec's wire conversion) and the real
// UpdateMachine with its member table.
//
// Input: one byte of options (bit 0: every deadline passes as soon as it is armed; bit 1: a token
// is required), then records. A record is one byte `op`, slot = op % kSlots: with bit 7 set the slot's connection
// closes (bit 6: by the heartbeat reaper), otherwise one frame from the slot follows.
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include <google/protobuf/stubs/logging.h>

#include "core/asio.h"
#include "core/log.h"
#include "core/version.h"
#include "coordinator/auth.h"
#include "coordinator/channel.h"
#include "coordinator/members.h"
#include "coordinator/update_machine.h"
#include "coordinator/wire.h"

namespace {

using namespace ferry;
using namespace ferry::coordinator;

constexpr int kSlots = 8;
constexpr uint64_t kMaxFrame = 1 << 20;
const std::string kToken = "fuzz-token";
const std::string kNonce(32, 'n');

class Conversation {
 public:
  Conversation(bool deadlines_pass, bool token)
      : updates_(io_, members_, deadlines_pass ? 0 : 3'600'000), deadlines_pass_(deadlines_pass),
        token_(token ? kToken : "") {}

  ~Conversation() {
    // Mirrors the coordinator's teardown: the connections close, the machine sees each loss.
    for (int slot = 0; slot < kSlots; ++slot) close(slot, Status::unavailable("coordinator stopped"));
    run();
  }

  void close(int slot, const Status& why) {
    const int id = ids_[slot];
    ids_[slot] = 0;
    auto it = members_.find(id);
    if (id == 0 || it == members_.end()) return;
    updates_.on_member_lost(it->second, why);
    members_.erase(it);
  }

  // CoordinatorImpl::on_message, for a connection that already answered the challenge.
  void on_message(int slot, wire::Envelope& env) {
    if (ids_[slot] == 0) {
      if (env.body_case() != wire::Envelope::kHello) return;  // closed: hello expected
      return on_hello(slot, env.hello());
    }
    Member& m = members_.at(ids_[slot]);
    switch (env.body_case()) {
      case wire::Envelope::kHeartbeat:
      case wire::Envelope::kStatusRequest: return;
      case wire::Envelope::kStartUpdate: return updates_.on_start(m, env.start_update());
      case wire::Envelope::kPauseAck: return updates_.on_pause_ack(m, env.pause_ack());
      case wire::Envelope::kFinishUpdate: return updates_.on_finish(m, env.finish_update());
      case wire::Envelope::kFinalized: return updates_.on_finalized(m, env.finalized());
      case wire::Envelope::kResumeAck: return updates_.on_resume_ack(m, env.resume_ack());
      case wire::Envelope::kAbortAck: return updates_.on_abort_ack(m, env.abort_ack());
      default: return close(slot, Status::invalid_argument("unexpected message"));
    }
  }

  // Runs what the last record queued. Deadlines of an hour never pass here; deadlines of 0 ms are
  // waited for in every phase that arms one (all but idle and transferring), so that the outcome
  // does not depend on timing.
  void run() {
    io_.restart();  // a poll that found no work stopped the context
    io_.poll();
    for (int i = 0; deadlines_pass_ && i < 100 && waits_on_deadline(); ++i) {
      io_.run_one_for(std::chrono::seconds(1));
    }
  }

 private:
  // CoordinatorImpl::on_hello's checks, in its order.
  void on_hello(int slot, const wire::Hello& h) {
    if (h.protocol_version() != kProtocolVersion) return;
    if (!token_.empty() && !check_answer(token_, kNonce, h.auth())) return;
    Member m;
    m.id = next_id_++;
    m.channel = std::make_shared<Channel>(boost::asio::ip::tcp::socket(io_), kMaxFrame);
    m.role = h.role();
    if (m.role == "rollout") {
      auto spec = from_wire(h.spec());
      if (!spec.ok()) return;
      m.spec = std::move(*spec);
      // What the coordinator hands the trainer later must convert back.
      wire::RankSpec again;
      to_wire(m.spec, &again);
      if (!from_wire(again).ok()) std::abort();
      m.endpoints.assign(h.endpoints().begin(), h.endpoints().end());
      if (m.endpoints.empty()) return;
    } else if (m.role != "trainer" && m.role != "observer") {
      return;
    } else {
      m.state = "connected";
    }
    ids_[slot] = m.id;
    members_.emplace(m.id, std::move(m));
  }

  bool waits_on_deadline() const {
    return updates_.in_update() && std::string_view(updates_.phase()) != "transferring";
  }

  boost::asio::io_context io_;  // declared first: outlives the channels and the machine's timer
  MemberTable members_;
  UpdateMachine updates_;
  bool deadlines_pass_;
  std::string token_;
  int ids_[kSlots] = {};
  int next_id_ = 1;
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
      c.close(slot, (op & 0x40) ? Status::deadline_exceeded("no heartbeat") : Status::unavailable("peer closed"));
    } else {
      wire::Envelope env;
      auto used = decode_frame(rest, kMaxFrame, "fuzz", &env);
      if (!used.ok()) {
        c.close(slot, used.status());
        break;
      }
      rest.remove_prefix(*used);
      c.on_message(slot, env);
    }
    c.run();
  }
  return 0;
}
