// Status and Result<T>: the one error currency of ferry. No exception crosses a public function.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace ferry {

// Canonical codes, grouped by what the caller should do (see DESIGN.md "Conventions").
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,     // the caller's input is wrong; do not retry as is
  kNotFound = 2,            // a named thing does not exist
  kOutOfRange = 3,          // an index or region lies outside its tensor
  kFailedPrecondition = 4,  // the system is not in a state for this call; do not retry
  kResourceExhausted = 5,   // a memory or size bound was hit
  kDeadlineExceeded = 6,    // a wait ran past its deadline
  kUnavailable = 7,         // a peer or link is down; retrying the call may work
  kAborted = 8,             // the operation was aborted; retry at a higher level
  kDataLoss = 9,            // bytes arrived corrupted
  kUnauthenticated = 10,    // a peer failed the token challenge
  kInternal = 11,           // a broken invariant inside ferry
};

std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message);

  static Status ok_status() { return Status(); }
  static Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status out_of_range(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
  static Status failed_precondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
  static Status resource_exhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
  static Status deadline_exceeded(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
  static Status unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
  static Status aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
  static Status data_loss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
  static Status unauthenticated(std::string m) { return {StatusCode::kUnauthenticated, std::move(m)}; }
  static Status internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  const std::string& message() const;
  // "InvalidArgument: message", or "OK".
  std::string to_string() const;
  // Prepends "context: " to the message, keeping the code. No-op on OK.
  Status with_context(std::string_view context) const;

  void ignore_error() const {}

 private:
  struct Rep {
    StatusCode code;
    std::string message;
  };
  std::shared_ptr<const Rep> rep_;
};

inline Status ok_status() { return Status(); }

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.ok()) status_ = Status::internal("Result constructed from an OK status without a value");
  }

  bool ok() const { return status_.ok(); }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }

  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace ferry

#define FERRY_CONCAT_INNER_(a, b) a##b
#define FERRY_CONCAT_(a, b) FERRY_CONCAT_INNER_(a, b)

#define FERRY_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::ferry::Status ferry_status_ = (expr);        \
    if (!ferry_status_.ok()) return ferry_status_; \
  } while (0)

#define FERRY_ASSIGN_OR_RETURN(lhs, expr) \
  FERRY_ASSIGN_OR_RETURN_IMPL_(FERRY_CONCAT_(ferry_result_, __LINE__), lhs, expr)
#define FERRY_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return std::move(tmp).status();     \
  lhs = std::move(tmp).value()
