#include "core/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace ferry {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors lengths are read as host integers");

constexpr std::string_view kMetadataKey = "__metadata__";
constexpr std::string_view kDTypeMarkerPrefix = "ferry.dtype.";

struct DTypeName {
  DType dtype;
  std::string_view name;
};
constexpr DTypeName kDTypeNames[] = {
    {DType::kF32, "F32"},     {DType::kF16, "F16"},         {DType::kBF16, "BF16"},
    {DType::kF8E4M3FN, "F8_E4M3"}, {DType::kF8E5M2, "F8_E5M2"}, {DType::kI8, "I8"},
    {DType::kU8, "U8"},       {DType::kI32, "I32"},         {DType::kI64, "I64"},
};

// Bytes per stored element; packed int4 is stored as bytes.
uint64_t storage_element_bytes(DType dt) { return dt == DType::kI4Packed ? 1 : static_cast<uint64_t>(dtype_bits(dt) / 8); }

std::string quote_name(std::string_view s) { return fmt::format("'{}'", s); }

Result<uint64_t> json_uint(const nlohmann::json& j) {
  if (!j.is_number_unsigned()) return Status::invalid_argument("not a non-negative integer: " + j.dump());
  return j.get<uint64_t>();
}

// Parses the header, reporting the first key that repeats inside any one object (nlohmann keeps the
// last value silently).
Status parse_header(std::string_view text, nlohmann::json* out) {
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  size_t duplicate_depth = 0;
  auto cb = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) -> bool {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) {
      keys.emplace_back();
    } else if (event == E::object_end) {
      if (!keys.empty()) keys.pop_back();
    } else if (event == E::key && !keys.empty() && duplicate.empty()) {
      std::string key = parsed.get<std::string>();
      if (!keys.back().insert(key).second) {
        duplicate = std::move(key);
        duplicate_depth = keys.size();
      }
    }
    return true;
  };
  try {
    *out = nlohmann::json::parse(text.begin(), text.end(), cb);
  } catch (const nlohmann::json::exception& e) {
    return Status::invalid_argument(fmt::format("invalid JSON header: {}", e.what()));
  }
  if (!duplicate.empty()) {
    if (duplicate_depth == 1) return Status::invalid_argument(fmt::format("duplicate tensor name {}", quote_name(duplicate)));
    return Status::invalid_argument(fmt::format("duplicate key {} in the header", quote_name(duplicate)));
  }
  if (!out->is_object()) return Status::invalid_argument("header is not a JSON object");
  return ok_status();
}

Result<SafetensorsEntry> parse_entry(const std::string& name, const nlohmann::json& j, uint64_t data_len) {
  if (!j.is_object()) return Status::invalid_argument(fmt::format("tensor {}: entry is not an object", quote_name(name)));
  SafetensorsEntry e;
  e.name = name;
  const auto dt = j.find("dtype");
  if (dt == j.end() || !dt->is_string()) {
    return Status::invalid_argument(fmt::format("tensor {}: missing string \"dtype\"", quote_name(name)));
  }
  auto parsed = parse_safetensors_dtype(dt->get<std::string>());
  if (!parsed.ok()) return parsed.status().with_context(fmt::format("tensor {}", quote_name(name)));
  e.dtype = *parsed;

  const auto shape = j.find("shape");
  if (shape == j.end() || !shape->is_array()) {
    return Status::invalid_argument(fmt::format("tensor {}: missing array \"shape\"", quote_name(name)));
  }
  uint64_t numel = 1;
  bool numel_overflow = false;
  for (const auto& d : *shape) {
    auto v = json_uint(d);
    if (!v.ok() || *v > static_cast<uint64_t>(INT64_MAX)) {
      return Status::invalid_argument(fmt::format("tensor {}: shape {} holds {}", quote_name(name), shape->dump(),
                                                  v.ok() ? "a dimension too large" : v.status().message()));
    }
    e.shape.push_back(static_cast<int64_t>(*v));
    numel_overflow = numel_overflow || __builtin_mul_overflow(numel, *v, &numel);
  }

  const auto offsets = j.find("data_offsets");
  if (offsets == j.end() || !offsets->is_array() || offsets->size() != 2) {
    return Status::invalid_argument(fmt::format("tensor {}: missing \"data_offsets\" [begin, end]", quote_name(name)));
  }
  auto begin = json_uint((*offsets)[0]);
  auto end = json_uint((*offsets)[1]);
  if (!begin.ok() || !end.ok()) {
    return Status::invalid_argument(fmt::format("tensor {}: data_offsets {} are not non-negative integers",
                                                quote_name(name), offsets->dump()));
  }
  e.begin = *begin;
  e.end = *end;
  if (e.begin > e.end) {
    return Status::invalid_argument(
        fmt::format("tensor {}: data_offsets [{}, {}] end before they begin", quote_name(name), e.begin, e.end));
  }
  uint64_t bytes = 0;
  if (numel_overflow || __builtin_mul_overflow(numel, storage_element_bytes(e.dtype), &bytes) ||
      bytes != e.end - e.begin) {
    return Status::invalid_argument(fmt::format(
        "tensor {}: data_offsets [{}, {}] span {} bytes but {}{} needs {}", quote_name(name), e.begin, e.end,
        e.end - e.begin, safetensors_dtype_name(e.dtype), shape_to_string(e.shape),
        numel_overflow ? std::string("more than 2^64") : std::to_string(bytes)));
  }
  if (e.end > data_len) {
    return Status::data_loss(fmt::format("tensor {}: data_offsets [{}, {}] run past the end of the data section ({} bytes)",
                                         quote_name(name), e.begin, e.end, data_len));
  }
  return e;
}

