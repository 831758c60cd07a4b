// Dims: a region's value per dimension, held inline up to four dimensions (every weight tensor of an
// LLM has at most three) and on the heap beyond. A plan holds millions of regions: a heap block for
// each, and the generic containers' copies, were most of the time a large plan took.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <vector>

namespace ferry {

class Dims {
 public:
  using value_type = int64_t;
  using size_type = size_t;
  using iterator = int64_t*;
  using const_iterator = const int64_t*;
  static constexpr size_t kInline = 4;

  Dims() noexcept = default;
  explicit Dims(size_t n, int64_t value = 0) { resize(n, value); }
  Dims(std::initializer_list<int64_t> values) { assign(values.begin(), values.end()); }
  template <typename It, typename = typename std::iterator_traits<It>::iterator_category>
  Dims(It first, It last) {
    assign(first, last);
  }
  Dims(const std::vector<int64_t>& values) { assign(values.begin(), values.end()); }  // NOLINT
  Dims(const Dims& other) { assign(other.begin(), other.end()); }
  Dims(Dims&& other) noexcept { take(other); }
  Dims& operator=(const Dims& other) {
    if (this != &other) assign(other.begin(), other.end());
    return *this;
  }
  Dims& operator=(Dims&& other) noexcept {
    if (this != &other) {
      release();
      take(other);
    }
    return *this;
  }
  ~Dims() { release(); }

  operator std::vector<int64_t>() const { return std::vector<int64_t>(begin(), end()); }  // NOLINT

  void assign(size_t n, int64_t value) {
    clear();
    resize(n, value);
  }
  template <typename It, typename = typename std::iterator_traits<It>::iterator_category>
  void assign(It first, It last) {
    const auto n = static_cast<size_t>(std::distance(first, last));
    reserve(n);
    std::copy(first, last, data());
    size_ = static_cast<uint32_t>(n);
  }
  void reserve(size_t n) {
    if (n <= capacity_) return;
    auto* grown = new int64_t[n];
    std::copy(begin(), end(), grown);
    release();
    heap_ = grown;
    capacity_ = static_cast<uint32_t>(n);
  }
  void resize(size_t n, int64_t value = 0) {
    reserve(n);
    if (n > size_) std::fill(data() + size_, data() + n, value);
    size_ = static_cast<uint32_t>(n);
  }
  void push_back(int64_t value) {
    if (size_ == capacity_) reserve(2 * capacity_);
    data()[size_++] = value;
  }
  void pop_back() noexcept { --size_; }
  void clear() noexcept { size_ = 0; }

  size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  int64_t* data() noexcept { return capacity_ > kInline ? heap_ : inline_; }
  const int64_t* data() const noexcept { return capacity_ > kInline ? heap_ : inline_; }
  iterator begin() noexcept { return data(); }
  iterator end() noexcept { return data() + size_; }
  const_iterator begin() const noexcept { return data(); }
  const_iterator end() const noexcept { return data() + size_; }
  int64_t& operator[](size_t i) noexcept { return data()[i]; }
  int64_t operator[](size_t i) const noexcept { return data()[i]; }
  int64_t& front() noexcept { return data()[0]; }
  int64_t front() const noexcept { return data()[0]; }
  int64_t& back() noexcept { return data()[size_ - 1]; }
  int64_t back() const noexcept { return data()[size_ - 1]; }

  bool operator==(const Dims& other) const noexcept { return std::equal(begin(), end(), other.begin(), other.end()); }
  bool operator==(const std::vector<int64_t>& other) const noexcept {
    return std::equal(begin(), end(), other.begin(), other.end());
  }
  // Lexicographic, as std::vector orders.
  bool operator<(const Dims& other) const noexcept {
    return std::lexicographical_compare(begin(), end(), other.begin(), other.end());
  }

 private:
  void release() noexcept {
    if (capacity_ > kInline) delete[] heap_;
    capacity_ = kInline;
  }
  // Moves `other`'s values here (this holds nothing) and leaves it empty.
  void take(Dims& other) noexcept {
    size_ = other.size_;
    capacity_ = other.capacity_;
    if (other.capacity_ > kInline) {
      heap_ = other.heap_;
      other.capacity_ = kInline;
    } else {
      std::memcpy(inline_, other.inline_, sizeof(int64_t) * size_);
    }
    other.size_ = 0;
  }

  uint32_t size_ = 0;
  uint32_t capacity_ = kInline;  // more than kInline: the values are on the heap
  union {
    int64_t inline_[kInline] = {};
    int64_t* heap_;
  };
};

}  // namespace ferry
