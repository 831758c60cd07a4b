// Safetensors files: read with the data memory-mapped, write atomically.
//
// Format: 8-byte little-endian header length N, N bytes of JSON header, then the data section.
// The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
// relative to the data section) and may hold "__metadata__", an object of string to string.
//
// dtype names: F32 F16 BF16 F8_E4M3 F8_E5M2 I8 U8 I32 I64. F8_E4M3 is the "fn" variant (kF8E4M3FN).
// ferry's packed int4 (kI4Packed) has no safetensors dtype: it is stored as U8 with the logical
// shape's last dimension halved (the bytes are unchanged: element 2k in the low nibble), and the
// metadata entry "ferry.dtype.<tensor name>": "i4x2" marks it. The reader turns such a tensor back
// into kI4Packed with the logical shape and does not report the marker in metadata(); the writer
// refuses user metadata keys that start with "ferry.dtype.".
//
// Errors while opening: NotFound (no such file), DataLoss (the file is shorter than its header
// says: header length or tensor offsets past the end of the file), InvalidArgument (everything
// else that is malformed: header length too large, invalid JSON, unknown dtype, duplicate names,
// offsets not matching shape x dtype, overlapping tensors, gaps or trailing bytes in the data
// section, bad metadata). Every message names the file and the tensor concerned.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/mapped_file.h"
#include "core/status.h"
#include "core/tensor.h"

namespace ferry {

// Largest accepted JSON header (the reference implementation's limit too).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// Safetensors dtype name for a ferry dtype ("BF16"); kI4Packed maps to "U8".
std::string_view safetensors_dtype_name(DType dt);
// Ferry dtype for a safetensors dtype name; InvalidArgument for names ferry does not handle.
Result<DType> parse_safetensors_dtype(std::string_view name);

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kU8;
  Shape shape;          // logical shape (for kI4Packed, the unpacked element count per dim)
  uint64_t begin = 0;   // byte offsets into the data section
  uint64_t end = 0;
};

class SafetensorsReader {
 public:
  SafetensorsReader() = default;
  SafetensorsReader(SafetensorsReader&&) noexcept = default;
  SafetensorsReader& operator=(SafetensorsReader&&) noexcept = default;
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  // Maps the file and validates its whole header; the mapping lives as long as the reader.
  static Result<SafetensorsReader> open(const std::string& path);

  // Tensor names in file order (by data offset).
  std::vector<std::string> names() const;
  // Entries in file order.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  bool contains(std::string_view name) const;
  // A contiguous CPU view into the mapping; valid while this reader lives. The memory is
  // read-only (writing through the view faults). The data pointer is aligned only as far as the
  // file's layout makes it (files written by write_safetensors align every tensor to its element
  // size); read it with memcpy when the file came from elsewhere. NotFound for an unknown name.
  Result<TensorView> tensor(std::string_view name) const;
  // "__metadata__", without ferry's own dtype markers.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return file_.path(); }

 private:
  MappedFile file_;
  uint64_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` (CPU, contiguous, unique non-empty names) and `metadata` as a safetensors file at
// `path`, atomically: the bytes go to a temporary file in the same directory that is renamed over
// `path` once complete and synced. Tensors are laid out by element size, largest first (input order
// among equals), so every tensor starts aligned to its element size; names() reads them back in that
// order.
Status write_safetensors(const std::string& path, std::span<const std::pair<std::string, TensorView>> tensors,
                         const std::map<std::string, std::string>& metadata = {});

}  // namespace ferry