// Turns U8 entries marked as packed int4 back into kI4Packed with their logical shape.
Status apply_dtype_markers(std::map<std::string, std::string>* metadata, std::vector<SafetensorsEntry>* entries,
                           const std::map<std::string, size_t, std::less<>>& index) {
  for (auto it = metadata->begin(); it != metadata->end();) {
    if (!it->first.starts_with(kDTypeMarkerPrefix)) {
      ++it;
      continue;
    }
    const std::string name = it->first.substr(kDTypeMarkerPrefix.size());
    if (it->second != dtype_name(DType::kI4Packed)) {
      return Status::invalid_argument(fmt::format("metadata {}: unknown ferry dtype {}", quote_name(it->first), quote_name(it->second)));
    }
    const auto found = index.find(name);
    if (found == index.end()) {
      return Status::invalid_argument(fmt::format("metadata {}: no tensor named {}", quote_name(it->first), quote_name(name)));
    }
    SafetensorsEntry& e = (*entries)[found->second];
    if (e.dtype != DType::kU8 || e.shape.empty() || e.shape.back() > INT64_MAX / 2) {
      return Status::invalid_argument(fmt::format("tensor {}: marked {} but stored as {}{}; expected U8 of rank >= 1",
                                                  quote_name(name), it->second, safetensors_dtype_name(e.dtype),
                                                  shape_to_string(e.shape)));
    }
    e.dtype = DType::kI4Packed;
    e.shape.back() *= 2;
    it = metadata->erase(it);
  }
  return ok_status();
}

Status write_all(int fd, const void* data, size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, std::min<size_t>(bytes, size_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::unavailable(fmt::format("write failed: {}", std::strerror(errno)));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return ok_status();
}

std::string temp_path_for(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return fmt::format("{}.tmp.{}.{}", path, ::getpid(), counter.fetch_add(1));
}

void sync_parent_dir(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fsync(fd);  // durability of the rename only; the file itself is already synced
  ::close(fd);
}

Status write_file_atomically(const std::string& path, const std::string& header,
                             const std::vector<const TensorView*>& layout) {
  const std::string tmp = temp_path_for(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Status::unavailable(fmt::format("cannot create {}: {}", tmp, std::strerror(errno)));
  auto fail = [&](Status s) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return s.with_context(tmp);
  };
  const uint64_t header_len = header.size();
  if (Status s = write_all(fd, &header_len, sizeof(header_len)); !s.ok()) return fail(s);
  if (Status s = write_all(fd, header.data(), header.size()); !s.ok()) return fail(s);
  for (const TensorView* t : layout) {
    if (Status s = write_all(fd, t->data(), t->nbytes()); !s.ok()) return fail(s);
  }
  if (::fsync(fd) != 0) return fail(Status::unavailable(fmt::format("fsync failed: {}", std::strerror(errno))));
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Status::unavailable(fmt::format("close {} failed: {}", tmp, std::strerror(err)));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Status::unavailable(fmt::format("rename {} to {} failed: {}", tmp, path, std::strerror(err)));
  }
  sync_parent_dir(path);
  return ok_status();
}

