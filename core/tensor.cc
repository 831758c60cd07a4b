#include "core/tensor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <utility>

#include "core/rank_devices.h"

namespace ferry {

std::string Device::to_string() const {
  return is_cpu() ? std::string("cpu") : fmt::format("cuda:{}", index);
}

Result<Device> parse_device(std::string_view text) {
  if (text == "cpu") return Device::cpu();
  if (text.starts_with("cuda:") && text.size() > 5 && text.size() < 9 &&
      text.find_first_not_of("0123456789", 5) == std::string_view::npos) {
    return Device::cuda(std::stoi(std::string(text.substr(5))));
  }
  return Status::invalid_argument(fmt::format("device \"{}\": expected cpu or cuda:N", text));
}

Result<std::vector<Device>> parse_rank_devices(std::string_view text, int ranks) {
  std::vector<Device> out;
  for (size_t at = 0; at <= text.size();) {
    const size_t comma = std::min(text.find(',', at), text.size());
    auto d = parse_device(text.substr(at, comma - at));
    if (!d.ok()) return d.status();
    out.push_back(*d);
    at = comma + 1;
  }
  if (out.size() == 1 && ranks > 1) out.assign(static_cast<size_t>(ranks), out[0]);
  if (std::cmp_not_equal(out.size(), ranks)) {
    return Status::invalid_argument(
        fmt::format("devices \"{}\": {} given for {} ranks (give one for all, or one per rank)", text, out.size(), ranks));
  }
  return out;
}

int64_t shape_numel(std::span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_to_string(std::span<const int64_t> shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

TensorView::TensorView(void* data, DType dtype, Shape shape, Device device)
    : data_(data), dtype_(dtype), shape_(std::move(shape)), device_(device) {
  strides_ = contiguous_strides(shape_);
}

TensorView::TensorView(void* data, DType dtype, Shape shape, Shape strides, Device device)
    : data_(data), dtype_(dtype), shape_(std::move(shape)), strides_(std::move(strides)), device_(device) {}

bool TensorView::is_contiguous() const {
  int64_t expect = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != expect) return false;
    expect *= shape_[i];
  }
  return true;
}

int64_t TensorView::rows() const { return shape_.empty() ? 1 : shape_[0]; }

int64_t TensorView::cols() const {
  int64_t c = 1;
  for (size_t i = 1; i < shape_.size(); ++i) c *= shape_[i];
  return c;
}

std::string TensorView::describe() const {
  return fmt::format("{}{} {}", dtype_name(dtype_), shape_to_string(shape_), device_.to_string());
}

Region Region::whole(const Shape& shape) { return Region{Dims(shape.size(), 0), Dims(shape)}; }

bool Region::overlaps(const Region& other) const {
  if (other.rank() != rank()) return false;
  for (int i = 0; i < rank(); ++i) {
    const auto k = static_cast<size_t>(i);
    if (size[k] == 0 || other.size[k] == 0) return false;
    if (offset[k] + size[k] <= other.offset[k] || other.offset[k] + other.size[k] <= offset[k]) return false;
  }
  return true;
}

bool Region::inside(const Dims& shape) const {
  if (shape.size() != size.size() || offset.size() != size.size()) return false;
  for (size_t i = 0; i < shape.size(); ++i) {
    // Without forming offset + size, which need not fit in int64_t when the region came off the wire.
    if (offset[i] < 0 || size[i] < 0 || size[i] > shape[i] || offset[i] > shape[i] - size[i]) return false;
  }
  return true;
}

std::string Region::to_string() const {
  std::string out = "[";
  for (size_t i = 0; i < size.size(); ++i) {
    if (i) out += ", ";
    int64_t end = 0;
    // A region off the wire may end past int64_t; it is printed as offset:offset+size then.
    out += __builtin_add_overflow(offset[i], size[i], &end) ? fmt::format("{}:{}+{}", offset[i], offset[i], size[i])
                                                            : fmt::format("{}:{}", offset[i], end);
  }
  return out + "]";
}

Status expect_tensor(const TensorView& view, std::string_view what, DType dtype, const Shape& shape) {
  if (view.empty() && view.numel() != 0) return Status::invalid_argument(fmt::format("{}: null data", what));
  if (view.dtype() != dtype) {
    return Status::invalid_argument(
        fmt::format("{}: dtype {} where {} was expected", what, dtype_name(view.dtype()), dtype_name(dtype)));
  }
  if (view.shape() != shape) {
    return Status::invalid_argument(fmt::format("{}: shape {} where {} was expected", what,
                                                shape_to_string(view.shape()), shape_to_string(shape)));
  }
  if (!view.is_contiguous()) return Status::invalid_argument(fmt::format("{}: must be contiguous", what));
  return ok_status();
}

}  // namespace ferry
