// What a sender last sent, kept so that the next update can send only what changed (delta.h).
//
// One copy per (manifest tensor, held box), in host memory, or (device_copies, FERRY_DELTA_COPY=device)
// a GPU tensor's in its own device's memory, where the compare then runs (delta_device.h): the whole local tensor this
// sender held at the version it was recorded at, whichever pieces of it went where. A delta for a rank is computed
// against it only when the rank holds exactly that version (Member.delta_base); any other rank gets
// dense bytes. The copies are bounded (FERRY_DELTA_MAX_BYTES): a tensor that does not fit keeps no
// copy and always travels dense, with one warning naming the bound.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/tensor.h"
#include "dataplane/delta.h"

namespace ferry::dataplane {

class DeltaBases {
 public:
  explicit DeltaBases(uint64_t max_bytes, bool device_copies = false)
      : max_bytes_(max_bytes), device_copies_(device_copies) {}

  struct Base {
    uint64_t version = 0;
    DType dtype = DType::kBF16;
    Shape shape;
    Buffer values;  // contiguous; on the host, or on the tensor's device
    TensorView view() const { return TensorView(values.data(), dtype, shape, values.device()); }
  };
  // The copy kept for `name`'s box `held`, when it is of `dtype` and `shape`; else null.
  const Base* find(const std::string& name, const Region& held, DType dtype, const Shape& shape) const;
  // The same copy, to be brought up to date in place (TensorScan): its version is set to 0 (no delta is
  // computed against it) before its bytes change, and to the new one once they all did.
  Base* find_to_update(const std::string& name, const Region& held, DType dtype, const Shape& shape) {
    return const_cast<Base*>(find(name, held, dtype, shape));
  }
  // Keeps `tensor` (the local tensor, contiguous) as sent at `version`: on the host, or on its device
  // when it is on one and copies are kept there. A tensor past the bound is dropped, and warned
  // about once.
  void record(const std::string& name, const Region& held, const TensorView& tensor, uint64_t version);
  // Whether a tensor on `device` keeps its copy there (and is compared there).
  bool keeps_on(Device device) const { return device_copies_ && device.is_cuda(); }
  // Whether GPU tensors keep their copies on their GPUs (FERRY_DELTA_COPY=device).
  bool device_copies() const { return device_copies_; }
  // Drops every copy.
  void clear() {
    bases_.clear();
    bytes_ = 0;
  }
  uint64_t bytes() const { return bytes_; }
  uint64_t max_bytes() const { return max_bytes_; }

 private:
  static std::string key(const std::string& name, const Region& held);

  uint64_t max_bytes_;
  bool device_copies_;
  uint64_t bytes_ = 0;
  bool warned_ = false;
  std::map<std::string, Base> bases_;
};

// FERRY_DELTA: kAuto sends deltas to ranks on other hosts only (over one host's links moving the
// bytes costs about what comparing them does, and the copy kept for deltas is memory spent for
// nothing); kOn to every rank; kAlways to every rank, even where the delta is not smaller.
enum class DeltaMode : uint8_t { kOff, kAuto, kOn, kAlways };

// Whether a rank takes deltas this update under `mode`: under kAuto only a rank on another host,
// and into a device bucket (nccl, cuda_ipc) only when GPU tensors are compared on their GPUs
// (`device_copies`, FERRY_DELTA_COPY=device): a link that moves device memory is faster than a
// compare on the host.
bool takes_deltas(DeltaMode mode, bool same_host, bool device_bucket, bool device_copies);

// How a sender encodes deltas: `prefer` (FERRY_DELTA=always) keeps a delta even when its encoding
// is not smaller than the dense bytes; `zstd` (FERRY_DELTA_ZSTD, 0: off) compresses each at that
// level, its values XORs with the old ones.
struct DeltaOptions {
  bool prefer = false;
  int zstd = 0;
};

// The changed elements of one part of a piece, as the sender encodes it: `packed` (the part's new
// elements, contiguous) against the same box of `base`. Returns the encoding field chosen (kDense
// when the dense bytes are smaller, unless preferred; flags with it, delta.h) and fills `encoded`;
// `scratch` holds the old elements.
struct PartDelta {
  uint32_t encoding = 0;
  uint64_t changed = 0;
};
// The encoding field of a choice (DeltaChoice), with the flags `options` add: the values as XORs,
// and `encoded` replaced by a zstd frame where that pays.
PartDelta finish_part(const DeltaChoice& choice, const DeltaOptions& options, std::vector<uint8_t>& encoded);
Result<PartDelta> encode_part(const DeltaBases::Base& base, const Region& src, const uint8_t* packed, size_t bytes,
                              const DeltaOptions& options, std::vector<uint8_t>& scratch,
                              std::vector<uint8_t>& encoded);

}  // namespace ferry::dataplane
