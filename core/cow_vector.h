// A vector whose copies share one buffer until one of them is written (copy on write). The rank
// specs of the identical replicas of a model hold their parameters once: copying a spec costs a
// reference, and the planner sees by identity (shares()) that two ranks are laid out alike, so it
// checks, hashes and walks their parameters once.
//
// Reads are const: element access and iteration never copy. Writes are explicit: edit(),
// push_back() and emplace_back() first give this copy a buffer of its own when another copy shares
// it. A reference taken through edit() must not be written after this object is copied (the copy
// shares what it points into). Like std::vector, one object is not written from two threads at
// once. Distinct copies may be read and written from different threads, with one condition: a
// write finding no other copy left writes in place, so a copy that another thread read and then
// destroyed must be ordered before it by the program's own synchronization (a join, a lock), as
// anything handed between threads is; the count of copies alone does not order it.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <memory>
#include <utility>
#include <vector>

namespace ferry {

template <typename T>
class CowVector {
 public:
  using value_type = T;
  using size_type = size_t;
  using const_iterator = typename std::vector<T>::const_iterator;
  using iterator = const_iterator;  // reads only: writes go through edit()

  CowVector() = default;
  CowVector(std::vector<T> v) : v_(std::make_shared<std::vector<T>>(std::move(v))) {}  // NOLINT: a vector is one
  CowVector(std::initializer_list<T> items) : v_(std::make_shared<std::vector<T>>(items)) {}

  const std::vector<T>& get() const { return v_ ? *v_ : empty_vector(); }
  operator const std::vector<T>&() const { return get(); }  // NOLINT: read as the vector it is

  size_t size() const { return v_ ? v_->size() : 0; }
  bool empty() const { return size() == 0; }
  const T& operator[](size_t i) const { return (*v_)[i]; }
  const T& at(size_t i) const { return get().at(i); }
  const T& front() const { return v_->front(); }
  const T& back() const { return v_->back(); }
  const_iterator begin() const { return get().begin(); }
  const_iterator end() const { return get().end(); }

  // This copy's own vector, to write: copied first when another copy shares the buffer.
  std::vector<T>& edit() {
    if (!v_) {
      v_ = std::make_shared<std::vector<T>>();
    } else if (v_.use_count() > 1) {
      v_ = std::make_shared<std::vector<T>>(*v_);
    }
    return *v_;
  }
  void push_back(T item) { edit().push_back(std::move(item)); }
  template <typename... Args>
  T& emplace_back(Args&&... args) {
    return edit().emplace_back(std::forward<Args>(args)...);
  }
  void reserve(size_t n) { edit().reserve(n); }
  void clear() { v_.reset(); }

  // True when both hold one buffer (equal without comparing an element).
  bool shares(const CowVector& other) const { return v_ != nullptr && v_ == other.v_; }
  // The buffer's address: equal for copies that share it, null for an empty vector never written.
  const void* identity() const { return v_.get(); }
  // Shares `other`'s buffer when the two are equal (compared element by element); true when they
  // then share one. Frees this copy's buffer for identical specs that were built apart.
  bool share_if_equal(const CowVector& other) {
    if (shares(other)) return true;
    if (other.v_ == nullptr || get() != other.get()) return false;
    v_ = other.v_;
    return true;
  }

  bool operator==(const CowVector& other) const { return v_ == other.v_ || get() == other.get(); }
  bool operator==(const std::vector<T>& other) const { return get() == other; }

 private:
  static const std::vector<T>& empty_vector() {
    static const std::vector<T> empty;
    return empty;
  }
  std::shared_ptr<std::vector<T>> v_;
};

}  // namespace ferry
