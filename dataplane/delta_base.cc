#include "dataplane/delta_base.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "core/device_copy.h"
#include "core/log.h"
#include "core/parallel.h"
#include "core/region_copy.h"
#include "dataplane/delta.h"

namespace ferry::dataplane {

std::string DeltaBases::key(const std::string& name, const Region& held) { return name + held.to_string(); }

const DeltaBases::Base* DeltaBases::find(const std::string& name, const Region& held, DType dtype,
                                         const Shape& shape) const {
  auto it = bases_.find(key(name, held));
  if (it == bases_.end() || it->second.dtype != dtype || it->second.shape != shape) return nullptr;
  return &it->second;
}

void DeltaBases::record(const std::string& name, const Region& held, const TensorView& tensor, uint64_t version) {
  const std::string k = key(name, held);
  auto it = bases_.find(k);
  const uint64_t want = tensor.nbytes();
  const Device where = keeps_on(tensor.device()) ? tensor.device() : Device::cpu();
  if (it != bases_.end() && (it->second.values.size() != want || it->second.values.device() != where)) {
    bytes_ -= it->second.values.size();
    bases_.erase(it);
    it = bases_.end();
  }
  if (it == bases_.end()) {
    if (bytes_ + want > max_bytes_) {
      if (!warned_) {
        FERRY_LOG_WARN(
            "{} ({} bytes), and any later tensor that does not fit, is sent whole every update: the "
            "copies kept for deltas would pass FERRY_DELTA_MAX_BYTES={} bytes",
            name, want, max_bytes_);
        warned_ = true;
      }
      return;
    }
    auto b = Buffer::allocate(want, where);
    if (!b.ok()) {
      FERRY_LOG_WARN("{} is sent whole every update: no {} memory for its delta copy ({})", name, where.to_string(),
                     b.status().message());
      return;
    }
    Base base;
    base.values = std::move(*b);
    it = bases_.emplace(k, std::move(base)).first;
    bytes_ += want;
  }
  Base& base = it->second;
  base.dtype = tensor.dtype();
  base.shape = tensor.shape();
  base.version = 0;
  if (where.is_cpu() && tensor.device().is_cpu()) {
    copy_parallel(base.values.data(), tensor.data(), want);
  } else if (const Status st = copy_bytes(base.values.data(), where, tensor.data(), tensor.device(), want); !st.ok()) {
    // Kept without a version: no delta is computed against it.
    FERRY_LOG_WARN("{}: its delta copy was not taken ({}); the next update sends it whole", name, st.message());
    return;
  }
  base.version = version;
}

bool takes_deltas(DeltaMode mode, bool same_host, bool device_bucket, bool device_copies) {
  if (mode == DeltaMode::kOff) return false;
  return mode != DeltaMode::kAuto || (!same_host && (!device_bucket || device_copies));
}

Result<PartDelta> encode_part(const DeltaBases::Base& base, const Region& src, const uint8_t* packed, size_t bytes,
                              const DeltaOptions& options, std::vector<uint8_t>& scratch,
                              std::vector<uint8_t>& encoded) {
  const uint8_t* old = region_span(base.view(), src);
  if (old == nullptr) {
    scratch.resize(bytes);
    FERRY_RETURN_IF_ERROR(pack_region(base.view(), src, scratch.data(), bytes));
    old = scratch.data();
  }
  // Sub-byte elements (packed int4) compare byte by byte.
  const size_t elem = std::max<size_t>(dtype_bits(base.dtype) / 8, 1);
  const bool zstd = options.zstd > 0;
  return finish_part(encode_delta(old, packed, bytes / elem, elem, options.prefer, encoded, zstd), options, encoded);
}

PartDelta finish_part(const DeltaChoice& choice, const DeltaOptions& options, std::vector<uint8_t>& encoded) {
  uint32_t field = static_cast<uint32_t>(choice.encoding);
  if (field != 0 && options.zstd > 0) {
    field |= kDeltaXor;
    if (compress_delta(encoded, options.zstd)) field |= kDeltaZstd;
  }
  return PartDelta{field, choice.changed};
}

}  // namespace ferry::dataplane
