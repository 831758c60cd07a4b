#include "transport/admission.h"

#include <fmt/format.h>

#include "core/log.h"

namespace ferry::transport {

Status check_credential(std::string_view credential) {
  if (credential.size() > kMaxCredentialBytes) {
    return Status::invalid_argument(
        fmt::format("a {}-byte credential; at most {} bytes are sent", credential.size(), kMaxCredentialBytes));
  }
  return ok_status();
}

Result<Admission> admit_peer(const AdmitCallback& admit, std::string_view credential, std::string_view transport,
                             std::string_view peer, uint64_t default_max_bucket) {
  Status why = check_credential(credential);
  Result<Admission> granted = Admission{};
  if (why.ok() && admit) {
    granted = admit(credential);
    if (!granted.ok()) why = granted.status();
  }
  if (why.ok()) {
    if (granted->max_bucket_bytes == 0) granted->max_bucket_bytes = default_max_bucket;
    return granted;
  }
  FERRY_LOG_WARN("{}: refused a sending connection from {}: {}", transport, peer, why.message());
  return Status::unauthenticated(fmt::format("{}: connection refused: {}", transport, why.message()));
}

Status bucket_over_limit(std::string_view transport, uint64_t size, uint64_t limit) {
  return Status::resource_exhausted(
      fmt::format("{}: a {}-byte bucket; this connection's limit is {}", transport, size, limit));
}

void log_unadmitted(std::string_view transport, std::string_view peer, std::string_view why) {
  FERRY_LOG_WARN("{}: closed a sending connection from {} before admission: {}", transport, peer, why);
}

std::string credential_frame(std::string_view credential) {
  std::string out(kCredentialHeaderBytes + credential.size(), '\0');
  const uint32_t words[2] = {kCredentialMagic, static_cast<uint32_t>(credential.size())};
  for (size_t i = 0; i < kCredentialHeaderBytes; ++i) {
    out[i] = static_cast<char>(words[i / 4] >> (8 * (i % 4)));
  }
  out.replace(kCredentialHeaderBytes, credential.size(), credential);
  return out;
}

Result<size_t> credential_length(const std::array<uint8_t, kCredentialHeaderBytes>& header) {
  uint32_t words[2] = {0, 0};
  for (size_t i = 0; i < kCredentialHeaderBytes; ++i) words[i / 4] |= uint32_t{header[i]} << (8 * (i % 4));
  if (words[0] != kCredentialMagic) return Status::invalid_argument("the connection does not start with a credential");
  if (words[1] > kMaxCredentialBytes) {
    return Status::invalid_argument(
        fmt::format("a {}-byte credential announced; at most {} bytes are read", words[1], kMaxCredentialBytes));
  }
  return size_t{words[1]};
}

}  // namespace ferry::transport
