// What a sender last sent, kept so that the next update can send only what changed (delta.h).
//
// One host copy per (manifest tensor, held box): the whole local tensor this sender held at the
// version it was recorded at, whichever pieces of it went where. A delta for a rank is computed
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

namespace ferry::dataplane {

class DeltaBases {
 public:
  explicit DeltaBases(uint64_t max_bytes) : max_bytes_(max_bytes) {}

  struct Base {
    uint64_t version = 0;
    DType dtype = DType::kBF16;
    Shape shape;
    Buffer values;  // contiguous, host
    TensorView view() const { return TensorView(values.data(), dtype, shape); }
  };
  // The copy kept for `name`'s box `held`, when it is of `dtype` and `shape`; else null.
  const Base* find(const std::string& name, const Region& held, DType dtype, const Shape& shape) const;
  // Keeps `host` (the local tensor, contiguous on the host) as sent at `version`. A tensor past the
  // bound is dropped, and warned about once.
  void record(const std::string& name, const Region& held, const TensorView& host, uint64_t version);
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
  uint64_t bytes_ = 0;
  bool warned_ = false;
  std::map<std::string, Base> bases_;
};

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
Result<PartDelta> encode_part(const DeltaBases::Base& base, const Region& src, const uint8_t* packed, size_t bytes,
                              const DeltaOptions& options, std::vector<uint8_t>& scratch,
                              std::vector<uint8_t>& encoded);

}  // namespace ferry::dataplane
