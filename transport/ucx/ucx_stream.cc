#include "transport/ucx/ucx_stream.h"

#include <algorithm>
#include <cstring>

#include "core/log.h"
#include "transport/ucx/ucx_receiver.h"

namespace ferry::transport::ucx {

std::shared_ptr<StreamTable> make_stream_table() {
  auto t = std::make_shared<StreamTable>();
  t->pool = std::make_shared<BufferPool>(nullptr);
  return t;
}

uint64_t Inbound::sequence(const void* header, size_t header_length) {
  if (stream == 0 || header_length != sizeof(LaneHeader)) return next_seq++;
  LaneHeader h;
  std::memcpy(&h, header, sizeof h);
  return h.seq;
}

std::shared_ptr<Inbound::Pending> Inbound::pop_ready() {
  if (queue.empty() || queue.begin()->first != next_deliver || !queue.begin()->second->ready) return nullptr;
  auto front = std::move(queue.begin()->second);
  queue.erase(queue.begin());
  ++next_deliver;
  return front;
}

bool StreamTable::join(std::shared_ptr<Inbound>& lane, const LaneHeader& h, ucp_ep_h ep, std::weak_ptr<Receiver> owner) {
  if (h.stream == 0) return true;
  auto joined = streams.find(h.stream);
  if (joined == streams.end() && std::find(ended.begin(), ended.end(), h.stream) != ended.end()) {
    FERRY_LOG_DEBUG("ucx: closed a lane of peer {} whose stream has ended", lane->peer);
    return false;
  }
  if (joined == streams.end()) {
    lane->stream = h.stream;
    lane->lanes = std::max<uint32_t>(h.lanes, 1);
    streams[h.stream] = lane;
    return true;
  }
  // Another lane of a stream seen before (here or at another receiver that shares the table). The
  // stream takes the smaller of the lanes' bucket limits.
  const std::shared_ptr<Inbound> in = joined->second;
  if (in->peer != lane->peer) {
    FERRY_LOG_WARN("ucx: closed a lane of peer {} that named a stream of peer {}", lane->peer, in->peer);
    return false;
  }
  in->max_bucket = std::min(in->max_bucket, lane->max_bucket);
  in->eps.push_back(ep);
  in->owners[ep] = std::move(owner);
  lane = in;
  return true;
}

void StreamTable::forget(Inbound& in, ucp_ep_h e) {
  in.eps.erase(std::remove(in.eps.begin(), in.eps.end(), e), in.eps.end());
  in.owners.erase(e);
  if (in.eps.empty() && in.stream != 0) {
    auto found = streams.find(in.stream);
    if (found != streams.end() && found->second.get() == &in) {
      streams.erase(found);
      ended.push_back(in.stream);
      if (ended.size() > kEndedKept) ended.pop_front();
    }
  }
}

void notify(ucp_ep_h ep, unsigned id, std::string text) {
  TableLock::later([ep, id, text = std::move(text)] {
    auto* owned = new std::string(text);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;  // the sender finds its endpoint by it
    p.cb.send = [](void* req, ucs_status_t, void* ud) {
      delete static_cast<std::string*>(ud);
      ucp_request_free(req);
    };
    p.user_data = owned;
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, nullptr, 0, owned->data(), owned->size(), &p);
    if (!UCS_PTR_IS_PTR(r)) delete owned;
  });
}

}  // namespace ferry::transport::ucx
