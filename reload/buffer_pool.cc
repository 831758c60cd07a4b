#include "reload/buffer_pool.h"

#include <algorithm>
#include <iterator>

namespace ferry::reload {

namespace {
constexpr int kHost = -1;
int device_key(Device d) { return d.is_cpu() ? kHost : d.index; }
}  // namespace

Result<Buffer> BufferPool::take(size_t bytes, Device device) {
  const int key = device_key(device);
  Buffer b;
  auto it = idle_.lower_bound({key, bytes});
  if (it != idle_.end() && it->first.first == key && it->first.second <= 2 * bytes + 4096) {
    b = std::move(it->second);
    (key == kHost ? idle_host_ : idle_device_) -= it->first.second;
    idle_.erase(it);
  } else {
    FERRY_ASSIGN_OR_RETURN(b, Buffer::allocate(bytes, device));
    if (key == kHost) allocated_ += b.size();
  }
  if (key == kHost) {
    out_host_ += b.size();
    peak_out_host_ = std::max(peak_out_host_, out_host_);
    // What is out at once comes back while other buffers are still out, to be taken again.
    host_cap_ = std::max(host_cap_, peak_out_host_);
  }
  return b;
}

void BufferPool::give(Buffer buffer) {
  if (buffer.data() == nullptr) return;
  const bool host = buffer.device().is_cpu();
  if (host) out_host_ -= std::min(out_host_, static_cast<uint64_t>(buffer.size()));
  uint64_t& idle = host ? idle_host_ : idle_device_;
  if (idle + buffer.size() > (host ? host_cap_ : device_cap_)) return;  // freed here
  idle += buffer.size();
  const std::pair<int, size_t> key{device_key(buffer.device()), buffer.size()};
  idle_.emplace(key, std::move(buffer));
}

void BufferPool::set_host_cap(uint64_t cap) {
  host_cap_ = cap;
  // Host keys sort first (-1); the largest host buffer is the last one before the first device key.
  while (idle_host_ > host_cap_) {
    auto end = idle_.lower_bound({kHost + 1, 0});
    if (end == idle_.begin()) break;
    auto last = std::prev(end);
    idle_host_ -= last->first.second;
    idle_.erase(last);
  }
}

void BufferPool::begin_period() { out_host_ = peak_out_host_ = 0; }

void BufferPool::settle_host(uint64_t floor, bool keep_peak) {
  // take() raised the cap to this period's peak already. Senders' paces vary from one update to the
  // next, and so does what is out at once: the cap comes down only for a period that needed at most
  // half of it (input in plan order again), not for each that needed a little less.
  const uint64_t peak = keep_peak ? std::max(floor, peak_out_host_) : floor;
  if (2 * peak <= host_cap_) set_host_cap(peak);
}

void BufferPool::clear() {
  idle_.clear();
  idle_host_ = idle_device_ = 0;
}

}  // namespace ferry::reload
