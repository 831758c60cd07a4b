// MappedFile: a whole file mapped read-only into memory. Move-only; unmaps on destruction.
#pragma once

#include <cstddef>
#include <string>

#include "core/status.h"

namespace ferry {

class MappedFile {
 public:
  MappedFile() = default;
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  // Maps the regular file at `path` with PROT_READ / MAP_PRIVATE. NotFound when it does not exist,
  // InvalidArgument when it is not a regular file, Unavailable for other system errors.
  // An empty file maps to data() == nullptr, size() == 0.
  static Result<MappedFile> open(const std::string& path);

  // The pages are read-only: writing through this pointer faults.
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void reset();

  std::byte* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

}  // namespace ferry