Status check_tensor_for_write(const std::string& name, const TensorView& t) {
  if (name.empty()) return Status::invalid_argument("empty tensor name");
  if (name == kMetadataKey) return Status::invalid_argument(fmt::format("tensor name {} is reserved", quote_name(name)));
  const std::string what = fmt::format("tensor {} ({})", quote_name(name), t.describe());
  if (!t.device().is_cpu()) return Status::invalid_argument(what + ": must be on the CPU");
  for (int64_t d : t.shape()) {
    if (d < 0) return Status::invalid_argument(what + ": negative dimension");
  }
  if (t.strides().size() != t.shape().size() || !t.is_contiguous()) {
    return Status::invalid_argument(what + ": must be contiguous");
  }
  if (t.empty() && t.numel() != 0) return Status::invalid_argument(what + ": null data");
  if (t.dtype() == DType::kI4Packed && (t.shape().empty() || t.shape().back() % 2 != 0)) {
    return Status::invalid_argument(what + ": packed int4 needs rank >= 1 and an even last dimension");
  }
  return ok_status();
}

}  // namespace

std::string_view safetensors_dtype_name(DType dt) {
  if (dt == DType::kI4Packed) return "U8";
  for (const auto& d : kDTypeNames) {
    if (d.dtype == dt) return d.name;
  }
  return "UNKNOWN";
}

Result<DType> parse_safetensors_dtype(std::string_view name) {
  for (const auto& d : kDTypeNames) {
    if (d.name == name) return d.dtype;
  }
  return Status::invalid_argument(fmt::format(
      "unknown dtype {} (ferry reads F32 F16 BF16 F8_E4M3 F8_E5M2 I8 U8 I32 I64)", quote_name(name)));
}

Result<SafetensorsReader> SafetensorsReader::open(const std::string& path) {
  SafetensorsReader r;
  FERRY_ASSIGN_OR_RETURN(r.file_, MappedFile::open(path));
  auto fail = [&](const Status& s) { return s.with_context("safetensors " + path); };
  const uint64_t size = r.file_.size();
  if (size < 8) {
    return fail(Status::data_loss(fmt::format("file is {} bytes, too short for the 8-byte header length", size)));
  }
  uint64_t header_len = 0;
  std::memcpy(&header_len, r.file_.data(), sizeof(header_len));
  if (header_len > kSafetensorsMaxHeaderBytes) {
    return fail(Status::invalid_argument(
        fmt::format("header length {} exceeds the limit of {} bytes", header_len, kSafetensorsMaxHeaderBytes)));
  }
  if (header_len > size - 8) {
    return fail(Status::data_loss(
        fmt::format("header length {} runs past the end of the file ({} bytes)", header_len, size)));
  }
  r.data_start_ = 8 + header_len;
  const uint64_t data_len = size - r.data_start_;

  nlohmann::json header;
  const std::string_view text(reinterpret_cast<const char*>(r.file_.data()) + 8, header_len);
  if (Status s = parse_header(text, &header); !s.ok()) return fail(s);

  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object()) return fail(Status::invalid_argument("__metadata__ is not an object"));
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) {
          return fail(Status::invalid_argument(fmt::format("__metadata__ {} is not a string: {}", quote_name(mk), mv.dump())));
        }
        r.metadata_.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    auto entry = parse_entry(key, value, data_len);
    if (!entry.ok()) return fail(entry.status());
    r.entries_.push_back(std::move(entry).value());
  }

  std::stable_sort(r.entries_.begin(), r.entries_.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // The data section must be covered exactly once: no overlaps, no gaps, nothing after the end.
  // Empty tensors occupy no bytes and only have to lie inside the section.
  uint64_t cursor = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const auto& e : r.entries_) {
    if (e.begin == e.end) continue;
    if (e.begin < cursor) {
      return fail(Status::invalid_argument(fmt::format("tensors {} [{}, {}] and {} [{}, {}] overlap", quote_name(prev->name),
                                                       prev->begin, prev->end, quote_name(e.name), e.begin, e.end)));
    }
    if (e.begin > cursor) {
      return fail(Status::invalid_argument(fmt::format("{} unused bytes at [{}, {}] before tensor {}", e.begin - cursor,
                                                       cursor, e.begin, quote_name(e.name))));
    }
    cursor = e.end;
    prev = &e;
  }
  if (cursor != data_len) {
    return fail(Status::invalid_argument(
        fmt::format("{} unused bytes after the last tensor (data section [0, {}])", data_len - cursor, data_len)));
  }
  for (size_t i = 0; i < r.entries_.size(); ++i) r.index_.emplace(r.entries_[i].name, i);
  if (Status s = apply_dtype_markers(&r.metadata_, &r.entries_, r.index_); !s.ok()) return fail(s);
  return r;
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& e : entries_) out.push_back(e.name);
  return out;
}

bool SafetensorsReader::contains(std::string_view name) const { return index_.find(name) != index_.end(); }

Result<TensorView> SafetensorsReader::tensor(std::string_view name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) {
    return Status::not_found(fmt::format("safetensors {}: no tensor named {}", path(), quote_name(name)));
  }
  const SafetensorsEntry& e = entries_[it->second];
  // The mapping is PROT_READ; TensorView has no const flavour, so the constness is documented instead.
  auto* data = const_cast<std::byte*>(file_.data() + data_start_ + e.begin);
  return TensorView(data, e.dtype, e.shape, Device::cpu());
}

Status write_safetensors(const std::string& path, std::span<const std::pair<std::string, TensorView>> tensors,
                         const std::map<std::string, std::string>& metadata) {
  auto fail = [&](const Status& s) { return s.with_context("writing safetensors " + path); };
  for (const auto& [key, value] : metadata) {
    if (key.starts_with(kDTypeMarkerPrefix)) {
      return fail(Status::invalid_argument(fmt::format("metadata key {} is reserved for ferry", quote_name(key))));
    }
  }
  std::set<std::string_view> seen;
  for (const auto& [name, t] : tensors) {
    if (Status s = check_tensor_for_write(name, t); !s.ok()) return fail(s);
    if (!seen.insert(name).second) return fail(Status::invalid_argument(fmt::format("duplicate tensor name {}", quote_name(name))));
  }

  // Largest elements first: every tensor then starts at a multiple of its element size, since the
  // 8-byte-aligned data section is filled with sizes that are multiples of every later element size.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return storage_element_bytes(tensors[a].second.dtype()) > storage_element_bytes(tensors[b].second.dtype());
  });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  nlohmann::ordered_json meta = nlohmann::ordered_json::object();
  for (const auto& [key, value] : metadata) meta[key] = value;
  for (const auto& [name, t] : tensors) {
    if (t.dtype() == DType::kI4Packed) meta[std::string(kDTypeMarkerPrefix) + name] = dtype_name(DType::kI4Packed);
  }
  if (!meta.empty()) header[std::string(kMetadataKey)] = std::move(meta);
  std::vector<const TensorView*> layout;
  uint64_t offset = 0;
  for (size_t i : order) {
    const auto& [name, t] = tensors[i];
    Shape stored = t.shape();
    if (t.dtype() == DType::kI4Packed) stored.back() /= 2;
    const uint64_t bytes = t.nbytes();
    header[name] = {{"dtype", safetensors_dtype_name(t.dtype())},
                    {"shape", stored},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    layout.push_back(&t);
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    return fail(Status::invalid_argument(fmt::format("cannot encode the header: {}", e.what())));
  }
  // The data section starts 8-byte aligned (8 bytes of length + a padded header).
  text.append((8 - text.size() % 8) % 8, ' ');
  return write_file_atomically(path, text, layout).with_context("writing safetensors " + path);
}

}  // namespace ferry
